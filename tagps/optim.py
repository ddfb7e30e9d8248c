"""torch optimizers whose step runs tagps's fused CPU kernels.

``tagps.optim.SGD``, ``Adam``, ``AdamW`` and ``RMSprop`` subclass the torch.optim classes of the same name:
same constructor arguments and defaults, same state names (``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``, ``momentum_buffer``, ``square_avg``, ``grad_avg``), so their ``state_dict`` loads into
torch's optimizers and back. Each parameter is updated by one fused pass
(:mod:`tagps.kernels`) instead of torch's several element-wise kernels; the numbers match torch's
single-tensor implementation to rounding.

Parameters must be dense, contiguous float32 or float64 CPU tensors. ``fused``, ``capturable`` and
``differentiable`` are rejected; ``foreach`` is accepted and has no effect (there is one implementation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tagps import kernels

__all__ = ["SGD", "Adam", "AdamW", "RMSprop"]

_UNSUPPORTED = ("fused", "capturable", "differentiable")


def _check_param(p: torch.Tensor, owner: str) -> None:
    """A dense float32/float64 CPU parameter with a dense gradient."""
    if p.device.type != "cpu":
        raise TypeError(f"{owner} runs on CPU tensors; got a parameter on {p.device}")
    if p.is_complex():
        raise TypeError(f"{owner} does not support complex parameters (dtype {p.dtype})")
    if p.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{owner} runs on float32 or float64 parameters; got {p.dtype}")
    if p.layout != torch.strided or p.grad.layout != torch.strided:
        raise TypeError(f"{owner} does not support sparse parameters or gradients")


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _step_tensor() -> torch.Tensor:
    # torch keeps `step` as a 0-dim tensor of its "scalar dtype" (float64 only under a float64 default).
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(0.0, dtype=dtype)


class _KernelOptimizer(torch.optim.Optimizer):
    """Shared step loop: validates each parameter and hands it to the subclass's ``_update``."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, rejecting the torch options the kernels do not implement."""
        for key in _UNSUPPORTED:
            if param_group.get(key, self.defaults.get(key)):
                raise ValueError(f"tagps.optim.{type(self).__name__} does not support {key}=True")
        super().add_param_group(param_group)

    def _update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owner = f"tagps.optim.{type(self).__name__}"
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_param(p, owner)
                self._update(p, group, self.state[p])
        return loss


class SGD(_KernelOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` with the step of :func:`tagps.kernels.sgd_step`."""

    def _update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        momentum = float(group["momentum"])
        first = False
        if momentum != 0.0 and state.get("momentum_buffer") is None:
            state["momentum_buffer"] = torch.empty_like(p, memory_format=torch.preserve_format)
            first = True
        kernels.sgd_step(
            p, p.grad, state.get("momentum_buffer") if momentum != 0.0 else None,
            lr=float(group["lr"]), momentum=momentum, dampening=float(group["dampening"]),
            nesterov=bool(group["nesterov"]), weight_decay=float(group["weight_decay"]),
            maximize=bool(group["maximize"]), first_step=first,
        )


class Adam(_KernelOptimizer, torch.optim.Adam):
    """``torch.optim.Adam`` with the step of :func:`tagps.kernels.adam_step` (or ``adamw_step`` when
    ``decoupled_weight_decay=True``)."""

    def _update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        if len(state) == 0:
            state["step"] = _step_tensor()
            state["exp_avg"] = _zeros(p)
            state["exp_avg_sq"] = _zeros(p)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = _zeros(p)
        state["step"] += 1
        fn = kernels.adamw_step if group["decoupled_weight_decay"] else kernels.adam_step
        beta1, beta2 = group["betas"]
        fn(
            p, p.grad, state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq"),
            step=int(state["step"].item()), lr=float(group["lr"]), betas=(float(beta1), float(beta2)),
            eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
            amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]),
        )


class AdamW(_KernelOptimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` with the step of :func:`tagps.kernels.adamw_step`."""

    _update = Adam._update


class RMSprop(_KernelOptimizer, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` with the step of :func:`tagps.kernels.rmsprop_step`."""

    def _update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        momentum = float(group["momentum"])
        if len(state) == 0:
            state["step"] = _step_tensor()
            state["square_avg"] = _zeros(p)
            if momentum > 0:
                state["momentum_buffer"] = _zeros(p)
            if group["centered"]:
                state["grad_avg"] = _zeros(p)
        state["step"] += 1
        kernels.rmsprop_step(
            p, p.grad, state["square_avg"], state.get("momentum_buffer"), state.get("grad_avg"),
            lr=float(group["lr"]), alpha=float(group["alpha"]), eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]), momentum=momentum,
            centered=bool(group["centered"]), maximize=bool(group["maximize"]),
        )
