"""The shared-memory arena of one tensor name in the intra-machine reduction (``tagps._core.Arena``).

An arena is a file (in ``/dev/shm``) that every participant of :class:`tagps.comm.local_reduce.LocalReducer`
maps: a control block, one row per participant (its slot) and a result row. Its full size is reserved when
it is created (``posix_fallocate``), so a full filesystem is an :class:`ArenaFull` error then, naming the
file, the bytes needed and the bytes free, instead of a SIGBUS on a later write. Copies and the shard sums
run in C++ with the GIL released.

The control block carries the rounds of a tensor the root sums alone, without messages: a participant
marks its slot ready for round ``seq`` (:meth:`ShmArena.mark_ready`), the root sees every slot ready
(:meth:`ShmArena.all_ready`) and publishes the round once the result row holds it
(:meth:`ShmArena.publish`), and the participants wait for that on a futex (:meth:`ShmArena.wait_done`,
the GIL released).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import numpy as np
import torch

from tagps import _core

__all__ = ["ALL_READY", "DONE", "FAILED", "NOT_READY", "SHAPES_DIFFER", "TIMED_OUT", "ArenaFull", "ShmArena"]

ArenaFull = _core.ArenaFull  # an OSError
# ShmArena.all_ready's answers.
NOT_READY, ALL_READY, SHAPES_DIFFER = 0, 1, 2
# ShmArena.wait_done's answers.
DONE, FAILED, TIMED_OUT = 0, 1, 2


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """The numpy uint8 view of a contiguous CPU tensor's memory (any dtype, bfloat16 included)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


class ShmArena:
    """One participant's mapping of an arena: ``slots`` input rows and a result row of ``count`` elements.

    Args:
        path: the arena's file; created if absent (every participant opens the same path).
        dtype: element type, one of the :func:`tagps.kernels.sum_into` dtypes.
        slots: participants (one input row each).
        count: elements per row.

    Raises:
        ArenaFull: the file's filesystem has no room for ``(slots + 1) * count`` elements (the file is
            removed).
        TypeError: ``dtype`` is not one the kernels sum.
    """

    def __init__(self, path: str, dtype: torch.dtype, slots: int, count: int) -> None:
        code = _core.DType.__members__.get(str(dtype).removeprefix("torch."))
        if code is None:
            raise TypeError(f"the shared-memory reduction cannot sum {dtype}")
        self.path = path
        self.dtype = dtype
        self.count = count
        self._arena = _core.Arena(path, int(code), slots, count)
        self._unlinked = False  # by this mapping (the root unlinks once every participant mapped it)
        #: Bytes of the control block before the rows (row ``i`` starts ``i`` rows after it).
        self.header_bytes: int = self._arena.header_bytes
        offset = self.header_bytes + slots * self._arena.row_bytes
        #: The result row as a tensor (it keeps the mapping alive).
        self.result = torch.frombuffer(self._arena, dtype=dtype, count=count, offset=offset)

    def write(self, slot: int, tensor: torch.Tensor) -> None:
        """Copy the contiguous CPU ``tensor`` (``count`` elements of ``dtype``) into slot ``slot``."""
        self._check(tensor)
        self._arena.copy_in(slot, _bytes(tensor))

    def read_result(self, tensor: torch.Tensor) -> None:
        """Copy the result row into the contiguous CPU ``tensor`` (``count`` elements of ``dtype``)."""
        self._check(tensor)
        self._arena.copy_out(_bytes(tensor))

    def reduce_shard(self, groups: Sequence[Sequence[int]], start: int, stop: int) -> None:
        """Sum elements ``[start, stop)``: each later group's slots into its first slot, then the first
        group's slots and the other groups' first slots into the result row, the first group's slots left
        as they were (each step rounded as :func:`tagps.kernels.sum_into`)."""
        self._arena.reduce_shard([list(g) for g in groups], start, stop)

    def mark_ready(self, slot: int, seq: int) -> None:
        """Mark slot ``slot`` written for round ``seq`` (with this mapping's dtype and count)."""
        self._arena.mark_ready(slot, seq)

    def all_ready(self, seq: int) -> int:
        """:data:`ALL_READY` when every slot is marked ready for round ``seq`` with this mapping's dtype and
        count, :data:`SHAPES_DIFFER` when some were written with others, else :data:`NOT_READY`."""
        return self._arena.all_ready(seq)

    def publish(self, seq: int) -> None:
        """The result row holds round ``seq``'s sum: wake every participant waiting for it."""
        self._arena.publish(seq)

    def fail(self) -> None:
        """Fail the reduction for good: every :meth:`wait_done` answers :data:`FAILED` from now on."""
        self._arena.fail()

    def done(self, seq: int) -> bool:
        """Whether round ``seq`` was published."""
        return self._arena.done(seq)

    def wait_done(self, seq: int, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for round ``seq``: :data:`DONE`, :data:`FAILED` or
        :data:`TIMED_OUT`."""
        return self._arena.wait_done(seq, timeout)

    def unlink(self) -> None:
        """Remove the file's name (mappings stay valid); no error when it is already gone."""
        if self._unlinked:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._unlinked = True

    def _check(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != self.dtype or tensor.numel() != self.count:
            raise ValueError(
                f"arena {self.path} holds {self.count} x {self.dtype}, got {tensor.numel()} x {tensor.dtype}"
            )
