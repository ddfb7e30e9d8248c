"""Broadcasts that make replicas start equal: parameters, optimizer state, arbitrary objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from tagps.torch import ops

__all__ = ["broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def _check_root(root_rank: int) -> None:
    size = ops.state().cfg.size
    if not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be a rank in [0, {size}), got {root_rank!r}")


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int
) -> None:
    """Overwrite, in place, every tensor in ``params`` with its value on ``root_rank``.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()`` (the same names on every worker).
        root_rank: the rank whose values win.
    """
    _check_root(root_rank)
    items = sorted(params.items() if isinstance(params, Mapping) else params, key=lambda kv: kv[0])
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"params[{name!r}] is a {type(tensor).__name__}, not a tensor")
        if ops.state().cfg.size > 1:
            dist.broadcast(tensor.detach(), src=root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Return ``root_rank``'s ``obj`` on every worker (pickled; keep it small).

    Args:
        obj: any picklable object (ignored on the other ranks).
        root_rank: the rank whose object wins.
        name: accepted for Horovod compatibility; unused.
    """
    _check_root(root_rank)
    box = [obj]
    if ops.state().cfg.size > 1:
        dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make every worker's optimizer state (hyperparameters and buffers) equal to ``root_rank``'s.

    Args:
        optimizer: a torch optimizer or a ``DistributedOptimizer`` over the same parameters everywhere.
        root_rank: the rank whose state wins.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    state = broadcast_object(optimizer.state_dict(), root_rank)
    optimizer.load_state_dict(state)
