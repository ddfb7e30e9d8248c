"""Calibration of the simulator against this host: the constants, their fit, and how plans use them.

The simulator's cost model has a few constants that vendor figures do not give: the roofline efficiencies
and per-op overhead of a device (``tagps.strategy.devices``) and the per-message latency and achieved
bandwidth of collectives (``tagps.strategy.simulator``). :mod:`tagps.calibrate` measures this host (op
times of a calibration set of models, ``gloo`` all-reduces over emulated links) and :func:`fit_compute` /
:func:`fit_comm` fit the constants; the result is a :class:`Calibration`, saved as JSON. This module
imports neither torch nor the runtime.

A calibrated CPU device is a share ``s`` of one full core (a worker process with one thread under its
machine's CPU quota): ``s`` is its group's ``peak_flops`` (measured under the quota) over a full core's,
and every term of the roofline scales with it,

.. math::
    t_{op} = \\frac{1}{s}\\Big[\\max\\Big(\\frac{F}{P_1\\,\\eta},\\ \\frac{M}{W_1\\,\\eta_m}\\Big) + o\\Big],

while a collective of ``S`` bytes over ``n`` devices costs the ring model with the fitted latency
``α`` and bandwidth efficiency ``η_b`` of the measured TCP goodput ``B`` (each fitted separately for rings
inside a machine, where the reduction competes for the machine's CPU quota, and between machines):

.. math::
    t_{ring} = \\frac{2(n-1)}{n}\\frac{S}{\\eta_b B} + 2(n-1)\\,\\alpha.

Every fitted constant has a meaning and a physical range (:class:`PhysicalRange`, declared beside its field
of :class:`Calibration`; all of them in :data:`FITTED`). The fits stay inside the ranges, and a constant
that ends on an end of its range is a failure of the cost model, not a fit: the model lacks a cost that
the constant absorbed. :attr:`Calibration.at_bound` names those constants (it is also in the JSON).

The CPU that communication takes from a machine's quota (:class:`~tagps.strategy.simulator.HostCpu`)
comes from ten host-CPU constants, each with a meaning and a physical range too (:data:`HOST_CPU`), or
0 when not costed (a calibration without them predicts as before). Eight are measured by micro-benchmarks:
``message_copies``, the memory passes per byte at ``memory_bandwidth`` that each side of a message costs
(one side of a loopback TCP transfer), the summation kernel's ``sum_bandwidth``, the PS engine's CPU
per message, ``message_overhead_s`` (a loopback server's), the CPU of one push_pull call on each worker
rank, ``ps_call_s``, what a machine of more than one rank adds once, ``ps_shared_call_s`` (its root's
coordination of the shared-memory reduction), and what each local rank beyond a machine's first adds,
``ps_local_call_s`` (back-to-back small push_pulls from machines of one rank, of two and of three), and
the CPU a rank's process consumes per ring step and per collective call, ``collective_step_cpu_s`` and
``collective_call_cpu_s`` (back-to-back small all-reduces on the calibration cluster), which the
simulator charges to the rank's machine quota so that ranks sharing a small quota are not predicted to
burst at once. Two are what the runtimes add, fitted on whole jobs
(:func:`fit_runs`): ``collective_step_s``, the CPU of one ring step of a collective on each rank, and
``collective_call_s``, the CPU of launching one collective call (once per call, whatever the ring's
size). Calibrations written before ``ps_local_call_s`` existed fitted ``ps_call_s`` on the jobs as well
(it then held the shared-memory reduction's cost too) and predict as they did; those written before
``ps_call_s`` existed fitted ``message_overhead_s`` instead.
A push to a server on the worker's own machine goes through shared memory: one copy, each byte read and
written at ``memory_bandwidth`` (which counts both).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tagps.atomic import write_text_atomic
from tagps.strategy.devices import DeviceType, device_type
from tagps.strategy.graph import Graph, model_graph
from tagps.strategy.grouping import Grouping, grouping_from_names
from tagps.strategy.plan import Plan
from tagps.strategy.profiles import Profile
from tagps.strategy.simulator import HostCpu, SimResult, Simulator
from tagps.strategy.topology import DeviceGroup, Link, Topology

__all__ = [
    "CALIBRATION_VERSION",
    "FITTED",
    "HOST_CPU",
    "RUNTIME_CPU",
    "Calibration",
    "CommSample",
    "ComputeSample",
    "PhysicalRange",
    "RunSample",
    "fit_comm",
    "fit_compute",
    "fit_runs",
    "load_calibration",
    "refit_runs",
    "single_device_time",
]

CALIBRATION_VERSION = 1


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or math.isinf(value):
        raise ValueError(f"calibration: {what} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PhysicalRange:
    """What a fitted constant means and the closed range of values it can physically take.

    Args:
        meaning: what the constant is, in a few words.
        low: the smallest physical value.
        high: the largest physical value.
        unit: its unit (``""`` for a fraction).
    """

    meaning: str
    low: float
    high: float
    unit: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"a physical range needs 0 <= low < high, got [{self.low}, {self.high}]")

    def on_bound(self, value: float) -> str | None:
        """``"lower"`` or ``"upper"`` when ``value`` lies on (within 0.1 % of) that end of the range, where a
        fit stops when the model would need a value outside it; else ``None``."""
        if value <= self.low * (1 + 1e-3):
            return "lower"
        return "upper" if value >= self.high * (1 - 1e-3) else None

    def __str__(self) -> str:
        return f"[{self.low:g}, {self.high:g}]" + (f" {self.unit}" if self.unit else "")

    def clip(self, value: float) -> float:
        """``value`` moved into the range."""
        return min(max(value, self.low), self.high)


def _fitted(meaning: str, low: float, high: float, unit: str = "") -> Any:
    """A :class:`Calibration` field for a fitted constant, with its meaning and physical range."""
    return field(metadata={"range": PhysicalRange(meaning, low, high, unit)})


def _host_cpu(meaning: str, low: float, high: float, unit: str = "") -> Any:
    """A :class:`Calibration` field for a host-CPU constant (0: not costed), with its physical range."""
    return field(default=0.0, metadata={"host_cpu": PhysicalRange(meaning, low, high, unit)})


@dataclass(frozen=True)
class Calibration:
    """Fitted simulator constants for one host's CPU devices and emulated links.

    Args:
        core_flops: measured float32 matmul rate of one thread on one full core (FLOP/s).
        memory_bandwidth: measured copy bandwidth of one thread (bytes/s).
        efficiency, memory_efficiency, op_overhead_s, inter_latency_s, intra_latency_s,
            inter_bandwidth_efficiency, intra_bandwidth_efficiency: the fitted constants; each field
            states its meaning and physical range (:data:`FITTED`).
        fit_error: mean absolute relative error of each fit on its own samples (``compute``, ``comm``).
        calibration_set: what the constants were fitted on.

    Attributes:
        at_bound: the fitted constants that lie on an end of their range (derived from the values):
            the cost model failed there, and predictions that depend on them are unreliable.
    """

    core_flops: float
    memory_bandwidth: float
    # No op beats the measured matmul rate; under 5 % of it the time is a cost the roofline lacks.
    efficiency: float = _fitted("fraction of core_flops that compute-bound ops reach", 0.05, 1.0)
    # Likewise for the measured copy bandwidth.
    memory_efficiency: float = _fitted("fraction of memory_bandwidth that memory-bound ops reach", 0.05, 1.0)
    # One ATen op called from Python costs about a microsecond at least; a millisecond is not dispatch.
    op_overhead_s: float = _fitted("fixed time per op on a full core (framework dispatch)", 0.5e-6, 1e-3, "s")
    # A ring step between machines is at least a TCP message over veth (tens of us measured); 10 ms per
    # message is queueing or CPU starvation, which the ring model lacks.
    inter_latency_s: float = _fitted(
        "per-message latency of a collective step between machines", 5e-6, 10e-3, "s"
    )
    # Inside a machine a step is at least a loopback TCP message, a few microseconds.
    intra_latency_s: float = _fitted(
        "per-message latency of a collective step inside a machine", 1e-6, 10e-3, "s"
    )
    # A collective crosses the links the goodput probe measured, so it reaches at most all of the goodput;
    # under 10 % the link is not what limits it (CPU, serialisation: costs the ring model lacks).
    inter_bandwidth_efficiency: float = _fitted(
        "fraction of the measured TCP goodput between machines that a collective reaches", 0.1, 1.0
    )
    intra_bandwidth_efficiency: float = _fitted(
        "fraction of the measured TCP goodput inside a machine that a collective reaches", 0.1, 1.0
    )
    fit_error: dict[str, float] = field(default_factory=dict)
    calibration_set: tuple[str, ...] = ()
    # Each side of a message is at least one copy (into or out of the socket); beyond 8 passes over the
    # bytes it is not copying.
    message_copies: float = _host_cpu(
        "memory passes per byte at memory_bandwidth that each side of a PS message costs the CPU", 1.0, 8.0
    )
    # bench/kernels.py measures tagps.kernels.sum_into at tens of GB/s; under 1 GB/s is not the kernel.
    sum_bandwidth: float = _host_cpu(
        "bytes per second that the summation kernel sums on one full core", 1e9, 200e9, "B/s"
    )
    # A message costs the engine at least a system call; a millisecond is not per-message work.
    message_overhead_s: float = _host_cpu(
        "CPU time of the PS engine (framing, ZeroMQ I/O) per message (one partition) on one full core",
        1e-6,
        1e-3,
        "s",
    )
    # Measured (calibrate.measure_runtime_cpu: back-to-back small push_pulls on machines of one rank and of
    # three). A call is at least a framework dispatch (microseconds); 5 ms of CPU per tensor is not that.
    ps_call_s: float = _host_cpu(
        "CPU time of one push_pull call (one tensor) on each worker rank, on one full core", 1e-6, 5e-3, "s"
    )
    # A machine of several ranks: its root wakes for the others' slots and publishes the round, once per
    # call (2026-12-06, bench/ps_call_cpu.py: a root of two ranks 462 us a call, a lone rank 207).
    ps_shared_call_s: float = _host_cpu(
        "CPU time per push_pull call of a machine of more than one local rank, once whatever their number "
        "(its root's coordination of the shared-memory reduction), on one full core",
        1e-6,
        5e-3,
        "s",
    )
    # Each further local rank adds the shared-memory reduction's messages (a few per rank and call).
    ps_local_call_s: float = _host_cpu(
        "CPU time per push_pull call for each local rank beyond a machine's first (the shared-memory "
        "reduction's coordination), on one full core",
        1e-6,
        5e-3,
        "s",
    )
    # A ring step is at least a send and a receive system call; 5 ms of CPU per step is not messaging.
    collective_step_s: float = _host_cpu(
        "CPU time of one ring step of a collective on each rank, on one full core", 1e-6, 5e-3, "s"
    )
    # A call is at least a framework dispatch (microseconds); 5 ms of CPU to launch one is not launching.
    collective_call_s: float = _host_cpu(
        "CPU time of launching and completing one collective call on each rank, on one full core",
        1e-6,
        5e-3,
        "s",
    )
    # Measured (calibrate.measure_runtime_cpu: back-to-back small all-reduces on rings of two sizes): the CPU
    # a rank's process consumes per ring step and per call beyond its steps, which its machine's quota
    # pays. The fitted two above are what a job's step time shows (wake-ups and waits on a quota'd core
    # included), so they may differ; these bound a step by the quota instead (Simulator).
    collective_step_cpu_s: float = _host_cpu(
        "CPU time consumed per ring step of a collective on each rank, on one full core (measured)",
        1e-6,
        5e-3,
        "s",
    )
    collective_call_cpu_s: float = _host_cpu(
        "CPU time consumed per collective call beyond its steps on each rank, on one full core (measured)",
        1e-6,
        5e-3,
        "s",
    )
    # The whole jobs collective_step_s and collective_call_s were fitted on (RunSample.to_dict),
    # so that a change to the cost model is refitted on the same measurements (refit_runs) instead of
    # rerunning them.
    job_runs: tuple[dict[str, Any], ...] = ()
    at_bound: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        _positive(self.core_flops, "core_flops")
        _positive(self.memory_bandwidth, "memory_bandwidth")
        for name, rng in FITTED.items():
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not rng.low <= value <= rng.high
            ):
                raise ValueError(
                    f"calibration: {name} ({rng.meaning}) must be in its physical range {rng}, "
                    f"got {value!r}; refit with `python -m tagps.calibrate`"
                )
        for name, rng in HOST_CPU.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                value == 0 or rng.low <= value <= rng.high
            ):
                raise ValueError(
                    f"calibration: {name} ({rng.meaning}) must be 0 (not costed) or in its physical range "
                    f"{rng}, got {value!r}"
                )
        object.__setattr__(self, "at_bound", tuple(n for n, r in _RANGES.items() if self._on_bound(n, r)))

    def _on_bound(self, name: str, rng: PhysicalRange) -> str | None:
        value = getattr(self, name)
        return None if name in HOST_CPU and value == 0 else rng.on_bound(value)

    def bound_warnings(self) -> list[str]:
        """One line per constant in :attr:`at_bound`: a failure of the cost model, not a fit."""
        lines = []
        for name in self.at_bound:
            rng = _RANGES[name]
            lines.append(
                f"WARNING: {name} ({rng.meaning}) ended on the {rng.on_bound(getattr(self, name))} end "
                f"of its physical range {rng}: the measurements need a value outside physics, so the cost "
                "model lacks (or double-counts) a cost here and predictions that depend on it are unreliable"
            )
        return lines

    # ------------------------------------------------------------------ use
    def device_type(self, peak_flops: float | None = None) -> DeviceType:
        """The calibrated CPU device running at ``peak_flops`` (default: one full core)."""
        share = (peak_flops or self.core_flops) / self.core_flops
        base = device_type("CPU")
        return DeviceType(
            base.name,
            self.core_flops * share,
            base.memory_bytes,
            self.memory_bandwidth * share,
            self.efficiency,
            self.memory_efficiency,
            self.op_overhead_s / share,
        )

    def device_types(self, topology: Topology) -> dict[str, DeviceType]:
        """Calibrated types of the topology's CPU device groups, keyed by group name (for the simulator)."""
        return {
            g.name: dataclasses.replace(self.device_type(g.peak_flops), memory_bytes=g.memory_bytes)
            for g in topology.groups
            if g.device == "CPU"
        }

    def apply(self, topology: Topology) -> Topology:
        """Return ``topology`` with the fitted latencies and its bandwidths scaled by the efficiencies."""
        eff, intra = self.inter_bandwidth_efficiency, self.intra_bandwidth_efficiency
        groups = tuple(
            dataclasses.replace(g, intra_bandwidth_gbps=g.intra_bandwidth_gbps * intra)
            for g in topology.groups
        )
        links = tuple(Link(ln.a, ln.b, ln.bandwidth_gbps * eff) for ln in topology.links)
        return Topology(
            topology.name,
            groups,
            topology.inter_bandwidth_gbps * eff,
            links,
            intra_latency_s=self.intra_latency_s,
            inter_latency_s=self.inter_latency_s,
        )

    def host_cpu(self) -> HostCpu | None:
        """The CPU that communication takes, from the host-CPU constants (None: none is costed).

        A worker's push to a server on its own machine goes through shared memory (the runtime's default,
        ``TAGPS_PS_IPC``): one copy each way, each byte read and written at ``memory_bandwidth``.
        """
        if not any(getattr(self, name) for name in HOST_CPU):
            return None
        return HostCpu(
            self.core_flops,
            copy_s_per_byte=self.message_copies / self.memory_bandwidth,
            sum_s_per_byte=1 / self.sum_bandwidth if self.sum_bandwidth else 0.0,
            message_s=self.message_overhead_s,
            ps_call_s=self.ps_call_s,
            ps_local_call_s=self.ps_local_call_s,
            ps_shared_call_s=self.ps_shared_call_s,
            collective_step_s=self.collective_step_s,
            collective_call_s=self.collective_call_s,
            collective_step_cpu_s=self.collective_step_cpu_s,
            collective_call_cpu_s=self.collective_call_cpu_s,
            shm_copy_s_per_byte=2 / self.memory_bandwidth,
        )

    def simulator(
        self,
        graph: Graph,
        grouping: Grouping,
        topology: Topology,
        seed: int = 0,
        profiles: dict[str, Profile] | None = None,
    ) -> Simulator:
        """A :class:`Simulator` for ``topology`` with these constants (``seed``: the simulator's METIS seed).

        Plans keep naming ``topology`` (the measured one); evaluate them with :meth:`evaluate`. ``profiles``
        (by device-type name) replace the ones the simulator finds itself (``Simulator``'s argument).
        """
        return Simulator(
            graph,
            grouping,
            self.apply(topology),
            self.device_types(topology),
            seed=seed,
            profiles=profiles,
            host_cpu=self.host_cpu(),
            cpu_core_flops=self.core_flops,
        )

    def simulate(self, sim: Simulator, plan: Any) -> SimResult:
        """Simulate ``plan`` (made for the measured topology) on calibrated ``sim``."""
        return sim.evaluate(dataclasses.replace(plan, topology=sim.topology))

    def evaluate(self, sim: Simulator, plan: Any) -> float:
        """Predicted iteration time of ``plan`` (made for the measured topology) on calibrated ``sim``."""
        return self.simulate(sim, plan).iteration_time

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form (what :meth:`from_dict` reads back to an equal object)."""
        data = dataclasses.asdict(self)
        data["calibration_set"] = list(self.calibration_set)
        data["job_runs"] = list(self.job_runs)
        data["at_bound"] = list(self.at_bound)  # derived: written for readers, recomputed on load
        return {"version": CALIBRATION_VERSION, **data}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        """Build and validate a calibration from its dict form; errors name the offending key."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a calibration must be a mapping, got {type(data).__name__}")
        if data.get("version") != CALIBRATION_VERSION:
            raise ValueError(
                f"calibration version {data.get('version')!r} is not supported (reads {CALIBRATION_VERSION})"
            )
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        body = {k: v for k, v in data.items() if k not in ("version", "at_bound")}
        optional = {"fit_error", "calibration_set", "job_runs", *HOST_CPU}  # host-CPU ones: 0, not costed
        unknown, missing = set(body) - names, names - set(body) - optional
        if unknown or missing:
            raise ValueError(f"calibration: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
        body["calibration_set"] = tuple(body.get("calibration_set", ()))
        body["fit_error"] = dict(body.get("fit_error", {}))
        runs = body.get("job_runs", [])
        if not isinstance(runs, list) or not all(isinstance(r, Mapping) for r in runs):
            raise ValueError("calibration: job_runs must be a list of recorded runs (objects)")
        body["job_runs"] = tuple(dict(r) for r in runs)
        return cls(**body)

    def save(self, path: str | Path) -> None:
        """Write the JSON form to ``path`` (atomically: a reader sees the old file or the new one)."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")


FITTED: dict[str, PhysicalRange] = {
    f.name: f.metadata["range"] for f in dataclasses.fields(Calibration) if "range" in f.metadata
}
"""The fitted constants of a :class:`Calibration` and their physical ranges, in field order."""

HOST_CPU: dict[str, PhysicalRange] = {
    f.name: f.metadata["host_cpu"] for f in dataclasses.fields(Calibration) if "host_cpu" in f.metadata
}
"""The host-CPU constants of a :class:`Calibration` (0: not costed) and their physical ranges."""

_RANGES = {**FITTED, **HOST_CPU}


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file written by :meth:`Calibration.save` (``python -m tagps.calibrate``).

    Raises:
        ValueError: the file is missing, unreadable, not JSON or not a valid calibration (the message
            names the file).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"calibration file {str(path)!r} does not exist; run `python -m tagps.calibrate`")
    try:
        return Calibration.from_dict(json.loads(p.read_text()))
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"calibration file {str(path)!r}: {exc}") from None


# ---------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class ComputeSample:
    """One measured training step of a model on one full core.

    Args:
        name: what was measured (for the calibration set's record).
        graph: the model's graph.
        batch: samples in the step.
        optimizer: ``sgd``, ``momentum`` or ``adam``.
        measured_s: measured seconds of forward + backward + optimizer step.
    """

    name: str
    graph: Graph
    batch: int
    optimizer: str
    measured_s: float


@dataclass(frozen=True)
class CommSample:
    """One measured all-reduce.

    Args:
        nbytes: bytes reduced.
        n: devices in the ring.
        bandwidth_Bps: measured TCP goodput of the ring's slowest link.
        inter: whether the ring crosses machines (else it is inside one).
        measured_s: measured seconds.
    """

    nbytes: int
    n: int
    bandwidth_Bps: float
    inter: bool
    measured_s: float


def single_device_time(graph: Graph, batch: int, optimizer: str, dtype: DeviceType) -> float:
    """Simulated seconds of one training step of ``graph`` on one device (no communication)."""
    grouping = Grouping((tuple(range(len(graph.ops))),), (0,) * len(graph.ops))
    single = Topology("single", (DeviceGroup("d", dtype.name, 1, 1.0),), 1.0)
    sim = Simulator(graph, grouping, single, {"d": dtype})
    fwd, bwd = sim.ops_time(range(len(graph.ops)), dtype, float(batch))
    return fwd + bwd + sim.apply_time(graph.param_bytes, len(graph.params), dtype, optimizer)


def _box(names: Sequence[str], units: Sequence[float]) -> tuple[list[float], list[float]]:
    """``least_squares`` bounds for fitting ``names``: their physical ranges in ``units``."""
    ranges = [_RANGES[n] for n in names]
    low = [r.low / u for r, u in zip(ranges, units, strict=True)]
    high = [r.high / u for r, u in zip(ranges, units, strict=True)]
    return low, high


def _constants(names: Sequence[str], units: Sequence[float], x: Sequence[float]) -> dict[str, float]:
    """The constants that ``x`` (in ``units``) stands for, rounding kept inside their ranges."""
    return {n: _RANGES[n].clip(float(v) * u) for n, u, v in zip(names, units, x, strict=True)}


_COMPUTE = ("efficiency", "memory_efficiency", "op_overhead_s")
_COMPUTE_UNITS = (1.0, 1.0, 1e-6)  # the overhead fitted in microseconds keeps the variables comparable


def fit_compute(
    samples: Sequence[ComputeSample], core_flops: float, memory_bandwidth: float
) -> tuple[float, float, float, float]:
    """Fit ``efficiency``, ``memory_efficiency`` and ``op_overhead_s`` to measured single-core steps.

    Minimises the squared log ratio of simulated to measured time over the samples, each constant inside
    its physical range (:data:`FITTED`); a constant that ends on an end of its range shows in
    :attr:`Calibration.at_bound`.

    Returns:
        ``(efficiency, memory_efficiency, op_overhead_s, mean absolute relative error)``.

    Raises:
        ValueError: fewer than three samples.
    """
    if len(samples) < 3:
        raise ValueError(f"fitting three compute constants needs at least 3 samples, got {len(samples)}")
    from scipy.optimize import least_squares

    base = device_type("CPU")

    def dtype(x: Sequence[float]) -> DeviceType:
        c = _constants(_COMPUTE, _COMPUTE_UNITS, x)
        return dataclasses.replace(base, peak_flops=core_flops, memory_bandwidth=memory_bandwidth, **c)

    def residuals(x: Sequence[float]) -> list[float]:
        d = dtype(x)
        return [
            math.log(single_device_time(s.graph, s.batch, s.optimizer, d) / s.measured_s) for s in samples
        ]

    fit = least_squares(residuals, [0.5, 0.5, 20.0], bounds=_box(_COMPUTE, _COMPUTE_UNITS))
    d = dtype(fit.x)
    errors = [abs(single_device_time(s.graph, s.batch, s.optimizer, d) / s.measured_s - 1) for s in samples]
    return d.efficiency, d.memory_efficiency, d.op_overhead_s, sum(errors) / len(errors)


def fit_comm(samples: Sequence[CommSample]) -> tuple[float, float, float, float, float]:
    """Fit the ring model's latencies and bandwidth efficiencies to measured all-reduces.

    Non-negative least squares on relative residuals, separately for rings between machines (``inter``)
    and inside one (``intra``):

    .. math::
        t = \\frac{2(n-1)}{n}\\frac{S}{B}\\cdot\\frac{1}{\\eta_b} + 2(n-1)\\,\\alpha

    Returns:
        ``(inter_latency_s, intra_latency_s, inter_bandwidth_efficiency, intra_bandwidth_efficiency,
        mean absolute relative error)``, each constant moved into its physical range (:data:`FITTED`; one
        moved onto an end shows in :attr:`Calibration.at_bound`); a kind without samples takes the other
        kind's constants.

    Raises:
        ValueError: fewer than two samples, a ring of one, or samples that leave a bandwidth term at 0.
    """
    if len(samples) < 2:
        raise ValueError(f"fitting the all-reduce model needs at least 2 samples, got {len(samples)}")
    import numpy as np
    from scipy.optimize import nnls

    rows = []
    for s in samples:
        if s.n < 2:
            raise ValueError(f"an all-reduce sample needs n >= 2, got {s.n}")
        steps = 2 * (s.n - 1)
        volume = steps / s.n * s.nbytes / s.bandwidth_Bps / s.measured_s
        latency = steps / s.measured_s
        # Columns: 1/eta inter, 1/eta intra, alpha inter, alpha intra; each row divided by its measurement.
        rows.append([volume, 0.0, latency, 0.0] if s.inter else [0.0, volume, 0.0, latency])
    matrix = np.array(rows)
    coef, _ = nnls(matrix, np.ones(len(rows)))
    error = float(np.mean(np.abs(matrix @ coef - 1.0)))
    kinds = {kind: any(s.inter == kind for s in samples) for kind in (True, False)}
    inv = {True: float(coef[0]), False: float(coef[1])}
    lat = {True: float(coef[2]), False: float(coef[3])}
    for kind, present in kinds.items():
        if not present:
            inv[kind], lat[kind] = inv[not kind], lat[not kind]
        elif inv[kind] <= 0:
            where = "between machines" if kind else "inside a machine"
            raise ValueError(f"the all-reduces {where} do not determine the bandwidth: add larger messages")
    inter_lat, intra_lat = (
        FITTED["inter_latency_s"].clip(lat[True]),
        FITTED["intra_latency_s"].clip(lat[False]),
    )
    inter_eff = FITTED["inter_bandwidth_efficiency"].clip(1 / inv[True])
    intra_eff = FITTED["intra_bandwidth_efficiency"].clip(1 / inv[False])
    return inter_lat, intra_lat, inter_eff, intra_eff, error


@dataclass(frozen=True)
class RunSample:
    """One measured training job on an emulated cluster.

    Args:
        name: what ran (model, strategy, runtime).
        graph: the model's graph.
        grouping: the op groups the plan uses.
        topology: the measured topology the plan was made for.
        plan: the plan that ran.
        measured_s: measured iteration time.
    """

    name: str
    graph: Graph
    grouping: Grouping
    topology: Topology
    plan: Any
    measured_s: float

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready record (:attr:`Calibration.job_runs`): the plan, naming :attr:`topology`, holds
        the model, the op groups and the measured topology."""
        plan = dataclasses.replace(self.plan, topology=self.topology)
        return {"name": self.name, "plan": plan.to_dict(), "measured_s": self.measured_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSample:
        """Rebuild a sample from :meth:`to_dict`'s record (traces the plan's model: needs torch).

        Raises:
            ValueError: the record is malformed, or its plan does not fit its model's graph.
        """
        try:
            name, measured, plan = str(data["name"]), float(data["measured_s"]), Plan.from_dict(data["plan"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a recorded job run needs name, plan and measured_s: {exc}") from None
        if not 0 < measured < float("inf"):
            raise ValueError(f"recorded job run {name!r}: measured_s must be positive, got {measured!r}")
        graph = model_graph(plan.model)
        grouping = grouping_from_names(graph, [g.ops for g in plan.groups])
        return cls(name, graph, grouping, plan.topology, plan, measured)


RUNTIME_CPU = ("collective_step_s", "collective_call_s")  # what fit_runs fits


def fit_runs(start: Calibration, runs: Sequence[RunSample]) -> tuple[Calibration, float]:
    """Fit what the runtimes add to communication, on whole training jobs.

    The links keep the constants their all-reduce probes measured (:func:`fit_comm`); what a training
    job adds on top is CPU: each ring step's work on every rank (``collective_step_s``, which a quota'd
    rank runs slowly) and launching each collective call (``collective_call_s``). A PS push_pull's CPU is
    measured (``ps_call_s``, ``ps_shared_call_s``, ``ps_local_call_s``, ``message_overhead_s``), so the PS
    jobs only check it.
    The runs must hold rings of more than one size, or steps and calls cannot be told apart.
    Minimises the squared
    log ratio of the calibrated simulator's iteration time to the measured one over ``runs``, inside the
    constants' physical ranges; a constant that stops on a bound shows in :attr:`Calibration.at_bound`.

    Returns:
        The refitted calibration and its mean absolute relative error on ``runs``.

    Raises:
        ValueError: fewer runs than constants to fit.
    """
    if len(runs) < 4:
        raise ValueError(f"fitting the runtimes' CPU constants needs at least 4 runs, got {len(runs)}")
    from scipy.optimize import least_squares

    names = RUNTIME_CPU
    units = (1e-3,) * len(names)  # fitted in milliseconds

    def with_x(x: Sequence[float]) -> Calibration:
        return dataclasses.replace(start, **_constants(names, units, x))

    def predict(cal: Calibration, run: RunSample) -> float:
        return cal.evaluate(cal.simulator(run.graph, run.grouping, run.topology), run.plan)

    def residuals(x: Sequence[float]) -> list[float]:
        cal = with_x(x)
        return [math.log(predict(cal, r) / r.measured_s) for r in runs]

    # A CPU cost hidden behind the wire or compute has no slope, so a fit that starts below the point where
    # it surfaces stays there; a second start above every such point descends onto it. Starts inside the
    # ranges (0 means not costed yet): 50 us is a Python-level message, 1 ms more than any call costs.
    low = [(getattr(start, n) or 50e-6) / u for n, u in zip(names, units, strict=True)]
    high = [1e-3 / u for u in units]
    fits = [least_squares(residuals, x, bounds=_box(names, units), diff_step=0.05) for x in (low, high)]
    fit = min(fits, key=lambda f: f.cost)
    cal = dataclasses.replace(with_x(fit.x), job_runs=tuple(r.to_dict() for r in runs))
    errors = [abs(predict(cal, r) / r.measured_s - 1) for r in runs]
    return cal, sum(errors) / len(errors)


def refit_runs(cal: Calibration) -> Calibration:
    """Refit ``cal``'s runtime CPU constants on the jobs it recorded, with the simulator as it is now.

    Returns:
        The refitted calibration (``fit_error["jobs"]`` updated).

    Raises:
        ValueError: ``cal`` recorded no jobs (made before they were recorded, or with ``--no-jobs``).
    """
    if not cal.job_runs:
        raise ValueError(
            "the calibration recorded no job runs to refit on; run `python -m tagps.calibrate` (with jobs)"
        )
    # From the start the calibration's own fit had (not costed yet), so a refit is that fit, reproduced.
    start = dataclasses.replace(cal, **dict.fromkeys(RUNTIME_CPU, 0.0))
    refitted, error = fit_runs(start, [RunSample.from_dict(r) for r in cal.job_runs])
    return dataclasses.replace(refitted, fit_error={**cal.fit_error, "jobs": error})
