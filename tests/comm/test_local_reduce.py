"""The shared-memory reduction's loopback socket: only its participants are heard, garbage is dropped."""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from tagps.comm.arena import ShmArena
from tagps.comm.local_reduce import LocalReducer

WRONG = secrets.token_bytes(16)


def _garbage(token: bytes) -> list[list[bytes]]:
    """Messages another local process could send to the root's endpoint; none may be acted on."""
    return [
        [b"garbage"],
        [b"ready", b"x", b"float32", b"1000"],  # the protocol without a token, as participant 1 would
        [WRONG, b"1", b"ready", b"x", b"float32", b"1000"],
        [WRONG, b"1", b"reduced", b"x"],
        # With the token but malformed: not a participant, bad counts and text, out of turn, unknown.
        [token, b"7", b"ready", b"x", b"float32", b"1000"],
        [token, b"1", b"ready", b"x", b"float32", b"-1"],
        [token, b"1", b"ready", b"\xff", b"float32", b"1000"],
        [token, b"1", b"reduced", b"x"],
        [token, b"1", b"bogus"],
        [token],
    ]


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _worker(rank: int, init: str, shm_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    count = _Count()
    logging.getLogger("tagps.comm.local_reduce").addHandler(count)
    reducer = LocalReducer([0, 1], [[0, 1]], rank, 0, cross=None, timeout=30, shm_dir=shm_dir)
    try:
        if rank == 0:  # send every kind of garbage to the root, then let its thread read it
            rogue = zmq.Context.instance().socket(zmq.DEALER)
            rogue.connect(reducer._sock.getsockopt(zmq.LAST_ENDPOINT).decode())
            garbage = _garbage(reducer._token)
            for frames in garbage:
                rogue.send_multipart(frames)
            deadline = time.monotonic() + 10
            while len(count.messages) < len(garbage) and time.monotonic() < deadline:
                time.sleep(0.01)
            rogue.close(linger=0)
            assert len(count.messages) == len(garbage), count.messages
            assert all("dropped a message" in m for m in count.messages), count.messages
        dist.barrier()
        for rnd in range(3):  # the service still sums, exactly
            x = torch.full((1000,), float(10 * rnd + rank + 1))
            reducer.submit("x", x).wait()
            assert torch.equal(x, torch.full((1000,), float(20 * rnd + 3))), (rank, x[:3])
        assert reducer._thread.is_alive()
    finally:
        reducer.close()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_garbage_on_the_loopback_socket_is_dropped_and_the_sums_stay_exact(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)


def _root_fails(rank: int, init: str, shm_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    reducer = LocalReducer([0, 1], [[0, 1]], rank, 0, cross=None, timeout=60, shm_dir=shm_dir)
    try:
        if rank == 0:

            def broken(*args: object) -> None:
                raise MemoryError("boom")

            ShmArena.reduce_shard = broken  # this process only
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="boom"):
            reducer.submit("x", torch.ones(1000)).wait()
        assert time.monotonic() - start < 10, "the other participant waited for the timeout"
    finally:
        reducer.close()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_failed_root_fails_every_participant_at_once(tmp_path: Path) -> None:
    mp.spawn(_root_fails, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
