"""The failure flag: every kind of wait raises :class:`PeerFailed` promptly once a peer is reported dead;
and the heartbeat settings the workers read."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tagps.comm.handle import Handle, PeerFailed, clear_failure, report_failure, wait_work
from tagps.comm.local_reduce import ReductionFuture
from tagps.config import ConfigError, comm_config


@pytest.fixture(autouse=True)
def _clean_flag() -> Iterator[None]:
    clear_failure()
    yield
    clear_failure()


class _Work:
    """A ``torch.distributed`` work stand-in: completes (or fails with ``error``) when its future does."""

    def __init__(self, error: str | None = None) -> None:
        self.future: torch.futures.Future[None] = torch.futures.Future()
        self._error = error

    def get_future(self) -> torch.futures.Future[None]:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.wait()
        if self._error is not None:
            raise RuntimeError(self._error)


def _later(seconds: float, action: object) -> None:
    threading.Timer(seconds, action).start()  # type: ignore[arg-type]


def test_a_blocked_work_raises_within_a_slice_of_the_report() -> None:
    work = _Work()
    _later(0.3, lambda: report_failure("worker rank 3 failed"))
    _later(3.0, lambda: work.future.set_result(None))  # a wait that ignored the flag returns only then
    start = time.monotonic()
    with pytest.raises(PeerFailed, match="worker rank 3 failed"):
        Handle([work], lambda: torch.zeros(1)).wait()
    assert time.monotonic() - start < 1.0


def test_a_completed_work_returns_normally() -> None:
    work = _Work()
    _later(0.2, lambda: work.future.set_result(None))
    assert wait_work(work) is None


def test_a_broken_transfer_waits_for_the_watcher_to_name_the_peer() -> None:
    clear_failure(confirm_s=5.0)
    work = _Work(error="Connection closed by peer [127.0.0.1]:4242")
    work.future.set_result(None)
    _later(0.3, lambda: report_failure("worker rank 2 failed"))
    with pytest.raises(PeerFailed, match=r"worker rank 2 failed \(Connection closed by peer"):
        wait_work(work)


def test_without_a_watcher_a_broken_transfer_raises_its_own_error() -> None:
    work = _Work(error="Connection closed by peer")
    work.future.set_result(None)
    with pytest.raises(RuntimeError, match="Connection closed by peer") as info:
        wait_work(work)
    assert type(info.value) is RuntimeError


def test_a_local_reduction_raises_within_a_slice_of_the_report() -> None:
    future = ReductionFuture("w", timeout=3.0)
    _later(0.3, lambda: report_failure("worker rank 1 failed"))
    start = time.monotonic()
    with pytest.raises(PeerFailed, match="worker rank 1 failed"):
        future.wait()
    assert time.monotonic() - start < 1.0


def test_a_local_reduction_still_times_out() -> None:
    with pytest.raises(RuntimeError, match="did not finish within"):
        ReductionFuture("w", timeout=0.2).wait()


def test_workers_read_the_heartbeat_settings() -> None:
    cfg = comm_config({"PS_HEARTBEAT_INTERVAL": "0.5", "PS_HEARTBEAT_TIMEOUT": "3"})
    assert (cfg.heartbeat_interval, cfg.heartbeat_timeout) == (0.5, 3.0)
    assert comm_config({"PS_HEARTBEAT_INTERVAL": "5"}).heartbeat_timeout == 15.0
    with pytest.raises(ConfigError, match=r"PS_HEARTBEAT_TIMEOUT=1\.0 is malformed"):
        comm_config({"PS_HEARTBEAT_TIMEOUT": "1"})
