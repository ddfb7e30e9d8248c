"""Horovod's process sets: subsets of the workers that run collectives among themselves.

A :class:`ProcessSet` is a sorted list of global ranks backed by a ``torch.distributed`` subgroup. As in
Horovod, registering or removing one is collective: every worker of the job calls :func:`add_process_set`
(or passes the same sets to ``init(process_sets=...)``) with the same ranks in the same order, members or
not. Collectives take ``process_set=``; root ranks stay global ranks, as in Horovod.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from tagps.comm.collectives import run_blocking
from tagps.comm.handle import wait_work
from tagps.torch import ops

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]


class ProcessSet:
    """A set of worker ranks that run collectives together.

    Args:
        ranks: the global ranks of the set (any order, no repeats); ``[]`` for :data:`global_process_set`,
            which stands for every worker.

    Attributes:
        ranks: the sorted ranks (every rank for the global set once initialised).
        process_set_id: ``0`` for the global set, a positive id once registered, ``None`` before and after
            removal.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        ranks = sorted(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet needs a list of integer ranks, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must not repeat, got {ranks!r}")
        self.ranks: list[int] = ranks
        self.process_set_id: int | None = None
        self._group: Any = None  # the torch.distributed subgroup; None for the global set

    def _members(self) -> list[int]:
        return list(range(ops.state().cfg.size)) if self.process_set_id == 0 else self.ranks

    def size(self) -> int | None:
        """Return the number of ranks in the set, or ``None`` if it is not registered."""
        if self.process_set_id is None:
            return None
        return len(self._members())

    def rank(self) -> int | None:
        """Return this process's rank within the set, or ``None`` if the set is not registered.

        Raises:
            ValueError: this process is not in the set.
        """
        if self.process_set_id is None:
            return None
        me = ops.state().cfg.rank
        members = self._members()
        if me not in members:
            raise ValueError("Process is not part of provided process set.")
        return members.index(me)

    def included(self) -> bool | None:
        """Return whether this process is in the set (``None`` before the set's ranks are known)."""
        if self.process_set_id == 0:
            return True
        if not self.ranks:
            return None
        return ops.state().cfg.rank in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registered: dict[int, ProcessSet] = {}
_next_id = 1


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every worker (collective) and return it.

    Args:
        process_set: a :class:`ProcessSet` or its ranks; the same on every worker.

    Returns:
        The registered set (``process_set_id`` assigned, the same on every worker).

    Raises:
        ValueError: ranks outside the job, a set with these ranks already registered, or workers passing
            different ranks (raised on every worker).
    """
    global _next_id
    size = ops.state().cfg.size
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    if not ps.ranks or not all(0 <= r < size for r in ps.ranks):
        raise ValueError(f"process set ranks must be a non-empty subset of [0, {size}), got {ps.ranks}")
    if size > 1:
        everyone: list[Any] = [None] * size
        run_blocking(lambda: dist.all_gather_object(everyone, ps.ranks))
        differing = [r for r, ranks in enumerate(everyone) if ranks != ps.ranks]
        if differing:
            raise ValueError(
                f"add_process_set is collective and needs the same ranks on every worker: this worker passed "
                f"{ps.ranks}, worker(s) {differing} passed {[everyone[r] for r in differing]}"
            )
    # Every rank is the global set already (id 0), as Horovod counts it.
    if ps.ranks == list(range(size)) or any(other.ranks == ps.ranks for other in _registered.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    # new_group is collective over the whole job: every worker creates every subgroup, members or not.
    ps._group = run_blocking(lambda: dist.new_group(ps.ranks)) if size > 1 else None
    ps.process_set_id = _next_id
    _next_id += 1
    _registered[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every worker (collective); return whether it was registered.

    The global set is never removed (``False``).
    """
    ps_id = process_set.process_set_id
    if ps_id is None or ps_id == 0 or _registered.get(ps_id) is not process_set:
        return False
    del _registered[ps_id]
    if process_set._group is not None:
        # Tear down together: a gloo rank that closes its pairs while a peer still uses them makes that
        # peer abort in std::terminate (seen in about 1 of 5 runs of the process-set tests without this).
        wait_work(dist.barrier(async_op=True))
        dist.destroy_process_group(process_set._group)
    process_set._group = None
    process_set.process_set_id = None
    return True


def group_of(process_set: ProcessSet) -> Any:
    """Return the ``torch.distributed`` group of a registered set this process is in (``None``: every worker).

    Raises:
        ValueError: the set is not registered or does not include this process.
    """
    ops.state()
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: call add_process_set() on every worker first")
    if not process_set.included():
        raise ValueError(
            f"rank {ops.state().cfg.rank} is not part of {process_set}; only its members call its collectives"
        )
    return process_set._group


def reset() -> None:
    """Forget every registered set (at shutdown: the subgroups die with the process group)."""
    global _next_id
    for ps in _registered.values():
        ps._group = None
        ps.process_set_id = None
    _registered.clear()
    _next_id = 1
