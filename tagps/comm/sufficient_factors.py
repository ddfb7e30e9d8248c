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

The local gradient :math:`G^\top X` of an SFB weight is never used (the rebuilt sum replaces it), so from the
second step on the layer skips it: once the first step has checked that the factors give the weight's whole
gradient, each ``nn.Linear`` that called the weight runs :class:`_FactoredLinear`, which gives the input and
the bias their gradients, records the output gradient, and hands the weight none. That saves one
rows × in × out matmul per call, the work the simulator never charges for an SFB weight.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
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
        # id(weight) -> the Linear modules that called it with the full backward (not yet factored)
        self._callers: dict[int, weakref.WeakSet[nn.Linear]] = {}
        self._factored: weakref.WeakSet[nn.Linear] = weakref.WeakSet()
        self._outside: dict[int, Any] = {}  # id(weight) -> the hook that refuses gradient from elsewhere
        self._hook = nn.modules.module.register_module_forward_hook(_make_hook(weakref.ref(self)))

    def close(self) -> None:
        """Stop recording: remove the forward hook and give the factored layers their own forward back."""
        self._hook.remove()
        for module in list(self._factored):
            module.__dict__.pop("forward", None)
        for handle in self._outside.values():
            handle.remove()
        self._factored = weakref.WeakSet()
        self._outside.clear()
        self._factors.clear()

    def clear(self) -> None:
        """Forget recorded factors (after a step, or after a forward pass that had no backward).

        Layers whose weight passed the first step's check skip their weight's local gradient from now on.
        """
        self._factors.clear()
        for wid in [w for w in self._callers if w in self._checked]:
            for module in list(self._callers.pop(wid)):
                self._factor(module)

    def _factor(self, module: nn.Linear) -> None:
        """Make ``module`` run :class:`_FactoredLinear`, unless it overrides ``nn.Linear.forward``."""
        if type(module).forward is not nn.Linear.forward or module in self._factored:
            return
        module.forward = _FactoredForward(self, module)  # type: ignore[method-assign]
        self._factored.add(module)
        weight = module.weight
        if id(weight) not in self._outside:
            self._outside[id(weight)] = weight.register_hook(
                functools.partial(_refuse_outside_gradient, weakref.ref(self), id(weight))
            )

    def _slot(self, module: nn.Linear, x: torch.Tensor) -> list[torch.Tensor | None]:
        slot: list[torch.Tensor | None] = [x.detach().reshape(-1, module.in_features), None]
        self._factors.setdefault(id(module.weight), []).append(slot)
        return slot

    def _record(self, module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
        weight = getattr(module, "weight", None)
        if (
            not isinstance(module, nn.Linear)
            or module in self._factored
            or weight is None
            or id(weight) not in self._names
            or not isinstance(output, torch.Tensor)
            or not output.requires_grad
        ):
            return
        x = inputs[0]
        assert isinstance(x, torch.Tensor)
        slot = self._slot(module, x)
        self._callers.setdefault(id(weight), weakref.WeakSet()).add(module)
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


class _FactoredLinear(torch.autograd.Function):
    """:math:`y = x W^\top + b` whose backward records the output gradient and gives ``W`` none.

    ``W`` still enters as an input that requires grad, so its post-accumulate hook fires when the call's
    backward is done (with nothing accumulated): the gradient sync starts exactly as for a full backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slot: list[torch.Tensor | None],
    ) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.slot = slot
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:  # type: ignore[override]
        (weight,) = ctx.saved_tensors
        rows = grad.reshape(-1, weight.shape[0])
        ctx.slot[1] = rows.detach()
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_bias = rows.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


class _FactoredForward:
    """The ``forward`` of a factored ``nn.Linear``: :class:`_FactoredLinear` while its recorder lives.

    Holds both weakly (no cycle through the module), and pickles or deep-copies as the plain
    ``nn.Linear.forward`` of the copy, so ``torch.save(model)`` and ``copy.deepcopy`` keep working.
    """

    def __init__(self, recorder: SufficientFactors, module: nn.Linear) -> None:
        self._recorder = weakref.ref(recorder)
        self._module = weakref.ref(module)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module, recorder = self._module(), self._recorder()
        assert module is not None  # it holds this object
        if recorder is None or not torch.is_grad_enabled() or id(module.weight) not in recorder._names:
            return nn.Linear.forward(module, x)  # no recorder, no backward, or a weight replaced since
        return _FactoredLinear.apply(x, module.weight, module.bias, recorder._slot(module, x))

    def __reduce__(self) -> tuple[Any, ...]:
        return functools.partial, (nn.Linear.forward, self._module())


def _refuse_outside_gradient(
    ref: Callable[[], SufficientFactors | None], wid: int, grad: torch.Tensor | None
) -> None:
    """Hook on a factored weight: its factored calls add nothing, so a gradient comes from another use,
    unless a Linear not factored yet called the weight in this step (its factors are recorded; the step's
    end factors it).

    Once the recorder is gone (never closed, e.g. with a dropped ``DistributedModel``), the layers run their
    own forward again and the hook lets every gradient through.
    """
    recorder = ref()
    if grad is not None and recorder is not None and wid not in recorder._callers:
        raise SFBNotApplicable(
            f"{recorder._names[wid]!r} gets gradient from outside its nn.Linear calls (tied or shared "
            "weights?), so its sufficient factors do not give its gradient. Use allreduce or ps for it."
        )


def _make_hook(ref: Callable[[], SufficientFactors | None]) -> Callable[..., None]:
    def hook(module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
        recorder = ref()
        if recorder is not None:
            recorder._record(module, inputs, output)

    return hook
