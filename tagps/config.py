"""The one place that reads environment variables (DMLC_*, BYTEPS_*, TAGPS_*, PS_*).

Every other module asks this one for a frozen, validated config object. A missing or malformed variable
raises :class:`ConfigError` naming the variable (BytePS silently exits 0 in that case; we fail loudly).
The variables are documented in ``docs/environment.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["CommConfig", "ConfigError", "KernelConfig", "comm_config", "kernel_config"]

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
        dist_port: torch.distributed rendezvous port (``TAGPS_DIST_PORT``, default ``root_port + 1``).
        dist_backend: ``auto`` (NCCL with CUDA, else gloo), ``gloo`` or ``nccl`` (``TAGPS_DIST_BACKEND``).
        dist_timeout_s: collective and rendezvous timeout in seconds (``TAGPS_DIST_TIMEOUT``, default 300).
        pcie_switch_size: local ranks per PCIe switch (``BYTEPS_PCIE_SWITCH_SIZE``, default 0 = one group).
        local_topology: explicit groups of local ranks, e.g. ``0,1|2,3`` (``TAGPS_LOCAL_TOPOLOGY``);
            overrides ``pcie_switch_size``.
    """

    num_worker: int = 1
    worker_id: int = 0
    num_server: int = 0
    root_uri: str = "127.0.0.1"
    root_port: int | None = None
    local_rank: int = 0
    local_size: int = 1
    dist_port: int | None = None
    dist_backend: str = "auto"
    dist_timeout_s: float = 300.0
    pcie_switch_size: int = 0
    local_topology: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.worker_id < self.num_worker:
            raise ConfigError(
                f"DMLC_WORKER_ID={self.worker_id} must be in [0, DMLC_NUM_WORKER={self.num_worker})"
            )
        if not 0 <= self.local_rank < self.local_size:
            raise ConfigError(
                f"BYTEPS_LOCAL_RANK={self.local_rank} must be in [0, BYTEPS_LOCAL_SIZE={self.local_size})"
            )
        if self.local_topology is not None:
            flat = sorted(r for g in self.local_topology for r in g)
            if flat != list(range(self.local_size)):
                raise ConfigError(
                    f"TAGPS_LOCAL_TOPOLOGY={self.local_topology} must name every local rank "
                    f"0..{self.local_size - 1} exactly once"
                )

    @property
    def size(self) -> int:
        """Worker processes in the job (machines times local size)."""
        return self.num_worker * self.local_size

    @property
    def rank(self) -> int:
        """Global rank of this process (machine-major, as BytePS numbers them)."""
        return self.worker_id * self.local_size + self.local_rank

    def local_groups(self) -> tuple[tuple[int, ...], ...]:
        """Return the groups of local ranks that reduce together first (PCIe switch or NUMA node)."""
        if self.local_topology is not None:
            return self.local_topology
        step = self.pcie_switch_size or self.local_size
        return tuple(tuple(range(s, min(s + step, self.local_size))) for s in range(0, self.local_size, step))


def comm_config(env: Mapping[str, str] = os.environ) -> CommConfig:
    """Read the job layout (``DMLC_*``, ``BYTEPS_LOCAL_*``) and the communication settings (``TAGPS_DIST_*``,
    ``BYTEPS_PCIE_SWITCH_SIZE``, ``TAGPS_LOCAL_TOPOLOGY``)."""
    root_port = _read(env, "DMLC_PS_ROOT_PORT", _int(1), None)
    default_dist_port = root_port + 1 if root_port is not None else None
    return CommConfig(
        num_worker=_read(env, "DMLC_NUM_WORKER", _int(1), 1),
        worker_id=_read(env, "DMLC_WORKER_ID", _int(0), 0),
        num_server=_read(env, "DMLC_NUM_SERVER", _int(0), 0),
        root_uri=_read(env, "DMLC_PS_ROOT_URI", str.strip, "127.0.0.1"),
        root_port=root_port,
        local_rank=_read(env, "BYTEPS_LOCAL_RANK", _int(0), 0),
        local_size=_read(env, "BYTEPS_LOCAL_SIZE", _int(1), 1),
        dist_port=_read(env, "TAGPS_DIST_PORT", _int(1), default_dist_port),
        dist_backend=_read(env, "TAGPS_DIST_BACKEND", _choice("auto", "gloo", "nccl"), "auto"),
        dist_timeout_s=_read(env, "TAGPS_DIST_TIMEOUT", float, 300.0),
        pcie_switch_size=_read(env, "BYTEPS_PCIE_SWITCH_SIZE", _int(0), 0),
        local_topology=_read(env, "TAGPS_LOCAL_TOPOLOGY", _topology, None),
    )
