"""Collectives among the worker processes over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Every worker process of the job (``DMLC_NUM_WORKER`` machines times ``BYTEPS_LOCAL_SIZE``) joins one
process group, ranked machine-major as BytePS ranks them. The rendezvous is a ``TCPStore`` served by rank
0 at ``DMLC_PS_ROOT_URI:TAGPS_DIST_PORT``.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from tagps.comm.handle import CompletedWork, Waitable
from tagps.config import CommConfig, ConfigError

__all__ = [
    "all_gather_varlen",
    "all_gather_varlen_async",
    "all_reduce_async",
    "backend_for",
    "init_process_group",
    "shutdown_process_group",
]

_owned = False


def backend_for(cfg: CommConfig) -> str:
    """Return the ``torch.distributed`` backend for ``cfg``: NCCL when CUDA is usable, else gloo."""
    if cfg.dist_backend != "auto":
        return cfg.dist_backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(cfg: CommConfig) -> None:
    """Join the job's process group, or adopt the one the caller already initialised.

    Args:
        cfg: the job layout; ``cfg.dist_port`` must be set when the job has more than one process.

    Raises:
        ConfigError: when no rendezvous port is known for a multi-process job.
        RuntimeError: when an existing process group disagrees with ``cfg`` about rank or size.
    """
    global _owned
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (cfg.rank, cfg.size):
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the DMLC/BYTEPS variables say rank {cfg.rank} of {cfg.size}"
            )
        return
    timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
    if cfg.size == 1:
        store: dist.Store = dist.HashStore()
    else:
        if cfg.dist_port is None:
            raise ConfigError(
                "TAGPS_DIST_PORT (or DMLC_PS_ROOT_PORT, whose successor is the default) is required "
                f"for a job of {cfg.size} worker processes"
            )
        store = dist.TCPStore(cfg.root_uri, cfg.dist_port, cfg.size, is_master=cfg.rank == 0, timeout=timeout)
    dist.init_process_group(
        backend_for(cfg), store=store, rank=cfg.rank, world_size=cfg.size, timeout=timeout
    )
    _owned = True


def shutdown_process_group() -> None:
    """Leave the process group, together with the other ranks, if :func:`init_process_group` created it."""
    global _owned
    if _owned and dist.is_initialized():
        # Leave together: a gloo rank that tears down its pairs and store while a peer is still closing
        # makes that peer abort in std::terminate (exit 134; 2 of 8 two-worker runs of
        # examples/train_synthetic.py before this barrier, 0 of 12 after). Bounded by TAGPS_DIST_TIMEOUT.
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    _owned = False


def all_reduce_async(tensor: torch.Tensor, group: object | None = None) -> Waitable:
    """Start summing ``tensor`` in place over ``group`` (the whole world when ``None``)."""
    if dist.get_world_size(group) == 1:
        return CompletedWork()
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    assert work is not None
    return work


def all_gather_varlen_async(
    tensor: torch.Tensor, group: object | None = None
) -> tuple[Waitable, Callable[[], torch.Tensor]]:
    """Start concatenating along dim 0 the ``tensor`` of every rank; first dimensions may differ.

    The row counts travel first (one small blocking all-gather), then the rows, padded to the longest, in
    an asynchronous all-gather.

    Returns:
        The work to wait for, and a function that, after it completed, returns the rows of rank 0, then
        rank 1, and so on.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return CompletedWork(), lambda: tensor
    rows = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    all_rows = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(all_rows, rows, group=group)
    counts = [int(r.item()) for r in all_rows]
    longest = max(counts)
    padded = tensor.contiguous()
    if tensor.shape[0] < longest:
        padded = torch.cat([padded, padded.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in range(world)]
    work = dist.all_gather(parts, padded, group=group, async_op=True)
    assert work is not None
    return work, lambda: torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])


def all_gather_varlen(tensor: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """Concatenate along dim 0 the ``tensor`` of every rank (first dimensions may differ); blocking."""
    work, result = all_gather_varlen_async(tensor, group)
    work.wait()
    return result()
