"""The shared-memory reduction's loopback socket: only its participants are heard, garbage is dropped."""

from __future__ import annotations

import logging
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from tagps.comm.arena import ShmArena
from tagps.comm.handle import CompletedWork
from tagps.comm.local_reduce import ROOT_SUMS_BYTES, LocalReducer
from tagps.launcher import free_ports
from tagps.tag_pipe import write_tag

REPO = Path(__file__).resolve().parents[2]
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
        [token, b"1", b"ready", b"x", b"int3", b"1000"],
        # Well formed, but "x" is a tensor the root sums alone: its readiness is in the arena, not a message.
        [token, b"1", b"ready", b"x", b"float32", b"1000"],
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


def _commands(rank: int, init: str, shm_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=3)
    reducer = LocalReducer([0, 1, 2], [[0, 1, 2]], rank, 0, cross=None, timeout=30, shm_dir=shm_dir)
    seen: list[tuple[str, bytes]] = []
    handle = reducer._on_command

    def recording(frames: list[bytes]) -> None:
        seen.append((frames[1].decode(), frames[0]))
        handle(frames)

    reducer._on_command = recording  # type: ignore[method-assign]
    try:
        big = ROOT_SUMS_BYTES // 4 + 1  # float32 elements: one past the size the root sums alone
        for name, count in (("small", 1000), ("big", big), ("small", 1000), ("big", big)):
            x = torch.arange(count, dtype=torch.float32) * (rank + 1)
            reducer.submit(name, x).wait()
            assert torch.equal(x, torch.arange(count, dtype=torch.float32) * 6), (rank, name, x[:3])
        if rank:  # a small tensor's participants hear nothing (the arena tells); a big one's sum a shard each
            assert seen == [("big", b"reduce"), ("big", b"done")] * 2, seen
    finally:
        reducer.close()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_root_sums_a_small_tensor_alone_and_a_big_one_in_shards(tmp_path: Path) -> None:
    mp.spawn(_commands, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=3, join=True)


