"""The adapter's process-wide state and the one helper that starts every summation.

``push_pull`` and friends and ``DistributedOptimizer`` sum through :func:`start_sum`, which compresses,
hands the tensor to the chosen method (a ``torch.distributed`` all-reduce or the PS service) and returns a
:class:`~tagps.comm.handle.Handle` whose ``wait()`` decompresses, scales and writes the result back.
"""

from __future__ import annotations

import atexit
import itertools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tagps import kernels
from tagps.comm import collectives
from tagps.comm.handle import Handle, Waitable, failure
from tagps.config import CommConfig, comm_config
from tagps.heap import keep_freed_buffers
from tagps.torch.compression import Compressor, NoneCompressor

if TYPE_CHECKING:
    from tagps.comm.ps_service import PSService

__all__ = ["METHODS", "State", "default_method", "init", "is_initialized", "shutdown", "start_sum", "state"]

METHODS = ("allreduce", "ps", "sfb", "none")


@dataclass
class State:
    """What :func:`tagps.torch.init` set up; :func:`tagps.torch.shutdown` tears it down."""

    cfg: CommConfig
    ps: PSService | None = None  # created on first use of the ps method
    handles: set[Handle] = field(default_factory=set)
    optimizers: itertools.count = field(default_factory=itertools.count)

    def ps_service(self) -> PSService:
        """Return the PS service (intra-machine reduction plus the summation servers), starting it once."""
        if self.ps is None:
            from tagps.comm.ps_service import PSService

            self.ps = PSService(self.cfg)
        return self.ps


_state: State | None = None
_atexit_registered = False


def init() -> State:
    """Create the process-wide state from the environment (idempotent), bind this local rank to its GPU
    when the job uses NCCL, and join the process group.

    Raises:
        tagps.config.ConfigError: a malformed variable, or more local ranks than GPUs under NCCL.
    """
    global _state, _atexit_registered
    if _state is None:
        cfg = comm_config(os.environ)
        # Every step frees and allocates tensor-sized buffers (the optimizer's temporaries, received
        # messages); glibc would fault each one in afresh (tagps.heap).
        keep_freed_buffers()
        if "TAGPS_NUM_THREADS" not in os.environ:
            # The summation kernels (local reduction, fusion) keep to torch's thread budget: their OpenMP
            # team on all cores made a quota'd CPU worker's spare thread spin away the quota training needs.
            kernels.set_num_threads(torch.get_num_threads())
        # Before the process group: NCCL picks each rank's GPU from the current device.
        collectives.bind_device(cfg)
        collectives.init_process_group(cfg)
        _state = State(cfg)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
    return _state


def shutdown() -> None:
    """Wait for outstanding handles, stop the PS service and leave the process group.

    Once a peer is known dead (:func:`tagps.comm.handle.failure`), outstanding handles are not waited for:
    they could only fail.
    """
    global _state
    if _state is None:
        return
    try:
        for handle in list(_state.handles):
            if failure() is not None:
                break
            handle.wait()
        if _state.ps is not None:
            _state.ps.close()
    finally:
        _state = None
        collectives.shutdown_process_group()


def is_initialized() -> bool:
    """Return whether :func:`init` ran and :func:`shutdown` did not since."""
    return _state is not None


def state() -> State:
    """Return the state, or raise if :func:`tagps.torch.init` was not called."""
    if _state is None:
        raise RuntimeError("tagps.torch is not initialised: call tagps.torch.init() first")
    return _state


def default_method(cfg: CommConfig) -> str:
    """Return the method used without a strategy: ``ps`` when summation servers exist, else ``allreduce``."""
    return "ps" if cfg.num_server > 0 else "allreduce"


def start_sum(
    tensor: torch.Tensor,
    *,
    method: str,
    name: str,
    priority: int = 0,
    compression: type[Compressor] = NoneCompressor,
    prescale: float = 1.0,
    postscale: float = 1.0,
    group: object | None = None,
) -> Handle:
    """Start summing ``tensor`` in place over the workers and return its handle.

    The result written back into ``tensor`` is

    .. math::
        t \\leftarrow \\text{postscale} \\cdot \\sum_r \\text{prescale}_r \\cdot t_r

    Args:
        tensor: contiguous tensor, overwritten with the result when the handle is waited for.
        method: ``allreduce`` or ``ps``.
        name: key of the tensor in the PS (the same on every worker).
        priority: PS scheduling priority (higher goes first).
        compression: applied after ``prescale`` and undone before ``postscale``.
        prescale: this worker's factor, applied before sending (uneven batch shares).
        postscale: factor applied to the sum (1/size for an average).
        group: for ``allreduce``, the ``torch.distributed`` subgroup to sum over (default: every worker).
    """
    st = state()
    if not tensor.is_contiguous():
        raise ValueError(f"tensor {name!r} must be contiguous to be synchronised in place")
    if prescale != 1.0:
        tensor.mul_(prescale)
    wire, ctx = compression.compress(tensor)
    work: Waitable
    if method == "allreduce":
        work = collectives.all_reduce_async(wire, group)
    elif method == "ps":
        work = st.ps_service().push_pull_async(name, wire, priority)
    else:
        raise ValueError(f"start_sum cannot sum with method {method!r}; use allreduce or ps")

    def finish() -> torch.Tensor:
        result = compression.decompress(wire, ctx)
        if result is not tensor:
            tensor.copy_(result)
        if postscale != 1.0:
            tensor.mul_(postscale)
        return tensor

    return Handle([work], finish, keep=(wire,))
