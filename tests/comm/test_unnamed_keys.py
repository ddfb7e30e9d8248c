"""Unnamed sums reuse a bounded set of keys: many calls through the servers do not grow keys or arenas."""

from __future__ import annotations

from pathlib import Path

import pytest
from bpslaunch_job import run_job

WORKER = Path(__file__).with_name("unnamed_worker.py")


@pytest.mark.timeout(200)
def test_many_unnamed_sums_use_two_keys(tmp_path: Path) -> None:
    # Two machines of two processes: shared-memory reduction in each, push and pull through the server.
    results = run_job(WORKER, tmp_path, {"calls": 300}, workers=2, servers=1, local_size=2)
    keys = ["noname.float32.1000.NoneCompressor.0", "noname.float32.1000.NoneCompressor.1"]
    for result in results:
        assert result["error"] == 0.0, result
        assert result["declared"] == keys, result["rank"]  # the old call-order names: 600 keys
        assert result["arenas"] == keys, result["rank"]
        assert len(result["shm"]) <= 2, result  # arenas are unlinked once mapped: at most the ones in flight
