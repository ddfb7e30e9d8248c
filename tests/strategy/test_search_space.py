"""The search space: ps over several machines, duplicate, mp splits recorded as costed, and the general
search never predicted slower than the data-parallel search."""

from __future__ import annotations

from dataclasses import replace

import pytest
from strategy_builders import deep_mlp_graph, three_groups

from tagps.models import default_batch_size
from tagps.strategy.baselines import byteps_like, dp_nccl
from tagps.strategy.grouping import group_ops
from tagps.strategy.mcts import (
    PARTITION_CHOICES,
    Action,
    SearchConfig,
    _Search,
    candidate_actions,
    search,
    tune_partition,
)
from tagps.strategy.plan import Plan
from tagps.strategy.planner import plan_model
from tagps.strategy.simulator import OPTIMIZER_STATE, Simulator
from tagps.strategy.topology import DeviceGroup, Topology, load_topology


def _three_equal(gbps: float) -> Topology:
    """The bench cluster's shape: three equal CPU machines behind slow links."""
    machines = tuple(DeviceGroup(f"m{i}", "CPU", 2, 16.0) for i in range(3))
    return Topology(f"three-equal-{gbps}", machines, gbps)


def _small_search() -> _Search:
    graph = deep_mlp_graph(1024, 6)
    sim = Simulator(graph, group_ops(graph, 6), three_groups("space"))
    return _Search(sim, 64, SearchConfig(iterations=1, sfb=False), None, False)


@pytest.fixture(scope="module")
def tree() -> _Search:
    return _small_search()


def test_ps_on_several_device_groups_and_duplicate_are_candidates(tree: _Search) -> None:
    actions = candidate_actions(tree.sim)
    subsets = {a.devices for a in actions}
    assert len(subsets) == 7
    for option in ("ps", "duplicate"):
        assert {a.devices for a in actions if a.option == option} == subsets
    assert any(a.option == "ps" and len(a.devices) == 3 for a in actions)


def test_ps_across_machines_puts_a_server_on_each_and_simulates(tree: _Search) -> None:
    plan = tree.plan([Action((0, 1, 2), "ps")])
    assert {g.option for g in plan.groups} == {"ps"}
    assert {s.sync for s in plan.gradients.values()} == {"ps"}
    result = tree.sim.evaluate(plan, trace=True)
    assert result.feasible and 0 < result.iteration_time < float("inf")
    # Every machine of the placement serves some partitions: pushes and pulls use each one's NIC.
    servers = {t.resource for t in result.tasks if t.category == "ps"}
    assert servers == {"fast/nic", "slow/nic", "mid/nic"}


def test_duplicate_groups_simulate_without_gradient_sync(tree: _Search) -> None:
    sim = tree.sim
    whole = tree.plan([Action((0, 1), "duplicate")])
    assert {s.sync for s in whole.gradients.values()} == {"none"}
    result = sim.evaluate(whole, trace=True)
    assert result.feasible
    assert not [t for t in result.tasks if t.category in ("allreduce", "ps", "sfb")]
    # Every device runs the full batch: no faster than the fast machine alone on the whole batch.
    full = sum(sum(sim.group_time(i, 0, 64.0)) for i in range(len(sim.groups)))
    assert result.iteration_time >= full
    assert set(whole.worker_devices()) == {"fast:0", "fast:1", "slow:0", "slow:1"}
    # Mixed: the heaviest group duplicated on one machine, the rest replicated on all.
    mixed = tree.plan([Action((0, 1, 2), "allreduce"), Action((0,), "duplicate")])
    assert sorted(g.option for g in mixed.groups).count("duplicate") == 1
    assert sim.evaluate(mixed).feasible


def _expected_memory(sim: Simulator, plan: Plan) -> dict[str, float]:
    """Per device, the memory of the mp parts the plan records (the simulator's formula)."""
    ops = {op.name: op for op in sim.graph.ops}
    state = OPTIMIZER_STATE[plan.optimizer]
    memory = dict.fromkeys(sim.topology.devices(), 0.0)
    for g in plan.groups:
        for device, names in g.mp_parts:
            memory[device] += sum(ops[n].param_bytes * (2 + state) + ops[n].out_bytes * plan.batch_size
                                  for n in names)
    return memory


