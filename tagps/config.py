"""The one place that reads environment variables (DMLC_*, BYTEPS_*, TAGPS_*, PS_*).

Every other module asks this one for a frozen, validated config object. A missing or malformed variable
raises :class:`ConfigError` naming the variable (BytePS silently exits 0 in that case; we fail loudly).
The variables are documented in ``docs/environment.md``.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = [
    "CommConfig",
    "ConfigError",
    "KernelConfig",
    "LauncherConfig",
    "PSConfig",
    "ServerOptimizerConfig",
    "StrategyConfig",
    "comm_config",
    "kernel_config",
    "launcher_config",
    "ps_config",
    "server_optimizer_config",
    "strategy_config",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """An environment variable is missing or malformed."""


def _read(
    env: Mapping[str, str],
    name: str,
    parse: Callable[[str], T],
    default: T | None = None,
    required: bool = False,
) -> T:
    raw = env.get(name)
    if raw is None or raw == "":
        if required:
            raise ConfigError(f"{name} is required but not set")
        return default  # type: ignore[return-value]
    try:
        return parse(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}={raw!r} is malformed: {exc}") from None


def _int(minimum: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw.strip())
        if minimum is not None and value < minimum:
            raise ValueError(f"must be >= {minimum}")
        return value

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 0/1 (or true/false)")


@dataclass(frozen=True)
class KernelConfig:
    """Settings of the C++ kernels.

    Args:
        simd: ``"auto"`` (AVX2/FMA/F16C when the CPU has them) or ``"scalar"`` (portable path).
        num_threads: OpenMP threads for large arrays; 0 means all cores.
    """

    simd: str = "auto"
    num_threads: int = 0


def kernel_config(env: Mapping[str, str] = os.environ) -> KernelConfig:
    """Read ``TAGPS_SIMD`` and ``TAGPS_NUM_THREADS``."""
    return KernelConfig(
        simd=_read(env, "TAGPS_SIMD", _choice("auto", "avx2", "scalar"), "auto"),
        num_threads=_read(env, "TAGPS_NUM_THREADS", _int(0), 0),
    )


def _sizes(raw: str) -> tuple[int, ...]:
    """Parse ``TAGPS_MACHINE_SIZES``: worker processes per machine, e.g. ``1,2,2``."""
    try:
        sizes = tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise ValueError("write the processes of each worker machine like 1,2,2") from None
    if any(n < 1 for n in sizes):
        raise ValueError("every machine runs at least one worker process")
    return sizes


def _topology(raw: str) -> tuple[tuple[int, ...], ...]:
    groups = tuple(tuple(int(r) for r in g.split(",") if r.strip()) for g in raw.split("|"))
    if any(not g for g in groups):
        raise ValueError("empty group; write groups of local ranks like 0,1|2,3")
    return groups


@dataclass(frozen=True)
class CommConfig:
    """Where this worker process sits in the job, as the torch adapter and the communication service see it.

    Args:
        num_worker: worker machines (``DMLC_NUM_WORKER``, default 1).
        worker_id: this machine's index (``DMLC_WORKER_ID``, default 0).
        num_server: summation servers (``DMLC_NUM_SERVER``, default 0); 0 means no PS.
        root_uri: rendezvous host (``DMLC_PS_ROOT_URI``, default 127.0.0.1).
        root_port: scheduler port (``DMLC_PS_ROOT_PORT``), ``None`` when unset.
        local_rank: this process's rank on its machine (``BYTEPS_LOCAL_RANK``, default 0).
        local_size: processes on this machine (``BYTEPS_LOCAL_SIZE``, default 1).
        machine_sizes: processes on each worker machine in ``DMLC_WORKER_ID`` order, for machines that run
            different numbers (``TAGPS_MACHINE_SIZES``, e.g. ``1,2,2``; ``tagps cluster run`` sets it);
            unset: every machine runs ``local_size``. Ranks stay machine-major.
        dist_port: torch.distributed rendezvous port (``TAGPS_DIST_PORT``, default ``root_port + 1``).
        dist_backend: ``auto`` (``cpu:gloo,cuda:nccl`` with CUDA, else gloo), ``gloo``, ``nccl`` or
            ``cpu:gloo,cuda:nccl`` (gloo for CPU tensors, NCCL for CUDA ones) (``TAGPS_DIST_BACKEND``).
        dist_timeout_s: collective and rendezvous timeout in seconds (``TAGPS_DIST_TIMEOUT``, default 300).
        fusion_bytes: consecutive all-reduced gradients are fused into buckets of up to this many bytes
            (``TAGPS_FUSION_BYTES``, default 25 MiB as DDP; 0 turns fusion off).
        pcie_switch_size: local ranks per PCIe switch (``BYTEPS_PCIE_SWITCH_SIZE``, default 0 = one group).
        local_topology: explicit groups of local ranks, e.g. ``0,1|2,3`` (``TAGPS_LOCAL_TOPOLOGY``);
            overrides ``pcie_switch_size``.
        device: the plan device this process is meant to be, e.g. ``m0:1`` (``TAGPS_DEVICE``, set by
            ``tagps cluster run``); the general-plan executor refuses a job whose ranks disagree with it.
        heartbeat_interval: seconds between a worker's heartbeats to the others (``PS_HEARTBEAT_INTERVAL``,
            default 1), through the rendezvous store.
        heartbeat_timeout: seconds of silence after which a worker counts as dead and every wait of the
            others raises naming it (``PS_HEARTBEAT_TIMEOUT``, default 10).
        register_timeout: seconds the rendezvous waits for every worker process to join
            (``PS_REGISTER_TIMEOUT``, default 120), as servers and workers wait for the scheduler.
        shm_dir: directory of the shared-memory arenas of the local reduction (``TAGPS_SHM_DIR``, default
            ``/dev/shm``; ``bpslaunch`` gives its workers a private directory inside it).
    """

    num_worker: int = 1
    worker_id: int = 0
    num_server: int = 0
    root_uri: str = "127.0.0.1"
    root_port: int | None = None
    local_rank: int = 0
    local_size: int = 1
    machine_sizes: tuple[int, ...] | None = None
    dist_port: int | None = None
    dist_backend: str = "auto"
    dist_timeout_s: float = 300.0
    fusion_bytes: int = 25 << 20
    pcie_switch_size: int = 0
    local_topology: tuple[tuple[int, ...], ...] | None = None
    device: str | None = None
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    register_timeout: float = 120.0
    shm_dir: str = "/dev/shm"

    def __post_init__(self) -> None:
        if not 0 <= self.worker_id < self.num_worker:
            raise ConfigError(
                f"DMLC_WORKER_ID={self.worker_id} must be in [0, DMLC_NUM_WORKER={self.num_worker})"
            )
        if not 0 <= self.local_rank < self.local_size:
            raise ConfigError(
                f"BYTEPS_LOCAL_RANK={self.local_rank} must be in [0, BYTEPS_LOCAL_SIZE={self.local_size})"
            )
        if self.machine_sizes is not None:
            sizes = ",".join(map(str, self.machine_sizes))
            if len(self.machine_sizes) != self.num_worker:
                raise ConfigError(
                    f"TAGPS_MACHINE_SIZES={sizes} must name {self.num_worker} machines (DMLC_NUM_WORKER)"
                )
            if self.machine_sizes[self.worker_id] != self.local_size:
                raise ConfigError(
                    f"TAGPS_MACHINE_SIZES={sizes} gives machine {self.worker_id} "
                    f"{self.machine_sizes[self.worker_id]} processes, but BYTEPS_LOCAL_SIZE={self.local_size}"
                )
            if self.local_topology is not None and len(set(self.machine_sizes)) > 1:
                raise ConfigError(
                    "TAGPS_LOCAL_TOPOLOGY names one machine's local ranks; it cannot hold for machines of "
                    f"different sizes (TAGPS_MACHINE_SIZES={sizes}); use BYTEPS_PCIE_SWITCH_SIZE"
                )
        if self.local_topology is not None:
            flat = sorted(r for g in self.local_topology for r in g)
            if flat != list(range(self.local_size)):
                raise ConfigError(
                    f"TAGPS_LOCAL_TOPOLOGY={self.local_topology} must name every local rank "
                    f"0..{self.local_size - 1} exactly once"
                )

    @property
    def sizes(self) -> tuple[int, ...]:
        """Worker processes on each machine, in ``DMLC_WORKER_ID`` order."""
        return self.machine_sizes or (self.local_size,) * self.num_worker

    @property
    def size(self) -> int:
        """Worker processes in the job (all machines' local sizes)."""
        return sum(self.sizes)

    @property
    def rank(self) -> int:
        """Global rank of this process (machine-major, as BytePS numbers them)."""
        return self.first_rank(self.worker_id) + self.local_rank

    def first_rank(self, machine: int) -> int:
        """Global rank of ``machine``'s local rank 0."""
        return sum(self.sizes[:machine])

    @property
    def cross_size(self) -> int:
        """Machines that run a process of this local rank (Horovod's cross communicator)."""
        return sum(n > self.local_rank for n in self.sizes)

    @property
    def cross_rank(self) -> int:
        """This machine's index among those of :attr:`cross_size`."""
        return sum(n > self.local_rank for n in self.sizes[: self.worker_id])

    def machine_of(self, rank: int) -> int:
        """The machine (``DMLC_WORKER_ID``) that global ``rank`` runs on."""
        return bisect.bisect_right(list(itertools.accumulate(self.sizes)), rank)

    def local_groups(self, machine: int | None = None) -> tuple[tuple[int, ...], ...]:
        """Return the groups of local ranks that reduce together first (PCIe switch or NUMA node) on
        ``machine`` (default this process's)."""
        if self.local_topology is not None:
            return self.local_topology
        size = self.sizes[self.worker_id if machine is None else machine]
        step = self.pcie_switch_size or size
        return tuple(tuple(range(s, min(s + step, size))) for s in range(0, size, step))


def comm_config(env: Mapping[str, str] = os.environ) -> CommConfig:
    """Read the job layout (``DMLC_*``, ``BYTEPS_LOCAL_*``) and the communication settings (``TAGPS_DIST_*``,
    ``BYTEPS_PCIE_SWITCH_SIZE``, ``TAGPS_LOCAL_TOPOLOGY``)."""
    root_port = _read(env, "DMLC_PS_ROOT_PORT", _int(1), None)
    default_dist_port = root_port + 1 if root_port is not None else None
    interval, timeout = _heartbeat(env)
    return CommConfig(
        num_worker=_read(env, "DMLC_NUM_WORKER", _int(1), 1),
        worker_id=_read(env, "DMLC_WORKER_ID", _int(0), 0),
        num_server=_read(env, "DMLC_NUM_SERVER", _int(0), 0),
        root_uri=_read(env, "DMLC_PS_ROOT_URI", str.strip, "127.0.0.1"),
        root_port=root_port,
        local_rank=_read(env, "BYTEPS_LOCAL_RANK", _int(0), 0),
        local_size=_read(env, "BYTEPS_LOCAL_SIZE", _int(1), 1),
        machine_sizes=_read(env, "TAGPS_MACHINE_SIZES", _sizes, None),
        dist_port=_read(env, "TAGPS_DIST_PORT", _int(1), default_dist_port),
        dist_backend=_read(
            env, "TAGPS_DIST_BACKEND", _choice("auto", "gloo", "nccl", "cpu:gloo,cuda:nccl"), "auto"
        ),
        dist_timeout_s=_read(env, "TAGPS_DIST_TIMEOUT", float, 300.0),
        fusion_bytes=_read(env, "TAGPS_FUSION_BYTES", _int(0), 25 << 20),
        pcie_switch_size=_read(env, "BYTEPS_PCIE_SWITCH_SIZE", _int(0), 0),
        local_topology=_read(env, "TAGPS_LOCAL_TOPOLOGY", _topology, None),
        device=_read(env, "TAGPS_DEVICE", str.strip, None) or None,
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        register_timeout=_read(env, "PS_REGISTER_TIMEOUT", _float(0.0, strict=True), 120.0),
        shm_dir=_read(env, "TAGPS_SHM_DIR", str.strip, "/dev/shm"),
    )


def _heartbeat(env: Mapping[str, str]) -> tuple[float, float]:
    """``PS_HEARTBEAT_INTERVAL`` and ``PS_HEARTBEAT_TIMEOUT`` (default the larger of 10 s and 3 intervals)."""
    interval = _read(env, "PS_HEARTBEAT_INTERVAL", _float(0.0, strict=True), 1.0)
    timeout = _read(env, "PS_HEARTBEAT_TIMEOUT", _float(0.0, strict=True), max(10.0, 3 * interval))
    if timeout <= interval:
        raise ConfigError(
            f"PS_HEARTBEAT_TIMEOUT={timeout} is malformed: must exceed PS_HEARTBEAT_INTERVAL={interval}"
        )
    return interval, timeout


def _float(minimum: float | None = None, strict: bool = False) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(raw.strip())
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("must be a finite number")
        if minimum is not None and (value <= minimum if strict else value < minimum):
            raise ValueError(f"must be {'>' if strict else '>='} {minimum}")
        return value

    return parse


def _floats(count: int) -> Callable[[str], tuple[float, ...]]:
    def parse(raw: str) -> tuple[float, ...]:
        values = tuple(_float()(part) for part in raw.split(","))
        if len(values) != count:
            raise ValueError(f"must be {count} comma-separated numbers")
        return values

    return parse


def _text(raw: str) -> str:
    return raw.strip()


@dataclass(frozen=True)
class ServerOptimizerConfig:
    """The optimizer a summation server applies to the summed gradient (``TAGPS_SERVER_*``).

    Args:
        name: ``"none"`` (plain summation, the default), ``"sgd"``, ``"adam"``, ``"adamw"`` or ``"rmsprop"``.
        lr: learning rate (default 1e-3).
        betas: Adam/AdamW coefficients (default ``(0.9, 0.999)``).
        eps: denominator term (default 1e-8).
        weight_decay: L2 penalty, decoupled for AdamW (default 0; AdamW's default is 0.01).
        momentum: SGD/RMSProp momentum (default 0).
        dampening: SGD dampening (default 0).
        nesterov: SGD Nesterov momentum (default off).
        alpha: RMSProp smoothing constant (default 0.99).
        centered: centered RMSProp (default off).
        amsgrad: AMSGrad variant of Adam/AdamW (default off).
        maximize: maximize the objective instead of minimizing it (default off).
    """

    name: str = "none"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    alpha: float = 0.99
    centered: bool = False
    amsgrad: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"TAGPS_SERVER_BETAS={self.betas} is malformed: each beta must be in [0, 1)")
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            raise ConfigError("TAGPS_SERVER_NESTEROV=1 needs TAGPS_SERVER_MOMENTUM > 0 and zero dampening")


