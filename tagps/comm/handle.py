"""One in-flight synchronisation: what every communication method hands back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["CompletedWork", "Handle", "Waitable"]


class Waitable(Protocol):
    """Anything that completes later: ``torch.distributed`` work objects and the PS service's futures."""

    def is_completed(self) -> bool: ...

    def wait(self) -> object: ...


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
                    work.wait()
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
