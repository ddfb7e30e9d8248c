"""PyTorch adapter: the ``byteps.torch`` / ``horovod.torch`` API on tagps's runtime.

Switch a training script by changing its import to ``import tagps.torch as bps`` (or ``as hvd``) and start
it with ``bpslaunch``. Every worker process joins one ``torch.distributed`` group (gloo on CPU, NCCL on
CUDA); the ``ps`` method goes through the intra-machine reduction and the summation servers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tagps.comm import collectives
from tagps.comm.handle import Handle
from tagps.torch import ops
from tagps.torch.compression import Compression, Compressor
from tagps.torch.executor import DistributedModel, distribute
from tagps.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from tagps.torch.optimizer import Adasum, Average, DistributedOptimizer, ReduceOp, Sum

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedModel",
    "DistributedOptimizer",
    "Handle",
    "ReduceOp",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "distribute",
    "gloo_built",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_async_inplace",
    "push_pull_inplace",
    "rank",
    "shutdown",
    "size",
    "synchronize",
]


def init() -> None:
    """Join the job described by the ``DMLC_*``/``BYTEPS_*`` variables (a job of one without them)."""
    ops.init()


def shutdown() -> None:
    """Finish outstanding operations and leave the job."""
    ops.shutdown()


def is_initialized() -> bool:
    """Return whether :func:`init` was called (and :func:`shutdown` not since)."""
    return ops.is_initialized()


def size() -> int:
    """Return the number of worker processes (machines times local size)."""
    return ops.state().cfg.size


def rank() -> int:
    """Return this process's global rank."""
    return ops.state().cfg.rank


def local_size() -> int:
    """Return the number of worker processes on this machine."""
    return ops.state().cfg.local_size


def local_rank() -> int:
    """Return this process's rank on its machine."""
    return ops.state().cfg.local_rank


def _start(
    tensor: torch.Tensor,
    average: bool,
    name: str | None,
    priority: int,
    compression: type[Compressor],
    inplace: bool,
) -> Handle:
    st = ops.state()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if average and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"average=True needs a floating-point tensor, got {tensor.dtype}; pass average=False")
    if inplace and not tensor.is_contiguous():
        raise ValueError("in-place push_pull needs a contiguous tensor")
    target = tensor if inplace else tensor.detach().clone(memory_format=torch.contiguous_format)
    handle = ops.start_sum(
        target,
        method=ops.default_method(st.cfg),
        name=name if name is not None else f"push_pull.noname.{next(st.names)}",
        priority=priority,
        compression=compression,
        postscale=1.0 / st.cfg.size if average else 1.0,
    )
    st.handles.add(handle)
    return handle


def push_pull_async(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    priority: int = 0,
    compression: type[Compressor] = Compression.none,
) -> Handle:
    """Start summing (or averaging) ``tensor`` over every worker into a new tensor; return the handle.

    Args:
        tensor: the local value; left unchanged.
        average: divide the sum by :func:`size` (default ``True``).
        name: key of the tensor (the same on every worker; default: by call order).
        priority: PS scheduling priority, higher first (default 0).
        compression: ``Compression.none``, ``.fp16`` or ``.bf16``.
    """
    return _start(tensor, average, name, priority, compression, inplace=False)


def push_pull_async_inplace(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    priority: int = 0,
    compression: type[Compressor] = Compression.none,
) -> Handle:
    """Like :func:`push_pull_async`, writing the result into ``tensor``."""
    return _start(tensor, average, name, priority, compression, inplace=True)


def push_pull(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    priority: int = 0,
    compression: type[Compressor] = Compression.none,
) -> torch.Tensor:
    """Return the sum (or average) of ``tensor`` over every worker; see :func:`push_pull_async`."""
    return synchronize(push_pull_async(tensor, average, name, priority, compression))


def push_pull_inplace(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    priority: int = 0,
    compression: type[Compressor] = Compression.none,
) -> torch.Tensor:
    """Sum (or average) ``tensor`` over every worker in place and return it."""
    return synchronize(push_pull_async_inplace(tensor, average, name, priority, compression))


def _known(handle: Handle) -> set[Handle]:
    handles = ops.state().handles
    if handle not in handles:
        raise ValueError("unknown handle: it was not returned by this process or was already synchronised")
    return handles


def poll(handle: Handle) -> bool:
    """Return whether the operation behind ``handle`` finished (``synchronize`` would not block)."""
    _known(handle)
    return handle.done()


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for ``handle``'s operation and return its result; the handle is forgotten afterwards."""
    handles = _known(handle)
    try:
        return handle.wait()
    finally:
        handles.discard(handle)


def _average_flag(average: bool | None, op: ReduceOp | None) -> bool:
    if average is not None and op is not None:
        raise ValueError("pass either average or op, not both")
    if op is not None:
        if op not in (Average, Sum):
            raise ValueError(f"op must be Average or Sum, got {op!r} (tagps has no Adasum)")
        return op is Average
    return True if average is None else bool(average)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
) -> Handle:
    """Horovod's name for :func:`push_pull_async` (``op=Sum`` or ``average=False`` for a sum)."""
    return push_pull_async(tensor, _average_flag(average, op), name, 0, compression)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
) -> Handle:
    """Horovod's name for :func:`push_pull_async_inplace`."""
    return push_pull_async_inplace(tensor, _average_flag(average, op), name, 0, compression)


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
) -> torch.Tensor:
    """Horovod's name for :func:`push_pull`."""
    return synchronize(allreduce_async(tensor, average, name, compression, op))


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
) -> torch.Tensor:
    """Horovod's name for :func:`push_pull_inplace`."""
    return synchronize(allreduce_async_(tensor, average, name, compression, op))


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Return the concatenation along dim 0 of every worker's ``tensor`` (first dimensions may differ)."""
    ops.state()
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension")
    return collectives.all_gather_varlen(tensor.detach())


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with its value on ``root_rank`` and return it."""
    if not 0 <= root_rank < size():
        raise ValueError(f"root_rank must be a rank in [0, {size()}), got {root_rank!r}")
    if size() > 1:
        dist.broadcast(tensor.detach(), src=root_rank)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` (a new tensor; the argument is unchanged)."""
    return broadcast_(tensor.detach().clone(), root_rank, name)


def allgather_object(obj: object, name: str | None = None) -> list[object]:
    """Return every worker's ``obj`` (pickled), in rank order."""
    gathered: list[object] = [None] * size()
    if size() == 1:
        gathered[0] = obj
    else:
        dist.all_gather_object(gathered, obj)
    return gathered


def gloo_built() -> bool:
    """Return whether collectives can run over gloo (Horovod's capability query)."""
    return dist.is_gloo_available()


def nccl_built() -> bool:
    """Return whether collectives can run over NCCL (Horovod's capability query)."""
    return dist.is_nccl_available()


def mpi_built() -> bool:
    """Return ``False``: tagps does not use MPI (Horovod's capability query)."""
    return False


def mpi_threads_supported() -> bool:
    """Return ``False``: tagps does not use MPI (Horovod's capability query)."""
    return False


def barrier() -> None:
    """Block until every worker reached this call."""
    ops.state()
    if size() > 1:
        dist.barrier()
