"""Gradient fusion buckets, cut the same way on every worker (``DistributedOptimizer`` and the executor)."""

from __future__ import annotations

from torch import nn

__all__ = ["fusion_units", "numel"]


def numel(unit: list[nn.Parameter]) -> int:
    """Elements of all the parameters of a bucket."""
    return sum(p.numel() for p in unit)


def fusion_units(
    order: list[nn.Parameter], method: dict[nn.Parameter, str], fusion_bytes: int
) -> list[list[nn.Parameter]]:
    """Cut the launch order into units: runs of gradients with the same method (``allreduce`` or ``ps``),
    dtype and device fused up to ``fusion_bytes``, and every SFB weight alone. The cut depends only on the
    model, so it is the same on every worker."""
    units: list[list[nn.Parameter]] = []
    size = 0
    for p in order:
        nbytes = p.numel() * p.element_size()
        last = units[-1] if units else None
        if (
            method[p] in ("allreduce", "ps")
            and last is not None
            and method[last[0]] == method[p]
            and (last[0].dtype, last[0].device) == (p.dtype, p.device)
            and size + nbytes <= fusion_bytes
        ):
            last.append(p)
            size += nbytes
        else:
            units.append([p])
            size = nbytes
    return units