def test_mp_parts_are_the_split_the_simulator_costs(tree: _Search) -> None:
    sim = tree.sim
    plan = tree.plan([Action((1, 0), "mp")])
    for i, g in enumerate(plan.groups):
        assert g.mp_parts and g.mp_parts == sim.mp_assignment(i, g.placement)
    # The memory the simulator charges each device is exactly that of the parts recorded for it.
    result = sim.evaluate(plan)
    expected = _expected_memory(sim, plan)
    for device, peak in result.peak_memory.items():
        assert peak == pytest.approx(expected[device], abs=1.0), device
    assert set(plan.worker_devices()) == {d for d, m in result.peak_memory.items() if m > 0}
    assert Plan.from_json(plan.to_json()) == plan


def test_a_searched_plan_with_mp_groups_records_their_split() -> None:
    graph = deep_mlp_graph(4096, 4)  # with Adam 1 GiB per replica: only model parallelism fits in 600 MiB
    sim = Simulator(graph, group_ops(graph, 4), three_groups("space", memory=600 << 20))
    result = search(sim, 16, SearchConfig(iterations=60, sfb=False))
    plan = result.plan
    assert plan is not None
    mp = [(i, g) for i, g in enumerate(plan.groups) if g.option == "mp"]
    assert mp
    for i, g in mp:
        assert g.mp_parts == sim.mp_assignment(i, g.placement)
        assert {dev for dev, _ in g.mp_parts} <= {f"{dg}:{k}" for dg in g.placement for k in range(2)}
    evaluated = sim.evaluate(plan)
    assert evaluated.feasible and evaluated.iteration_time == pytest.approx(result.time_s)
    assert set(plan.worker_devices()) == {d for d, m in evaluated.peak_memory.items() if m > 0}
    again = Plan.from_json(plan.to_json())
    assert again == plan and sim.evaluate(again).iteration_time == pytest.approx(result.time_s)


def test_mp_assignment_rejects_unknown_device_groups(tree: _Search) -> None:
    with pytest.raises(ValueError, match="unknown device groups"):
        tree.sim.mp_assignment(0, ("fast", "nowhere"))


TOPOLOGIES = {
    "paper-testbed": lambda: load_topology("paper-testbed"),
    "paper-cloud": lambda: load_topology("paper-cloud"),
    "random:1": lambda: load_topology("random:1"),
    "random:7": lambda: load_topology("random:7"),
    "three-equal-1": lambda: _three_equal(1.0),
    "three-equal-0.2": lambda: _three_equal(0.2),
}


@pytest.mark.parametrize("model", ["vgg-mini", "transformer-mini", "mlp-mini"])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_the_general_search_is_never_slower_than_the_data_parallel_search(model: str, topology: str) -> None:
    # plan_model is what `tagps plan` runs; only --data-parallel differs.
    topo = TOPOLOGIES[topology]()
    batch = default_batch_size(model)
    config = SearchConfig(iterations=60, sfb=False)
    dp, _ = plan_model(model, topo, batch, replace(config, data_parallel=True), groups=12)
    general, sim = plan_model(model, topo, batch, config, groups=12)
    assert dp.plan is not None and general.plan is not None
    assert general.time_s <= dp.time_s * (1 + 1e-9)
    assert sim.evaluate(general.plan).iteration_time == pytest.approx(general.time_s)
    for i, g in enumerate(general.plan.groups):
        assert g.option != "mp" or g.mp_parts == sim.mp_assignment(i, g.placement)


