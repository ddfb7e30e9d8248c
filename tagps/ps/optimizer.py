"""Server-side optimizers: the summation server updates its copy of the weights with the fused kernels.

Workers push gradients; once a round's gradients are summed the server applies one step of the
optimizer named by ``TAGPS_SERVER_OPTIMIZER`` to the summed gradient :math:`g = \\sum_w g_w` (not the
mean: scale the learning rate by :math:`1/W` for the mean), exactly as ``torch.optim`` would with the same
hyperparameters, and pulls return the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tagps import kernels
from tagps.config import ServerOptimizerConfig

__all__ = ["OptimizerState", "ServerOptimizer"]


@dataclass
class OptimizerState:
    """The per-key mutable state of a server-side optimizer."""

    step: int = 0
    buffers: dict[str, np.ndarray] = field(default_factory=dict)


class ServerOptimizer:
    """Apply ``config``'s optimizer to float32 or float64 weights.

    Args:
        config: optimizer name and hyperparameters; ``name`` must not be ``"none"``.
    """

    def __init__(self, config: ServerOptimizerConfig) -> None:
        if config.name == "none":
            raise ValueError("ServerOptimizer needs TAGPS_SERVER_OPTIMIZER=sgd|adam|adamw|rmsprop")
        self.config = config

    def buffer_names(self) -> tuple[str, ...]:
        """Names of the per-key state buffers this optimizer keeps (all of the weights' dtype and size)."""
        c = self.config
        if c.name in ("adam", "adamw"):
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if c.amsgrad else ("exp_avg", "exp_avg_sq")
        if c.name == "sgd":
            return ("momentum_buffer",) if c.momentum else ()
        names = ["square_avg"]
        if c.momentum:
            names.append("momentum_buffer")
        if c.centered:
            names.append("grad_avg")
        return tuple(names)

    def new_state(self, count: int, dtype: np.dtype | type = np.float32) -> OptimizerState:
        """Return zeroed state for a key of ``count`` elements of ``dtype`` (float32 or float64)."""
        return OptimizerState(0, {n: np.zeros(count, dtype) for n in self.buffer_names()})

    def step(self, param: np.ndarray, grad: np.ndarray, state: OptimizerState) -> None:
        """Update ``param`` in place with one step on ``grad``, as ``torch.optim`` does."""
        c, b = self.config, state.buffers
        state.step += 1
        if c.name in ("adam", "adamw"):
            update = kernels.adam_step if c.name == "adam" else kernels.adamw_step
            update(
                param,
                grad,
                b["exp_avg"],
                b["exp_avg_sq"],
                b.get("max_exp_avg_sq"),
                step=state.step,
                lr=c.lr,
                betas=c.betas,
                eps=c.eps,
                weight_decay=c.weight_decay,
                amsgrad=c.amsgrad,
                maximize=c.maximize,
            )
        elif c.name == "sgd":
            kernels.sgd_step(
                param,
                grad,
                b.get("momentum_buffer"),
                lr=c.lr,
                momentum=c.momentum,
                dampening=c.dampening,
                nesterov=c.nesterov,
                weight_decay=c.weight_decay,
                maximize=c.maximize,
                first_step=state.step == 1,
            )
        else:
            kernels.rmsprop_step(
                param,
                grad,
                b["square_avg"],
                b.get("momentum_buffer"),
                b.get("grad_avg"),
                lr=c.lr,
                alpha=c.alpha,
                eps=c.eps,
                weight_decay=c.weight_decay,
                momentum=c.momentum,
                centered=c.centered,
                maximize=c.maximize,
            )
