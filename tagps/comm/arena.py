"""The shared-memory arena of one tensor name in the intra-machine reduction (``tagps._core.Arena``).

An arena is a file (in ``/dev/shm``) that every participant of :class:`tagps.comm.local_reduce.LocalReducer`
maps: one row per participant (its slot) and a result row. Its full size is reserved when it is created
(``posix_fallocate``), so a full filesystem is an :class:`ArenaFull` error then, naming the file, the
bytes needed and the bytes free, instead of a SIGBUS on a later write. Copies and the shard sums run in
C++ with the GIL released.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import numpy as np
import torch

from tagps import _core

__all__ = ["ArenaFull", "ShmArena"]

ArenaFull = _core.ArenaFull  # an OSError


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
        #: The result row as a tensor (it keeps the mapping alive).
        self.result = torch.frombuffer(
            self._arena, dtype=dtype, count=count, offset=slots * self._arena.row_bytes
        )

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

    def unlink(self) -> None:
        """Remove the file's name (mappings stay valid); no error when it is already gone."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _check(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != self.dtype or tensor.numel() != self.count:
            raise ValueError(
                f"arena {self.path} holds {self.count} x {self.dtype}, got {tensor.numel()} x {tensor.dtype}"
            )
