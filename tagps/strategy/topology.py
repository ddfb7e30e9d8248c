"""Device topologies: device groups (identical devices, usually one machine) and the links between them.

A topology file (YAML or JSON) looks like::

    name: two-machines
    inter_bandwidth_gbps: 100        # default bandwidth between any two device groups
    groups:
      - {name: m0, device: V100-32GB, count: 4, intra_bandwidth_gbps: 1200}
      - {name: m1, device: 1080Ti, count: 2, intra_bandwidth_gbps: 96}
      - {name: cpu0, count: 0}       # a server-only machine: summation servers, no training devices
    links:                           # optional per-pair overrides
      - {a: m0, b: m1, bandwidth_gbps: 40}

Every device group is a set of identical devices with equal bandwidth between each pair. ``memory_bytes``
and ``peak_flops`` of a device group default to its device type's (``tagps.strategy.devices``). Bandwidths
are in Gbit/s in the file and in bytes/s through :meth:`Topology.bandwidth`. A device group with
``count: 0`` is a server-only machine (BytePS's spare CPU machines): it only hosts PS summation servers
(``Plan.ps_servers``), never ops; its ``device`` defaults to ``CPU`` and its ``intra_bandwidth_gbps`` (unused:
no two devices of it talk) to :data:`SERVER_INTRA_GBPS`. A device group is not an op
group (a set of ops, :mod:`tagps.strategy.grouping`) nor a local reduction group (the devices under one
PCIe switch, which the runtime reduces among first); docs/plan.md has the glossary.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tagps.strategy.devices import DeviceType, device_type

__all__ = [
    "PRESETS",
    "SERVER_INTRA_GBPS",
    "DeviceGroup",
    "Link",
    "Topology",
    "load_topology",
    "paper_cloud",
    "paper_testbed",
    "random_topology",
]


SERVER_INTRA_GBPS = 100.0  # intra bandwidth a server-only device group gets when its file gives none


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DeviceGroup:
    """A device group: ``count`` identical devices with equal bandwidth between each pair.

    Args:
        name: unique device group name.
        device: device-type name from the table (``"1080Ti"``).
        count: number of devices (>= 0; 0: a server-only machine, which hosts PS servers and runs no ops).
        intra_bandwidth_gbps: bandwidth between two devices of the device group in Gbit/s.
        memory_bytes: per-device memory; defaults to the device type's.
        peak_flops: per-device peak FP32 FLOP/s; defaults to the device type's.
        cpu_cores: the CPU cores everything on this machine shares (an emulated machine's quota), which
            its ranks' communication CPU is charged to; 0: unknown (a CPU machine's devices' peak over a
            full core stands in).
    """

    name: str
    device: str
    count: int
    intra_bandwidth_gbps: float
    memory_bytes: int = 0
    peak_flops: float = 0.0
    cpu_cores: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or ":" in self.name:
            raise ValueError(f"device group name must be a non-empty string without ':', got {self.name!r}")
        dtype = device_type(self.device)
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise ValueError(
                f"device group {self.name!r}: count must be an integer >= 0 (0: a server-only machine), "
                f"got {self.count!r}"
            )
        _positive(self.intra_bandwidth_gbps, f"device group {self.name!r}: intra_bandwidth_gbps")
        if not self.memory_bytes:
            object.__setattr__(self, "memory_bytes", dtype.memory_bytes)
        if not self.peak_flops:
            object.__setattr__(self, "peak_flops", dtype.peak_flops)
        mem = self.memory_bytes
        if isinstance(mem, bool) or not isinstance(mem, int) or mem < 1:
            raise ValueError(f"device group {self.name!r}: memory_bytes must be a positive integer")
        _positive(self.peak_flops, f"device group {self.name!r}: peak_flops")
        cores = self.cpu_cores
        if isinstance(cores, bool) or not isinstance(cores, int | float) or not 0 <= cores < math.inf:
            raise ValueError(
                f"device group {self.name!r}: cpu_cores must be >= 0 (0: unknown), got {cores!r}"
            )

    @property
    def server_only(self) -> bool:
        """Whether this is a server-only machine: it hosts PS summation servers and has no devices."""
        return self.count == 0

    @property
    def device_type(self) -> DeviceType:
        """The table entry of this device group's devices, with its memory and peak FLOP/s."""
        base = device_type(self.device)
        if base.memory_bytes == self.memory_bytes and base.peak_flops == self.peak_flops:
            return base
        return DeviceType(
            base.name,
            self.peak_flops,
            self.memory_bytes,
            base.memory_bandwidth,
            base.efficiency,
            base.memory_efficiency,
            base.op_overhead_s,
        )

    def devices(self) -> list[str]:
        """Names of the device group's devices: ``"<device group>:<index>"``."""
        return [f"{self.name}:{i}" for i in range(self.count)]


@dataclass(frozen=True)
class Link:
    """Bandwidth override between two device groups (Gbit/s)."""

    a: str
    b: str
    bandwidth_gbps: float


