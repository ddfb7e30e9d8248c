"""The ``ps`` method: intra-machine reduction, then one push and pull per machine to the summation servers.

With a single worker machine the local sum is the global one, so nothing is pushed (the servers, if any,
stay idle; the client still registers so that the job's scheduler sees every worker).

:meth:`PSService.subset` sums over some of the job's worker processes only (a replicated op group of a
general plan): the shared-memory reduction runs among the subset's local ranks of each machine, and when
the subset spans several machines their local ranks 0 push and pull keys declared for those machines only
(``PSClient.declare(..., workers=...)``). A subset inside one machine needs no server.

Every local rank takes part in the shared-memory reduction (:mod:`tagps.comm.local_reduce`) of CPU
tensors. A CUDA tensor, on any backend, is staged through a pinned host buffer (one per name, reused) by
a worker thread, on a copy stream of its own: the device-to-host copy waits on an event recorded on the
caller's stream when the sum was started (right after backward produced the gradient), so backward's
stream never waits for the copies. When the job runs NCCL and a PCIe-switch group holds several local
ranks, the group first reduces on the GPUs (NCCL, on the copy stream), only the leaders stage and sum
their group's result on the host, and NCCL broadcasts it back inside the group. A subset stages every
CUDA tensor. The CUDA path runs only on GPU machines (``tests/torch/test_gpu.py``, ``bench/gpu.sh``).
"""

from __future__ import annotations

import concurrent.futures
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tagps.comm import collectives
from tagps.comm.handle import Waitable, timed_out, wait_sliced
from tagps.comm.local_reduce import LocalReducer
from tagps.config import CommConfig, server_optimizer_config

__all__ = ["PSService", "PSSubset", "check_subset_ranks"]

_WIRE_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


class _ClientWork:
    """A push-pull handle of :class:`tagps.ps.client.PSClient` as a
    :class:`~tagps.comm.handle.NotifyingWaitable`.

    ``wait()`` raises :class:`~tagps.comm.handle.PeerFailed` as soon as a peer is known dead, and a
    ``RuntimeError`` after ``timeout`` seconds, as the local reduction's futures do.
    """

    def __init__(self, client: Any, handle: Any, name: str, timeout: float) -> None:
        self._client = client
        self._handle = handle
        self._name = name
        self._timeout = timeout

    def is_completed(self) -> bool:
        return bool(self._client.poll(self._handle))

    def notify(self, fd: int, tag: int) -> None:
        self._handle.notify(fd, tag)

    def wait(self) -> None:
        what = f"push_pull of {self._name!r}"
        wait_sliced(self._wait_slice, self._timeout, lambda: timed_out(what, self._timeout))

    def _wait_slice(self, seconds: float) -> bool:
        try:
            self._client.wait(self._handle, seconds)
        except TimeoutError:
            return False
        return True


class _FutureWork:
    """A ``concurrent.futures.Future`` as a :class:`Waitable`."""

    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self._future = future

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()