def server_optimizer_config(env: Mapping[str, str] = os.environ) -> ServerOptimizerConfig:
    """Read ``TAGPS_SERVER_OPTIMIZER`` and its hyperparameters ``TAGPS_SERVER_{LR,BETAS,EPS,...}``."""
    name = _read(env, "TAGPS_SERVER_OPTIMIZER", _choice("none", "sgd", "adam", "adamw", "rmsprop"), "none")
    betas = _read(env, "TAGPS_SERVER_BETAS", _floats(2), (0.9, 0.999))
    return ServerOptimizerConfig(
        name=name,
        lr=_read(env, "TAGPS_SERVER_LR", _float(0.0), 1e-3),
        betas=(betas[0], betas[1]),
        eps=_read(env, "TAGPS_SERVER_EPS", _float(0.0), 1e-8),
        weight_decay=_read(env, "TAGPS_SERVER_WEIGHT_DECAY", _float(0.0), 0.01 if name == "adamw" else 0.0),
        momentum=_read(env, "TAGPS_SERVER_MOMENTUM", _float(0.0), 0.0),
        dampening=_read(env, "TAGPS_SERVER_DAMPENING", _float(0.0), 0.0),
        nesterov=_read(env, "TAGPS_SERVER_NESTEROV", _bool, False),
        alpha=_read(env, "TAGPS_SERVER_ALPHA", _float(0.0), 0.99),
        centered=_read(env, "TAGPS_SERVER_CENTERED", _bool, False),
        amsgrad=_read(env, "TAGPS_SERVER_AMSGRAD", _bool, False),
        maximize=_read(env, "TAGPS_SERVER_MAXIMIZE", _bool, False),
    )