@dataclass(frozen=True)
class Topology:
    """Device groups plus the bandwidths between them.

    Args:
        name: the topology's name.
        groups: the device groups (at least one, unique names).
        inter_bandwidth_gbps: default bandwidth between two device groups in Gbit/s.
        links: per-pair overrides of ``inter_bandwidth_gbps``.
        intra_latency_s: per-message latency inside a device group (the alpha of the alpha-beta model).
        inter_latency_s: per-message latency between device groups.
    """

    name: str
    groups: tuple[DeviceGroup, ...]
    inter_bandwidth_gbps: float
    links: tuple[Link, ...] = ()
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 25e-6
    _bw: dict[tuple[str, str], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError(f"topology {self.name!r} has no device groups")
        names = [g.name for g in self.groups]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"topology {self.name!r}: duplicate device group names {dup}")
        if all(g.server_only for g in self.groups):
            raise ValueError(
                f"topology {self.name!r}: every device group is server-only (count 0); "
                "at least one needs devices to train on"
            )
        _positive(self.inter_bandwidth_gbps, f"topology {self.name!r}: inter_bandwidth_gbps")
        for lat in ("intra_latency_s", "inter_latency_s"):
            value = getattr(self, lat)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"topology {self.name!r}: {lat} must be a number >= 0, got {value!r}")
        known = set(names)
        for link in self.links:
            for end in (link.a, link.b):
                if end not in known:
                    raise ValueError(
                        f"topology {self.name!r}: link {link.a}-{link.b} names unknown device group {end!r}"
                    )
            if link.a == link.b:
                raise ValueError(
                    f"topology {self.name!r}: link {link.a}-{link.b} joins a device group to itself; "
                    "use intra_bandwidth_gbps"
                )
            what = f"topology {self.name!r}: link {link.a}-{link.b} bandwidth_gbps"
            bw = _positive(link.bandwidth_gbps, what)
            self._bw[(link.a, link.b)] = self._bw[(link.b, link.a)] = bw * 1e9 / 8

    def group(self, name: str) -> DeviceGroup:
        """Return the device group ``name``; ValueError if there is none."""
        for g in self.groups:
            if g.name == name:
                return g
        raise ValueError(f"topology {self.name!r} has no device group {name!r}")

    def bandwidth(self, a: str, b: str) -> float:
        """Bytes/s between a device of device group ``a`` and one of ``b`` (intra bandwidth when a == b)."""
        if a == b:
            return self.group(a).intra_bandwidth_gbps * 1e9 / 8
        for end in (a, b):
            self.group(end)
        return self._bw.get((a, b), self.inter_bandwidth_gbps * 1e9 / 8)

    def devices(self) -> list[str]:
        """All device names, ``"<device group>:<index>"``, in device group order."""
        return [d for g in self.groups for d in g.devices()]

    @property
    def server_only(self) -> tuple[str, ...]:
        """Names of the server-only device groups (count 0), in order."""
        return tuple(g.name for g in self.groups if g.server_only)

    @property
    def worker_indices(self) -> tuple[int, ...]:
        """Indices (into ``groups``) of the device groups with devices: those that can run ops."""
        return tuple(i for i, g in enumerate(self.groups) if not g.server_only)

    @property
    def num_devices(self) -> int:
        """Total number of devices."""
        return sum(g.count for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form (what :meth:`from_dict` reads back to an equal object)."""
        return {
            "name": self.name,
            "inter_bandwidth_gbps": self.inter_bandwidth_gbps,
            "intra_latency_s": self.intra_latency_s,
            "inter_latency_s": self.inter_latency_s,
            "groups": [
                {
                    "name": g.name,
                    "device": g.device,
                    "count": g.count,
                    "intra_bandwidth_gbps": g.intra_bandwidth_gbps,
                    "memory_bytes": g.memory_bytes,
                    "peak_flops": g.peak_flops,
                    **({"cpu_cores": g.cpu_cores} if g.cpu_cores else {}),
                }
                for g in self.groups
            ],
            "links": [{"a": ln.a, "b": ln.b, "bandwidth_gbps": ln.bandwidth_gbps} for ln in self.links],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """Build and validate a topology from its dict form; errors name the offending entry."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a topology must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {
            "name",
            "inter_bandwidth_gbps",
            "intra_latency_s",
            "inter_latency_s",
            "groups",
            "links",
        }
        if unknown:
            raise ValueError(f"topology: unknown keys {sorted(unknown)}")
        name = str(data.get("name", "topology"))
        groups_raw = data.get("groups")
        if not isinstance(groups_raw, list) or not groups_raw:
            raise ValueError(f"topology {name!r}: 'groups' must be a non-empty list")
        groups = []
        for i, g in enumerate(groups_raw):
            if not isinstance(g, Mapping):
                raise ValueError(f"topology {name!r}: groups[{i}] must be a mapping")
            # A server-only machine (count 0) may leave out what only devices need.
            required = {"name", "count"}
            if g.get("count") != 0:
                required |= {"device", "intra_bandwidth_gbps"}
            missing = required - set(g)
            extra = set(g) - {f.name for f in fields(DeviceGroup)}
            if missing or extra:
                raise ValueError(
                    f"topology {name!r}: groups[{i}] missing {sorted(missing)} / unknown {sorted(extra)}"
                )
            groups.append(
                DeviceGroup(
                    g["name"],
                    g.get("device", "CPU"),
                    g["count"],
                    g.get("intra_bandwidth_gbps", SERVER_INTRA_GBPS),
                    g.get("memory_bytes", 0),
                    g.get("peak_flops", 0.0),
                    g.get("cpu_cores", 0.0),
                )
            )
        links = []
        for i, ln in enumerate(data.get("links") or []):
            if not isinstance(ln, Mapping) or set(ln) != {"a", "b", "bandwidth_gbps"}:
                raise ValueError(f"topology {name!r}: links[{i}] must have exactly a, b, bandwidth_gbps")
            links.append(Link(str(ln["a"]), str(ln["b"]), ln["bandwidth_gbps"]))
        if "inter_bandwidth_gbps" not in data:
            raise ValueError(f"topology {name!r}: 'inter_bandwidth_gbps' is required")
        return cls(
            name,
            tuple(groups),
            data["inter_bandwidth_gbps"],
            tuple(links),
            data.get("intra_latency_s", 5e-6),
            data.get("inter_latency_s", 25e-6),
        )

    def describe(self) -> str:
        """A human-readable table of the topology."""
        lines = [
            f"topology {self.name}: {len(self.groups)} device groups, {self.num_devices} devices, "
            f"{self.inter_bandwidth_gbps:g} Gbit/s between device groups"
        ]
        lines.append(
            f"{'device group':<12} {'device':<10} {'count':>5} {'memory GiB':>10} {'TFLOP/s':>8} "
            f"{'intra Gbit/s':>12}"
        )
        for g in self.groups:
            lines.append(
                f"{g.name:<12} {g.device:<10} {g.count:>5} {g.memory_bytes / 2**30:>10.1f} "
                f"{g.peak_flops / 1e12:>8.1f} {g.intra_bandwidth_gbps:>12g}"
            )
        for ln in self.links:
            lines.append(f"link {ln.a} - {ln.b}: {ln.bandwidth_gbps:g} Gbit/s")
        return "\n".join(lines)