class _Summation:
    """What :class:`PSService` and :class:`PSSubset` share: declarations, the push and pull across machines,
    and the start of a sum (CPU tensors through the shared-memory reduction, CUDA ones on a thread).

    Subclasses set ``_reducer`` (and may override :meth:`_cuda_push_pull`).

    Args:
        cfg: the job layout and local topology.
        client: the machine's PS client when this process pushes for the machine, else ``None``.
        prefix: prepended to every tensor name to form the PS key name.
        workers: the machines (``DMLC_WORKER_ID``) the keys are declared for; ``None``: every machine.
        member: whether this process takes part in the sums.
    """

    _reducer: LocalReducer

    def __init__(
        self, cfg: CommConfig, client: Any, prefix: str, workers: tuple[int, ...] | None, member: bool
    ) -> None:
        self._cfg = cfg
        self._client = client
        self._prefix = prefix
        self._workers = workers
        self._member = member
        self._declared: set[str] = set()
        # CUDA staging, created on the first CUDA tensor: one thread keeps the sums in submission order,
        # which every member shares (NCCL switch-group collectives need the same order on every rank).
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pinned: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def declare(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Register tensor names and shapes with the summation servers (collective over the members).

        Every member process must declare the same names in the same order; names declared before are
        skipped. :meth:`push_pull_async` declares a new name itself, so this only moves the (blocking)
        registration out of the training step.

        Raises:
            TypeError: a dtype the summation servers cannot sum.
            ValueError: this process is not a member.
        """
        self._check_member()
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
                nbytes = tensor.numel() * tensor.element_size()
                self._client.declare(
                    self._prefix + name, nbytes, _WIRE_DTYPES[tensor.dtype], workers=self._workers
                )
            self._client.flush_declarations()

    def push_pull_async(self, name: str, tensor: torch.Tensor, priority: int = 0) -> Waitable:
        """Start summing ``tensor`` in place over the member processes; returns the work to wait for.

        Args:
            name: the tensor's name, the same on every member.
            tensor: a contiguous CPU or CUDA tensor; a CUDA one must be complete on the current stream
                (its sum starts after the work queued there so far).
            priority: higher values are pushed first.

        Raises:
            ValueError: this process is not a member, or a CUDA tensor on another GPU than the bound one.
            TypeError: a dtype the summation servers cannot sum.
        """
        if tensor.is_cuda:
            collectives.check_device(tensor, repr(name))
        self.declare([(name, tensor)])
        if not tensor.is_cuda:
            return self._reducer.submit(name, tensor, priority)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tagps-ps-cuda")
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(tensor.device))
        return _FutureWork(self._pool.submit(self._cuda_push_pull, name, tensor, priority, produced))

    def _check_member(self) -> None:
        if not self._member:
            raise ValueError(f"rank {self._cfg.rank} does not take part in {self!r}")

    def _cross(self, name: str, summed: torch.Tensor, priority: int) -> _ClientWork:
        # The PS client sends lower priority values first; ours follow BytePS (higher first).
        handle = self._client.push_pull(
            self._prefix + name, summed.numpy(), average=False, priority=-priority
        )
        return _ClientWork(self._client, handle, name, self._cfg.dist_timeout_s)

    def _cuda_route(self) -> tuple[Any, int, LocalReducer]:
        """Where a CUDA sum goes: (NCCL switch group or ``None``, its leader's rank, the host reducer)."""
        return None, self._cfg.rank, self._reducer

    def _cuda_push_pull(
        self, name: str, tensor: torch.Tensor, priority: int, produced: torch.cuda.Event
    ) -> None:
        """Sum the CUDA ``tensor`` in place through pinned host memory (on the staging thread; blocking).

        Everything runs on this device's copy stream, which first waits for ``produced``; NCCL collectives
        called here wait on that stream too. The stream is synchronised before returning, so the caller's
        ``wait()`` sees the result without further ordering.
        """
        group, leader, reducer = self._cuda_route()
        stream = self._streams.get(tensor.device)
        if stream is None:
            stream = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        # The current device is per thread: set it for this one, or NCCL and the copies would use GPU 0.
        with torch.cuda.device(tensor.device), torch.cuda.stream(stream):
            stream.wait_event(produced)
            if group is not None:
                dist.reduce(tensor, dst=leader, group=group)
            if reducer.participating:
                host = self._pinned.get(name)
                if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                    host = self._pinned[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                stream.synchronize()  # the host reduction reads ``host`` from another thread
                reducer.submit(name, host, priority).wait()
                tensor.copy_(host, non_blocking=True)
            if group is not None:
                dist.broadcast(tensor, src=leader, group=group)
            stream.synchronize()

    def _stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._reducer.close()


class PSService(_Summation):
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
        client: Any = None
        if cfg.local_rank == 0 and cfg.num_server > 0:
            from tagps.ps.client import PSClient

            client = PSClient.from_env()
            if client.config.enable_async:
                client.close()
                raise RuntimeError(
                    "the ps sync method needs synchronous rounds, but BYTEPS_ENABLE_ASYNC=1 makes pushes "
                    "deltas and pulls the store; unset it or use allreduce"
                )
        super().__init__(cfg, client, "", None, True)
        self._subsets: dict[tuple[int, ...], PSSubset] = {}
        groups = cfg.local_groups()
        # One machine's local sum is already the global sum: no push and pull is needed.
        cross = self._cross if self._client is not None and cfg.num_worker > 1 else None
        self._reducer = LocalReducer(
            range(cfg.local_size), groups, cfg.local_rank, cfg.worker_id, cross, cfg.dist_timeout_s,
            cfg.shm_dir,
        )  # fmt: skip
        # CUDA tensors of a switch group reduce over NCCL first; then only the leaders meet on the host.
        self._switch: tuple[Any, int] | None = None
        self._leaders: LocalReducer | None = None
        # Decided on every machine's groups: creating the switch groups is collective over the whole job.
        everywhere = (g for m in range(cfg.num_worker) for g in cfg.local_groups(m))
        if collectives.uses_nccl(cfg) and any(len(g) > 1 for g in everywhere):
            self._switch = self._switch_groups(cfg)
            leaders = [g[0] for g in groups]
            self._leaders = LocalReducer(
                leaders, [[r] for r in leaders], cfg.local_rank, cfg.worker_id, cross, cfg.dist_timeout_s,
                cfg.shm_dir,
            )  # fmt: skip

    @staticmethod
    def _switch_groups(cfg: CommConfig) -> tuple[Any, int]:
        """Create every machine's switch groups (collectively) and return this process's and its leader."""
        mine: tuple[Any, int] = (None, cfg.rank)
        for machine in range(cfg.num_worker):
            for g in cfg.local_groups(machine):
                ranks = [cfg.first_rank(machine) + r for r in g]
                pg = dist.new_group(ranks)
                if cfg.rank in ranks:
                    mine = (pg, ranks[0])
        return mine

    def subset(self, ranks: Sequence[int]) -> PSSubset:
        """Return a service that sums over the worker processes ``ranks`` only.

        Collective: every worker process of the job calls it, members or not, with the same ``ranks`` and
        in the same order relative to the other collectives (the first call for a set of ranks creates a
        :class:`LocalReducer`; later calls return that subset). The checks run before anything collective
        and give the same outcome on every process.

        Args:
            ranks: global ranks (machine-major: the machines' local sizes before ``DMLC_WORKER_ID``, plus
                ``local_rank``).

        Returns:
            The :class:`PSSubset` of these ranks; closed with this service.

        Raises:
            ValueError: ``ranks`` is empty, repeats a rank or names one outside the job, or spans several
                machines but leaves out the local rank 0 of one of them (only that process has a PS
                client and pushes for its machine).
        """
        key = check_subset_ranks(self._cfg, ranks)
        if key not in self._subsets:
            self._subsets[key] = PSSubset(self._cfg, self._client, key)
        return self._subsets[key]

    def _cuda_route(self) -> tuple[Any, int, LocalReducer]:
        """The NCCL switch group and the leaders' reducer when the job runs NCCL, else the default route."""
        if self._switch is None or self._leaders is None:
            return super()._cuda_route()
        return (*self._switch, self._leaders)

    def close(self) -> None:
        """Stop the subsets, the reduction service and the PS client."""
        for sub in self._subsets.values():
            sub.close()
        self._stop()  # first: the staging thread may still be using the leaders' reducer
        if self._leaders is not None:
            self._leaders.close()
        if self._client is not None:
            self._client.close()


class PSSubset(_Summation):
    """Sum tensors over some of the job's worker processes (made by :meth:`PSService.subset`).

    The sum runs through the shared-memory reduction among the subset's local ranks on each machine, then,
    when the subset spans several machines, one push and pull per machine by its local rank 0, on keys
    declared for those machines only. Processes outside the subset construct it too but never use it.

    Args:
        cfg: the job layout and local topology.
        client: this machine's PS client on local rank 0, else ``None``.
        ranks: the member processes' global ranks.

    Raises:
        ValueError: see :meth:`PSService.subset`.
    """

    def __init__(self, cfg: CommConfig, client: Any, ranks: Sequence[int]) -> None:
        self.ranks = check_subset_ranks(cfg, ranks)
        machines = tuple(sorted({cfg.machine_of(r) for r in self.ranks}))
        first = cfg.first_rank(cfg.worker_id)
        local = [r - first for r in self.ranks if cfg.machine_of(r) == cfg.worker_id]
        member = cfg.rank in self.ranks
        # Only the machines' local ranks 0 push (the check above made them members when they must push).
        pusher = member and cfg.local_rank == 0 and len(machines) > 1
        prefix = f"subset[{','.join(map(str, self.ranks))}]/"
        super().__init__(cfg, client if pusher else None, prefix, machines, member)
        self._closed = False
        self._reducer = LocalReducer(
            local,
            [list(g) for g in cfg.local_groups()],
            cfg.local_rank,
            cfg.worker_id,
            cross=self._cross if pusher else None,
            timeout=cfg.dist_timeout_s,
            shm_dir=cfg.shm_dir,
        )

    def __repr__(self) -> str:
        return f"PSSubset(ranks={list(self.ranks)})"

    @property
    def member(self) -> bool:
        """Whether this process is one of the subset's ranks."""
        return self._member

    def close(self) -> None:
        """Stop the subset's reduction service (idempotent; the PS client belongs to the parent)."""
        if not self._closed:
            self._closed = True
            self._stop()


def check_subset_ranks(cfg: CommConfig, ranks: Sequence[int]) -> tuple[int, ...]:
    """Return ``ranks`` sorted after checking that a subset over them can be summed (see ``subset``).

    Needs no other process, so a caller can refuse a layout before anything collective.
    """
    if isinstance(ranks, (str, bytes)) or not all(
        isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in ranks
    ):
        raise ValueError(f"ps subset ranks must be a sequence of integers, got {ranks!r}")
    ordered = tuple(sorted(int(r) for r in ranks))
    if not ordered or len(set(ordered)) != len(ordered) or ordered[0] < 0 or ordered[-1] >= cfg.size:
        raise ValueError(
            f"ps subset ranks {list(ordered)} must be distinct ranks of the job's {cfg.size} worker processes"
        )
    by_machine: dict[int, list[int]] = {}
    for r in ordered:
        by_machine.setdefault(cfg.machine_of(r), []).append(r)
    if len(by_machine) > 1:
        for machine, members in by_machine.items():
            root = cfg.first_rank(machine)
            if members[0] != root:
                raise ValueError(
                    f"ps over the ranks {list(ordered)}: machine {machine} takes part with ranks {members} "
                    f"(local ranks {[r - root for r in members]}) but not with rank {root}, its local rank "
                    "0, the only process of a machine that pushes to the summation servers; include it "
                    "or sum with allreduce"
                )
    return ordered
