"""The virtual runtime: expands graph + topology + plan into a training graph and list-schedules it.

One iteration is forward, backward, gradient synchronisation and the optimizer's apply. Every op group
becomes one compute task per device group it runs on (the devices of a device group run in lockstep at the
largest per-device batch among them); tensors crossing device groups become transfer tasks; gradients become
collective tasks. ``_TaskGraph`` builds these tasks phase by phase and ``_Schedule`` hands them to the C++
core's list scheduler (``csrc/sim``). Local reduction groups (devices under one PCIe switch) are not
modelled: a device group's devices share one intra-group bandwidth. Resources are one compute stream per
device group, one NIC channel per device group (inter-group traffic) and one bus channel per device group
(intra-group traffic). A task starts when its predecessors are done and all its resources are free;
resources serve tasks in the order they become ready (ties: creation order), from a heap of ``(finish time,
creation index)`` events. :data:`SIMULATED_STEPS` iterations run back to back, each device group's next
forward after its own apply, and the iteration time is their mean period. Costs (see ``docs/simulator.md``):

.. math::
    t_{ring}(S, n) = \\frac{2(n-1)}{n}\\frac{S}{B_{min}} + 2(n-1)\\,\\alpha\\,c

    t_{ps}(S_s) = \\Big(1 + \\frac{1}{P}\\Big)\\max_h
        \\sum_{s' \\ne w,\\ h \\in \\{w, s'\\}}\\frac{S_{s'}}{B_{ws'}}
        + 2\\max_w\\frac{m_w-1}{m_w}\\frac{S_s}{B^{intra}_w} + 2\\alpha c_s

    t_{sfb}(F, n) = \\frac{n-1}{n}\\frac{F}{B_{min}} + (n-1)\\,\\alpha + t_{wgrad}

Peak memory per device is parameters + gradients + optimizer state + the activations kept for backward
(+ gathered sufficient factors); a device over its memory makes the plan infeasible (OOM).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tagps import _core
from tagps.config import PSConfig
from tagps.strategy.devices import DeviceType
from tagps.strategy.graph import Graph, model_graph
from tagps.strategy.grouping import DEFAULT_GROUPS, Grouping, group_ops, grouping_from_names, split_ops
from tagps.strategy.plan import Plan
from tagps.strategy.profiles import Profile, find_profile, load_profile
from tagps.strategy.topology import Topology

__all__ = [
    "OPTIMIZER_STATE",
    "HostCpu",
    "SimResult",
    "Simulator",
    "TaskRecord",
    "allgather_time",
    "ring_allreduce_time",
    "summarize",
]

# Optimizer state per parameter byte, and bytes touched per parameter byte by the apply step.
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2}
APPLY_TRAFFIC = {"sgd": 3, "momentum": 5, "adam": 7}
FUSION_COPIES = 2  # a fused buffer is copied in and out once
# A plan's ps chunk size when it sets none (CommSettings.partition_bytes 0): the runtime's default.
PS_PARTITION_BYTES = PSConfig.partition_bytes
# Steps scheduled back to back: a machine starts step k + 1 as soon as its own step k is done, so a plan
# whose op groups sit on different machines overlaps consecutive steps; the iteration time is the mean
# period after the first step.
SIMULATED_STEPS = 2


def ring_allreduce_time(
    nbytes: float, n: int, bandwidth: float, latency: float, count: int = 1, step_cpu: float = 0.0
) -> float:
    """Return the time of a ring all-reduce.

    Each of the :math:`2(n-1)` steps moves :math:`S/n` over the slowest link while the ranks do the step's CPU
    work (:math:`\\gamma` per tensor, :class:`HostCpu`); the two overlap (the transport streams a chunk while
    the previous one is summed), so a step takes the longer of them:

    .. math::
        t = 2(n-1)\\left(\\max\\left(\\frac{S}{n B_{min}}, \\gamma c\\right) + \\alpha c\\right)

    Args:
        nbytes: bytes reduced (S).
        n: number of devices in the ring (1 means no communication).
        bandwidth: the slowest link of the ring in bytes/s (B_min).
        latency: per-message latency of the wire (alpha).
        count: number of tensors (each pays the latency and CPU terms).
        step_cpu: seconds of CPU per step and tensor on the slowest member (gamma; 0: not costed).
    """
    if n < 1 or bandwidth <= 0:
        raise ValueError(f"ring all-reduce needs n >= 1 and bandwidth > 0, got n={n}, bandwidth={bandwidth}")
    if n == 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * (max(nbytes / (n * bandwidth), step_cpu * count) + latency * count)


def allgather_time(
    nbytes: float, n: int, bandwidth: float, latency: float, count: int = 1, step_cpu: float = 0.0
) -> float:
    """Return the time of a ring all-gather of ``nbytes`` in total (steps as in :func:`ring_allreduce_time`).

    .. math::
        t = (n-1)\\left(\\max\\left(\\frac{S}{n B_{min}}, \\gamma c\\right) + \\alpha c\\right)
    """
    if n < 1 or bandwidth <= 0:
        raise ValueError(f"all-gather needs n >= 1 and bandwidth > 0, got n={n}, bandwidth={bandwidth}")
    if n == 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * (max(nbytes / (n * bandwidth), step_cpu * count) + latency * count)


_HOST_CPU_COSTS = (
    "copy_s_per_byte",
    "sum_s_per_byte",
    "message_s",
    "ps_call_s",
    "ps_local_call_s",
    "ps_shared_call_s",
    "collective_step_s",
    "collective_call_s",
    "shm_copy_s_per_byte",
    "collective_step_cpu_s",
    "collective_call_cpu_s",
)


@dataclass(frozen=True)
class HostCpu:
    """The CPU that PS communication takes from a CPU machine's quota (BytePS's path; 0: not costed).

    Each cost is CPU seconds on one full core; a machine runs it at ``q = min(1, devices · share)`` cores,
    ``share`` = a device's peak FLOP/s over ``core_flops`` (one thread under the machine's quota). Only
    device groups of device type ``CPU`` are costed (a GPU machine's host CPU is not modelled).

    Args:
        core_flops: peak FLOP/s of one full core.
        copy_s_per_byte: per byte of a message, for each side: serialisation and socket copies (memory
            passes over the memory bandwidth).
        sum_s_per_byte: per byte summed by the summation kernel (``tagps.kernels.sum_into``).
        message_s: per message (one partition), on each side: the PS engine's framing and ZeroMQ I/O (the
            same C++ engine in a server and in a worker's communication service).
        ps_call_s: per push_pull call (one tensor) on each worker rank: the framework's dispatch into the
            PS path (the gradient hook, enqueueing the tensor, waiting for it and copying the result back).
            Every rank of a machine pays it, though the machine pushes each partition once after its local
            reduction, so a machine's PS CPU grows with its ranks.
        ps_local_call_s: per push_pull call for each local rank beyond a machine's first: the shared-memory
            reduction's coordination (its messages between the ranks' processes, on them and on the
            machine's root), which a machine of one rank skips.
        ps_shared_call_s: per push_pull call of a machine of more than one rank, once whatever their
            number: its root's part of that coordination (waking for the others' slots, publishing the
            round). With ``ps_local_call_s``, a machine of ``m > 1`` ranks pays
            ``m ps_call_s + ps_shared_call_s + (m - 1) ps_local_call_s`` per call.
        collective_step_s: per step of a collective (one message each rank sends and receives in a ring
            step): the runtime's and the transport's CPU work. A rank runs it at the speed its quota
            leaves it (its device's share of a core when it computes all step long, more in bursts when
            it computes less: ``_TaskGraph._quota_bursts``), so a ring step waits for the slowest member:
            ``collective_step_s / q_min`` adds to the step's time, which the wire's transfer of the step
            hides when it takes longer (:func:`ring_allreduce_time`). This is what makes many small
            all-reduces slow on a quota'd machine.
        collective_call_s: per collective call (one tensor, or one fused bucket): launching it and waiting
            for it in the runtime (a gradient hook, the framework's dispatch, queueing the work), once per
            call whatever the ring's size; at the slowest member's speed like ``collective_step_s``. A PS
            call pays ``ps_call_s`` instead (another path: the runtime's dispatch into the PS engine).
        shm_copy_s_per_byte: per byte copied into or out of the shared-memory region a worker shares with
            a server on its own machine (``TAGPS_PS_IPC``: one memcpy instead of a message's socket
            copies). 0: such a push is costed as a message like any other.
        collective_step_cpu_s, collective_call_cpu_s: the CPU a rank's process consumes per ring step and
            per collective call beyond its steps, measured (back-to-back small all-reduces), where the two
            above are what a step's time shows. Charged to the rank's machine: a step takes at least
            the machine's compute stream plus its ranks' collective CPU at its quota, so ranks that share
            a small quota cannot all burst at full speed at once. 0: no such bound.
    """

    core_flops: float
    copy_s_per_byte: float = 0.0
    sum_s_per_byte: float = 0.0
    message_s: float = 0.0
    ps_call_s: float = 0.0
    ps_local_call_s: float = 0.0
    collective_step_s: float = 0.0
    collective_call_s: float = 0.0
    shm_copy_s_per_byte: float = 0.0
    collective_step_cpu_s: float = 0.0
    collective_call_cpu_s: float = 0.0
    ps_shared_call_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.core_flops < float("inf"):
            raise ValueError(f"HostCpu: core_flops must be positive and finite, got {self.core_flops!r}")
        for name in _HOST_CPU_COSTS:
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"HostCpu: {name} must be >= 0 and finite, got {value!r}")

    @property
    def costed(self) -> bool:
        """Whether any cost is non-zero (else the simulator skips this model: the old results exactly)."""
        return any(getattr(self, name) for name in _HOST_CPU_COSTS)


class _Ring(NamedTuple):
    """A ring over some device groups: its slowest link (bytes/s), wire latency, the slowest member's CPU
    per step and per call (:class:`HostCpu`), and the channels (resources) it occupies."""

    bandwidth: float
    latency: float
    step_cpu: float
    call_cpu: float
    channels: tuple[int, ...]

    def allreduce_time(self, nbytes: float, n: int) -> float:
        """One all-reduce call of ``nbytes`` over ``n`` devices: the ring plus launching the call."""
        if n == 1 or nbytes <= 0:
            return 0.0
        return ring_allreduce_time(nbytes, n, self.bandwidth, self.latency, 1, self.step_cpu) + self.call_cpu


@dataclass(frozen=True)
class TaskRecord:
    """One scheduled task (recorded when ``trace=True``); ``step`` counts from 1 (:data:`SIMULATED_STEPS`)."""

    name: str
    category: str
    resource: str
    start: float
    end: float
    step: int = 1


@dataclass
class SimResult:
    """What one simulation reports.

    Args:
        iteration_time: seconds per training iteration.
        feasible: False when a device runs out of memory.
        oom_devices: devices over their memory.
        peak_memory: bytes per device.
        busy: compute seconds per device.
        idle: ``iteration_time - busy`` per device.
        group_finish: per op group, when its backward finished (max over its device groups).
        tasks: every scheduled task (only with ``trace=True``).
        op_times: per op, ``(start, end)`` of its forward on its first device group (``trace=True``).
        compute: per device type, what its compute times came from: ``"profile"`` (measured op times),
            ``"roofline"``, or ``"profile + roofline"`` when its device groups differ.
        cpu_seconds: per used CPU device under a host-CPU model (:class:`HostCpu`), the core seconds of its
            compute-resource tasks per iteration (``busy`` times its share of a core): what its rank takes
            from the machine's quota for compute, the optimizer and the communication CPU costed on it
            (a collective's per-step CPU, inside the ring's time, is not in it).
    """

    iteration_time: float
    feasible: bool
    oom_devices: tuple[str, ...]
    peak_memory: dict[str, int]
    busy: dict[str, float]
    idle: dict[str, float]
    group_finish: list[float]
    tasks: list[TaskRecord] = field(default_factory=list)
    op_times: dict[str, tuple[float, float]] = field(default_factory=dict)
    compute: dict[str, str] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)

    def utilization(self) -> dict[str, float]:
        """Busy fraction of the iteration per device."""
        t = self.iteration_time or 1.0
        return {d: b / t for d, b in self.busy.items()}

    def chrome_trace(self) -> dict[str, Any]:
        """The tasks as a Chrome trace (``chrome://tracing`` / Perfetto JSON object format)."""
        if not self.tasks:
            raise ValueError("no tasks recorded: simulate with trace=True to export a trace")
        resources = sorted({t.resource for t in self.tasks})
        tid = {r: i for i, r in enumerate(resources)}
        events: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[r], "args": {"name": r}}
            for r in resources
        ]
        events += [
            {
                "name": t.name,
                "cat": t.category,
                "ph": "X",
                "pid": 0,
                "tid": tid[t.resource],
                "ts": t.start * 1e6,
                "dur": (t.end - t.start) * 1e6,
                "args": {"step": t.step},
            }
            for t in self.tasks
        ]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str | Path) -> None:
        """Write :meth:`chrome_trace` to ``path``."""
        Path(path).write_text(json.dumps(self.chrome_trace()))


