"""Gradient fusion buckets, cut the same way on every worker (``DistributedOptimizer`` and the executor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from tagps.comm.handle import Handle
from tagps.strategy.plan import CommSettings

__all__ = ["FlatBucket", "fused_sum", "fusion_units", "numel", "unit_key"]


def numel(unit: list[nn.Parameter]) -> int:
    """Elements of all the parameters of a bucket."""
    return sum(p.numel() for p in unit)


def unit_key(unit: list[nn.Parameter], keys: dict[nn.Parameter, str]) -> str:
    """PS key of a bucket: its first parameter's, with the count of the others."""
    return keys[unit[0]] if len(unit) == 1 else f"{keys[unit[0]]}+{len(unit) - 1}"


class FlatBucket(NamedTuple):
    """A bucket's flat buffer, kept between steps, and one view of it per gradient in the gradient's shape."""

    flat: torch.Tensor
    views: list[torch.Tensor]


def fused_sum(
    unit: list[nn.Parameter],
    flats: dict[int, FlatBucket],
    index: int,
    scale: float,
    start: Callable[[torch.Tensor], Handle],
) -> Handle:
    """Sum the gradients of bucket ``unit`` as one flat buffer, kept in ``flats[index]`` between steps.

    The gradients (zeros for a parameter without one) are packed and scaled by ``scale`` (the batch
    weight), ``start(flat)`` starts the in-place sum, and the returned handle's ``wait()`` unpacks the result
    into every parameter's ``grad``. Packing and unpacking go through the kept views: one foreach copy each,
    or one ``mul`` per gradient into its view when packing scales (a copy then a scale of the flat buffer
    would pass over its memory twice); three dispatches per tensor cost a CPU worker under a quota
    milliseconds per step.
    """
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in unit]
    bucket = flats.get(index)
    if bucket is None:
        flat = torch.empty(numel(unit), dtype=grads[0].dtype, device=grads[0].device)
        parts = flat.split([g.numel() for g in grads])
        bucket = flats[index] = FlatBucket(flat, [v.view_as(g) for v, g in zip(parts, grads, strict=True)])
    flat, views = bucket
    if scale == 1.0:
        torch._foreach_copy_(views, grads)
    else:
        for view, g in zip(views, grads, strict=True):
            torch.mul(g, scale, out=view)
    inner = start(flat)

    def finish() -> torch.Tensor:
        torch._foreach_copy_(grads, views)
        for p, g in zip(unit, grads, strict=True):
            if p.grad is None:
                p.grad = g
        return flat

    return Handle([inner], finish, keep=(flat,))


def fusion_units(
    order: list[nn.Parameter], method: dict[nn.Parameter, str], comm: CommSettings
) -> list[list[nn.Parameter]]:
    """Cut the launch order into units: runs of gradients with the same method (``allreduce`` or ``ps``),
    dtype and device fused up to ``comm.fusion_bytes`` (the first unit up to
    :meth:`~tagps.strategy.plan.CommSettings.first_bucket_cap`, so that the first sync starts early in
    backward), and every SFB weight alone. The cut depends only on the model, so it is the same on every
    worker."""
    units: list[list[nn.Parameter]] = []
    size = 0
    for p in order:
        nbytes = p.numel() * p.element_size()
        last = units[-1] if units else None
        cap = comm.first_bucket_cap() if len(units) == 1 else comm.fusion_bytes
        if (
            method[p] in ("allreduce", "ps")
            and last is not None
            and method[last[0]] == method[p]
            and (last[0].dtype, last[0].device) == (p.dtype, p.device)
            and size + nbytes <= cap
        ):
            last.append(p)
            size += nbytes
        else:
            units.append([p])
            size = nbytes
    return units
