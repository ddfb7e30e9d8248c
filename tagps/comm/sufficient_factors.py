"""Sufficient factor broadcasting (SFB) for ``nn.Linear`` weights.

For a linear layer :math:`y = x W^\\top + b` the weight gradient of one batch is a product of two thin
factors, the layer input :math:`X` (rows × in) and the output gradient :math:`G` (rows × out):

.. math::
    \\nabla W = \\sum_r w_r\\, G_r^\\top X_r
             = \\big[w_1 G_1; \\dots; w_N G_N\\big]^\\top \\big[X_1; \\dots; X_N\\big]

so instead of summing an out × in matrix, every worker all-gathers the factors (rows × (in + out)) and
rebuilds the exact full gradient with one matmul. It pays off when rows × (in + out) is much smaller than
in × out: fully connected layers with small per-worker batches. The bias is summed by all-reduce.

Factors are recorded by a process-wide module forward hook (no model reference needed) and by a tensor
hook on the layer's output; calls of the same layer within one step, or over several backward passes,
are concatenated, which keeps the result exact.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from tagps.comm import collectives
from tagps.comm.handle import Handle

__all__ = ["SFBNotApplicable", "SufficientFactors"]


class SFBNotApplicable(ValueError):
    """A parameter marked ``sfb`` is not (only) the weight of an ``nn.Linear`` module call."""


class SufficientFactors:
    """Record the sufficient factors of chosen ``nn.Linear`` weights and rebuild their full gradients.

    Args:
        weights: parameter → its name, for every weight synchronised by SFB. Each must be 2-D.

    Raises:
        SFBNotApplicable: when a parameter cannot be a linear weight (not 2-D).
    """

    def __init__(self, weights: dict[nn.Parameter, str]) -> None:
        for p, name in weights.items():
            if p.dim() != 2:
                raise SFBNotApplicable(
                    f"sfb applies to nn.Linear weights only; {name!r} has shape {tuple(p.shape)}. "
                    "Use allreduce or ps for it (a Linear bias marked sfb is all-reduced)."
                )
        self._names = {id(p): name for p, name in weights.items()}
        # id(weight) -> list of [input rows, output-gradient rows or None]
        self._factors: dict[int, list[list[torch.Tensor | None]]] = {}
        self._checked: set[int] = set()
        self._hook = nn.modules.module.register_module_forward_hook(_make_hook(weakref.ref(self)))

    def close(self) -> None:
        """Stop recording (removes the process-wide forward hook)."""
        self._hook.remove()
        self._factors.clear()

    def clear(self) -> None:
        """Forget recorded factors (after a step, or after a forward pass that had no backward)."""
        self._factors.clear()

    def _record(self, module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
        weight = getattr(module, "weight", None)
        if (
            not isinstance(module, nn.Linear)
            or weight is None
            or id(weight) not in self._names
            or not isinstance(output, torch.Tensor)
            or not output.requires_grad
        ):
            return
        x = inputs[0]
        assert isinstance(x, torch.Tensor)
        slot: list[torch.Tensor | None] = [x.detach().reshape(-1, module.in_features), None]
        self._factors.setdefault(id(weight), []).append(slot)
        out_features = module.out_features

        def keep_grad(grad: torch.Tensor) -> None:
            slot[1] = grad.detach().reshape(-1, out_features)

        output.register_hook(keep_grad)

    def _local(self, weight: nn.Parameter, backward_ran: bool) -> tuple[torch.Tensor, torch.Tensor]:
        slots = [s for s in self._factors.pop(id(weight), []) if s[1] is not None]
        name = self._names[id(weight)]
        if not slots:
            if backward_ran:
                raise SFBNotApplicable(
                    f"{name!r} is marked sfb and has a gradient, but no nn.Linear module call using it "
                    "reached the loss in this step (is it used through F.linear, e.g. "
                    "MultiheadAttention.out_proj?). Use allreduce or ps for it."
                )
            out_f, in_f = weight.shape
            return weight.new_zeros((0, in_f)), weight.new_zeros((0, out_f))
        xs = torch.cat([s[0] for s in slots])  # type: ignore[misc]
        gs = torch.cat([s[1] for s in slots])  # type: ignore[misc]
        if id(weight) not in self._checked:
            self._check(weight, name, xs, gs)
        return xs, gs

    def _check(self, weight: nn.Parameter, name: str, xs: torch.Tensor, gs: torch.Tensor) -> None:
        """Compare the local gradient with the factors' product along a random direction (first step only)."""
        assert weight.grad is not None
        # A private generator: the user's random stream (dropout masks, data order) stays untouched.
        generator = torch.Generator(device=weight.device).manual_seed(len(self._checked))
        probe = torch.randn(weight.shape[1], dtype=weight.dtype, device=weight.device, generator=generator)
        lhs = weight.grad @ probe
        rhs = gs.t() @ (xs @ probe)
        scale = float(lhs.abs().max()) + float(rhs.abs().max()) + 1e-12
        if float((lhs - rhs).abs().max()) > 1e-3 * scale:
            raise SFBNotApplicable(
                f"{name!r} gets gradient from outside its nn.Linear calls (tied or shared weights?), so "
                "its sufficient factors do not give its gradient. Use allreduce or ps for it."
            )
        self._checked.add(id(weight))

    def start(
        self, weight: nn.Parameter, scale: float, backward_ran: bool, group: object | None = None
    ) -> Handle:
        """Gather the factors of ``weight`` from every worker and start rebuilding its gradient.

        Args:
            weight: an SFB weight whose backward pass is complete on this worker.
            scale: this worker's weight in the sum (its batch share for an average, 1 for a sum).
            backward_ran: whether backward produced a gradient for ``weight`` in this step; without one
                this worker contributes no factors.
            group: the ``torch.distributed`` subgroup of the replicas (default: every worker).

        Returns:
            A handle whose ``wait()`` writes :math:`\\sum_r w_r G_r^\\top X_r` into ``weight.grad``.
        """
        xs, gs = self._local(weight, backward_ran)
        out_f = weight.shape[0]
        packed = torch.cat([gs * scale, xs], dim=1)
        work, gathered = collectives.all_gather_varlen_async(packed, group)

        def finish() -> torch.Tensor:
            rows = gathered()
            if weight.grad is None:
                weight.grad = torch.empty_like(weight)
            # Written in place: no fresh out x in buffer (and its page faults) per step.
            torch.matmul(rows[:, :out_f].t(), rows[:, out_f:], out=weight.grad)
            return weight.grad

        return Handle([work], finish, keep=(packed,))


def _make_hook(ref: Callable[[], SufficientFactors | None]) -> Callable[..., None]:
    def hook(module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
        recorder = ref()
        if recorder is not None:
            recorder._record(module, inputs, output)

    return hook
