"""Broadcasts and gathers of whole objects: parameters, optimizer state, picklable objects.

Each takes Horovod's ``process_set=`` (every worker by default); root ranks are global ranks of the set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from tagps.comm.collectives import run_blocking
from tagps.comm.handle import wait_work
from tagps.torch.process_sets import ProcessSet, global_process_set, group_of

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def _group_and_size(process_set: ProcessSet, root_rank: int | None = None) -> tuple[Any, int]:
    """Return the set's ``torch.distributed`` group and size, checking ``root_rank`` is a member."""
    group = group_of(process_set)
    size = process_set.size()
    assert size is not None
    if root_rank is not None:
        members = process_set.ranks if process_set.process_set_id != 0 else range(size)
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in members:
            raise ValueError(f"root_rank must be a (global) rank of {process_set}, got {root_rank!r}")
    return group, size


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Overwrite, in place, every tensor in ``params`` with its value on ``root_rank``.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()`` (the same names on every worker).
        root_rank: the rank whose values win.
        process_set: the ranks that take part (default: every worker).
    """
    group, size = _group_and_size(process_set, root_rank)
    items = sorted(params.items() if isinstance(params, Mapping) else params, key=lambda kv: kv[0])
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"params[{name!r}] is a {type(tensor).__name__}, not a tensor")
        if size > 1:
            wait_work(dist.broadcast(tensor.detach(), src=root_rank, group=group, async_op=True))


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Return ``root_rank``'s ``obj`` on every worker of the set (pickled; keep it small).

    Args:
        obj: any picklable object (ignored on the other ranks).
        root_rank: the rank whose object wins.
        name: accepted for Horovod compatibility; unused.
        process_set: the ranks that take part (default: every worker).

    Returns:
        ``root_rank``'s object.
    """
    group, size = _group_and_size(process_set, root_rank)
    box = [obj]
    if size > 1:
        run_blocking(lambda: dist.broadcast_object_list(box, src=root_rank, group=group))
    return box[0]


def allgather_object(
    obj: object, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[object]:
    """Return every worker's ``obj`` (pickled), in rank order of the set.

    Args:
        obj: any picklable object.
        name: accepted for Horovod compatibility; unused.
        process_set: the ranks that take part (default: every worker).

    Returns:
        One object per rank of the set.
    """
    group, size = _group_and_size(process_set)
    gathered: list[object] = [obj] if size == 1 else [None] * size
    if size > 1:
        run_blocking(lambda: dist.all_gather_object(gathered, obj, group=group))
    return gathered


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """Make every worker's optimizer state (hyperparameters and buffers) equal to ``root_rank``'s.

    As in Horovod, an optimizer that has no state yet (it never stepped) is first given one, by a step with
    zero gradients on every parameter that requires one, so that ranks agree even before the first step
    (``step`` counts and moment buffers included). A ``DistributedOptimizer`` takes that step without
    synchronising. Unlike Horovod, the parameters and gradients are then put back as they were, so that
    optimizers with weight decay do not move the weights.

    Args:
        optimizer: a torch optimizer or a ``DistributedOptimizer`` over the same parameters everywhere.
        root_rank: the rank whose state wins.
        process_set: the ranks that take part (default: every worker).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not optimizer.state_dict()["state"] and not isinstance(optimizer, torch.optim.LBFGS):
        _initialise_state(optimizer)
    state = broadcast_object(optimizer.state_dict(), root_rank, process_set=process_set)
    optimizer.load_state_dict(state)


def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state with one step on zero gradients, leaving parameters and gradients as
    they were (LBFGS is left out: its step needs a closure)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    skip = getattr(optimizer, "skip_synchronize", None)  # a DistributedOptimizer: other ranks may not step
    with skip() if skip is not None else contextlib.nullcontext():
        optimizer.step()
    with torch.no_grad():
        for p, value, grad in saved:
            p.copy_(value)
            p.grad = grad