# A task's label: (category, op group or -1, device group / server / source op group or -1).
_Label = tuple[str, int, int]


class _Schedule:
    """One step's tasks (durations, resources, predecessors; plain lists for speed) and how to repeat them;
    :meth:`run` hands them to the list scheduler of the C++ core (``csrc/sim/schedule.cc``)."""

    __slots__ = ("add", "dur", "names", "npred", "preds", "res", "steps", "waits")

    def __init__(self) -> None:
        dur: list[float] = []
        res: list[tuple[int, ...]] = []
        npred: list[int] = []
        preds: list[int] = []  # every task's predecessors, one after another
        names: list[_Label] = []
        self.dur, self.res, self.npred, self.preds, self.names = dur, res, npred, preds, names
        self.steps = 1
        self.waits: list[tuple[int, int]] = []

        def add(d: float, r: tuple[int, ...], deps: Sequence[int], name: _Label) -> int:
            """Add a task of ``d`` seconds on resources ``r`` after ``deps``; return its id."""
            dur.append(d)
            res.append(r)
            npred.append(len(deps))
            preds.extend(deps)
            names.append(name)
            return len(dur) - 1

        self.add = add

    def repeat(self, steps: int, waits: list[tuple[int, int]]) -> None:
        """Schedule ``steps`` copies of the tasks, each a later training step.

        Args:
            steps: steps in all (>= 1).
            waits: ``(task, prerequisite)`` pairs: in every later step, ``task`` also waits for the previous
                step's ``prerequisite``.
        """
        self.steps, self.waits = steps, waits

    def run(self, nres: int) -> tuple[list[float], list[float], list[float]]:
        """List-schedule every step; return per-task start and finish (step k's task t at ``k * len(dur) +
        t``) and per-resource busy time."""
        return _core.list_schedule(self.dur, self.res, self.npred, self.preds, self.steps, self.waits, nres)


@dataclass(frozen=True)
class _GroupCost:
    """What the costing needs of one op group: its ops, its parameters and its activations."""

    ops: tuple[int, ...]
    param_names: tuple[str, ...]
    param_bytes: int
    act_bytes: int  # per sample


@dataclass(frozen=True)
class _MPSegment:
    """Consecutive METIS parts of an ``mp`` op group that run on one device group (one chain task)."""

    dgroup: int
    fwd: float
    bwd: float
    out_bytes: int  # per sample, to later segments
    memory: dict[int, tuple[int, int, int]]  # device index -> (param bytes, activation bytes/sample, params)


# How an op group's input from producer op group ``src`` arrives, recorded in the forward pass so that the
# backward pass returns the gradient the same way. NamedTuples: thousands are made per evaluation.
class _Direct(NamedTuple):
    """The producer is laid out like the consumer: its output is already in place, on every device group."""

    src: int


class _Local(NamedTuple):
    """Device group ``dgroup`` already holds some of the samples it needs (no transfer for those)."""

    src: int
    dgroup: int


class _Transfer(NamedTuple):
    """Device group ``dgroup`` receives the samples it lacks from ``sources`` over its NIC (``duration`` s);
    in backward the gradient goes back at the same cost to every source."""

    src: int
    dgroup: int
    duration: float
    sources: tuple[int, ...]


class _GradientToReplicas(NamedTuple):
    """Device group ``dgroup`` reads its rows of a ``duplicate`` producer's output locally; in backward the
    rows' gradient goes to every replica, since no replica's copy is synced: ``duration`` s over its NIC to
    the producer's ``others`` device groups, and ``bus`` s to its own other devices."""

    src: int
    dgroup: int
    duration: float
    others: tuple[int, ...]
    bus: float


class _Broadcast(NamedTuple):
    """A ``duplicate`` op group's full-batch input is broadcast to the devices of ``dgroup`` over its bus
    (``duration`` s); in backward the copies' gradients are reduced inside the device group at that cost."""

    src: int
    dgroup: int
    duration: float


_Input = _Direct | _Local | _Transfer | _Broadcast


class _FusionBucket:
    """The all-reduce being filled under tensor fusion: its members, bytes and op groups (backward order)."""

    __slots__ = ("groups", "members", "nbytes")

    def __init__(self, members: dict[int, int]) -> None:
        self.members = members
        self.nbytes = 0
        self.groups: list[int] = []