def test_the_search_puts_ps_servers_on_server_only_machines() -> None:
    """Three one-device workers behind 10 Gbit/s and two spare CPU machines: BytePS's case."""
    workers = tuple(DeviceGroup(f"w{i}", "1080Ti", 1, 96.0) for i in range(3))
    spare = (DeviceGroup("cpu0", "CPU", 0, 100.0), DeviceGroup("cpu1", "CPU", 0, 100.0))
    topology = Topology("spare-servers", workers[:2] + spare[:1] + workers[2:] + spare[1:], 10.0)
    graph = deep_mlp_graph(2048, 4)
    sim = Simulator(graph, group_ops(graph, 4), topology)
    assert all(2 not in a.devices and 4 not in a.devices for a in candidate_actions(sim))
    result = search(sim, 8192, SearchConfig(iterations=60, sfb=False))
    plan = result.plan
    assert plan is not None and any(g.option == "ps" for g in plan.groups)
    assert set(plan.ps_servers) >= {"cpu0", "cpu1"}
    assert not any(plan.batch_shares.get(d, 0) for d in ("cpu0:0", "cpu1:0"))
    # The servers on the spare machines are what makes the plan fast: on the workers alone it is slower.
    alone = sim.evaluate(replace(plan, ps_servers=()))
    assert alone.iteration_time > 1.1 * result.time_s
    # The search chose the plan's chunk size: the fastest of the sizes it tries, as the simulator costs them.
    costed = {
        size: sim.evaluate(replace(plan, comm=replace(plan.comm, partition_bytes=size))).iteration_time
        for size in PARTITION_CHOICES
    }
    assert plan.comm.partition_bytes == min(costed, key=costed.__getitem__)
    assert result.time_s == pytest.approx(costed[plan.comm.partition_bytes])
    assert costed[plan.comm.partition_bytes] < costed[0]  # 16 MiB gradients: BytePS's 4 MB pipelines worse


def test_the_search_costs_ps_at_byteps_best_partition_size() -> None:
    """BytePS's case, three workers and three server-only machines: its plan wins at 256 KiB chunks and
    loses to all-reduce at the 4 MB default. A search that costs ps at 4 MB keeps all-reduce on some op
    groups; at BytePS's best size it finds BytePS's plan."""
    workers = tuple(DeviceGroup(f"w{i}", "1080Ti", 1, 96.0) for i in range(3))
    spare = tuple(DeviceGroup(f"cpu{i}", "CPU", 0, 100.0) for i in range(3))
    topology = Topology("three-and-three", workers + spare, 10.0)
    graph = deep_mlp_graph(2048, 4)
    sim = Simulator(graph, group_ops(graph, 4), topology)
    byteps = byteps_like(sim, 8192, ps_servers=tuple(g.name for g in spare))
    at_default = sim.evaluate(byteps).iteration_time
    tuned, best = tune_partition(sim, byteps)
    assert best.iteration_time < sim.evaluate(dp_nccl(sim, 8192)).iteration_time < at_default
    result = search(sim, 8192, SearchConfig(iterations=60, sfb=False))
    assert result.plan is not None and all(g.option == "ps" for g in result.plan.groups)
    assert set(result.plan.ps_servers) == {g.name for g in spare}
    assert result.plan.comm.partition_bytes == tuned.comm.partition_bytes
    assert result.time_s <= best.iteration_time * (1 + 1e-9)


def test_tune_partition_leaves_a_plan_without_ps_as_it_is(tree: _Search) -> None:
    plan = dp_nccl(tree.sim, 64)
    tuned, result = tune_partition(tree.sim, plan)
    assert tuned is plan and result.iteration_time == tree.sim.evaluate(plan).iteration_time


def test_paths_that_make_the_same_plan_are_simulated_once() -> None:
    s = _small_search()  # its own: the shared fixture's outcome cache depends on the tests before
    first = next(k for k, a in enumerate(s.actions) if a.option == "allreduce")
    other = next(k for k, a in enumerate(s.actions) if a.option == "ps")
    before = s.evaluations
    value, result = s.evaluate((first,))
    # The second level's op group follows the first action when undecided: (first, first) is that plan.
    assert s.evaluate((first, first)) == (value, result)
    assert s.evaluations == before + 1
    assert s.plan([s.actions[first]]) == s.plan([s.actions[first], s.actions[first]])
    changed, _ = s.evaluate((first, other))
    assert s.evaluations == before + 2
    direct = s.sim.evaluate(s.plan([s.actions[first], s.actions[other]]))
    assert changed == pytest.approx(s.baseline_time / direct.iteration_time - 1.0)
