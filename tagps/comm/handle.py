"""One in-flight synchronisation: what every communication method hands back.

Also the process-wide failure flag: when a peer process of the job stops sending heartbeats (see
:class:`tagps.comm.collectives.PeerWatcher`), every wait raises :class:`PeerFailed` naming it within 0.1 s
instead of blocking until ``TAGPS_DIST_TIMEOUT``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from tagps.tag_pipe import write_tag

__all__ = [
    "CompletedWork",
    "Handle",
    "NotifyingWaitable",
    "PeerFailed",
    "Waitable",
    "clear_failure",
    "failure",
    "raise_if_failed",
    "report_failure",
    "timed_out",
    "wait_sliced",
    "wait_work",
]

# How often a blocked wait looks at the failure flag: short enough to raise promptly, long enough to cost
# nothing next to a collective.
WAIT_SLICE_S = 0.1


class PeerFailed(RuntimeError):
    """A process of the job died (killed, hung, partitioned); the message names it.

    A ``RuntimeError``, so that the torch adapter reports it as ``HorovodInternalError``.
    """


_failed = threading.Event()
_failure: str | None = None
_confirm_s = 0.0  # how long a failed transfer waits for the watcher to name the peer (0: no watcher)


def report_failure(message: str) -> None:
    """Set the failure flag (the first report wins): every wait of this process raises with ``message``."""
    global _failure
    if _failure is None:
        _failure = message
        _failed.set()


def clear_failure(confirm_s: float = 0.0) -> None:
    """Reset the flag for a new process group, whose watcher names a dead peer within ``confirm_s``."""
    global _failure, _confirm_s
    _failure = None
    _confirm_s = confirm_s
    _failed.clear()


def failure() -> str | None:
    """The reported failure's message, or ``None``."""
    return _failure


def raise_if_failed() -> None:
    """Raise the reported failure, if any."""
    if _failure is not None:
        raise PeerFailed(_failure)


def wait_sliced(
    done: Callable[[float], bool],
    timeout: float | None = None,
    timed_out_error: Callable[[], Exception] | None = None,
) -> None:
    """Call ``done(WAIT_SLICE_S)`` until it returns true, raising a reported peer failure between slices.

    Args:
        done: a wait of at most the given seconds that says whether it finished.
        timeout: seconds after which ``timed_out_error()`` is raised; ``None`` waits without a deadline.
        timed_out_error: builds the error of a timed-out wait; given exactly when ``timeout`` is.
    """
    if (timeout is None) != (timed_out_error is None):
        raise TypeError("wait_sliced: give timeout and timed_out_error together, or neither")
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done(WAIT_SLICE_S):
        raise_if_failed()
        if deadline is not None and timed_out_error is not None and time.monotonic() >= deadline:
            raise timed_out_error()


def wait_work(work: Waitable) -> object:
    """Wait for ``work``; raise :class:`PeerFailed` as soon as a failure is reported.

    A ``torch.distributed`` work is waited for in :data:`WAIT_SLICE_S` slices; other waitables (handles,
    PS and local-reduction futures) watch the flag themselves. When the transfer itself fails (the dead
    peer's neighbours see its connection close before its heartbeats stop), the error is held for up to the
    heartbeat timeout so that it names the dead peer as it does on the other ranks.
    """
    get_future = getattr(work, "get_future", None)
    if get_future is not None and not work.is_completed():
        done = threading.Event()
        get_future().add_done_callback(lambda _: done.set())
        wait_sliced(done.wait)  # no deadline here: the process group's TAGPS_DIST_TIMEOUT ends the work
    try:
        return work.wait()
    except PeerFailed:
        raise
    except RuntimeError as exc:
        if get_future is not None and _failed.wait(_confirm_s):
            raise PeerFailed(f"{_failure} ({exc})") from exc
        raise


class Waitable(Protocol):
    """Anything that completes later: ``torch.distributed`` work objects and the PS service's futures."""

    def is_completed(self) -> bool: ...

    def wait(self) -> object: ...


def timed_out(what: str, timeout: float, hint: str = "") -> RuntimeError:
    """The error of a wait that ``TAGPS_DIST_TIMEOUT`` ended: ``what`` (e.g. "push_pull of 'w'") did not
    finish within ``timeout`` seconds, with an optional ``hint`` at the likely cause."""
    return RuntimeError(f"{what} did not finish within {timeout:.0f} s (TAGPS_DIST_TIMEOUT){hint}")


class NotifyingWaitable(Waitable, Protocol):
    """A :class:`Waitable` that can tell a polling thread it completed: once it has (at once if it has), it
    writes ``tag`` into the non-blocking pipe ``fd`` (:mod:`tagps.tag_pipe`). The last call
    counts; ``fd`` -1 cancels, and no write reaches the earlier fd after that call returns."""

    def notify(self, fd: int, tag: int) -> None: ...


class Handle:
    """A started synchronisation of one tensor.

    The handle keeps the tensors the communication reads and writes alive until :meth:`wait` returns, and
    runs ``finish`` (decompression, scaling, copying into the user's tensor) exactly once.

    Args:
        works: what must complete, in order.
        finish: called once after every work completed; returns the result tensor.
        keep: tensors the transfer uses, kept alive until the handle is waited for.
    """

    def __init__(
        self,
        works: list[Waitable],
        finish: Callable[[], torch.Tensor],
        keep: tuple[object, ...] = (),
    ) -> None:
        self._works = works
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._keep = keep
        self._result: torch.Tensor | None = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Return whether :meth:`wait` would return without blocking."""
        return self._finish is None or all(w.is_completed() for w in self._works)

    def is_completed(self) -> bool:
        """Same as :meth:`done`; makes a handle a :class:`Waitable` that other handles can wait for."""
        return self.done()

    def wait(self) -> torch.Tensor:
        """Block until the synchronisation finished and return its result."""
        with self._lock:
            if self._finish is not None:
                for work in self._works:
                    wait_work(work)
                self._result = self._finish()
                self._finish = None
                self._works = []
                self._keep = ()
            assert self._result is not None
            return self._result


class CompletedWork:
    """A work object that is already complete (a world of one, or nothing to send)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def notify(self, fd: int, tag: int) -> None:
        if fd >= 0:
            write_tag(fd, tag)
