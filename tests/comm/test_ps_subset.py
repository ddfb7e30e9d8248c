"""``PSService.subset``: sums over some of the job's worker processes, as real ``bpslaunch --local`` jobs.

Each job runs ``ps_subset_worker.py`` on every rank; the subsets' sums run next to a sum over every rank,
with distinct values per rank and round, and must be exact.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from bpslaunch_job import run_job

from tagps.comm.ps_service import PSSubset
from tagps.config import CommConfig

#: Chunks of 4 KiB: the worker's 5000-element sums span several (BytePS's default is 4 MB).
JOB_ENV = {"BYTEPS_PARTITION_BYTES": "4096"}
WORKER = Path(__file__).with_name("ps_subset_worker.py")


def _check_sums(results: list[dict[str, Any]], sums: dict[str, set[int]]) -> None:
    """Every rank reports exactly the sums it is a member of (key prefix -> ranks), all exact."""
    for result in results:
        rank = result["rank"]
        mine = {key.split(".")[0] for key in result["errors"]}
        assert mine == {name for name, members in sums.items() if rank in members}, (rank, mine)
        assert all(error == 0.0 for error in result["errors"].values()), (rank, result["errors"])
        assert result["cached"], rank


@pytest.mark.timeout(200)
@pytest.mark.parametrize("servers", [1, 2])
def test_subset_of_three_machines_next_to_a_sum_over_all(tmp_path: Path, servers: int) -> None:
    # {0, 2} crosses machines through the servers while rank 1 sums only "all"; {1} is one machine's.
    case = {"subsets": [[2, 0], [1]]}
    results = run_job(WORKER, tmp_path, case, workers=3, servers=servers, local_size=1, env=JOB_ENV)
    _check_sums(results, {"s0": {0, 2}, "s1": {1}, "all": {0, 1, 2}})


@pytest.mark.timeout(200)
def test_subset_of_two_machines_with_two_local_ranks(tmp_path: Path) -> None:
    # {0, 1, 2}: machine 0's two ranks reduce in shared memory, machine 1 takes part with its local rank 0;
    # {2, 3} lies inside machine 1 and {1} inside machine 0 (no server; {1} without its local rank 0).
    # [0, 3] leaves out machine 1's local rank 0: every rank refuses it before anything collective.
    case = {"subsets": [[0, 1, 2], [2, 3], [1]], "refused": [[0, 3], [0, 1, 3]]}
    results = run_job(WORKER, tmp_path, case, workers=2, servers=1, local_size=2, env=JOB_ENV)
    _check_sums(results, {"s0": {0, 1, 2}, "s1": {2, 3}, "s2": {1}, "all": {0, 1, 2, 3}})
    for result in results:
        first, second = result["refused"]
        assert first is not None and "machine 1 takes part with ranks [3] (local ranks [1])" in first, first
        assert "not with rank 2, its local rank 0" in first, first
        assert second is not None and "machine 1 takes part with ranks [3]" in second, second


@pytest.mark.timeout(200)
def test_machines_of_different_sizes_push_once_each(tmp_path: Path) -> None:
    # Machines of 1 and 2 processes (TAGPS_MACHINE_SIZES=1,2): rank 1 is machine 1's local rank 0, so
    # {0, 1} crosses machines through the server; {1, 2} is machine 1's shared memory alone.
    case = {"subsets": [[0, 1], [1, 2]], "refused": [[0, 2]]}
    results = run_job(WORKER, tmp_path, case, workers=2, servers=1, local_size=[1, 2], env=JOB_ENV)
    _check_sums(results, {"s0": {0, 1}, "s1": {1, 2}, "all": {0, 1, 2}})
    for result in results:
        (refused,) = result["refused"]
        assert refused is not None and "machine 1 takes part with ranks [2] (local ranks [1])" in refused


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        ([], "must be distinct ranks of the job's 4"),
        ([0, 0], "must be distinct"),
        ([0, 4], "must be distinct"),
        ([-1, 0], "must be distinct"),
        ([True], "sequence of integers"),
        ("01", "sequence of integers"),
        ([1, 2], "machine 0 takes part with ranks [1] (local ranks [1]) but not with rank 0"),
    ],
)
def test_subset_ranks_are_checked_before_anything_collective(ranks: Any, message: str) -> None:
    cfg = CommConfig(num_worker=2, worker_id=1, local_rank=1, local_size=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        PSSubset(cfg, None, ranks)