class _TaskGraph:
    """The training graph of one plan (``docs/simulator.md``, "The training graph") as tasks of a schedule.

    Built phase by phase, each reading what the earlier ones left: :meth:`lay_out` (each op group's batch
    per device), :meth:`forward`, :meth:`backward`, :meth:`sync` and :meth:`apply` (which also sums the
    memory per device). Task creation order decides ties in the schedule, so the phases run in this order.

    Args:
        sim: the simulator (costs, caches, topology).
        plan: a plan that fits ``sim`` (checked by the caller).
    """

    __slots__ = (
        "barrier",
        "batch",
        "bwd_done",
        "cpu_slowdown",
        "exits",
        "fbatch",
        "flushed",
        "fwd_out",
        "fwd_tasks",
        "inputs",
        "layouts",
        "memory",
        "mp_segments",
        "plan",
        "rank_cpu",
        "sched",
        "sfb_bytes",
        "sim",
        "step_end",
        "sync_done",
    )

    def __init__(self, sim: Simulator, plan: Plan) -> None:
        self.sim, self.plan = sim, plan
        self.sched = _Schedule()
        self.batch = plan.batch_size
        self.fbatch = float(plan.batch_size)
        # Per op group: {device group: per-device batch (0: device not used)}.
        self.layouts: list[dict[int, list[float]]] = []
        # Per op group: its METIS segments when ``mp``, else None.
        self.mp_segments: list[list[_MPSegment] | None] = []
        # Per op group: {device group: the task that leaves its output there}.
        self.fwd_out: list[dict[int, int]] = []
        # Per op group: {device group: samples of its output there}.
        self.exits: list[dict[int, float]] = []
        self.inputs: list[list[_Input]] = []  # per op group: how each input arrived
        self.fwd_tasks: list[list[int]] = []  # per op group: its forward tasks
        self.bwd_done: list[dict[int, int]] = []  # per op group: {device group: its last backward task}
        self.barrier: int | None = None  # without overlap: the end of the whole backward
        self.flushed = 0  # fused all-reduces added so far
        self.sync_done: list[list[int]] = [[] for _ in sim.dgroups]  # per device group: what apply waits for
        self.sfb_bytes: list[float] = [0.0] * len(sim.groups)  # per op group: gathered SFB factors
        self.memory: list[list[float]] = []  # per device group, per device: peak bytes
        self.step_end: dict[int, int] = {}  # per device group with work: the task that ends its step
        self.cpu_slowdown: list[float] = []  # per device group: how slowly its collectives' CPU runs
        # Per device group: CPU seconds (full core) its ranks spend per step in collective steps and calls,
        # which the ring's timeline waits for but no compute stream carries (_charge_collectives).
        self.rank_cpu: list[float] = [0.0] * len(sim.dgroups)

    def lay_out(self) -> None:
        """Lay out every op group; op groups with the same placement and option share one layout object."""
        sim, plan, batch, fbatch = self.sim, self.plan, self.batch, self.fbatch
        dgroups, dindex = sim.dgroups, sim.dindex
        shares = [[plan.batch_shares.get(f"{g.name}:{k}", 0) for k in range(g.count)] for g in dgroups]
        cache: dict[tuple[tuple[str, ...], str], dict[int, list[float]]] = {}
        for gp in plan.groups:
            key = (gp.placement, gp.option)
            per = cache.get(key)
            if per is None:
                idx = [dindex[name] for name in gp.placement]
                per = {}
                if gp.option in ("allreduce", "ps"):
                    total = sum(sum(shares[g]) for g in idx)
                    for g in idx:
                        if any(shares[g]):
                            per[g] = [batch * s / total for s in shares[g]]
                else:
                    for g in idx:
                        per[g] = [fbatch] * dgroups[g].count
                cache[key] = per
            self.layouts.append(per)

    def forward(self) -> None:
        """Add the forward tasks in topological order, with the transfers and broadcasts of their inputs."""
        sim, plan, add = self.sim, self.plan, self.sched.add
        dgroups, dindex, bw = sim.dgroups, sim.dindex, sim.bw
        nic = len(dgroups)
        bus = 2 * nic
        batch, fbatch = self.batch, self.fbatch
        inter_lat, intra_lat = sim.topology.inter_latency_s, sim.topology.intra_latency_s
        layouts, fwd_out, exits = self.layouts, self.fwd_out, self.exits
        for i, gp in enumerate(plan.groups):
            per = layouts[i]
            option = gp.option
            if option == "mp":
                segs = sim._mp_layout(i, tuple(dindex[name] for name in gp.placement), batch)
                entry = [segs[0].dgroup]
            else:
                segs = None
                entry = list(per)
            self.mp_segments.append(segs)
            deps: dict[int, list[int]] = {g: [] for g in entry}
            inputs: list[_Input] = []
            for j, nbytes in sim.preds[i]:
                src = layouts[j]
                if (
                    option != "mp"
                    and plan.groups[j].option != "mp"
                    and (src is per or src == per)
                    and ((option == "duplicate") == (plan.groups[j].option == "duplicate"))
                ):
                    for g in entry:
                        deps[g].append(fwd_out[j][g])
                    inputs.append(_Direct(j))
                    continue
                have = exits[j]
                for g in entry:
                    need = fbatch if option in ("duplicate", "mp") else sum(per[g])
                    local = have.get(g, 0.0)
                    edge_deps: list[int] = []
                    if local > 0:
                        edge_deps.append(fwd_out[j][g])
                        if plan.groups[j].option == "duplicate" and option != "duplicate":
                            inputs.append(self._to_replicas(j, g, sum(per[g]) * nbytes))
                        else:
                            inputs.append(_Local(j, g))
                    sources = [h for h in have if h != g]
                    if sources and need - local > 1e-9 * fbatch:  # tolerance: shares are float ratios
                        dur = (need - local) * nbytes / min(bw[h][g] for h in sources) + inter_lat
                        t = add(dur, (nic + g,), [fwd_out[j][h] for h in sources], ("transfer", i, j))
                        edge_deps.append(t)
                        inputs.append(_Transfer(j, g, dur, tuple(sources)))
                    if option == "duplicate" and dgroups[g].count > 1:
                        dur = fbatch * nbytes / bw[g][g] + intra_lat
                        t = add(dur, (bus + g,), edge_deps, ("broadcast", i, j))
                        edge_deps = [t]
                        inputs.append(_Broadcast(j, g, dur))
                    deps[g] += edge_deps
            self.inputs.append(inputs)
            tasks: list[int] = []
            out: dict[int, int] = {}
            if segs is not None:
                prev: list[int] = deps[entry[0]]
                for k, seg in enumerate(segs):
                    if k:  # the cut tensors from the previous segment
                        before = segs[k - 1]
                        seg_bytes = before.out_bytes * fbatch
                        dur = seg_bytes / bw[before.dgroup][seg.dgroup] + inter_lat if seg_bytes else 0.0
                        prev = [add(dur, (nic + seg.dgroup,), prev, ("transfer", i, i))]
                    t = add(seg.fwd, (seg.dgroup,), prev, ("forward", i, seg.dgroup))
                    tasks.append(t)
                    prev = [t]
                out[segs[-1].dgroup] = tasks[-1]
                exits.append({segs[-1].dgroup: fbatch})
            else:
                for g, row in per.items():
                    out[g] = t = add(sim.group_time(i, g, max(row))[0], (g,), deps[g], ("forward", i, g))
                    tasks.append(t)
                exits.append({g: (fbatch if option == "duplicate" else sum(row)) for g, row in per.items()})
            fwd_out.append(out)
            self.fwd_tasks.append(tasks)

    def _to_replicas(self, src: int, dgroup: int, nbytes: float) -> _GradientToReplicas:
        """The backward cost of sending ``nbytes`` of ``dgroup``'s rows' gradient to every replica of the
        ``duplicate`` op group ``src``: once to each of its other device groups, one after another over this
        NIC, and to this device group's other devices over its bus."""
        sim = self.sim
        others = tuple(h for h in self.layouts[src] if h != dgroup)
        wire = sum(nbytes / sim.bw[dgroup][h] for h in others)
        duration = wire + sim.topology.inter_latency_s if others else 0.0
        count = sim.dgroups[dgroup].count  # each device's rows go to its count - 1 neighbours
        bus = 0.0
        if count > 1:
            bus = (count - 1) * nbytes / sim.bw[dgroup][dgroup] + sim.topology.intra_latency_s
        return _GradientToReplicas(src, dgroup, duration, others, bus)

    def backward(self) -> None:
        """Add the backward tasks in reverse order, returning each input's gradient the way it came."""
        sim, add, fbatch = self.sim, self.sched.add, self.fbatch
        bw, nic = sim.bw, len(sim.dgroups)
        bus = 2 * nic
        inter_lat = sim.topology.inter_latency_s
        fwd_out = self.fwd_out
        ngroups = len(sim.groups)
        grad_deps: list[dict[int, list[int]]] = [{} for _ in range(ngroups)]  # what a backward waits for
        bwd_done: list[dict[int, int]] = [{} for _ in range(ngroups)]
        all_bwd: list[int] = []
        for i in range(ngroups - 1, -1, -1):
            segs = self.mp_segments[i]
            gd = grad_deps[i]
            bwd_entry: dict[int, int] = {}  # backward task producing input gradients on device group g
            if segs is not None:
                prev = [fwd_out[i][segs[-1].dgroup], *gd.get(segs[-1].dgroup, [])]
                for k in range(len(segs) - 1, -1, -1):
                    seg = segs[k]
                    t = add(seg.bwd, (seg.dgroup,), prev, ("backward", i, seg.dgroup))
                    bwd_done[i][seg.dgroup] = t
                    all_bwd.append(t)
                    prev = [t]
                    if k:
                        before = segs[k - 1]
                        seg_bytes = before.out_bytes * fbatch
                        dur = seg_bytes / bw[seg.dgroup][before.dgroup] + inter_lat if seg_bytes else 0.0
                        prev = [add(dur, (nic + before.dgroup,), prev, ("transfer", i, i))]
                bwd_entry[segs[0].dgroup] = prev[0]
            else:
                for g, row in self.layouts[i].items():
                    d = gd.get(g, [])
                    d.append(fwd_out[i][g])
                    t = add(sim.group_time(i, g, max(row))[1], (g,), d, ("backward", i, g))
                    bwd_done[i][g] = bwd_entry[g] = t
                    all_bwd.append(t)
            for rec in self.inputs[i]:
                target = grad_deps[rec.src]
                kind = type(rec)
                if kind is _Direct:
                    for g, t in bwd_entry.items():
                        target.setdefault(g, []).append(t)
                elif kind is _Local:
                    target.setdefault(rec.dgroup, []).append(bwd_entry[rec.dgroup])
                elif kind is _Transfer:
                    g = rec.dgroup
                    t = add(rec.duration, (nic + g,), [bwd_entry[g]], ("transfer", rec.src, i))
                    for h in rec.sources:
                        target.setdefault(h, []).append(t)
                elif kind is _GradientToReplicas:
                    g = rec.dgroup
                    t = bwd_entry[g]
                    if rec.bus:
                        t = add(rec.bus, (bus + g,), [t], ("gather", rec.src, i))
                    target.setdefault(g, []).append(t)
                    if rec.others:
                        t = add(rec.duration, (nic + g,), [bwd_entry[g]], ("transfer", rec.src, i))
                        for h in rec.others:
                            target.setdefault(h, []).append(t)
                else:  # _Broadcast
                    g = rec.dgroup
                    t = add(rec.duration, (bus + g,), [bwd_entry[g]], ("reduce", rec.src, i))
                    target.setdefault(g, []).append(t)
        self.bwd_done = bwd_done
        self._quota_bursts()
        if not self.plan.comm.overlap:
            self.barrier = add(0.0, (), all_bwd, ("barrier", -1, -1))

    def _quota_bursts(self) -> None:
        """Set how slowly each device group's collective CPU runs, from how busy its compute keeps it.

        A CPU quota (CFS) lets a machine run at full speed until the period's quota is spent: a rank that
        computes all step long runs its collectives' CPU at its share ``s`` of a core, one that computes a
        fraction ``b`` of the busiest rank's compute runs it at ``s + (1 - s)(1 - b)``.
        """
        sim = self.sim
        if sim.host_cpu is None:
            return
        busy = [0.0] * len(sim.dgroups)
        sched = self.sched
        for d, r, name in zip(sched.dur, sched.res, sched.names, strict=True):
            if name[0] in ("forward", "backward"):
                busy[r[0]] += d
        most = max(busy) or 1.0
        self.cpu_slowdown = [
            1 / (s + (1 - s) * (1 - b / most)) if s else 0.0 for s, b in zip(sim._share, busy, strict=True)
        ]

    def _ring(self, members: dict[int, int]) -> _Ring:
        """:meth:`Simulator._ring` with the CPU of its steps and calls at this plan's quota bursts."""
        sim = self.sim
        ring = sim._ring(members)
        if sim.host_cpu is None:
            return ring
        slow = self.cpu_slowdown
        return ring._replace(
            step_cpu=max(sim._step_full[g] * slow[g] for g in members),
            call_cpu=max(sim._call_full[g] * slow[g] for g in members),
        )

    def sync(self) -> None:
        """Add the gradient synchronisation of every replicated op group, in backward order.

        Raises:
            ValueError: a parameter has no gradient entry in the plan.
        """
        sim, plan, add = self.sim, self.plan, self.sched.add
        dtypes, fbatch = sim.dtypes, self.fbatch
        inter_lat, intra_lat = sim.topology.inter_latency_s, sim.topology.intra_latency_s
        gradients, params = plan.gradients, sim.graph.params
        ops, owner = sim.graph.ops, sim.owner_op
        bwd_done, sync_done, barrier = self.bwd_done, self.sync_done, self.barrier
        host = sim.host_cpu is not None
        fusion = plan.comm.fusion_bytes if plan.comm.overlap else 0
        partition = plan.comm.partition_bytes or PS_PARTITION_BYTES
        # The first bucket of backward may close early (used only with fusion, so only with overlap).
        first_cap = plan.comm.first_bucket_cap()
        bucket: _FusionBucket | None = None
        for i in range(len(sim.groups) - 1, -1, -1):
            gp = plan.groups[i]
            names = sim.groups[i].param_names
            if gp.option not in ("allreduce", "ps"):
                for name in names:
                    if name not in gradients:
                        raise ValueError(f"plan has no gradient entry for parameter {name!r}")
                continue
            per = self.layouts[i]
            members, n = sim._members(per)
            syncs = []
            for name in names:
                entry = gradients.get(name)
                if entry is None:
                    raise ValueError(f"plan has no gradient entry for parameter {name!r}")
                syncs.append(entry.sync)
            if n == 1 or not names:
                continue
            servers = tuple(plan.ps_servers or gp.placement)
            ar_sizes, ps_bytes, sfb, nics = sim._sync_split(i, members, servers, partition, tuple(syncs))
            deps = [barrier] if barrier is not None else [bwd_done[i][g] for g in per]
            if ar_sizes:
                if fusion:
                    if bucket is not None and bucket.members != members:
                        self._flush(bucket)
                        bucket = None
                    if bucket is None:
                        bucket = _FusionBucket(members)
                    bucket.nbytes += sum(ar_sizes)
                    bucket.groups.append(i)
                    if bucket.nbytes >= (first_cap if self.flushed == 0 else fusion):
                        self._flush(bucket)
                        bucket = None
                else:  # one all-reduce per tensor: each step hides its CPU behind the wire or not
                    ring = self._ring(members)
                    dur = sum(ring.allreduce_time(size, n) for size in ar_sizes)
                    t = add(dur, ring.channels, deps, ("allreduce", i, -1))
                    for g in per:
                        sync_done[g].append(t)
                    self._ring_cpu(members, sum(ar_sizes), deps, i)
                    self._charge_collectives(members, len(ar_sizes), 2 * (n - 1))
            wire = max(nics.values(), default=0.0)
            for s, (nbytes, count, partitions, calls) in ps_bytes.items():
                local, res, remote = sim._ps(members, s)
                dur = wire + 2 * nbytes * local + 2 * count * (inter_lat if remote else intra_lat)
                busy: list[tuple[int, float]] = []
                if host:
                    server_s, busy = sim._ps_cpu(members, s, nbytes, partitions, calls)
                    # Partitions pipeline the network and the server's CPU (credits keep both busy).
                    dur = max(dur, server_s) + min(dur, server_s) / partitions
                t = add(dur, res, deps, ("ps", i, s))
                for g in per:
                    sync_done[g].append(t)
                for g, seconds in busy:  # the CPU taken from each machine's quota, off its compute
                    t = add(seconds, (g,), deps, ("ps-cpu", i, g))
                    if g in per:
                        sync_done[g].append(t)
            # A member that hosts none of these servers pushes to all of them (and pulls back) over its own
            # NIC while their transfers last: that NIC is busy too, for other syncs as for this one.
            for w in members:
                if w in nics and w not in ps_bytes:
                    sync_done[w].append(add(nics[w], (len(sim.dgroups) + w,), deps, ("ps-nic", i, w)))
            if sfb:
                ring = self._ring(members)
                for name in sfb:
                    op = ops[owner[name]]
                    per_sample, dup_flops = sim.sfb_factors(name, gradients[name].sfb_ops)
                    factor = per_sample * fbatch
                    self.sfb_bytes[i] += factor
                    gather = allgather_time(factor, n, ring.bandwidth, ring.latency, step_cpu=ring.step_cpu)
                    t = add(gather + ring.call_cpu, ring.channels, deps, ("sfb", i, -1))
                    self._charge_collectives(members, 1, n - 1)
                    wgrad = op.fwd_flops * params[name] / max(op.param_bytes, 1) + dup_flops
                    for g, row in per.items():
                        extra = dtypes[g].op_time(wgrad * (fbatch - max(row)), factor)
                        sync_done[g].append(add(extra, (g,), [t], ("sfb-compute", i, g)))
        if bucket is not None:
            self._flush(bucket)

    def _flush(self, bucket: _FusionBucket) -> None:
        """Add the fused all-reduce of ``bucket``: one latency term, plus copying in and out of the buffer."""
        sim, members, nbytes = self.sim, bucket.members, bucket.nbytes
        ring = self._ring(members)
        n = sum(members.values())
        dur = ring.allreduce_time(nbytes, n) + FUSION_COPIES * nbytes / (
            min(sim.dtypes[g].memory_bandwidth * sim.dtypes[g].memory_efficiency for g in members)
        )
        deps = [self.bwd_done[i][g] for i in bucket.groups for g in members]
        self.flushed += 1
        t = self.sched.add(dur, ring.channels, deps, ("allreduce", bucket.groups[0], -1))
        for g in members:
            self.sync_done[g].append(t)
        self._ring_cpu(members, nbytes, deps, bucket.groups[0])
        self._charge_collectives(members, 1, 2 * (n - 1))

    def _charge_collectives(self, members: dict[int, int], calls: int, steps: int) -> None:
        """Charge the CPU that ``calls`` collectives of ``steps`` ring steps each consume on every member rank
        to its machine (:attr:`HostCpu.collective_step_cpu_s`, ``collective_call_cpu_s``).

        The ring's timeline waits for the step's CPU at the rank's burst speed (``_Ring.step_cpu``); this
        bounds the step by the machine's quota instead (:meth:`Simulator._evaluate`): ranks sharing a
        small quota cannot all burst at once.
        """
        sim, cpu = self.sim, self.rank_cpu
        if sim.host_cpu is None:
            return
        for g, m in members.items():
            cpu[g] += m * calls * (steps * sim._step_cpu[g] + sim._call_cpu[g])

    def _ring_cpu(self, members: dict[int, int], nbytes: float, deps: list[int], group: int) -> None:
        """Take the CPU of a ring all-reduce's bytes from each costed member machine's compute.

        Each of a machine's :math:`m` ranks sends and receives :math:`2(n-1)/n \\cdot S` and sums
        :math:`(n-1)/n \\cdot S`; on a CPU machine that work shares the quota with the backward pass it
        overlaps, so it runs on the machine's compute stream at its :math:`q` cores:

        .. math::
            t_g = \\frac{m_g S}{q_g}\\cdot\\frac{n-1}{n}\\left(4 c_{copy} + c_{sum}\\right)
        """
        host, cores = self.sim.host_cpu, self.sim._cpu_cores
        if host is None:
            return
        n = sum(members.values())
        per_byte = (n - 1) / n * (4 * host.copy_s_per_byte + host.sum_s_per_byte)
        for g, m in members.items():
            if cores[g] and per_byte:
                t = self.sched.add(m * nbytes * per_byte / cores[g], (g,), deps, ("allreduce-cpu", group, g))
                self.sync_done[g].append(t)

    def apply(self) -> None:
        """Sum the memory per device and add one apply task per device group, after its syncs."""
        sim, plan, fbatch = self.sim, self.plan, self.fbatch
        dgroups, dtypes, layouts = sim.dgroups, sim.dtypes, self.layouts
        state = OPTIMIZER_STATE[plan.optimizer]
        ndg = len(dgroups)
        mem = [[0.0] * g.count for g in dgroups]
        apply_bytes = [0.0] * ndg
        apply_count = [0] * ndg
        # Op groups sharing a layout object are summed first, then spread over its devices once:
        # id(layout) -> [layout, static bytes per device, activation bytes per sample].
        per_layout: dict[int, list[Any]] = {}
        for i, cost in enumerate(sim.groups):
            segs = self.mp_segments[i]
            if segs is not None:
                for seg in segs:
                    row = mem[seg.dgroup]
                    for k, (pbytes, abytes, _) in seg.memory.items():
                        row[k] += pbytes * (2 + state) + abytes * fbatch
                    # Devices of a device group apply in parallel: it waits for its busiest device.
                    pbytes, _, nparams = max(seg.memory.values())
                    apply_bytes[seg.dgroup] += pbytes
                    apply_count[seg.dgroup] += nparams
                continue
            slot = per_layout.get(id(layouts[i]))
            if slot is None:
                slot = per_layout[id(layouts[i])] = [layouts[i], 0.0, 0.0]
            slot[1] += cost.param_bytes * (2 + state) + self.sfb_bytes[i]
            slot[2] += cost.act_bytes
            for g in layouts[i]:
                apply_bytes[g] += cost.param_bytes
                apply_count[g] += len(cost.param_names)
        for layout, static, act in per_layout.values():
            for g, row in layout.items():
                mrow = mem[g]
                for k, b in enumerate(row):
                    if b > 0:
                        mrow[k] += static + act * b
        self.memory = mem
        barrier = self.barrier
        for g in range(ndg):
            d = [barrier] if barrier is not None else [tasks[g] for tasks in self.bwd_done if g in tasks]
            if apply_count[g]:
                self.step_end[g] = self.sched.add(
                    sim.apply_time(apply_bytes[g], apply_count[g], dtypes[g], plan.optimizer),
                    (g,),
                    d + self.sync_done[g],
                    ("apply", -1, g),
                )
            elif d:  # no parameters here: the step still ends with its backward and syncs
                self.step_end[g] = self.sched.add(0.0, (), d + self.sync_done[g], ("step-end", -1, g))

    def repeat(self, steps: int) -> None:
        """Schedule ``steps`` steps: a device group's forward of step k + 1 waits for the end of its step k
        (its worker returns from ``optimizer.step()`` before the next ``train_step``)."""
        names, ends = self.sched.names, self.step_end
        waits = [(t, ends[g]) for t, (category, _, g) in enumerate(names) if category == "forward"]
        self.sched.repeat(steps, waits)


