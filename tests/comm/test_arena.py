"""The shared-memory arena: shard sums equal numpy's for every dtype and topology, and a full filesystem is
a clear ArenaFull error (the file removed), never a SIGBUS."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tagps.comm.arena import (
    ALL_READY,
    DONE,
    FAILED,
    NOT_READY,
    SHAPES_DIFFER,
    TIMED_OUT,
    ArenaFull,
    ShmArena,
)
from tagps.comm.local_reduce import LocalReducer, shard_bounds

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
# Slot groups as LocalReducer orders them (slot 0 leads the first group), and two it never makes: every
# slot counts whichever leads.
TOPOLOGIES = [
    [[0]],
    [[0, 1, 2, 3]],
    [[0, 1], [2, 3]],
    [[0], [1], [2]],
    [[0, 2, 4], [1, 3]],
    [[1, 0], [2]],
]
MIB = 1 << 20


def _inputs(dtype: torch.dtype, slots: int, count: int) -> list[torch.Tensor]:
    """Distinct values per slot, exactly representable in ``dtype``."""
    rng = np.random.default_rng(slots * 1000 + count)
    if dtype.is_floating_point:
        return [torch.from_numpy(rng.uniform(-8, 8, count)).to(dtype) for _ in range(slots)]
    return [torch.from_numpy(rng.integers(-(10**6), 10**6, count)).to(dtype) for _ in range(slots)]


def _reference(xs: list[torch.Tensor], groups: list[list[int]]) -> torch.Tensor:
    """numpy: each later group into its leader, then the first group's slots plus the other leaders;
    float16/bfloat16 summed in float32 and rounded once per step, as sum_into does."""
    dtype = xs[0].dtype
    acc = np.float32 if dtype in (torch.float16, torch.bfloat16) else None

    def as_np(t: torch.Tensor) -> np.ndarray:
        return (t.float() if acc else t).numpy().copy()

    def store(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(dtype)

    def summed(members: list[torch.Tensor]) -> torch.Tensor:
        total = as_np(members[0])
        for m in members[1:]:
            total += as_np(m)
        return store(total)

    rows = list(xs)
    for group in groups[1:]:
        rows[group[0]] = summed([rows[m] for m in group])
    first = summed([rows[m] for m in groups[0]])
    return summed([first, *(rows[g[0]] for g in groups[1:])]) if len(groups) > 1 else first


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("groups", TOPOLOGIES, ids=str)
@pytest.mark.parametrize("count", [1, 7, 8, 1023, 1 << 17])
def test_shard_sums_equal_numpy(
    tmp_path: Path, dtype: torch.dtype, groups: list[list[int]], count: int
) -> None:
    slots = 1 + max(m for g in groups for m in g)
    xs = _inputs(dtype, slots, count)
    arena = ShmArena(str(tmp_path / "arena"), dtype, slots, count)
    for i, x in enumerate(xs):
        arena.write(i, x)
    for shard in range(slots):  # every participant's shard, some of them empty for tiny counts
        arena.reduce_shard(groups, *shard_bounds(count, slots, shard))
    out = torch.empty(count, dtype=dtype)
    arena.read_result(out)
    expected = _reference(xs, groups)
    assert torch.equal(out, expected), (out[:4], expected[:4])
    assert torch.equal(arena.result, expected)


def test_a_second_mapping_sees_the_same_rows(tmp_path: Path) -> None:
    path = str(tmp_path / "arena")
    a, b = ShmArena(path, torch.float32, 2, 100), ShmArena(path, torch.float32, 2, 100)
    a.write(0, torch.full((100,), 1.0))
    b.write(1, torch.full((100,), 2.0))
    b.reduce_shard([[0, 1]], 0, 100)
    assert torch.equal(a.result, torch.full((100,), 3.0))


def test_a_round_is_ready_when_every_slot_is_marked_with_the_same_shape(tmp_path: Path) -> None:
    path = str(tmp_path / "arena")
    a, b = ShmArena(path, torch.float32, 2, 100), ShmArena(path, torch.float32, 2, 100)
    assert a.all_ready(1) == NOT_READY
    a.mark_ready(0, 1)
    assert a.all_ready(1) == NOT_READY
    b.mark_ready(1, 1)
    assert a.all_ready(1) == b.all_ready(1) == ALL_READY
    assert a.all_ready(2) == NOT_READY
    other = ShmArena(path, torch.float32, 2, 50)  # the same name mapped with another count
    a.mark_ready(0, 2)
    other.mark_ready(1, 2)
    assert a.all_ready(2) == SHAPES_DIFFER


def test_waiters_wake_when_a_round_is_published_or_the_arena_fails(tmp_path: Path) -> None:
    path = str(tmp_path / "arena")
    root, member = ShmArena(path, torch.float32, 2, 100), ShmArena(path, torch.float32, 2, 100)
    start = time.monotonic()
    assert member.wait_done(1, 0.05) == TIMED_OUT
    assert 0.04 < time.monotonic() - start < 1
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(member.wait_done, 1, 30)
        time.sleep(0.1)
        assert not waiting.done()
        root.publish(1)
        assert waiting.result(timeout=5) == DONE
        assert member.done(1) and not member.done(2)
        waiting = pool.submit(member.wait_done, 2, 30)
        time.sleep(0.1)
        root.fail()
        assert waiting.result(timeout=5) == FAILED
    assert member.wait_done(1, 0) == DONE  # a published round stays done
    assert member.wait_done(3, 0) == FAILED  # a failed arena stays failed


def test_rounds_compare_across_the_wrap_of_their_counter(tmp_path: Path) -> None:
    arena = ShmArena(str(tmp_path / "arena"), torch.float32, 1, 10)
    arena.publish(2**32 - 1)
    assert arena.done(2**32 - 2) and arena.done(2**32 - 1) and not arena.done(0)
    arena.publish(1)  # two rounds later, past the wrap
    assert arena.done(2**32 - 1) and arena.done(0) and arena.done(1) and not arena.done(2)


def test_bad_arguments_are_clear_errors(tmp_path: Path) -> None:
    arena = ShmArena(str(tmp_path / "arena"), torch.float32, 2, 100)
    with pytest.raises(ValueError, match=r"holds 100 x torch\.float32, got 100 x torch\.float64"):
        arena.write(0, torch.zeros(100, dtype=torch.float64))
    with pytest.raises(ValueError, match="holds 100"):
        arena.read_result(torch.zeros(99))
    with pytest.raises(ValueError, match="slot 2 of 2"):
        arena.write(2, torch.zeros(100))
    with pytest.raises(ValueError, match="group member 2 of 2"):
        arena.reduce_shard([[0, 2]], 0, 100)
    with pytest.raises(ValueError, match="an empty group"):
        arena.reduce_shard([[0], []], 0, 100)
    with pytest.raises(ValueError, match=r"shard \[0, 101\) outside its 100 elements"):
        arena.reduce_shard([[0, 1]], 0, 101)
    with pytest.raises(TypeError, match=r"cannot sum torch\.uint8"):
        ShmArena(str(tmp_path / "other"), torch.uint8, 2, 100)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs standing in for a nearly full /dev/shm (mounting needs root)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_full_filesystem_is_arena_full_and_the_file_is_removed(small_tmpfs: Path) -> None:
    fits = ShmArena(str(small_tmpfs / "fits"), torch.float32, 3, 32 * 1024)  # 512 KiB of the 1 MiB
    path = small_tmpfs / "too-big"
    # 5 rows of 1 MiB and the control block (16 bytes and 16 per slot, rounded up to 64).
    needed = rf"{re.escape(str(path))}: it needs {5 * MIB + 128} bytes .* has \d+ bytes free"
    with pytest.raises(ArenaFull, match=needed) as info:
        ShmArena(str(path), torch.float32, 4, MIB // 4)
    assert isinstance(info.value, OSError)
    assert not path.exists()
    fits.write(2, torch.ones(32 * 1024))  # the arena that fitted still works
    fits.reduce_shard([[0, 1, 2]], 0, 32 * 1024)
    assert fits.result.sum().item() == 32 * 1024


def _full_worker(rank: int, init: str, shm_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    reducer = LocalReducer([0, 1], [[0, 1]], rank, 0, cross=None, timeout=60, shm_dir=shm_dir)
    try:
        with pytest.raises(RuntimeError, match=r"no room for the shared-memory arena .* needs 3145792 bytes"):
            reducer.submit("big", torch.ones(MIB // 4)).wait()
    finally:
        reducer.close()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_full_shm_dir_fails_the_reduction_clearly_without_sigbus(small_tmpfs: Path, tmp_path: Path) -> None:
    # 3 rows of 1 MiB in a 1 MiB tmpfs: a sparse file (ftruncate) here died of SIGBUS on the first write.
    mp.spawn(_full_worker, args=(str(tmp_path / "init"), str(small_tmpfs)), nprocs=2, join=True)
    assert os.listdir(small_tmpfs) == []
