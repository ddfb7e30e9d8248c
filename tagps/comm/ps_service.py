"""The ``ps`` method: intra-machine reduction, then one push and pull per machine to the summation servers.

With a single worker machine the local sum is the global one, so nothing is pushed (the servers, if any,
stay idle; the client still registers so that the job's scheduler sees every worker).

On CPU every local rank takes part in the shared-memory reduction (:mod:`tagps.comm.local_reduce`). On
CUDA the same topology maps to an NCCL reduce inside each PCIe-switch group, a copy of the group leader's
result to pinned host memory, the shared-memory reduction among the leaders, and the way back (copy to
the device, NCCL broadcast inside the group). The CUDA path is written for GPU machines and is untested
here (these machines have no GPU); the CPU path is what the tests exercise.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tagps.comm import collectives
from tagps.comm.handle import Waitable
from tagps.comm.local_reduce import LocalReducer
from tagps.config import CommConfig, server_optimizer_config

__all__ = ["PSService"]

_WIRE_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


class _ClientWork:
    """A push-pull handle of :class:`tagps.ps.client.PSClient` as a :class:`Waitable`."""

    def __init__(self, client: Any, handle: Any) -> None:
        self._client = client
        self._handle = handle

    def is_completed(self) -> bool:
        return bool(self._client.poll(self._handle))

    def wait(self) -> None:
        self._client.wait(self._handle)


class _FutureWork:
    """A ``concurrent.futures.Future`` as a :class:`Waitable`."""

    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self._future = future

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()


class PSService:
    """Sum tensors over every worker process through local reduction and the summation servers.

    Construction is collective: every worker process of the job must create it (in the same order as
    other collectives), as :meth:`tagps.torch.DistributedOptimizer` and ``push_pull`` do.

    Args:
        cfg: the job layout and local topology.

    Raises:
        RuntimeError: several machines but no summation server (``DMLC_NUM_SERVER=0``), or servers that
            run an optimizer (``TAGPS_SERVER_OPTIMIZER``) and so return weights instead of sums.
    """

    def __init__(self, cfg: CommConfig) -> None:
        if cfg.num_worker > 1 and cfg.num_server == 0:
            raise RuntimeError(
                f"the ps method needs summation servers to sum across {cfg.num_worker} machines: set "
                "DMLC_NUM_SERVER > 0 (bpslaunch --servers S) or use allreduce"
            )
        server_optimizer = server_optimizer_config().name
        if server_optimizer != "none":
            raise RuntimeError(
                f"the ps sync method needs summing servers, but TAGPS_SERVER_OPTIMIZER={server_optimizer} "
                "makes them return updated weights; unset it or use allreduce"
            )
        self._cfg = cfg
        self._client: Any = None
        self._declared: set[str] = set()
        if cfg.local_rank == 0 and cfg.num_server > 0:
            from tagps.ps.client import PSClient

            self._client = PSClient.from_env()
            if self._client.config.enable_async:
                self._client.close()
                raise RuntimeError(
                    "the ps sync method needs synchronous rounds, but BYTEPS_ENABLE_ASYNC=1 makes pushes "
                    "deltas and pulls the store; unset it or use allreduce"
                )
        groups = cfg.local_groups()
        self._cuda = collectives.backend_for(cfg) == "nccl"
        if self._cuda:
            self._switch = self._switch_groups(cfg, groups)
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tagps-ps-cuda")
            self._pinned: dict[str, torch.Tensor] = {}
            leaders = [g[0] for g in groups]
            participants, reduce_groups = leaders, [[r] for r in leaders]
        else:
            participants, reduce_groups = list(range(cfg.local_size)), [list(g) for g in groups]
        self._reducer = LocalReducer(
            participants,
            reduce_groups,
            cfg.local_rank,
            cfg.worker_id,
            # One machine's local sum is already the global sum: no push and pull is needed.
            cross=self._cross if self._client is not None and cfg.num_worker > 1 else None,
            timeout=cfg.dist_timeout_s,
        )

    @staticmethod
    def _switch_groups(cfg: CommConfig, groups: tuple[tuple[int, ...], ...]) -> tuple[Any, int]:
        """Create every machine's switch groups (collectively) and return this process's and its leader."""
        mine: tuple[Any, int] = (None, cfg.rank)
        for machine in range(cfg.num_worker):
            for g in groups:
                ranks = [machine * cfg.local_size + r for r in g]
                pg = dist.new_group(ranks)
                if cfg.rank in ranks:
                    mine = (pg, ranks[0])
        return mine

    def declare(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Register tensor names and shapes with the summation servers (collective over the workers).

        Every worker process must declare the same names in the same order; names declared before are
        skipped. :meth:`push_pull_async` declares a new name itself, so this only moves the (blocking)
        registration out of the training step.
        """
        new = [(n, t) for n, t in tensors if n not in self._declared]
        if not new:
            return
        for name, tensor in new:
            if tensor.dtype not in _WIRE_DTYPES:
                raise TypeError(
                    f"{name!r}: the ps method sums float32/float64/float16 tensors, not {tensor.dtype}"
                )
            self._declared.add(name)
        if self._client is not None:
            for name, tensor in new:
                self._client.declare(name, tensor.numel() * tensor.element_size(), _WIRE_DTYPES[tensor.dtype])
            self._client.flush_declarations()

    def _cross(self, name: str, summed: torch.Tensor, priority: int) -> Waitable:
        # The PS client sends lower priority values first; ours follow BytePS (higher first).
        handle = self._client.push_pull(name, summed.numpy(), average=False, priority=-priority)
        return _ClientWork(self._client, handle)

    def push_pull_async(self, name: str, tensor: torch.Tensor, priority: int = 0) -> Waitable:
        """Start summing ``tensor`` in place over every worker process; returns the work to wait for."""
        self.declare([(name, tensor)])
        if tensor.is_cuda:
            if not self._cuda:
                raise ValueError(f"{name!r} is a CUDA tensor but the job runs the CPU (gloo) path")
            return _FutureWork(self._pool.submit(self._cuda_push_pull, name, tensor, priority))
        return self._reducer.submit(name, tensor, priority)

    def _cuda_push_pull(self, name: str, tensor: torch.Tensor, priority: int) -> None:
        """NCCL reduce inside the switch group, host reduction among leaders, then back (untested here)."""
        group, leader = self._switch
        if group is not None:
            dist.reduce(tensor, dst=leader, group=group)
        if self._reducer.participating:
            host = self._pinned.get(name)
            if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._pinned[name] = host
            host.copy_(tensor)
            self._reducer.submit(name, host, priority).wait()
            tensor.copy_(host)
        if group is not None:
            dist.broadcast(tensor, src=leader, group=group)

    def close(self) -> None:
        """Stop the reduction service and the PS client."""
        if self._cuda:
            self._pool.shutdown(wait=True)
        self._reducer.close()
        if self._client is not None:
            self._client.close()
