"""Cluster spec files: the emulated machines of a ``tagps cluster`` and what each one runs.

A spec (YAML or JSON) looks like::

    name: hetero
    machines:
      - {name: m0, workers: 2, cpu: 0.6, rate_mbit: 1000}
      - {name: m1, workers: 2, cpu: 0.6, rate_mbit: 1000}
      - {name: slow, workers: 2, cpu: 0.3, rate_mbit: 200, delay_ms: 0.5}
      - {name: ps, workers: 0, servers: 1, cpu: 0.4, rate_mbit: 1000}

Each machine becomes one network namespace whose link to the cluster's bridge is limited to ``rate_mbit``
(each direction) with ``delay_ms`` of one-way delay, and one CPU cgroup holding its processes to ``cpu``
cores (``null``: no quota). ``workers`` worker processes and ``servers`` summation servers run there; the
scheduler runs on the first machine with workers (``torch.distributed``'s rendezvous is served by rank 0
at the scheduler's address, so the two must share a machine).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ClusterSpec", "MachineSpec", "load_spec"]

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,15}$")
_NAME_RULE = "use [a-z0-9][a-z0-9_-]*, at most 16 characters"
_MACHINE_KEYS = {"name", "workers", "servers", "cpu", "rate_mbit", "delay_ms"}


def _number(value: Any, what: str, minimum: float, strict: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{what} must be a number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{what} must be {'>' if strict else '>='} {minimum}, got {value!r}")
    return float(value)


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class MachineSpec:
    """One emulated machine.

    Args:
        name: lower-case letters, digits, ``-``, ``_``; at most 16 characters.
        workers: worker processes (devices) on it (default 1).
        servers: summation servers on it (default 0).
        cpu: CPU quota in cores for everything it runs (``None``: no quota).
        rate_mbit: link rate in Mbit/s in each direction (``None``: unlimited).
        delay_ms: one-way delay in ms added to what it sends (default 0).
    """

    name: str
    workers: int = 1
    servers: int = 0
    cpu: float | None = None
    rate_mbit: float | None = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"bad machine name {self.name!r}: {_NAME_RULE}")
        what = f"machine {self.name!r}"
        _count(self.workers, f"{what}: workers")
        _count(self.servers, f"{what}: servers")
        if self.workers + self.servers == 0:
            raise ValueError(f"{what} runs nothing: give it workers or servers")
        if self.cpu is not None:
            object.__setattr__(self, "cpu", _number(self.cpu, f"{what}: cpu", 0.01, strict=False))
        if self.rate_mbit is not None:
            object.__setattr__(self, "rate_mbit", _number(self.rate_mbit, f"{what}: rate_mbit", 0, True))
        object.__setattr__(self, "delay_ms", _number(self.delay_ms, f"{what}: delay_ms", 0, strict=False))


@dataclass(frozen=True)
class ClusterSpec:
    """An emulated cluster: its name and machines (in order; devices are numbered machine-major).

    Args:
        name: lower-case letters, digits, ``-``, ``_``; at most 16 characters.
        machines: at least one machine with workers, unique names.
    """

    name: str
    machines: tuple[MachineSpec, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"bad cluster name {self.name!r}: {_NAME_RULE}")
        names = [m.name for m in self.machines]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"cluster {self.name!r}: duplicate machine names {dup}")
        if not any(m.workers for m in self.machines):
            raise ValueError(f"cluster {self.name!r}: no machine has workers")

    def machine(self, name: str) -> MachineSpec:
        """Return machine ``name``; KeyError naming the known machines otherwise."""
        for m in self.machines:
            if m.name == name:
                return m
        raise KeyError(f"cluster {self.name!r} has no machine {name!r}; machines: {', '.join(self.names)}")

    @property
    def names(self) -> list[str]:
        """Machine names in order."""
        return [m.name for m in self.machines]

    @property
    def worker_machines(self) -> list[MachineSpec]:
        """The machines that run workers, in order (the device groups of the cluster's topology)."""
        return [m for m in self.machines if m.workers]

    @property
    def num_servers(self) -> int:
        """Summation servers over all machines."""
        return sum(m.servers for m in self.machines)

    def devices(self) -> list[str]:
        """Worker devices ``"<machine>:<index>"`` machine-major, as the topology and plans name them."""
        return [f"{m.name}:{i}" for m in self.worker_machines for i in range(m.workers)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """Build and validate a spec from its dict form; errors name the offending entry."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a cluster spec must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {"name", "machines"}
        if unknown:
            raise ValueError(f"cluster spec: unknown keys {sorted(unknown)}")
        raw = data.get("machines")
        if not isinstance(raw, list) or not raw:
            raise ValueError("cluster spec: 'machines' must be a non-empty list")
        machines = []
        for i, m in enumerate(raw):
            if not isinstance(m, Mapping) or "name" not in m:
                raise ValueError(f"cluster spec: machines[{i}] must be a mapping with a 'name'")
            extra = set(m) - _MACHINE_KEYS
            if extra:
                raise ValueError(
                    f"cluster spec: machines[{i}] has unknown keys {sorted(extra)}; "
                    f"known: {sorted(_MACHINE_KEYS)}"
                )
            machines.append(MachineSpec(**dict(m)))
        return cls(data.get("name", "cluster"), tuple(machines))

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form (what :meth:`from_dict` reads back to an equal object)."""
        return {
            "name": self.name,
            "machines": [
                {
                    "name": m.name,
                    "workers": m.workers,
                    "servers": m.servers,
                    "cpu": m.cpu,
                    "rate_mbit": m.rate_mbit,
                    "delay_ms": m.delay_ms,
                }
                for m in self.machines
            ],
        }


def load_spec(source: str | Path | Mapping[str, Any] | ClusterSpec) -> ClusterSpec:
    """Return the spec in ``source``: a spec, its dict form, or a YAML/JSON file.

    Raises:
        ValueError: the file is missing or the spec is malformed (the message names the entry).
    """
    if isinstance(source, ClusterSpec):
        return source
    if isinstance(source, Mapping):
        return ClusterSpec.from_dict(source)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"cluster spec {str(source)!r} is not a file")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    return ClusterSpec.from_dict(data)