@dataclass(frozen=True)
class PSConfig:
    """Settings of the parameter-server runtime (``DMLC_*``, ``BYTEPS_*``, ``PS_*``, ``TAGPS_*``).

    Args:
        role: ``DMLC_ROLE``: ``"worker"``, ``"server"`` or ``"scheduler"``.
        num_workers: ``DMLC_NUM_WORKER``, worker machines in the job.
        num_servers: ``DMLC_NUM_SERVER``, summation servers in the job.
        root_uri: ``DMLC_PS_ROOT_URI``, address of the scheduler.
        root_port: ``DMLC_PS_ROOT_PORT``, port of the scheduler.
        worker_id: ``DMLC_WORKER_ID``, this worker machine's id in ``[0, num_workers)`` (0 elsewhere).
        node_host: ``DMLC_NODE_HOST``, the address this node binds to and advertises (``None``: the
            local address that routes to the scheduler).
        local_rank: ``BYTEPS_LOCAL_RANK``, this process's rank inside its machine (default 0).
        local_size: ``BYTEPS_LOCAL_SIZE``, processes per worker machine (default 1).
        partition_bytes: ``BYTEPS_PARTITION_BYTES``, tensors are cut into chunks of at most this size.
        engine_threads: ``BYTEPS_SERVER_ENGINE_THREAD``, summation threads per server (default 4).
        server_io_threads: ``TAGPS_SERVER_IO_THREADS``, ZeroMQ I/O threads of a server's data socket
            (``None``: one per worker, at most one per usable core; see :meth:`server_io_thread_count`).
        enable_async: ``BYTEPS_ENABLE_ASYNC``, asynchronous updates instead of synchronous rounds.
        max_staleness: ``TAGPS_MAX_STALENESS``, in async mode the most rounds a pull may run ahead of the
            slowest worker's pushes (``None``: unbounded).
        key_hash_fn: ``BYTEPS_KEY_HASH_FN``: ``djb2``, ``sdbm``, ``naive`` or ``balanced``.
        scheduling_credit: ``BYTEPS_SCHEDULING_CREDIT``, pushes a worker keeps unacknowledged (default 8).
        log_level: ``BYTEPS_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``; default ``WARNING``).
        trace_on: ``BYTEPS_TRACE_ON``, record push_pull timelines.
        trace_dir: ``BYTEPS_TRACE_DIR``, where traces go (default ``./traces``).
        trace_start_step: ``BYTEPS_TRACE_START_STEP``, first traced step (default 10).
        trace_end_step: ``BYTEPS_TRACE_END_STEP``, last traced step (default 20).
        heartbeat_interval: ``PS_HEARTBEAT_INTERVAL``, seconds between heartbeats (default 1).
        heartbeat_timeout: ``PS_HEARTBEAT_TIMEOUT``, seconds of silence after which a node counts as dead
            (default 10).
        register_timeout: ``PS_REGISTER_TIMEOUT``, seconds a node waits for the scheduler to answer and the
            scheduler waits for the whole job to register before each fails naming what is missing
            (default 120).
        secret: ``TAGPS_PS_SECRET``, shared secret from which the CURVE keys are derived (``None``: no
            encryption or authentication).
        engine: ``TAGPS_PS_ENGINE``, the data path: ``cpp`` (the libzmq engine in ``tagps._core``; the
            default when it was built with libzmq) or ``python`` (pyzmq).
        ipc: ``TAGPS_PS_IPC`` (default on), BytePS's IPC mode: a worker of the cpp engine offers a server
            that advertises its own address (the same host) each chunk's bytes in shared memory, so only
            headers cross the socket; a cpp server takes the offer unless it keeps a store (async mode, a
            server optimizer). Off: every byte goes over TCP.
    """

    role: str
    num_workers: int
    num_servers: int
    root_uri: str
    root_port: int
    worker_id: int = 0
    node_host: str | None = None
    local_rank: int = 0
    local_size: int = 1
    partition_bytes: int = 4096000
    engine_threads: int = 4
    server_io_threads: int | None = None
    enable_async: bool = False
    max_staleness: int | None = None
    key_hash_fn: str = "djb2"
    scheduling_credit: int = 8
    log_level: str = "WARNING"
    trace_on: bool = False
    trace_dir: str = "traces"
    trace_start_step: int = 10
    trace_end_step: int = 20
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    register_timeout: float = 120.0
    secret: str | None = field(default=None, repr=False)
    engine: str = "python"
    ipc: bool = True

    def server_io_thread_count(self) -> int:
        """Return the ZeroMQ I/O threads of a server's data socket: ``server_io_threads`` when set, else one
        per worker, so that each worker's connection is received and answered on its own thread, at most one
        per usable core (docs/environment.md has the measurement)."""
        if self.server_io_threads is not None:
            return self.server_io_threads
        return max(1, min(self.num_workers, usable_cores()))


