"""PyTorch adapter: the ``byteps.torch`` / ``horovod.torch`` API on tagps's runtime.

Switch a training script by changing its import to ``import tagps.torch as bps`` (or ``as hvd``) and start
it with ``bpslaunch``. Every worker process joins one ``torch.distributed`` group (gloo on CPU, NCCL on
CUDA); the ``ps`` method goes through the intra-machine reduction and the summation servers.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tagps.comm.handle import Handle
from tagps.config import comm_config
from tagps.torch import elastic, ops, process_sets
from tagps.torch.collective_ops import (
    HorovodInternalError,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reduce_spec,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    start_allreduce,
)
from tagps.torch.collective_ops import wait as _wait
from tagps.torch.compression import Compression, Compressor
from tagps.torch.executor import DistributedModel, distribute
from tagps.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from tagps.torch.join_ops import join
from tagps.torch.optimizer import Adasum, Average, DistributedOptimizer, Max, Min, Product, ReduceOp, Sum
from tagps.torch.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from tagps.torch.sync_batch_norm import SyncBatchNorm
from tagps.torch.timeline import start_timeline, stop_timeline

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedModel",
    "DistributedOptimizer",
    "Handle",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "declare",
    "distribute",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_async_inplace",
    "push_pull_inplace",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "resume",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "suspend",
    "synchronize",
]


def init(comm: object = None, process_sets: list[ProcessSet] | None = None) -> None:
    """Join the job described by the ``DMLC_*``/``BYTEPS_*`` variables (a job of one without them).

    Args:
        comm: Horovod's MPI communicator or rank list; tagps takes its job from ``bpslaunch``, so only
            ``None`` is accepted.
        process_sets: :class:`ProcessSet` objects to register at once (the same list on every worker).
    """
    if comm is not None:
        raise ValueError("init(comm=...) is not supported: tagps takes the job's ranks from bpslaunch")
    ops.init()
    for ps in process_sets or []:
        add_process_set(ps)
    # Horovod's variables: rank 0 records from init to shutdown ("DYNAMIC": only start_timeline records).
    timeline = os.environ.get("HOROVOD_TIMELINE", "")
    if timeline and timeline != "DYNAMIC" and rank() == 0:
        marks = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0") not in ("", "0")
        start_timeline(timeline, mark_cycles=marks)


def shutdown() -> None:
    """Finish outstanding operations, write the timeline if one is recorded, and leave the job."""
    stop_timeline()
    process_sets.reset()
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


def cross_size() -> int:
    """Return the number of machines that run a process of this local rank (Horovod's meaning)."""
    return ops.state().cfg.cross_size


def cross_rank() -> int:
    """Return this machine's index among those of :func:`cross_size` (Horovod's meaning)."""
    return ops.state().cfg.cross_rank


def is_homogeneous() -> bool:
    """Return whether every machine runs the same number of worker processes (``TAGPS_MACHINE_SIZES``)."""
    return len(set(ops.state().cfg.sizes)) == 1


def _start(
    tensor: torch.Tensor,
    average: bool,
    name: str | None,
    priority: int,
    compression: type[Compressor],
    inplace: bool,
) -> Handle:
    spec = reduce_spec(None, Average if average else Sum, 1.0, 1.0, global_process_set, compression, priority)
    handle = start_allreduce(tensor, spec, name, inplace)
    ops.state().handles.add(handle)
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
        average: divide the sum by :func:`size` (default ``True``; integers are truncated toward zero).
        name: key of the tensor (the same on every worker; default: a reused key, see docs/torch.md).
        priority: PS scheduling priority, higher first (default 0).
        compression: ``Compression.none``, ``.fp16`` or ``.bf16``.

    Returns:
        The handle; ``synchronize(handle)`` returns the result.
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


def declare(name: str) -> None:
    """Declare a tensor name before its first ``push_pull`` (BytePS's call).

    BytePS assigns server keys in declaration order; tagps keys tensors by their names, so declaring only
    checks the name.

    Args:
        name: the tensor's name, as later passed to ``push_pull``.

    Raises:
        TypeError: ``name`` is not a non-empty string.
    """
    ops.state()
    if not isinstance(name, str) or not name:
        raise TypeError(f"declare needs a non-empty tensor name, got {name!r}")


def suspend() -> None:
    """Stop communicating until :func:`resume` (BytePS elastic); outstanding operations finish first."""
    shutdown()


def resume(num_workers: int, num_servers: int, global_rank: int = -1, context: object = None) -> None:
    """Rejoin the job after :func:`suspend` (BytePS elastic), with the layout it had.

    Args:
        num_workers: worker machines (``DMLC_NUM_WORKER``).
        num_servers: summation servers (``DMLC_NUM_SERVER``).
        global_rank: this process's rank (-1: unchanged).
        context: BytePS's optimizer context; unused.

    Raises:
        NotImplementedError: another number of workers or servers, or another rank: a tagps job keeps the
            layout ``bpslaunch`` gave it (elastic scaling is not implemented).
    """
    cfg = comm_config(os.environ)
    if (num_workers, num_servers) != (cfg.num_worker, cfg.num_server) or global_rank not in (-1, cfg.rank):
        raise NotImplementedError(
            f"resume({num_workers}, {num_servers}, global_rank={global_rank}) changes the job started with "
            f"{cfg.num_worker} worker machines, {cfg.num_server} servers and rank {cfg.rank}: elastic "
            "scaling is not implemented in tagps"
        )
    init()


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
    """Wait for ``handle``'s operation and return its result; the handle is forgotten afterwards.

    Returns:
        The result: a tensor; a list for the grouped operations; ``(tensor, received splits)`` for
        ``alltoall_async``.

    Raises:
        HorovodInternalError: the operation failed in the communication layer.
    """
    handles = _known(handle)
    try:
        return _wait(handle)  # type: ignore[no-any-return]
    finally:
        handles.discard(handle)


def gloo_built() -> bool:
    """Return whether collectives can run over gloo (Horovod's capability query)."""
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    """Return whether this job's collectives run over gloo."""
    ops.state()
    return dist.get_backend() == "gloo"


def nccl_built() -> bool:
    """Return whether collectives can run over NCCL (Horovod's capability query)."""
    return dist.is_nccl_available()


def mpi_built() -> bool:
    """Return ``False``: tagps does not use MPI (Horovod's capability query)."""
    return False


def mpi_enabled() -> bool:
    """Return ``False``: tagps does not use MPI."""
    return False


def mpi_threads_supported() -> bool:
    """Return ``False``: tagps does not use MPI (Horovod's capability query)."""
    return False


def ccl_built() -> bool:
    """Return ``False``: tagps has no oneCCL backend (Horovod's answer without it)."""
    return False


def ddl_built() -> bool:
    """Return ``False``: tagps has no IBM DDL backend (Horovod's answer without it)."""
    return False


def cuda_built() -> bool:
    """Return whether the installed torch was built with CUDA (tagps then runs NCCL collectives)."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """Return whether the installed torch was built for ROCm."""
    return torch.version.hip is not None