NVLINK_GBPS = 1200.0  # V100 NVLink ring, ~150 GB/s
PCIE_GBPS = 96.0  # PCIe 3.0 x16, ~12 GB/s


def paper_testbed() -> Topology:
    """The TAG paper's testbed: 1x(4 V100-32GB, NVLink), 4x(2 1080Ti), 2x(2 P100), 100 Gbit/s."""
    groups = [DeviceGroup("v100", "V100-32GB", 4, NVLINK_GBPS)]
    groups += [DeviceGroup(f"1080ti-{i}", "1080Ti", 2, PCIE_GBPS) for i in range(4)]
    groups += [DeviceGroup(f"p100-{i}", "P100", 2, PCIE_GBPS) for i in range(2)]
    return Topology("paper-testbed", tuple(groups), 100.0)


def paper_cloud() -> Topology:
    """The TAG paper's cloud: 2x(8 V100-16GB, NVLink), 4x(4 T4), 10 Gbit/s."""
    groups = [DeviceGroup(f"v100-{i}", "V100-16GB", 8, NVLINK_GBPS) for i in range(2)]
    groups += [DeviceGroup(f"t4-{i}", "T4", 4, PCIE_GBPS) for i in range(4)]
    return Topology("paper-cloud", tuple(groups), 10.0)


RANDOM_TYPES = ("V100-32GB", "1080Ti", "P100")


def random_topology(seed: int) -> Topology:
    """A random topology as in the TAG paper's generality study (seeded).

    1-6 machines, 1-8 GPUs each of one of three types, intra-machine 64-160 Gbit/s, inter-machine
    20-50 Gbit/s drawn per pair.
    """
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    groups = tuple(
        DeviceGroup(f"m{i}", rng.choice(RANDOM_TYPES), rng.randint(1, 8), round(rng.uniform(64, 160), 1))
        for i in range(n)
    )
    links = tuple(
        Link(groups[i].name, groups[j].name, round(rng.uniform(20, 50), 1))
        for i in range(n)
        for j in range(i + 1, n)
    )
    return Topology(f"random-{seed}", groups, 50.0, links)


PRESETS = {"paper-testbed": paper_testbed, "paper-cloud": paper_cloud}


def load_topology(spec: str | Path) -> Topology:
    """Return a preset (``paper-testbed``, ``paper-cloud``, ``random:<seed>``) or read a YAML/JSON file."""
    text = str(spec)
    if text in PRESETS:
        return PRESETS[text]()
    if text.startswith("random:"):
        try:
            return random_topology(int(text.split(":", 1)[1]))
        except ValueError:
            raise ValueError(f"random topology spec must be random:<int seed>, got {text!r}") from None
    path = Path(text)
    if not path.is_file():
        raise ValueError(
            f"topology {text!r} is neither a preset ({', '.join(PRESETS)}, random:<seed>) nor a file"
        )
    raw = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(raw)
    else:
        data = json.loads(raw)
    return Topology.from_dict(data)