def usable_cores() -> int:
    """Return the cores this process may run on (its CPU affinity, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ps_config(env: Mapping[str, str] = os.environ, role: str | None = None) -> PSConfig:
    """Read and cross-check the parameter-server variables; raise :class:`ConfigError` naming a bad one.

    Args:
        env: the environment to read.
        role: the role of the calling program (``python -m tagps.server`` passes ``"server"``):
            ``DMLC_ROLE`` may then be unset, and must match when set.
    """
    declared = _read(env, "DMLC_ROLE", _choice("worker", "server", "scheduler"), role, required=role is None)
    if role is not None and declared != role:
        raise ConfigError(f"DMLC_ROLE={declared} is malformed: this program runs the {role} role")
    role = declared
    num_workers = _read(env, "DMLC_NUM_WORKER", _int(1), required=True)
    num_servers = _read(env, "DMLC_NUM_SERVER", _int(1), required=True)
    worker_id = _read(env, "DMLC_WORKER_ID", _int(0), 0, required=role == "worker" and num_workers > 1)
    if worker_id >= num_workers:
        raise ConfigError(f"DMLC_WORKER_ID={worker_id} is malformed: must be < DMLC_NUM_WORKER={num_workers}")
    local_size = _read(env, "BYTEPS_LOCAL_SIZE", _int(1), 1)
    local_rank = _read(env, "BYTEPS_LOCAL_RANK", _int(0), 0)
    if local_rank >= local_size:
        raise ConfigError(
            f"BYTEPS_LOCAL_RANK={local_rank} is malformed: must be < BYTEPS_LOCAL_SIZE={local_size}"
        )
    interval, timeout = _heartbeat(env)
    trace_start = _read(env, "BYTEPS_TRACE_START_STEP", _int(0), 10)
    trace_end = _read(env, "BYTEPS_TRACE_END_STEP", _int(0), 20)
    if trace_end < trace_start:
        raise ConfigError(
            f"BYTEPS_TRACE_END_STEP={trace_end} is malformed: "
            f"must be >= BYTEPS_TRACE_START_STEP={trace_start}"
        )
    return PSConfig(
        role=role,
        num_workers=num_workers,
        num_servers=num_servers,
        root_uri=_read(env, "DMLC_PS_ROOT_URI", _text, required=True),
        root_port=_read(env, "DMLC_PS_ROOT_PORT", _port, required=True),
        worker_id=worker_id,
        node_host=_read(env, "DMLC_NODE_HOST", _text, None),
        local_rank=local_rank,
        local_size=local_size,
        partition_bytes=_read(env, "BYTEPS_PARTITION_BYTES", _int(1), 4096000),
        engine_threads=_read(env, "BYTEPS_SERVER_ENGINE_THREAD", _int(1), 4),
        server_io_threads=_read(env, "TAGPS_SERVER_IO_THREADS", _int(1), None),
        enable_async=_read(env, "BYTEPS_ENABLE_ASYNC", _bool, False),
        max_staleness=_read(env, "TAGPS_MAX_STALENESS", _int(0), None),
        key_hash_fn=_read(env, "BYTEPS_KEY_HASH_FN", _choice("djb2", "sdbm", "naive", "balanced"), "djb2"),
        scheduling_credit=_read(env, "BYTEPS_SCHEDULING_CREDIT", _int(1), 8),
        log_level=_read(env, "BYTEPS_LOG_LEVEL", _log_level, "WARNING"),
        trace_on=_read(env, "BYTEPS_TRACE_ON", _bool, False),
        trace_dir=_read(env, "BYTEPS_TRACE_DIR", _text, "traces"),
        trace_start_step=trace_start,
        trace_end_step=trace_end,
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        register_timeout=_read(env, "PS_REGISTER_TIMEOUT", _float(0.0, strict=True), 120.0),
        secret=_read(env, "TAGPS_PS_SECRET", str, None),
        engine=_read(env, "TAGPS_PS_ENGINE", _ps_engine, _default_ps_engine()),
        ipc=_read(env, "TAGPS_PS_IPC", _bool, True),
    )


def _default_ps_engine() -> str:
    from tagps import _core  # the compiled core says whether it has the libzmq engine

    return "cpp" if _core.HAVE_NET else "python"


def _ps_engine(raw: str) -> str:
    value = _choice("cpp", "python")(raw)
    if value == "cpp" and _default_ps_engine() != "cpp":
        raise ValueError("tagps._core was built without libzmq (tagps._core.HAVE_NET is False); use python")
    return value


def _port(raw: str) -> int:
    value = int(raw.strip())
    if not 1 <= value <= 65535:
        raise ValueError("must be a TCP port in [1, 65535]")
    return value


def _log_level(raw: str) -> str:
    value = raw.strip().upper()
    aliases = {"TRACE": "DEBUG", "WARN": "WARNING", "FATAL": "CRITICAL"}
    value = aliases.get(value, value)
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("must be one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL")
    return value


def _device_count(raw: str) -> int:
    value = raw.strip().lower()
    if value in ("none", "void", "-1"):
        return 0
    if value == "all":
        raise ValueError("'all' does not say how many devices there are; set BYTEPS_LOCAL_SIZE")
    return len([d for d in value.split(",") if d.strip()])


@dataclass(frozen=True)
class LauncherConfig:
    """What ``bpslaunch`` needs to know about this machine.

    Args:
        role: ``worker``, ``server`` or ``scheduler`` (``DMLC_ROLE``); ``None`` for ``bpslaunch --local``,
            which sets every role itself.
        local_size: worker processes to start on this machine (``BYTEPS_LOCAL_SIZE``; default: the count in
            ``CUDA_VISIBLE_DEVICES``, else in ``NVIDIA_VISIBLE_DEVICES``, else 1).
        shm_dir: where the job's private shared-memory directory is made (``TAGPS_SHM_DIR``, default
            ``/dev/shm``).
        threads_chosen: ``OMP_NUM_THREADS`` is set, so each worker keeps the thread count it gives; else
            bpslaunch splits the machine's cores among its workers.
    """

    role: str | None = None
    local_size: int = 1
    shm_dir: str = "/dev/shm"
    threads_chosen: bool = False

    def __post_init__(self) -> None:
        if self.role not in (None, "worker", "server", "scheduler"):
            raise ConfigError(f"DMLC_ROLE={self.role!r} must be one of worker, server, scheduler")
        if self.local_size < 1:
            raise ConfigError(f"BYTEPS_LOCAL_SIZE={self.local_size} must be >= 1")


def launcher_config(env: Mapping[str, str] = os.environ, *, local: bool = False) -> LauncherConfig:
    """Read ``DMLC_ROLE`` (required unless ``local``), the local size (``BYTEPS_LOCAL_SIZE``,
    ``CUDA_VISIBLE_DEVICES``, ``NVIDIA_VISIBLE_DEVICES``), ``TAGPS_SHM_DIR`` and whether ``OMP_NUM_THREADS``
    is set."""
    role = None if local else _read(env, "DMLC_ROLE", _choice("worker", "server", "scheduler"), required=True)
    local_size = _read(env, "BYTEPS_LOCAL_SIZE", _int(1), None)
    if local_size is None:
        for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
            if name in env:
                local_size = _read(env, name, _device_count, 0) or 1
                break
    shm_dir = _read(env, "TAGPS_SHM_DIR", str.strip, "/dev/shm")
    chosen = bool(env.get("OMP_NUM_THREADS", "").strip())
    return LauncherConfig(role=role, local_size=local_size or 1, shm_dir=shm_dir, threads_chosen=chosen)


@dataclass(frozen=True)
class StrategyConfig:
    """Settings of the strategy layer (``tagps.strategy``).

    Args:
        cache_dir: where op profiles are cached on disk (``TAGPS_CACHE_DIR``, default ``~/.cache/tagps``).
    """

    cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "tagps")


def strategy_config(env: Mapping[str, str] = os.environ) -> StrategyConfig:
    """Read ``TAGPS_CACHE_DIR``."""
    return StrategyConfig(cache_dir=_read(env, "TAGPS_CACHE_DIR", _text, StrategyConfig.cache_dir))
