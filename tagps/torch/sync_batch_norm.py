"""Horovod's ``SyncBatchNorm``: batch normalisation over the global batch, on CPU and GPU.

In training, every rank sums its per-channel :math:`\\sum x`, :math:`\\sum x^2` and row count, and one
differentiable allreduce (see :mod:`tagps.torch.collective_ops`) gives the statistics of the whole batch:

.. math::
    \\mu = \\frac{\\sum_r \\sum x}{N}, \\qquad \\sigma^2 = \\frac{\\sum_r \\sum x^2}{N} - \\mu^2

The gradient of that allreduce is the allreduce of the gradients, so autograd yields the exact gradient of
the global-batch normalisation without a hand-written backward. Ranks may hold different batch sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tagps.torch.collective_ops import allreduce
from tagps.torch.optimizer import Sum
from tagps.torch.process_sets import ProcessSet, global_process_set

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch normalisation whose training statistics cover every rank's batch (Horovod's ``SyncBatchNorm``).

    Args:
        num_features: channels (dim 1 of the input).
        eps: added to the variance (default 1e-5).
        momentum: running-statistics factor (default 0.1; ``None``: cumulative average).
        affine: learn a per-channel scale and shift (default ``True``).
        track_running_stats: keep running mean and variance for evaluation (default ``True``).
        process_set: the ranks whose batches are normalised together (default: every worker).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` (N, C, ...) with the global batch's statistics in training, else as BatchNorm.

        Returns:
            A tensor of ``input``'s shape and dtype.
        """
        self._check_input_dim(input)
        factor = 0.0
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias,
                not self.track_running_stats, factor, self.eps,
            )  # fmt: skip
        # Statistics in at least float32: sums of squares overflow or lose digits in 16 bits.
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        dims = [0, *range(2, x.dim())]
        count = x.new_full((1,), x.numel() // x.shape[1])
        total = allreduce(
            torch.cat([x.sum(dims), x.pow(2).sum(dims), count]), op=Sum, process_set=self.process_set
        )
        c = self.num_features
        n = total[-1]
        mean = total[:c] / n
        var = total[c : 2 * c] / n - mean.pow(2)
        if self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                unbiased = var * n / (n - 1).clamp(min=1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        shape = [1, c] + [1] * (x.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.weight is not None and self.bias is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)