class Simulator:
    """Costs plans for one (graph, grouping, topology); per-op-group costs are computed once and cached.

    Args:
        graph: the model's op graph.
        grouping: its op groups (the plan's ``groups`` must list the same ops in the same order).
        topology: the device topology plans are made for.
        device_types: optional calibrated device types, keyed by device-group name or by device-type name
            (a device group's own entry wins), overriding the table's.
        seed: METIS seed for model-parallel splits.
        profiles: measured op profiles keyed by device-type name; default: the profile of ``graph.name``
            for each device type that :func:`~tagps.strategy.profiles.find_profile` finds. ``{}`` keeps the
            roofline everywhere. A profile applies to device groups with its peak FLOP/s, and a ``CPU``
            profile also to a quota'd share of the core it was recorded on (see ``cpu_core_flops``).
        host_cpu: the CPU that PS communication takes from CPU machines (default: not costed).
        cpu_core_flops: FLOP/s of one full core of the host the ``CPU`` profiles were recorded on (the
            calibration's ``core_flops``); a profile's own ``core_flops``, measured when it was recorded,
            wins. A ``CPU`` device group of peak ``p`` below it is a share of that core under a quota, which
            runs every op ``core / p`` times slower, dispatch included; ``None``: such groups keep the
            roofline.
        steps: training steps scheduled back to back (default :data:`SIMULATED_STEPS`); with more than
            one, the iteration time is the mean period after the first step.

    Attributes (read-only, for the search): ``graph``, ``grouping``, ``topology``; ``groups`` (per op
    group: ops, parameter names, parameter bytes, activation bytes per sample); ``dgroups`` (the
    topology's device groups) with their ``dtypes`` and the bandwidth matrix ``bw`` (bytes/s, diagonal =
    intra-group); :meth:`group_time` gives an op group's forward/backward seconds on a device group and
    :meth:`mp_assignment` the split of an ``mp`` op group that the plan records.
    """

    def __init__(
        self,
        graph: Graph,
        grouping: Grouping,
        topology: Topology,
        device_types: dict[str, DeviceType] | None = None,
        seed: int = 0,
        profiles: dict[str, Profile] | None = None,
        host_cpu: HostCpu | None = None,
        cpu_core_flops: float | None = None,
        steps: int = SIMULATED_STEPS,
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.graph, self.grouping, self.topology, self.seed = graph, grouping, topology, seed
        self.steps = steps
        overrides = device_types or {}
        self.dgroups = topology.groups
        self.dindex = {g.name: i for i, g in enumerate(self.dgroups)}
        self.dtypes = [overrides.get(g.name, overrides.get(g.device, g.device_type)) for g in self.dgroups]
        n = len(self.dgroups)
        self.bw = [[topology.bandwidth(a.name, b.name) for b in self.dgroups] for a in self.dgroups]
        # Resources: compute stream g, NIC g (n + g), bus g (2n + g).
        self.nres = 3 * n
        self.host_cpu = host_cpu if host_cpu is not None and host_cpu.costed else None
        # Cores of each machine's quota that one communication thread can use (0: not a costed CPU machine);
        # a server-only machine (no devices) gives its server one device's share.
        self._cpu_cores = [
            min(1.0, max(g.count, 1) * t.peak_flops / host_cpu.core_flops)
            if host_cpu is not None and t.name == "CPU"
            else 0.0
            for g, t in zip(self.dgroups, self.dtypes, strict=True)
        ]
        # CPU seconds of one collective step and of one collective call on each device group's ranks: on a
        # full core (_step_full, _call_full: a plan scales them by its quota bursts) and at the device's
        # share of a core (_step_s, _call_s: a rank that computes all step long; what ring_link reports).
        slowdown = [
            host_cpu.core_flops / min(t.peak_flops, host_cpu.core_flops)
            if host_cpu is not None and cores
            else 0.0
            for t, cores in zip(self.dtypes, self._cpu_cores, strict=True)
        ]
        step = host_cpu.collective_step_s if host_cpu is not None else 0.0
        call = host_cpu.collective_call_s if host_cpu is not None else 0.0
        step_cpu = host_cpu.collective_step_cpu_s if host_cpu is not None else 0.0
        call_cpu = host_cpu.collective_call_cpu_s if host_cpu is not None else 0.0
        self._share = [1 / x if x else 0.0 for x in slowdown]
        # Cores each costed machine's ranks share (its quota; else what its devices' peak says).
        self._quota = [g.cpu_cores or g.count * s for g, s in zip(self.dgroups, self._share, strict=True)]
        self._step_full = [step if x else 0.0 for x in slowdown]
        self._call_full = [call if x else 0.0 for x in slowdown]
        self._step_s = [step * x for x in slowdown]
        self._call_s = [call * x for x in slowdown]
        # CPU consumed per collective step and call on each costed machine's ranks, on a full core.
        self._step_cpu = [step_cpu if x else 0.0 for x in slowdown]
        self._call_cpu = [call_cpu if x else 0.0 for x in slowdown]
        self.param_index = {name: i for i, name in enumerate(graph.params)}
        owner_op: dict[str, int] = {}
        for i, op in enumerate(graph.ops):
            for p in op.params:
                owner_op[p] = i
        self.owner_op = owner_op
        self.groups: list[_GroupCost] = []
        for ops in grouping.groups:
            names = tuple(p for i in ops for p in graph.ops[i].params)
            self.groups.append(
                _GroupCost(
                    tuple(ops),
                    names,
                    sum(graph.params[p] for p in names),
                    sum(graph.ops[i].out_bytes for i in ops),
                )
            )
        op_group = grouping.op_group
        edges: dict[tuple[int, int], int] = {}
        for src, dst, nbytes in graph.edges:
            a, b = op_group[src], op_group[dst]
            if a != b:
                edges[(a, b)] = edges.get((a, b), 0) + nbytes
        self.edges = sorted(edges.items())
        self.preds: list[list[tuple[int, int]]] = [[] for _ in self.groups]
        for (a, b), nbytes in self.edges:
            self.preds[b].append((a, nbytes))
        self._time_cache: dict[tuple[int, int, float], tuple[float, float]] = {}
        self._op_index: dict[str, int] | None = None
        self._mp_cache: dict[tuple[int, tuple[int, ...], int], list[_MPSegment]] = {}
        self._parts_cache: dict[tuple[int, int], tuple[list[tuple[int, ...]], dict[int, int]]] = {}
        self._assign_cache: dict[tuple[int, tuple[str, ...]], tuple[tuple[str, tuple[str, ...]], ...]] = {}
        self._inner_edges: list[list[tuple[int, int, int]]] = [[] for _ in self.groups]
        for src, dst, nbytes in graph.edges:
            if op_group[src] == op_group[dst]:
                self._inner_edges[op_group[src]].append((src, dst, nbytes))
        self._ring_cache: dict[tuple[tuple[int, int], ...], _Ring] = {}
        self._ps_cache: dict[
            tuple[tuple[tuple[int, int], ...], int], tuple[float, tuple[int, ...], bool]
        ] = {}
        self._sync_cache: dict[
            tuple[int, tuple[tuple[int, int], ...], tuple[str, ...], int, tuple[str, ...]],
            tuple[list[int], dict[int, list[float]], list[str], dict[int, float]],
        ] = {}
        self._compute_tables(profiles, cpu_core_flops)

    def _compute_tables(self, profiles: dict[str, Profile] | None, cpu_core_flops: float | None) -> None:
        """Build the compute tables: per-op profile fits per device type, and their sums per op group.

        A device type's fits are ``(a_fwd, c_fwd, a_bwd, c_bwd)`` per op where a profile applies (else
        None: the roofline); summed per (device type, op group) once, :meth:`group_time` is then two
        multiply-adds.
        """
        graph = self.graph
        self._op_fits: dict[DeviceType, list[tuple[float, float, float, float]] | None] = {}
        # Per device type with a profile: (profile, slowdown of its device against the profiled one).
        self._apply_profiles: dict[DeviceType, tuple[Profile, float]] = {}
        sums: dict[DeviceType, list[tuple[float, float, float, float]] | None] = {}
        for dtype in self.dtypes:
            if dtype in self._op_fits:
                continue
            if profiles is None:
                path = find_profile(graph.name, dtype.name)
                profile = load_profile(path) if path is not None else None
            else:
                profile = profiles.get(dtype.name)
            fits = profile.coefficients(graph) if profile is not None else None  # a mismatch raises
            slow = 1.0
            if fits is not None and profile is not None and profile.peak_flops != dtype.peak_flops:
                # The profiled core's speed when it was profiled, where the profile measured it.
                core = (profile.core_flops or cpu_core_flops) if cpu_core_flops else None
                if dtype.name == "CPU" and core and dtype.peak_flops <= core:
                    slow = core / dtype.peak_flops  # a quota'd share of the profiled core
                    fits = [(af * slow, cf * slow, ab * slow, cb * slow) for af, cf, ab, cb in fits]
                else:
                    fits = None  # another peak (a measured or another device): the roofline
            self._op_fits[dtype] = fits
            if fits is not None and profile is not None:
                self._apply_profiles[dtype] = (profile, slow)
            sums[dtype] = None if fits is None else [
                (
                    sum(fits[i][0] for i in g.ops),
                    sum(fits[i][1] for i in g.ops),
                    sum(fits[i][2] for i in g.ops),
                    sum(fits[i][3] for i in g.ops),
                )
                for g in self.groups
            ]
        self._group_fits = [sums[dtype] for dtype in self.dtypes]  # per device group
        sources: dict[str, set[str]] = {}
        for dtype, fits in self._op_fits.items():
            sources.setdefault(dtype.name, set()).add("roofline" if fits is None else "profile")
        self.compute_sources = {name: " + ".join(sorted(kinds)) for name, kinds in sources.items()}

    @classmethod
    def for_model(
        cls, model: str, topology: Topology, groups: int = DEFAULT_GROUPS, seed: int = 0
    ) -> Simulator:
        """Simulator for reference model ``model`` grouped into ``groups`` op groups with METIS."""
        graph = model_graph(model)
        return cls(graph, group_ops(graph, groups, seed), topology, seed=seed)

    @classmethod
    def for_plan(cls, plan: Plan, graph: Graph | None = None) -> Simulator:
        """Simulator for a plan file: its topology and its op groups over ``graph`` (default: its model's)."""
        graph = graph if graph is not None else model_graph(plan.model)
        return cls(graph, grouping_from_names(graph, [g.ops for g in plan.groups]), plan.topology)

    # ------------------------------------------------------------------ cost pieces
    def ops_time(self, ops: Sequence[int], dtype: DeviceType, batch: float) -> tuple[float, float]:
        """Forward and backward seconds of ``ops`` on one device of ``dtype`` at ``batch`` samples.

        From the profile of ``dtype`` where one applies (a device type of this topology):
        :math:`t = \\sum_{op} a_{op} + c_{op} b`; else the roofline:

        .. math::
            t_{fwd} = \\sum_{op} \\mathrm{roofline}(F_{op} b,\\ M_{op} + (I_{op} + O_{op}) b), \\quad
            t_{bwd} = \\sum_{op} \\mathrm{roofline}(F^{bwd}_{op} b,\\ 2M_{op} + 2(I_{op} + O_{op}) b)
        """
        fwd = bwd = 0.0
        fits = self._op_fits.get(dtype)
        if fits is not None:
            for i in ops:
                af, cf, ab, cb = fits[i]
                fwd += af + cf * batch
                bwd += ab + cb * batch
            return fwd, bwd
        ops_list = self.graph.ops
        for i in ops:
            op = ops_list[i]
            io = (op.in_bytes + op.out_bytes) * batch
            fwd += dtype.op_time(op.fwd_flops * batch, op.param_bytes + io)
            bwd += dtype.op_time(op.bwd_flops * batch, 2 * op.param_bytes + 2 * io)
        return fwd, bwd

    def group_time(self, group: int, dgroup: int, batch: float) -> tuple[float, float]:
        """Cached :meth:`ops_time` of op group ``group`` on device group ``dgroup``."""
        key = (group, dgroup, batch)
        hit = self._time_cache.get(key)
        if hit is None:
            fits = self._group_fits[dgroup]
            if fits is None:
                hit = self.ops_time(self.groups[group].ops, self.dtypes[dgroup], batch)
            else:
                af, cf, ab, cb = fits[group]
                hit = (af + cf * batch, ab + cb * batch)
            self._time_cache[key] = hit
        return hit

    def apply_time(self, param_bytes: float, nparams: int, dtype: DeviceType, optimizer: str) -> float:
        """Seconds of the optimizer step over ``param_bytes`` on one device: the profile's measured step, pro
        rata, where the device type has a profile that timed ``optimizer``; else memory bound."""
        if nparams == 0:
            return 0.0
        measured = self._apply_profiles.get(dtype)
        if measured is not None:
            profile, slow = measured
            seconds = profile.apply_time(optimizer, param_bytes)
            if seconds is not None:
                return seconds * slow
        traffic = APPLY_TRAFFIC[optimizer] * param_bytes
        return traffic / (dtype.memory_bandwidth * dtype.memory_efficiency) + nparams * dtype.op_overhead_s

    def _ring(self, members: dict[int, int]) -> _Ring:
        """The links, CPU costs and channels of a ring over ``{device group: participating devices}``."""
        key = tuple(members.items())
        hit = self._ring_cache.get(key)
        if hit is None:
            hit = self._ring_cache[key] = self._ring_uncached(members)
        return hit

    def _ring_uncached(self, members: dict[int, int]) -> _Ring:
        n = len(self.dgroups)
        inner = [g for g, m in members.items() if m > 1]
        # A step and a call also wait for the slowest member's CPU (HostCpu; 0 when not costed).
        step = max(self._step_s[g] for g in members)
        call = max(self._call_s[g] for g in members)
        if len(members) == 1:
            (g,) = members
            return _Ring(self.bw[g][g], self.topology.intra_latency_s, step, call, (2 * n + g,))
        bmin = min(self.bw[a][b] for a in members for b in members if a != b)
        for g in inner:
            bmin = min(bmin, self.bw[g][g])
        res = tuple(n + g for g in members) + tuple(2 * n + g for g in inner)
        return _Ring(bmin, self.topology.inter_latency_s, step, call, res)

    def ring_link(self, members: dict[int, int]) -> tuple[float, float]:
        """Slowest link (bytes/s) and per-message latency of a ring over ``{device group: devices}``.

        The latency counts the slowest member's CPU per step as well (exact for small messages, where the
        wire does not hide it; :func:`ring_allreduce_time` takes the two apart).
        """
        ring = self._ring(members)
        return ring.bandwidth, ring.latency + ring.step_cpu

    def _members(self, per: dict[int, list[float]]) -> tuple[dict[int, int], int]:
        """Participating devices per device group of a replicated layout, and their total."""
        members = {g: sum(1 for b in row if b > 0) for g, row in per.items()}
        return members, sum(members.values())

    def _ps(self, members: dict[int, int], server: int) -> tuple[float, tuple[int, ...], bool]:
        """Seconds per byte of the reduction inside the slowest member device group (and of the broadcast
        after the pull), the channels of a PS transfer through ``server``, and whether it is remote.

        Each device group first reduces inside itself; the network's part is :meth:`_ps_nics`.
        """
        key = (tuple(members.items()), server)
        hit = self._ps_cache.get(key)
        if hit is None:
            bw, n = self.bw, len(self.dgroups)
            remote = any(w != server for w in members)
            local = max((m - 1) / m / bw[w][w] for w, m in members.items())
            res = (n + server,) if remote else tuple(2 * n + w for w in members)
            hit = self._ps_cache[key] = (local, res, remote)
        return hit

    def _sync_split(
        self,
        group: int,
        members: dict[int, int],
        servers: tuple[str, ...],
        partition: int,
        syncs: tuple[str, ...],
    ) -> tuple[list[int], dict[int, list[float]], list[str], dict[int, float]]:
        """How op group ``group``'s gradients sync (``syncs``: each parameter's method, in order): the sizes
        all-reduced, the bytes each PS server takes (server device group -> ``[bytes, tensors, partitions,
        calls]``, calls: tensors whose first partition it has), the ``sfb`` parameters, and each NIC's
        seconds for the PS part (:meth:`_ps_nics`). Cached: a search costs the same op group's choice in
        many plans. The result is shared; callers must not modify it."""
        key = (group, tuple(members.items()), servers, partition, syncs)
        hit = self._sync_cache.get(key)
        if hit is not None:
            return hit
        params, dindex = self.graph.params, self.dindex
        ar_sizes: list[int] = []
        ps_bytes: dict[int, list[float]] = {}
        sfb: list[str] = []
        ns = len(servers)
        for name, sync in zip(self.groups[group].param_names, syncs, strict=True):
            if sync == "allreduce":
                ar_sizes.append(params[name])
            elif sync == "ps":
                size = params[name]
                first = self.param_index[name]
                parts = -(-size // partition)
                for q in range(min(parts, ns)):  # partitions go round-robin over the servers
                    slot = ps_bytes.setdefault(dindex[servers[(first + q) % ns]], [0.0, 0, 0, 0])
                    mine = parts // ns + (1 if q < parts % ns else 0)
                    slot[0] += size * mine / parts
                    slot[1] += 1
                    slot[2] += mine
                    slot[3] += q == 0
            else:
                sfb.append(name)
        nics = self._ps_nics(members, ps_bytes) if ps_bytes else {}
        hit = self._sync_cache[key] = (ar_sizes, ps_bytes, sfb, nics)
        return hit

    def _ps_nics(self, members: dict[int, int], ps_bytes: dict[int, list[float]]) -> dict[int, float]:
        """Seconds each machine's NIC takes for one op group's PS sync (``ps_bytes``: server device group ->
        ``[bytes, tensors, partitions, calls]``); each of its servers' transfers lasts the busiest one's.

        Links are full duplex and the op group's partitions stream through every server at once (credits):
        pulls flow back while later partitions are pushed. Each machine's NIC carries its workers' pushes to
        every remote server and, if it hosts a server, every remote worker's pushes to it (the pulls mirror
        both the other way). A partition's pull waits for every member's push of it, so a NIC's load ends
        with its last partition still to drain: a server's NIC sends the pull of it to each remote member
        (as many partitions' worth as it took pushes of it), a worker's NIC receives one. A NIC takes its one
        direction plus its drain, and the wire lasts the busiest NIC's: 4 MB partitions of 13 MB over 3
        servers (2, 1 and 1) take 2.25x the bytes' time, 512 KiB ones 1.1x.
        """
        nic: dict[int, float] = {}
        server_drain: dict[int, float] = {}
        worker_drain: dict[int, float] = {}
        for s, (nbytes, _, partitions, _) in ps_bytes.items():
            chunk = nbytes / max(1, partitions)
            for w in members:
                if w != s:
                    seconds = nbytes / self.bw[w][s]
                    nic[w] = nic.get(w, 0.0) + seconds
                    nic[s] = nic.get(s, 0.0) + seconds
                    server_drain[s] = server_drain.get(s, 0.0) + chunk / self.bw[w][s]
                    worker_drain[w] = max(worker_drain.get(w, 0.0), chunk / self.bw[w][s])
        return {g: load + max(server_drain.get(g, 0.0), worker_drain.get(g, 0.0)) for g, load in nic.items()}

    def _ps_cpu(
        self, members: dict[int, int], server: int, nbytes: float, partitions: int, calls: int
    ) -> tuple[float, list[tuple[int, float]]]:
        """CPU that syncing ``nbytes`` in ``partitions`` of ``calls`` tensors through ``server`` takes (needs
        :attr:`host_cpu`).

        The server receives a push from each of the ``k`` member device groups, sums it in and sends each a
        pull; a worker device group's ``m_w`` ranks each call push_pull per tensor, the group sums their
        gradients, then pushes and pulls:

        .. math::
            t_s = \\frac{k S (2 c_{copy} + c_{sum}) + 2 k P c_{msg}}{q_s}, \\quad
            t_w = \\frac{S (2 c_{copy} + (m_w - 1) c_{sum}) + 2 P c_{msg}
                + C (m_w c_{call} + [m_w > 1] c_{shared} + (m_w - 1) c_{local})}{q_w}

        A member on the server's own machine shares memory with it when :attr:`HostCpu.shm_copy_s_per_byte`
        is set (the runtime's default): its push is one copy into the region and its pull one copy out
        (``2 c_{shm}`` instead of ``2 c_{copy}``), and the server sums straight from the region and copies
        the result back into it (``c_{shm} + c_{sum}``); the headers still go as messages.

        Returns:
            The server's seconds (0 on a machine that is not costed) and ``(device group, seconds)`` for
            every costed machine involved, server first.
        """
        host, cores = self.host_cpu, self._cpu_cores
        assert host is not None  # internal: only called with host_cpu set
        copy, summ, msg, call = host.copy_s_per_byte, host.sum_s_per_byte, host.message_s, host.ps_call_s
        local, shared_call = host.ps_local_call_s, host.ps_shared_call_s
        shm = host.shm_copy_s_per_byte
        shared = {w: bool(shm) and w == server for w in members}
        k = len(members)
        server_s = 0.0
        busy: list[tuple[int, float]] = []
        if cores[server]:
            received = sum((shm if shared[w] else 2 * copy) + summ for w in members)
            server_s = (nbytes * received + 2 * k * partitions * msg) / cores[server]
            busy.append((server, server_s))
        for w, m in members.items():
            if cores[w]:
                side = shm if shared[w] else copy
                own = nbytes * (2 * side + (m - 1) * summ) + 2 * partitions * msg
                own += calls * (m * call + (m - 1) * local + (shared_call if m > 1 else 0.0))
                busy.append((w, own / cores[w]))
        return server_s, busy

    def _mp_parts(self, group: int, k: int) -> tuple[list[tuple[int, ...]], dict[int, int]]:
        """METIS split of op group ``group`` into at most ``k`` parts and each op's part (cached)."""
        hit = self._parts_cache.get((group, k))
        if hit is None:
            parts = split_ops(self.graph, self.groups[group].ops, k, self.seed)
            hit = self._parts_cache[(group, k)] = (
                parts,
                {op: j for j, part in enumerate(parts) for op in part},
            )
        return hit

    def _mp_split(
        self, group: int, order: tuple[int, ...]
    ) -> tuple[list[tuple[int, ...]], dict[int, int], list[tuple[int, int]]]:
        """METIS parts of op group ``group`` over device groups ``order``, each op's part, each part's device.

        The parts, in topological order, go to consecutive devices ``(device group, index)`` of the
        placement starting at device ``group mod k``, so that op groups with fewer parts than devices do not
        all land on the first device. The one place that decides an mp split: the costing
        (:meth:`_mp_layout`) and the plan (:meth:`mp_assignment`) both read it.
        """
        devices = [(g, d) for g in order for d in range(self.dgroups[g].count)]
        parts, part_of = self._mp_parts(group, len(devices))
        return parts, part_of, [devices[(group + j) % len(devices)] for j in range(len(parts))]

    def mp_assignment(self, group: int, placement: Sequence[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The split this simulator costs for op group ``group`` as ``mp`` on ``placement`` (cached).

        Args:
            group: op group index.
            placement: device-group names in the plan's order (the order decides which device each part
                goes to).

        Returns:
            ``(device "<group>:<index>", op names)`` per METIS part in topological order: the value of
            :attr:`~tagps.strategy.plan.OpGroupPlan.mp_parts`.

        Raises:
            ValueError: a device group is not in the topology.
        """
        key = (group, tuple(placement))
        hit = self._assign_cache.get(key)
        if hit is None:
            unknown = [name for name in placement if name not in self.dindex]
            if unknown or not placement:
                raise ValueError(f"mp placement {list(placement)} has unknown device groups {unknown}")
            parts, _, devices = self._mp_split(group, tuple(self.dindex[name] for name in placement))
            ops = self.graph.ops
            hit = self._assign_cache[key] = tuple(
                (f"{self.dgroups[g].name}:{d}", tuple(ops[i].name for i in part))
                for part, (g, d) in zip(parts, devices, strict=True)
            )
        return hit

    def _mp_layout(self, group: int, order: tuple[int, ...], batch: int) -> list[_MPSegment]:
        """Model-parallel layout of op group ``group`` over device groups ``order`` (cached).

        The split is :meth:`_mp_split`'s; consecutive parts on one device group form one segment (they
        run as a chain).
        """
        key = (group, order, batch)
        hit = self._mp_cache.get(key)
        if hit is not None:
            return hit
        parts, part_of, devices = self._mp_split(group, order)
        ops = self.graph.ops
        runs: list[tuple[int, list[int]]] = []  # (device group, part indices)
        for j in range(len(parts)):
            g = devices[j][0]
            if runs and runs[-1][0] == g:
                runs[-1][1].append(j)
            else:
                runs.append((g, [j]))
        segments: list[_MPSegment] = []
        for g, mine in runs:
            dtype = self.dtypes[g]
            fwd = bwd = 0.0
            for j in mine:
                f, b = self.ops_time(parts[j], dtype, batch)
                fwd, bwd = fwd + f, bwd + b
            intra = out = 0
            for src, dst, nbytes in self._inner_edges[group]:
                a, b = part_of[src], part_of[dst]
                if a != b and a in mine:
                    if b in mine:
                        intra += nbytes
                    else:
                        out += nbytes
            cut = intra * batch / self.bw[g][g]
            memory = {
                devices[j][1]: (
                    sum(ops[i].param_bytes for i in parts[j]),
                    sum(ops[i].out_bytes for i in parts[j]),
                    sum(len(ops[i].params) for i in parts[j]),
                )
                for j in mine
            }
            segments.append(_MPSegment(g, fwd + cut, bwd + cut, out, memory))
        self._mp_cache[key] = segments
        return segments

    def sfb_factors(self, param: str, dup_ops: Sequence[str] = ()) -> tuple[int, float]:
        """Sufficient factors of ``param`` when ``dup_ops`` are duplicated (default: its owner op).

        The factors are the owner's output gradient plus every tensor entering the duplicated ops from
        outside them; the other duplicated ops are recomputed on every device.

        Returns:
            ``(factor bytes per sample, forward FLOPs per sample of the duplicated ops besides the owner)``.

        Raises:
            ValueError: an op is unknown or the owner op is not among ``dup_ops``.
        """
        owner = self.owner_op[param]
        if not dup_ops:
            dup = {owner}
        else:
            if self._op_index is None:
                self._op_index = {op.name: i for i, op in enumerate(self.graph.ops)}
            unknown = [o for o in dup_ops if o not in self._op_index]
            if unknown:
                raise ValueError(f"sfb_ops of {param!r}: unknown ops {unknown}")
            dup = {self._op_index[o] for o in dup_ops}
            if owner not in dup:
                raise ValueError(f"sfb_ops of {param!r} must include its op {self.graph.ops[owner].name!r}")
        ops = self.graph.ops
        inner = sum(nbytes for src, dst, nbytes in self.graph.edges if src in dup and dst in dup)
        factor = ops[owner].out_bytes + sum(ops[i].in_bytes for i in dup) - inner
        return factor, sum(ops[i].fwd_flops for i in dup if i != owner)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, plan: Plan, trace: bool = False) -> SimResult:
        """Simulate one training iteration of ``plan``.

        The evaluation allocates thousands of small, acyclic containers; Python's cyclic garbage collector
        is paused meanwhile (reference counting frees them all), which halves the cost in a long search.

        Args:
            plan: a validated plan whose op groups are this simulator's grouping, in order.
            trace: also record every task (for :meth:`SimResult.chrome_trace`) and per-op forward times.

        Returns:
            The :class:`SimResult`.

        Raises:
            ValueError: the plan does not fit this simulator (group count, topology, missing gradients).
        """
        enabled = gc.isenabled()
        gc.disable()
        try:
            result = self._evaluate(plan, trace)
        finally:
            if enabled:
                gc.enable()
        result.compute = self.compute_sources  # shared, never modified
        return result

    def _evaluate(self, plan: Plan, trace: bool) -> SimResult:
        if len(plan.groups) != len(self.groups):
            raise ValueError(
                f"plan has {len(plan.groups)} op groups, the simulator's grouping has {len(self.groups)}"
            )
        if plan.topology.groups != self.topology.groups:
            raise ValueError(f"plan was made for topology {plan.topology.name!r}, not {self.topology.name!r}")
        graph = _TaskGraph(self, plan)
        graph.lay_out()
        graph.forward()
        graph.backward()
        graph.sync()
        graph.apply()
        steps = self.steps
        graph.repeat(steps)
        start, finish, busy = graph.sched.run(self.nres)
        n = len(graph.sched.dur)  # tasks per step
        first = max(finish[:n], default=0.0)
        total = (max(finish[-n:]) - first) / (steps - 1) if steps > 1 and n else first
        busy = [b / steps for b in busy]
        # A quota'd machine cannot take more CPU per step than its quota gives: its compute stream's busy
        # time (compute, the bytes of its syncs) plus its ranks' collective CPU at its cores.
        for g, cpu_s in enumerate(graph.rank_cpu):
            if cpu_s:
                total = max(total, busy[g] + cpu_s / self._quota[g])
        mem = graph.memory
        peak: dict[str, int] = {}
        oom: list[str] = []
        busy_dev: dict[str, float] = {}
        idle_dev: dict[str, float] = {}
        cpu: dict[str, float] = {}
        ranks = [max(1, sum(1 for b in row if b > 0)) for row in mem]
        for g, dg in enumerate(self.dgroups):
            for k in range(dg.count):
                name = f"{dg.name}:{k}"
                peak[name] = int(mem[g][k])
                if mem[g][k] > dg.memory_bytes:
                    oom.append(name)
                used = mem[g][k] > 0
                busy_dev[name] = busy[g] if used else 0.0
                idle_dev[name] = total - busy_dev[name]
                if used and self._share[g]:
                    cpu[name] = busy[g] * self._share[g] + graph.rank_cpu[g] / ranks[g]
        group_finish = [max(finish[t] for t in done.values()) for done in graph.bwd_done]
        result = SimResult(
            total, not oom, tuple(oom), peak, busy_dev, idle_dev, group_finish, cpu_seconds=cpu
        )
        if trace:
            self._record(result, graph, start, finish)
        return result

    def _record(self, result: SimResult, graph: _TaskGraph, start: list[float], finish: list[float]) -> None:
        """Fill ``result.tasks`` and ``result.op_times`` from the schedule of ``graph``."""
        sched = graph.sched
        n = len(self.dgroups)
        kinds = ("compute", "nic", "bus")
        shown: list[tuple[int, str, str, str]] = []  # (task, label, category, resource): the same every step
        for t, (category, i, extra) in enumerate(sched.names):
            if not sched.res[t]:
                continue
            r = sched.res[t][0]
            label = f"{category} g{i}" if i >= 0 else category
            if category == "transfer" and extra >= 0 and extra != i:
                label = f"transfer g{min(i, extra)}-g{max(i, extra)}"
            shown.append((t, label, category, f"{self.dgroups[r % n].name}/{kinds[r // n]}"))
        per_step = len(sched.dur)
        for step in range(sched.steps):
            for t, label, category, resource in shown:
                u = step * per_step + t
                result.tasks.append(TaskRecord(label, category, resource, start[u], finish[u], step + 1))
        ops = self.graph.ops
        for i, tasks in enumerate(graph.fwd_tasks):
            if graph.mp_segments[i] is not None or not tasks:
                continue
            t = tasks[0]
            g = sched.names[t][2]
            members = self.groups[i].ops
            times = [self.ops_time((op,), self.dtypes[g], 1.0)[0] for op in members]
            scale = (finish[t] - start[t]) / (sum(times) or 1.0)
            clock = start[t]
            for op, dt in zip(members, times, strict=True):
                result.op_times[ops[op].name] = (clock, clock + dt * scale)
                clock += dt * scale


def summarize(result: SimResult, batch: int) -> str:
    """Human-readable report: iteration time, throughput, per-device utilisation and peak memory."""
    lines = [
        f"iteration time   {result.iteration_time * 1e3:10.2f} ms",
        f"throughput       {batch / result.iteration_time if result.iteration_time else 0.0:10.1f} samples/s",
        "feasible         " + ("yes" if result.feasible else f"NO (OOM: {', '.join(result.oom_devices)})"),
        f"{'device':<14} {'busy ms':>9} {'idle ms':>9} {'util':>6} {'peak GiB':>9}",
    ]
    if result.compute:
        lines.insert(3, "compute          " + ", ".join(f"{dt}: {src}" for dt, src in result.compute.items()))
    util = result.utilization()
    for dev in result.peak_memory:
        lines.append(
            f"{dev:<14} {result.busy[dev] * 1e3:>9.2f} {result.idle[dev] * 1e3:>9.2f} "
            f"{util[dev]:>6.1%} {result.peak_memory[dev] / 2**30:>9.2f}"
        )
    return "\n".join(lines)
