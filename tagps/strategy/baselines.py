"""The baselines of the TAG paper as plans the simulator (and the runtime) can run; plan builders.

- ``dp-nccl``: data parallelism over every device, the batch split evenly, ring all-reduce of every
  gradient after the backward pass (in-graph replication).
- ``dp-nccl-p``: the same with batch shares chosen for the device speeds: samples go one at a time to
  the device whose forward+backward time grows least (min-max; it respects device memory).
- ``horovod-like``: even split, all-reduce overlapped with backward, tensor fusion (64 MiB buffers).
- ``byteps-like``: even split, every gradient through a parameter server, one CPU server per machine
  (device group), overlapped with backward.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

from tagps.strategy.plan import OPTIONS, SYNC_ALLOWED, CommSettings, GradientSync, OpGroupPlan, Plan
from tagps.strategy.simulator import OPTIMIZER_STATE, Simulator

__all__ = [
    "BASELINES",
    "HOROVOD_FUSION_BYTES",
    "byteps_like",
    "data_parallel_plan",
    "dp_nccl",
    "dp_nccl_p",
    "even_shares",
    "horovod_like",
    "op_group_plan",
    "proportional_shares",
    "random_plan",
]

HOROVOD_FUSION_BYTES = 64 << 20


def op_group_plan(sim: Simulator, index: int, placement: tuple[str, ...], option: str) -> OpGroupPlan:
    """Op group ``index`` of ``sim``'s grouping on ``placement`` with ``option``.

    An ``mp`` group carries the split the simulator costs (:meth:`Simulator.mp_assignment`), which the
    runtime executes.
    """
    ops = sim.graph.ops
    parts = sim.mp_assignment(index, placement) if option == "mp" else ()
    return OpGroupPlan(tuple(ops[k].name for k in sim.groups[index].ops), placement, option, parts)


def even_shares(sim: Simulator, batch: int) -> dict[str, int]:
    """Split ``batch`` evenly over all devices (the first ``batch % N`` devices get one more)."""
    devices = sim.topology.devices()
    base, extra = divmod(batch, len(devices))
    return {d: base + (1 if k < extra else 0) for k, d in enumerate(devices)}


def proportional_shares(sim: Simulator, batch: int, optimizer: str = "adam") -> dict[str, int]:
    """Shares that minimise the slowest device's step time, within device memory.

    A device's step time is its forward+backward plus its optimizer step: each device starts its next
    forward once its own optimizer step is done, so a device with a slower optimizer step gets fewer samples.
    Greedy min-max over identical samples: each sample goes to the device whose time after taking it is
    smallest; optimal for the maximum because every device's time is non-decreasing in its batch.

    Raises:
        ValueError: the batch does not fit in the devices' memory.
    """
    groups = range(len(sim.groups))
    param_bytes = sum(g.param_bytes for g in sim.groups)
    static = param_bytes * (2 + OPTIMIZER_STATE[optimizer])
    act = sum(g.act_bytes for g in sim.groups)
    nparams = sum(len(g.param_names) for g in sim.groups)
    apply = [sim.apply_time(param_bytes, nparams, dtype, optimizer) for dtype in sim.dtypes]

    def cost(dg: int, b: int) -> float:
        return apply[dg] + sum(sum(sim.group_time(i, dg, float(b))) for i in groups) if b else 0.0

    heap: list[tuple[float, int, int]] = []
    devices: list[tuple[str, int]] = []
    for dg, group in enumerate(sim.dgroups):
        for k in range(group.count):
            devices.append((f"{group.name}:{k}", dg))
    counts = [0] * len(devices)
    for idx, (_, dg) in enumerate(devices):
        heap.append((cost(dg, 1), idx, dg))
    heapq.heapify(heap)
    for _ in range(batch):
        while heap:
            _, idx, dg = heapq.heappop(heap)
            if static + act * (counts[idx] + 1) <= sim.dgroups[dg].memory_bytes:
                break
        else:
            raise ValueError(f"batch {batch} does not fit in device memory on {sim.topology.name!r}")
        counts[idx] += 1
        heapq.heappush(heap, (cost(dg, counts[idx] + 1), idx, dg))
    return {name: counts[idx] for idx, (name, _) in enumerate(devices)}


def data_parallel_plan(
    sim: Simulator,
    batch: int,
    shares: dict[str, int],
    option: str = "allreduce",
    comm: CommSettings | None = None,
    ps_servers: tuple[str, ...] = (),
    optimizer: str = "adam",
) -> Plan:
    """A data-parallel plan: every op group replicated on every device group with a share.

    Args:
        sim: the simulator (gives graph, grouping and topology).
        batch: global batch size.
        shares: samples per device.
        option: ``allreduce`` or ``ps`` for every group; gradients use the same method.
        comm: overlap and fusion of gradient synchronisation (default: overlapped, no fusion).
        ps_servers: device groups hosting a PS server (``ps`` only).
        optimizer: ``sgd``, ``momentum`` or ``adam``.
    """
    used = tuple(g.name for g in sim.dgroups if any(shares.get(d, 0) for d in g.devices()))
    groups = tuple(op_group_plan(sim, i, used, option) for i in range(len(sim.groups)))
    gradients = {name: GradientSync(i, option) for i, g in enumerate(sim.groups) for name in g.param_names}
    plan = Plan(
        sim.topology,
        sim.graph.name,
        batch,
        groups,
        gradients,
        dict(shares),
        kind="data-parallel",
        optimizer=optimizer,
        comm=comm or CommSettings(),
        ps_servers=ps_servers,
    )
    return plan.validate()


def dp_nccl(sim: Simulator, batch: int, optimizer: str = "adam") -> Plan:
    """DP-NCCL: even split, ring all-reduce after backward."""
    return data_parallel_plan(
        sim, batch, even_shares(sim, batch), comm=CommSettings(overlap=False), optimizer=optimizer
    )


def dp_nccl_p(sim: Simulator, batch: int, optimizer: str = "adam") -> Plan:
    """DP-NCCL-P: shares proportional to device speed, ring all-reduce after backward."""
    return data_parallel_plan(
        sim,
        batch,
        proportional_shares(sim, batch, optimizer),
        comm=CommSettings(overlap=False),
        optimizer=optimizer,
    )


def horovod_like(sim: Simulator, batch: int, optimizer: str = "adam") -> Plan:
    """Horovod-like: even split, all-reduce overlapped with backward, 64 MiB tensor fusion."""
    return data_parallel_plan(
        sim,
        batch,
        even_shares(sim, batch),
        comm=CommSettings(overlap=True, fusion_bytes=HOROVOD_FUSION_BYTES),
        optimizer=optimizer,
    )


def byteps_like(
    sim: Simulator, batch: int, optimizer: str = "adam", ps_servers: tuple[str, ...] | None = None
) -> Plan:
    """BytePS-like: even split, PS for every gradient, one CPU server per machine (server-only ones too),
    or on the machines ``ps_servers`` names."""
    return data_parallel_plan(
        sim,
        batch,
        even_shares(sim, batch),
        option="ps",
        comm=CommSettings(overlap=True),
        ps_servers=tuple(g.name for g in sim.dgroups) if ps_servers is None else ps_servers,
        optimizer=optimizer,
    )


BASELINES: dict[str, Callable[[Simulator, int], Plan]] = {
    "dp-nccl": dp_nccl,
    "dp-nccl-p": dp_nccl_p,
    "horovod-like": horovod_like,
    "byteps-like": byteps_like,
}


def random_plan(
    sim: Simulator,
    batch: int,
    rng: random.Random,
    options: tuple[str, ...] = OPTIONS,
    sfb_fraction: float = 0.1,
    decided: int | None = None,
) -> Plan:
    """A random general plan (random placement and option per op group), for tests and benchmarks.

    Args:
        sim: the simulator (gives graph, grouping and topology).
        batch: global batch size, split evenly over all devices.
        rng: the random generator (seeded by the caller).
        options: options to draw from.
        sfb_fraction: probability that a replicated gradient uses SFB instead of the group's method.
        decided: when given, only the first ``decided`` op groups draw their own placement and option and
            the others copy group 0's, like the partial plans a tree search evaluates.
    """
    names = [g.name for g in sim.dgroups if not g.server_only]  # server-only machines run no ops
    shares = even_shares(sim, batch)
    funded = [g.name for g in sim.dgroups if any(shares[d] for d in g.devices())]
    groups: list[OpGroupPlan] = []
    gradients: dict[str, GradientSync] = {}
    for i, g in enumerate(sim.groups):
        if decided is not None and i >= max(decided, 1):
            placement, option = groups[0].placement, groups[0].option
        else:
            chosen = set(rng.sample(names, rng.randint(1, len(names))))
            option = rng.choice(options)
            if option in ("allreduce", "ps") and not chosen & set(funded):
                chosen.add(funded[0])  # a replicated group needs a device with a batch share
            placement = tuple(n for n in names if n in chosen)
        groups.append(op_group_plan(sim, i, placement, option))
        for name in g.param_names:
            sync = SYNC_ALLOWED[option][0]
            if option in ("allreduce", "ps") and rng.random() < sfb_fraction:
                sync = "sfb"
            gradients[name] = GradientSync(i, sync)
    plan = Plan(sim.topology, sim.graph.name, batch, tuple(groups), gradients, shares)
    return plan.validate()