def _disagree(rank: int, init: str, shm_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    reducer = LocalReducer([0, 1], [[0, 1]], rank, 0, cross=None, timeout=60, shm_dir=shm_dir)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"local ranks disagree on 'x'"):
            reducer.submit("x", torch.ones(1000 + rank)).wait()  # both small: the root sums them alone
        assert time.monotonic() - start < 10, "a participant waited for the timeout"
    finally:
        reducer.close()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_local_ranks_that_disagree_on_a_small_tensor_fail_at_once(tmp_path: Path) -> None:
    mp.spawn(_disagree, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    assert os.listdir(tmp_path) == []  # neither the arena nor the root's doorbell is left behind


def _root_fails(rank: int, init: str, shm_dir: str, late: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    reducer = LocalReducer([0, 1], [[0, 1]], rank, 0, cross=None, timeout=60, shm_dir=shm_dir)
    try:
        if rank == 0:

            def broken(*args: object) -> None:
                raise MemoryError("boom")

            ShmArena.reduce_shard = broken  # this process only
        if rank == late:  # the other's "ready" comes first: the root fails on a message, or on its own submit
            time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="boom"):
            reducer.submit("x", torch.ones(1000)).wait()
        assert time.monotonic() - start < 10, "the other participant waited for the timeout"
    finally:
        reducer.close()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late", [0, 1], ids=["root-submits-last", "root-submits-first"])
def test_a_failed_root_fails_every_participant_at_once(tmp_path: Path, late: int) -> None:
    mp.spawn(_root_fails, args=(str(tmp_path / "init"), str(tmp_path), late), nprocs=2, join=True)


# argv: the victim's local rank, the signal it sends itself before the reducer's setup, a file where it
# writes when, the shared-memory directory.
_SETUP_WORKER = """
import os, signal, sys, time
from pathlib import Path
from tagps.comm import collectives
from tagps.comm.local_reduce import ROOT_SUMS_BYTES, LocalReducer
from tagps.config import comm_config

victim, sig, died, shm_dir = int(sys.argv[1]), getattr(signal, sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
cfg = comm_config()
collectives.init_process_group(cfg)
if cfg.local_rank == victim:
    died.write_text(repr(time.time()))
    os.kill(os.getpid(), sig)
ranks = list(range(cfg.local_size))
try:
    LocalReducer(ranks, [ranks], cfg.local_rank, 0, None, cfg.dist_timeout_s, shm_dir).close()
except RuntimeError as exc:
    print(f"raised at {time.time()!r}: {type(exc).__name__}: {exc}", flush=True)
    collectives.shutdown_process_group()  # as tagps.torch does at exit: gloo aborts in a live group's exit
    raise SystemExit(3)
print("set up", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_a_peer_that_dies_before_the_setup_is_named_within_the_heartbeat_timeout(
    tmp_path: Path, sig: str
) -> None:
    """The setup's all_gather_object waits like every other wait: a stopped peer (its connections stay
    open) is named after PS_HEARTBEAT_TIMEOUT, not after TAGPS_DIST_TIMEOUT, and a killed one by rank."""
    script, died = tmp_path / "setup.py", tmp_path / "died"
    script.write_text(_SETUP_WORKER)
    port, victim, size, heartbeat_timeout = free_ports(1)[0], 1, 3, 3.0
    procs = []
    for rank in range(size):
        env = {
            **os.environ, "DMLC_NUM_WORKER": "1", "DMLC_WORKER_ID": "0", "DMLC_NUM_SERVER": "0",
            "BYTEPS_LOCAL_SIZE": str(size), "BYTEPS_LOCAL_RANK": str(rank), "DMLC_PS_ROOT_URI": "127.0.0.1",
            "TAGPS_DIST_PORT": str(port), "TAGPS_DIST_TIMEOUT": "60", "PS_HEARTBEAT_INTERVAL": "0.5",
            "PS_HEARTBEAT_TIMEOUT": str(heartbeat_timeout),
        }  # fmt: skip
        cmd = [sys.executable, str(script), str(victim), sig, str(died), str(tmp_path)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, text=True, **pipes))
    try:
        for rank in (r for r in range(size) if r != victim):
            try:  # without the heartbeat the setup would wait TAGPS_DIST_TIMEOUT (60 s)
                out, _ = procs[rank].communicate(timeout=30)
            except subprocess.TimeoutExpired:
                procs[rank].kill()
                out = procs[rank].communicate()[0] + "\n[killed after 30 s]"
            match = re.search(r"raised at ([0-9.]+): PeerFailed: (.*)", out)
            assert procs[rank].returncode == 3 and match, (
                f"rank {rank} ({procs[rank].returncode}):\n{out[-3000:]}"
            )
            assert f"worker rank {victim} failed" in match[2], match[2]
            assert float(match[1]) - float(died.read_text()) < heartbeat_timeout + 4.0, match[0]
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert [p.name for p in tmp_path.glob("tagps-*")] == []  # no arena was made


class _Doubling:
    """A ``cross`` that records what it was handed and sums it with an identical remote machine."""

    def __init__(self) -> None:
        self.handed: list[torch.Tensor] = []

    def __call__(self, name: str, tensor: torch.Tensor, priority: int) -> CompletedWork:
        self.handed.append(tensor)
        tensor.mul_(2)
        return CompletedWork()


def _alone(rank: int, init: str, shm_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    # Two machines of one local rank each: every process is the only participant of its machine.
    cross = _Doubling()
    reducer = LocalReducer([0], [[0]], 0, rank, cross=cross, timeout=30, shm_dir=shm_dir)
    alone = LocalReducer([0], [[0]], 0, rank, cross=None, timeout=30, shm_dir=shm_dir)
    try:
        for rnd in range(2):
            x = torch.full((1000,), float(rnd + 1))
            reducer.submit("x", x, priority=5).wait()
            assert torch.equal(x, torch.full((1000,), 2.0 * (rnd + 1)))
            assert cross.handed[-1] is x  # the caller's tensor itself, not an arena row
            y = torch.full((7,), 3.0)
            work = alone.submit("y", y)
            assert work.is_completed() and torch.equal(y, torch.full((7,), 3.0))
    finally:
        reducer.close()
        alone.close()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_single_participant_hands_its_tensor_to_cross_in_place(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    mp.spawn(_alone, args=(str(tmp_path / "init"), str(shm)), nprocs=2, join=True)


class _LaterWork:
    """A push and pull that end on a timer thread: the sum doubled (an identical remote machine), a failure,
    or never; it notifies as :class:`~tagps.comm.handle.NotifyingWaitable` says."""

    def __init__(self, tensor: torch.Tensor, mode: str) -> None:
        self.error: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._notify = (-1, 0)
        if mode != "never":
            threading.Timer(0.05, self._end, args=(tensor, mode)).start()

    def _end(self, tensor: torch.Tensor, mode: str) -> None:
        if mode == "ok":
            tensor.mul_(2)
        else:
            self.error = "the server rejected it"
        with self._lock:
            self._done.set()
            if self._notify[0] >= 0:
                write_tag(*self._notify)

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(self.error)

    def notify(self, fd: int, tag: int) -> None:
        with self._lock:
            self._notify = (fd, tag)
            if fd >= 0 and self._done.is_set():
                write_tag(fd, tag)


def _crossing(rank: int, init: str, shm_dir: str, mode: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    cross = lambda name, tensor, priority: _LaterWork(tensor, mode)  # noqa: E731
    timeout = 1.0 if mode == "never" else 30.0
    reducer = LocalReducer([0, 1], [[0, 1]], rank, 0, cross=cross, timeout=timeout, shm_dir=shm_dir)
    try:
        # A small tensor (the root sums it alone) and a big one (shards), both in flight at once.
        sizes = {"small": 1000, "big": ROOT_SUMS_BYTES // 4 + 1}
        for rnd in range(3 if mode == "ok" else 1):
            tensors = {n: torch.full((k,), float(10 * rnd + rank + 1)) for n, k in sizes.items()}
            works = {n: reducer.submit(n, t) for n, t in tensors.items()}
            if mode == "ok":
                for n, work in works.items():
                    work.wait()
                    assert torch.equal(tensors[n], torch.full((sizes[n],), 2.0 * (20 * rnd + 3))), (rank, n)
                continue
            for work in works.values():
                with pytest.raises(RuntimeError, match="rejected" if mode == "fail" else "did not finish"):
                    work.wait()
        if rank == 0:
            # No thread of the reducer's waits for a push and pull: their ends reach it through the pipe.
            assert not [t.name for t in threading.enumerate() if "cross" in t.name]
            if mode == "never":  # the service itself gives up on the push and pull at the timeout
                deadline = time.monotonic() + 2
                while reducer._error is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert "push_pull of" in str(reducer._error) and "did not finish" in str(reducer._error)
        dist.barrier()
    finally:
        reducer.close()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ok", "fail", "never"])
def test_the_root_learns_that_a_push_and_pull_ended_from_its_notification(tmp_path: Path, mode: str) -> None:
    mp.spawn(_crossing, args=(str(tmp_path / "init"), str(tmp_path), mode), nprocs=2, join=True)
