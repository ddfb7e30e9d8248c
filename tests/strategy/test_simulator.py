import dataclasses
import json
import random
from pathlib import Path

import pytest
from strategy_builders import deep_mlp_graph

from tagps.strategy.baselines import (
    BASELINES,
    data_parallel_plan,
    dp_nccl,
    dp_nccl_p,
    even_shares,
    op_group_plan,
    proportional_shares,
    random_plan,
)
from tagps.strategy.calibration import HOST_CPU, Calibration
from tagps.strategy.devices import device_type
from tagps.strategy.graph import model_graph
from tagps.strategy.grouping import group_ops
from tagps.strategy.plan import CommSettings, GradientSync, OpGroupPlan, Plan
from tagps.strategy.simulator import (
    APPLY_TRAFFIC,
    PS_PARTITION_BYTES,
    SIMULATED_STEPS,
    HostCpu,
    SimResult,
    Simulator,
    TaskRecord,
    allgather_time,
    ring_allreduce_time,
    summarize,
)
from tagps.strategy.topology import DeviceGroup, Topology, paper_cloud, paper_testbed, random_topology

MODELS = ["vgg19", "resnet101", "inceptionv3", "transformer", "bert-large", "gpt2"]


def topology(
    *groups: tuple[str, str, int], inter_gbps: float = 100.0, intra_gbps: float = 96.0, memory: int = 0
) -> Topology:
    """A topology from ``(name, device type, count)`` triples."""
    return Topology("test", tuple(DeviceGroup(n, d, c, intra_gbps, memory) for n, d, c in groups), inter_gbps)


def sim_for(model: str, topo: Topology, k: int = 60) -> Simulator:
    graph = model_graph(model)
    return Simulator(graph, group_ops(graph, k), topo)


def first_step(result: SimResult) -> list[TaskRecord]:
    """The traced tasks of the first simulated step."""
    return [t for t in result.tasks if t.step == 1]


def faster(topo: Topology, factor: float) -> Topology:
    groups = tuple(
        dataclasses.replace(g, intra_bandwidth_gbps=g.intra_bandwidth_gbps * factor) for g in topo.groups
    )
    links = tuple(dataclasses.replace(ln, bandwidth_gbps=ln.bandwidth_gbps * factor) for ln in topo.links)
    return dataclasses.replace(
        topo, groups=groups, links=links, inter_bandwidth_gbps=topo.inter_bandwidth_gbps * factor
    )


@pytest.mark.parametrize(("model", "batch"), [("vgg19", 8), ("bert-large", 2), ("inceptionv3", 5)])
def test_one_device_without_communication_costs_the_sum_of_its_ops(model, batch):
    topo = topology(("gpu", "V100-32GB", 1))
    sim = sim_for(model, topo)
    result = sim.evaluate(dp_nccl(sim, batch))
    dev = device_type("V100-32GB")
    expected = 0.0
    for op in sim.graph.ops:
        io = (op.in_bytes + op.out_bytes) * batch
        expected += dev.op_time(op.fwd_flops * batch, op.param_bytes + io)
        expected += dev.op_time(op.bwd_flops * batch, 2 * op.param_bytes + 2 * io)
    params = sim.graph.param_bytes
    expected += APPLY_TRAFFIC["adam"] * params / (dev.memory_bandwidth * dev.memory_efficiency)
    expected += len(sim.graph.params) * dev.op_overhead_s
    assert result.iteration_time == pytest.approx(expected, rel=1e-9)
    assert result.busy["gpu:0"] == pytest.approx(expected, rel=1e-9)
    assert result.idle["gpu:0"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(
    ("groups", "inter", "intra"),
    [
        ((("a", "V100-32GB", 4),), 100.0, 96.0),  # ring inside one group: intra bandwidth
        ((("a", "1080Ti", 2), ("b", "1080Ti", 2)), 10.0, 96.0),  # inter link is the slowest
        ((("a", "P100", 3), ("b", "P100", 1), ("c", "T4", 2)), 200.0, 50.0),  # intra link is the slowest
    ],
)
def test_ring_allreduce_task_matches_the_formula(mlp, groups, inter, intra):
    topo = topology(*groups, inter_gbps=inter, intra_gbps=intra)
    sim = Simulator(mlp, group_ops(mlp, 1), topo)
    plan = dp_nccl(sim, 2 * topo.num_devices)
    result = sim.evaluate(plan, trace=True)
    (task,) = [t for t in first_step(result) if t.category == "allreduce"]
    n = topo.num_devices
    bmin = min(inter, intra) * 1e9 / 8 if len(groups) > 1 else intra * 1e9 / 8
    latency = topo.inter_latency_s if len(groups) > 1 else topo.intra_latency_s
    expected = 2 * (n - 1) / n * mlp.param_bytes / bmin + 2 * (n - 1) * latency * len(mlp.params)
    assert task.end - task.start == pytest.approx(expected, rel=1e-12)
    assert ring_allreduce_time(mlp.param_bytes, n, bmin, latency, len(mlp.params)) == pytest.approx(expected)


def test_collective_formulas_and_errors():
    assert ring_allreduce_time(1e9, 1, 1e9, 1e-5) == 0.0
    assert ring_allreduce_time(1e9, 4, 1e9, 0.0) == pytest.approx(1.5)
    assert allgather_time(1e9, 4, 1e9, 0.0) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="n >= 1"):
        ring_allreduce_time(1.0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        allgather_time(1.0, 2, 0.0, 0.0)


def test_a_ring_step_takes_the_longer_of_its_transfer_and_its_cpu():
    # 1 GB over 4 devices at 1 GB/s: 6 steps of 0.25 s each; 1 ms of CPU per step hides behind the wire.
    assert ring_allreduce_time(1e9, 4, 1e9, 0.0, step_cpu=1e-3) == pytest.approx(1.5)
    # 1 kB: the CPU sets each step, once per tensor, and the wire latency adds to it.
    assert ring_allreduce_time(1e3, 4, 1e9, 0.0, step_cpu=1e-3) == pytest.approx(6e-3)
    assert ring_allreduce_time(1e3, 4, 1e9, 1e-5, count=3, step_cpu=1e-3) == pytest.approx(6 * 3 * 1.01e-3)
    assert allgather_time(1e3, 4, 1e9, 0.0, step_cpu=1e-3) == pytest.approx(3e-3)


def test_ps_task_matches_the_formula(mlp):
    topo = topology(
        ("a", "1080Ti", 2), ("b", "1080Ti", 2), ("c", "1080Ti", 1), inter_gbps=10.0, intra_gbps=80.0
    )
    sim = Simulator(mlp, group_ops(mlp, 1), topo)
    plan = data_parallel_plan(sim, 10, even_shares(sim, 10), option="ps", ps_servers=("c",))
    result = sim.evaluate(plan, trace=True)
    (task,) = [t for t in first_step(result) if t.category == "ps"]
    size, count, inter, intra = mlp.param_bytes, len(mlp.params), 10e9 / 8, 80e9 / 8
    # Full duplex: c's NIC, the busiest, takes a's and b's pushes (and sends both pulls at once), plus one of
    # the P partitions' pull to drain; inside a and b the reduction before the push and the broadcast after.
    partitions = sum(-(-nbytes // PS_PARTITION_BYTES) for nbytes in mlp.params.values())
    wire = 2 * size / inter * (1 + 1 / partitions)
    expected = wire + 2 * (1 / 2) * size / intra + 2 * count * topo.inter_latency_s
    assert task.end - task.start == pytest.approx(expected, rel=1e-12)
    assert task.resource == "c/nic"


def test_ps_through_spare_servers_is_bound_by_the_busiest_nic_in_one_direction():
    """BytePS's case: 2 workers push 4 equal tensors to 4 server-only machines. Each server takes a quarter
    from each worker, so a worker's NIC, pushing every byte while it pulls, is the busiest: the transfer is
    S / B plus one of the 4 partitions' pull, where pushes then pulls on one wire would take 2 S / B."""
    import torch

    from tagps.strategy.graph import extract_graph

    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(4)))
    graph = extract_graph(model, (torch.randn(1, 64),), "four-equal")
    spare = tuple(DeviceGroup(f"s{i}", "CPU", 0, 100.0) for i in range(4))
    workers = (DeviceGroup("w0", "1080Ti", 1, 96.0), DeviceGroup("w1", "1080Ti", 1, 96.0))
    topo = Topology("spare", workers + spare, 10.0)
    sim = Simulator(graph, group_ops(graph, 1), topo)
    servers = tuple(g.name for g in spare)
    plan = data_parallel_plan(sim, 8, even_shares(sim, 8), option="ps", ps_servers=servers)
    tasks = [t for t in first_step(sim.evaluate(plan, trace=True)) if t.category == "ps"]
    assert sorted(t.resource for t in tasks) == [f"s{i}/nic" for i in range(4)]
    size = graph.param_bytes
    expected = size / (10e9 / 8) * (1 + 1 / 4) + 2 * topo.inter_latency_s  # one tensor per server
    for task in tasks:
        assert task.end - task.start == pytest.approx(expected, rel=1e-12)


def test_a_ps_sync_through_a_spare_server_keeps_the_workers_nics_busy():
    """Op group 0 syncs through a server-only machine, op group 1 all-reduces among the same two workers.
    Each worker's NIC pushes group 0's gradient to the server (the pull comes back the other way), so that
    NIC carries it for S / B plus the last of its P partitions' pull, and the all-reduce, which needs the
    same NIC, cannot run at the same time."""
    graph = deep_mlp_graph(512, 2)
    workers = ("w0", "w1")
    machines = tuple(DeviceGroup(name, "1080Ti", 1, 96.0) for name in workers)
    topo = Topology("spare1", (*machines, DeviceGroup("srv", "CPU", 0, 96.0)), 10.0)
    sim = Simulator(graph, group_ops(graph, 2), topo)
    groups = (op_group_plan(sim, 0, workers, "ps"), op_group_plan(sim, 1, workers, "allreduce"))
    gradients = {
        name: GradientSync(i, g.option) for i, g in enumerate(groups) for name in sim.groups[i].param_names
    }
    plan = Plan(topo, graph.name, 8, groups, gradients, even_shares(sim, 8), ps_servers=("srv",)).validate()
    tasks = first_step(sim.evaluate(plan, trace=True))
    (ring,) = [t for t in tasks if t.category == "allreduce"]
    pushes = {t.resource: t for t in tasks if t.category == "ps-nic"}
    assert sorted(pushes) == ["w0/nic", "w1/nic"]
    sizes = [graph.params[name] for name in sim.groups[0].param_names]
    partitions = sum(-(-size // PS_PARTITION_BYTES) for size in sizes)
    expected = sum(sizes) / (10e9 / 8) * (1 + 1 / partitions)
    for push in pushes.values():
        assert push.end - push.start == pytest.approx(expected, rel=1e-12)
        assert push.end <= ring.start or ring.end <= push.start


def test_a_ps_sync_ends_with_its_busiest_servers_last_partition_drained():
    """One 64 KiB tensor in 4 chunks over 3 spare servers (2, 1 and 1 of them): the first server takes 3
    workers' pushes of 32 KiB, and its last chunk's pull to the 3 of them waits for all 3 pushes of it, so the
    wire lasts 1.5 + 0.75 = 2.25x the tensor's time on one link. The plan's partition size sets the chunks:
    in 16 chunks (6, 5 and 5) it takes 9 / 8 of it, in BytePS's default one chunk (one server) 6x."""
    import torch

    from tagps.strategy.graph import extract_graph

    model = torch.nn.Sequential(torch.nn.Linear(128, 128, bias=False))
    graph = extract_graph(model, (torch.randn(1, 128),), "one-tensor")
    spare = tuple(DeviceGroup(f"s{i}", "CPU", 0, 100.0) for i in range(3))
    workers = tuple(DeviceGroup(f"w{i}", "1080Ti", 1, 96.0) for i in range(3))
    topo = Topology("spare3", workers + spare, 1.0)
    sim = Simulator(graph, group_ops(graph, 1), topo)
    size = graph.param_bytes
    assert size == 65536
    servers = tuple(g.name for g in spare)
    plan = data_parallel_plan(sim, 6, even_shares(sim, 6), option="ps", ps_servers=servers)

    def wire_time(partition_bytes: int) -> float:
        comm = dataclasses.replace(plan.comm, partition_bytes=partition_bytes)
        tasks = [t for t in first_step(sim.evaluate(dataclasses.replace(plan, comm=comm), trace=True))
                 if t.category == "ps"]  # fmt: skip
        return max(t.end - t.start for t in tasks) - 2 * topo.inter_latency_s

    link = size / (1e9 / 8)
    assert wire_time(size // 4) == pytest.approx(2.25 * link, rel=1e-12)
    # 16 chunks: 6 on the first server, 3 workers' pushes of 6/16 of the tensor, then one chunk's pulls.
    assert wire_time(size // 16) == pytest.approx((3 * 6 / 16 + 3 / 16) * link, rel=1e-12)
    assert wire_time(0) == wire_time(PS_PARTITION_BYTES) == pytest.approx(6 * link, rel=1e-12)


def test_a_duplicate_producers_replicas_each_get_every_rows_gradient():
    """Op group 0 duplicated on two machines, op group 1 split between them: in backward each machine sends
    its rows' gradient of op group 0's output to the other replica (none is synced), over its NIC."""
    graph = deep_mlp_graph(64, 4)
    topo = topology(("a", "1080Ti", 1), ("b", "1080Ti", 1), inter_gbps=1.0)
    sim = Simulator(graph, group_ops(graph, 2), topo)
    plan = data_parallel_plan(sim, 8, even_shares(sim, 8))
    dup = dataclasses.replace(plan.groups[0], option="duplicate")
    gradients = {
        name: dataclasses.replace(g, sync="none") if g.group == 0 else g for name, g in plan.gradients.items()
    }
    plan = dataclasses.replace(plan, kind="general", groups=(dup, *plan.groups[1:]), gradients=gradients)
    plan = plan.validate()
    ((_, nbytes),) = [e for e in sim.preds[1] if e[0] == 0]
    result = sim.evaluate(plan, trace=True)
    back = [t for t in first_step(result) if t.category == "transfer" and t.resource.endswith("/nic")]
    assert sorted(t.resource for t in back) == ["a/nic", "b/nic"]
    for task in back:  # 4 rows each
        assert task.end - task.start == pytest.approx(4 * nbytes / (1e9 / 8) + topo.inter_latency_s)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("make", [paper_testbed, paper_cloud, lambda: random_topology(11)])
def test_more_bandwidth_never_slows_the_baselines(model, make):
    topo = make()
    sim, sim_fast = sim_for(model, topo), sim_for(model, faster(topo, 4.0))
    batch = 64
    for name, baseline in BASELINES.items():
        slow = sim.evaluate(baseline(sim, batch)).iteration_time
        fast = sim_fast.evaluate(baseline(sim_fast, batch)).iteration_time
        assert fast <= slow * (1 + 1e-12), name


@pytest.mark.parametrize("model", ["vgg19", "transformer"])
def test_more_bandwidth_never_slows_random_plans(model):
    topo = paper_testbed()
    sim, sim_fast = sim_for(model, topo), sim_for(model, faster(topo, 2.0))
    rng = random.Random(7)
    for _ in range(25):
        plan = random_plan(sim, 32, rng)
        fast_plan = dataclasses.replace(plan, topology=sim_fast.topology)
        assert sim_fast.evaluate(fast_plan).iteration_time <= sim.evaluate(plan).iteration_time * (1 + 1e-12)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(
    "make", [paper_testbed, paper_cloud, lambda: random_topology(3), lambda: random_topology(8)]
)
def test_dp_nccl_p_is_never_slower_than_dp_nccl(model, make):
    sim = sim_for(model, make())
    for batch in (16, 64):
        even = sim.evaluate(dp_nccl(sim, batch))
        prop = sim.evaluate(dp_nccl_p(sim, batch))
        assert prop.iteration_time <= even.iteration_time * (1 + 1e-12)
        assert prop.feasible or not even.feasible


def test_proportional_shares_follow_device_speed():
    sim = sim_for("vgg19", paper_testbed(), 19)
    shares = proportional_shares(sim, 128)
    assert sum(shares.values()) == 128
    assert shares["v100:0"] > shares["1080ti-0:0"] >= shares["p100-0:0"]


def mp_plan(sim: Simulator, batch: int) -> Plan:
    names = tuple(g.name for g in sim.dgroups)
    ops = sim.graph.ops
    groups = tuple(OpGroupPlan(tuple(ops[i].name for i in g.ops), names, "mp") for g in sim.groups)
    gradients = {p: GradientSync(i, "none") for i, g in enumerate(sim.groups) for p in g.param_names}
    return Plan(sim.topology, sim.graph.name, batch, groups, gradients, even_shares(sim, batch)).validate()


def test_model_too_big_for_one_device_is_oom_under_dp_and_fits_under_mp():
    topo = Topology("small", (DeviceGroup("g", "T4", 4, 96.0, 2 << 30),), 10.0)
    sim = sim_for("gpt2", topo)
    assert sim.graph.param_bytes * 4 > 2 << 30  # params + grads + Adam state exceed one device
    dp = sim.evaluate(dp_nccl(sim, 4))
    assert not dp.feasible
    assert set(dp.oom_devices) == {"g:0", "g:1", "g:2", "g:3"}
    mp = sim.evaluate(mp_plan(sim, 4))
    assert mp.feasible, mp.peak_memory
    assert max(mp.peak_memory.values()) < 2 << 30
    assert sum(mp.peak_memory.values()) >= sim.graph.param_bytes * 4


def test_sfb_beats_allreduce_for_a_big_linear_at_small_batch():
    import torch
    from torch import nn

    from tagps.strategy.graph import extract_graph

    graph = extract_graph(nn.Sequential(nn.Linear(4096, 4096)), (torch.randn(1, 4096),), "fc")
    topo = topology(("a", "1080Ti", 2), ("b", "1080Ti", 2), inter_gbps=10.0)
    sim = Simulator(graph, group_ops(graph, 1), topo)
    plan = dp_nccl(sim, 4)
    sfb = dataclasses.replace(
        plan, gradients={**plan.gradients, "0.weight": GradientSync(0, "sfb")}
    ).validate()
    assert sim.evaluate(sfb).iteration_time < sim.evaluate(plan).iteration_time / 10
    big_batch = dp_nccl(sim, 4096)
    sfb_big = dataclasses.replace(
        big_batch, gradients={**big_batch.gradients, "0.weight": GradientSync(0, "sfb")}
    )
    assert sim.evaluate(sfb_big).iteration_time > sim.evaluate(big_batch).iteration_time


def test_overlap_and_fusion_help():
    sim = sim_for("bert-large", paper_testbed())
    dp = sim.evaluate(dp_nccl(sim, 32)).iteration_time
    horovod = sim.evaluate(BASELINES["horovod-like"](sim, 32)).iteration_time
    assert horovod < dp
    unfused = dataclasses.replace(BASELINES["horovod-like"](sim, 32), comm=CommSettings(overlap=True))
    assert sim.evaluate(unfused).iteration_time >= horovod * (1 - 1e-12)


@pytest.mark.parametrize("model", MODELS)
def test_random_general_plans_simulate_deterministically(model):
    sim = sim_for(model, paper_testbed())
    rng = random.Random(1)
    for _ in range(5):
        plan = random_plan(sim, 32, rng)
        first = sim.evaluate(plan)
        assert first.iteration_time > 0
        assert sim.evaluate(plan) == first
        assert (
            Simulator(sim.graph, sim.grouping, sim.topology).evaluate(plan).iteration_time
            == first.iteration_time
        )


def test_chrome_trace_and_op_times(tmp_path):
    sim = sim_for("resnet101", paper_testbed())
    plan = BASELINES["byteps-like"](sim, 32)
    result = sim.evaluate(plan, trace=True)
    path = tmp_path / "trace.json"
    result.save_chrome_trace(path)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} >= {"forward", "backward", "ps", "apply"}
    # Every step is in the trace; the iteration time is the mean period after the first.
    steps = range(1, sim.steps + 1)
    ends = {k: max(e["ts"] + e["dur"] for e in spans if e["args"]["step"] == k) for k in steps}
    assert sim.steps == SIMULATED_STEPS and len(ends) == sim.steps
    period = (ends[sim.steps] - ends[1]) / (sim.steps - 1)
    assert period == pytest.approx(result.iteration_time * 1e6)
    assert len(result.op_times) == len(sim.graph.ops)
    assert all(0 <= s <= e <= ends[1] / 1e6 for s, e in result.op_times.values())
    assert "iteration time" in summarize(result, 32)
    with pytest.raises(ValueError, match="trace=True"):
        sim.evaluate(plan).chrome_trace()


def test_plan_that_does_not_fit_the_simulator_is_refused():
    sim = sim_for("vgg19", paper_testbed())
    plan = dp_nccl(sim, 16)
    with pytest.raises(ValueError, match="op groups"):
        sim_for("vgg19", paper_testbed(), 5).evaluate(plan)
    other = sim_for("vgg19", paper_cloud())
    with pytest.raises(ValueError, match="made for topology"):
        other.evaluate(plan)
    missing = dict(plan.gradients)
    missing.pop(next(iter(missing)))
    with pytest.raises(ValueError, match="no gradient entry"):
        sim.evaluate(dataclasses.replace(plan, gradients=missing))


def test_baselines_are_valid_data_parallel_plans():
    sim = sim_for("transformer", paper_cloud())
    for name, baseline in BASELINES.items():
        plan = baseline(sim, 64)
        assert plan.kind == "data-parallel", name
        assert sum(plan.batch_shares.values()) == 64
        assert set(plan.gradients) == set(sim.graph.params)
        assert Simulator.for_plan(plan, sim.graph).evaluate(plan) == sim.evaluate(plan)


REGRESSION_FILE = Path(__file__).parent / "data" / "simulator_regression.json"


def regression_cases() -> list[tuple[str, Simulator, Plan]]:
    """A fixed set of plans: every baseline and random general plans with every option, PS servers, fusion
    and optimizer, on paper-testbed, paper-cloud, random:3 and a 2+1 CPU topology (with its op profile)."""
    cpu = topology(("a", "CPU", 2), ("b", "CPU", 1), inter_gbps=1.0, intra_gbps=40.0)
    setups = [
        ("vgg19", paper_testbed(), 64),
        ("vgg19", paper_cloud(), 64),
        ("transformer", random_topology(3), 32),
        ("vgg-mini", cpu, 24),
        ("transformer-mini", cpu, 12),
    ]
    cases: list[tuple[str, Simulator, Plan]] = []
    for model, topo, batch in setups:
        sim = sim_for(model, topo)
        tag = f"{model}/{topo.name}"
        for name, make in BASELINES.items():
            cases.append((f"{tag}/{name}", sim, make(sim, batch)))
        rng = random.Random(f"regression {tag}")
        names = [g.name for g in sim.dgroups]
        for k in range(7):
            decided = None if k % 3 else rng.randint(1, 9)
            plan = random_plan(sim, batch, rng, sfb_fraction=0.2, decided=decided)
            plan = dataclasses.replace(
                plan,
                optimizer=rng.choice(["sgd", "momentum", "adam"]),
                comm=CommSettings(
                    overlap=rng.random() < 0.7, fusion_bytes=rng.choice([0, 1 << 20, 64 << 20])
                ),
                ps_servers=tuple(n for n in names if rng.random() < 0.5),
            ).validate()
            cases.append((f"{tag}/random{k}", sim, plan))
    return cases


def regression_figures(result) -> dict[str, object]:
    """What the regression test compares: iteration time, peak memory, busy time and group finish times."""
    return {
        "iteration_time": result.iteration_time,
        "peak_memory": result.peak_memory,
        "busy": result.busy,
        "group_finish": result.group_finish,
        "tasks": len(result.tasks),
        "task_ends": sum(t.end for t in result.tasks),
        "op_ends": sum(end for _, end in result.op_times.values()),
    }


def write_regression_file() -> None:
    """Record the figures of :func:`regression_cases` (run once, before a change that must not alter them)."""
    cases = regression_cases()
    figures = {key: regression_figures(sim.evaluate(plan, trace=True)) for key, sim, plan in cases}
    REGRESSION_FILE.parent.mkdir(exist_ok=True)
    REGRESSION_FILE.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")


def test_simulator_results_match_the_recorded_regression_set():
    expected = json.loads(REGRESSION_FILE.read_text())
    cases = regression_cases()
    assert sorted(key for key, _, _ in cases) == sorted(expected)
    for key, sim, plan in cases:
        got = json.loads(json.dumps(regression_figures(sim.evaluate(plan, trace=True))))
        want = expected[key]
        assert got.keys() == want.keys(), key
        for field_name, value in want.items():
            flat_got = value_list(got[field_name])
            flat_want = value_list(value)
            assert len(flat_got) == len(flat_want), (key, field_name)
            for a, b in zip(flat_got, flat_want, strict=True):
                assert a == pytest.approx(b, rel=1e-12, abs=0.0), (key, field_name)


def value_list(value: object) -> list[float]:
    """Numbers of a figure in a fixed order (dicts by key)."""
    if isinstance(value, dict):
        return [float(value[k]) for k in sorted(value)]
    if isinstance(value, list):
        return [float(v) for v in value]
    return [float(value)]


HOST = HostCpu(160e9, copy_s_per_byte=2 / 17e9, sum_s_per_byte=1 / 37e9, message_s=10e-6)


def cpu_cluster(cores: float) -> Topology:
    """Two one-device CPU machines under a quota of ``cores`` each (the device's share of a core)."""
    groups = tuple(DeviceGroup(n, "CPU", 1, 40.0, peak_flops=160e9 * cores) for n in ("a", "b"))
    return Topology("quota", groups, 1.0)


def test_ps_through_a_colocated_server_takes_cpu_from_a_quotad_machine():
    extra = {}
    for cores in (1.0, 0.25):
        base = sim_for("vgg-mini", cpu_cluster(cores))
        costed = Simulator(base.graph, base.grouping, base.topology, host_cpu=HOST)
        plan = BASELINES["byteps-like"](base, 16)
        before, after = base.evaluate(plan).iteration_time, costed.evaluate(plan, trace=True)
        assert after.iteration_time > before
        assert {t.resource for t in first_step(after) if t.category == "ps-cpu"} == {"a/compute", "b/compute"}
        extra[cores] = after.iteration_time - before
        # all-reduce keeps its ring model (the host CPU is costed on the PS path only)
        ring = BASELINES["dp-nccl"](base, 16)
        assert costed.evaluate(ring).iteration_time == base.evaluate(ring).iteration_time
    assert extra[0.25] > 3 * extra[1.0]  # a quarter of a core: about four times the CPU seconds


def test_cpu_seconds_are_a_quotad_ranks_compute_busy_time_at_its_share_of_a_core():
    base = sim_for("vgg-mini", cpu_cluster(0.25))
    costed = Simulator(base.graph, base.grouping, base.topology, host_cpu=HOST)
    plan = BASELINES["byteps-like"](base, 16)
    result = costed.evaluate(plan)
    assert set(result.cpu_seconds) == {"a:0", "b:0"}
    for device, seconds in result.cpu_seconds.items():
        assert seconds == pytest.approx(0.25 * result.busy[device], rel=1e-9)
        assert 0 < seconds < result.iteration_time
    # Without a host-CPU model (a GPU cluster, or none given) nothing is reported.
    assert base.evaluate(plan).cpu_seconds == {}
    gpu = sim_for("vgg-mini", paper_testbed())
    assert gpu.evaluate(BASELINES["byteps-like"](gpu, 16)).cpu_seconds == {}


def test_a_push_to_a_server_on_its_own_machine_costs_shared_memory_copies_not_messages():
    base = sim_for("vgg-mini", cpu_cluster(0.5))
    plan = BASELINES["byteps-like"](base, 16)  # a server on each machine: one member local, one remote
    shm = 1 / 17e9
    cpu = {}
    for name, host in (("tcp", HOST), ("shm", dataclasses.replace(HOST, shm_copy_s_per_byte=shm))):
        result = Simulator(base.graph, base.grouping, base.topology, host_cpu=host).evaluate(plan, trace=True)
        cpu[name] = sum(t.end - t.start for t in first_step(result) if t.category == "ps-cpu")
    # Per server of S bytes, its local member saves 2 (c_copy - c_shm) and the server c_copy + c_copy -
    # c_shm; the remote member's push costs what it did. Both machines run at half a core.
    nbytes = sum(base.graph.params.values())
    saved = nbytes * (4 * HOST.copy_s_per_byte - 3 * shm) / 0.5
    assert cpu["tcp"] - cpu["shm"] == pytest.approx(saved, rel=1e-9)


def test_host_cpu_costs_at_zero_give_the_old_results_exactly():
    zero = HostCpu(160e9)
    assert not zero.costed
    for topo in (cpu_cluster(0.5), paper_testbed()):
        base = sim_for("vgg-mini", topo)
        costed = Simulator(base.graph, base.grouping, topo, host_cpu=zero)
        rng = random.Random(5)
        plans = [BASELINES["byteps-like"](base, 16)] + [random_plan(base, 16, rng) for _ in range(5)]
        for plan in plans:
            a, b = base.evaluate(plan), costed.evaluate(plan)
            assert (a.iteration_time, a.peak_memory, a.group_finish) == (
                b.iteration_time,
                b.peak_memory,
                b.group_finish,
            )
    with pytest.raises(ValueError, match="message_s"):
        HostCpu(160e9, message_s=-1.0)
    with pytest.raises(ValueError, match="ps_call_s"):
        HostCpu(160e9, ps_call_s=float("inf"))


def test_calibration_host_cpu_constants_cost_ps_on_quotad_machines_and_default_to_the_old_results():
    cal = Calibration(160e9, 17e9, 0.5, 0.5, 20e-6, 300e-6, 50e-6, 0.8, 0.5)
    measured = dataclasses.replace(cal, message_copies=2.0, sum_bandwidth=37e9, message_overhead_s=10e-6)
    assert cal.host_cpu() is None
    assert measured.host_cpu() == HostCpu(160e9, 2 / 17e9, 1 / 37e9, 10e-6, shm_copy_s_per_byte=2 / 17e9)
    assert set(HOST_CPU) == {
        "message_copies",
        "sum_bandwidth",
        "message_overhead_s",
        "ps_call_s",
        "ps_local_call_s",
        "ps_shared_call_s",
        "collective_step_s",
        "collective_call_s",
        "collective_step_cpu_s",
        "collective_call_cpu_s",
    }
    for name, rng in HOST_CPU.items():
        assert rng.meaning and 0 < rng.low < rng.high, name
        with pytest.raises(ValueError, match=f"{name} .* must be 0 \\(not costed\\) or in its physical"):
            dataclasses.replace(cal, **{name: rng.high * 2})
    # A file written before these constants loads with them at 0: not costed.
    old = {k: v for k, v in cal.to_dict().items() if k not in HOST_CPU}
    assert Calibration.from_dict(old) == cal
    base = sim_for("vgg-mini", cpu_cluster(0.25))
    plan = BASELINES["byteps-like"](base, 16)
    before = cal.evaluate(cal.simulator(base.graph, base.grouping, base.topology), plan)
    after = measured.evaluate(measured.simulator(base.graph, base.grouping, base.topology), plan)
    plain = Simulator(
        base.graph,
        base.grouping,
        cal.apply(base.topology),
        cal.device_types(base.topology),
        cpu_core_flops=cal.core_flops,
    ).evaluate(dataclasses.replace(plan, topology=cal.apply(base.topology)))
    assert before == plain.iteration_time
    assert after > before


def test_a_server_only_machine_bounds_ps_by_its_servers_cpu():
    groups = (*cpu_cluster(1.0).groups, DeviceGroup("srv", "CPU", 0, 40.0, peak_flops=160e9 * 0.05))
    topo = Topology("quota+server", groups, 1.0)
    base = sim_for("vgg-mini", topo)
    costed = Simulator(base.graph, base.grouping, topo, host_cpu=HOST)
    plan = dataclasses.replace(BASELINES["byteps-like"](base, 16), ps_servers=("srv",)).validate()
    result = costed.evaluate(plan, trace=True)
    assert result.iteration_time > base.evaluate(plan).iteration_time
    assert "srv/compute" in {t.resource for t in first_step(result) if t.category == "ps-cpu"}


def test_collective_steps_cost_the_slowest_members_cpu_and_zero_changes_nothing():
    unfused = CommSettings(overlap=True, fusion_bytes=0)
    extra = {}
    for cores in (1.0, 0.25):
        base = sim_for("vgg-mini", cpu_cluster(cores))
        plan = dataclasses.replace(BASELINES["dp-nccl"](base, 16), comm=unfused)
        stepped = Simulator(
            base.graph, base.grouping, base.topology, host_cpu=HostCpu(160e9, collective_step_s=1e-4)
        )
        assert stepped.ring_link({0: 1, 1: 1})[1] == pytest.approx(
            base.ring_link({0: 1, 1: 1})[1] + 1e-4 / cores
        )
        extra[cores] = stepped.evaluate(plan).iteration_time - base.evaluate(plan).iteration_time
        assert extra[cores] > 0
        zero = Simulator(base.graph, base.grouping, base.topology, host_cpu=HostCpu(160e9))
        assert zero.evaluate(plan).iteration_time == base.evaluate(plan).iteration_time
    assert extra[0.25] > 3 * extra[1.0]  # each step runs at a quarter of a core
    # Fewer, fused messages pay for fewer steps.
    base = sim_for("vgg-mini", cpu_cluster(0.25))
    stepped = Simulator(
        base.graph, base.grouping, base.topology, host_cpu=HostCpu(160e9, collective_step_s=1e-4)
    )
    fused = dataclasses.replace(
        BASELINES["dp-nccl"](base, 16), comm=CommSettings(overlap=True, fusion_bytes=64 << 20)
    )
    assert stepped.evaluate(fused).iteration_time - base.evaluate(fused).iteration_time < extra[0.25]


def test_a_collective_call_costs_once_per_call_whatever_the_ring_size():
    base = sim_for("vgg-mini", cpu_cluster(0.5))
    unfused = CommSettings(overlap=True, fusion_bytes=0)
    plan = dataclasses.replace(BASELINES["dp-nccl"](base, 16), comm=unfused)
    called = Simulator(
        base.graph, base.grouping, base.topology, host_cpu=HostCpu(160e9, collective_call_s=1e-3)
    )
    tasks = first_step(base.evaluate(plan, trace=True))
    plain = {t.name: t.end - t.start for t in tasks if t.category == "allreduce"}
    for t in first_step(called.evaluate(plan, trace=True)):
        if t.category == "allreduce":  # 1 ms of CPU at half a core, once per tensor of the op group
            tensors = len(base.groups[int(t.name.split("g")[-1])].param_names)
            assert t.end - t.start == pytest.approx(plain[t.name] + tensors * 2e-3)


def test_a_rank_that_computes_little_runs_its_collectives_cpu_in_quota_bursts():
    # a: a full core; b: a quarter core. A call's CPU (1 ms on a full core) waits for the slower member.
    groups = (
        DeviceGroup("a", "CPU", 1, 40.0, peak_flops=160e9),
        DeviceGroup("b", "CPU", 1, 40.0, peak_flops=160e9 * 0.25),
    )
    base = sim_for("vgg-mini", Topology("quota", groups, 1.0))
    called = Simulator(
        base.graph, base.grouping, base.topology, host_cpu=HostCpu(160e9, collective_call_s=1e-3)
    )
    unfused = CommSettings(overlap=True, fusion_bytes=0)
    per_call, computing = {}, {}
    for shares in ((8, 8), (15, 1)):
        plan = data_parallel_plan(base, 16, {"a:0": shares[0], "b:0": shares[1]}, comm=unfused)
        plain_tasks = first_step(base.evaluate(plan, trace=True))
        plain = {t.name: t.end - t.start for t in plain_tasks}
        computing[shares] = {
            m: sum(t.end - t.start for t in plain_tasks
                   if t.resource == f"{m}/compute" and t.category in ("forward", "backward"))
            for m in "ab"
        }  # fmt: skip
        (name, dur), *_ = (
            (t.name, t.end - t.start) for t in first_step(called.evaluate(plan, trace=True))
            if t.category == "allreduce"
        )  # fmt: skip
        per_call[shares] = (dur - plain[name]) / len(base.groups[int(name.split("g")[-1])].param_names)
    # Equal shares: b computes all step long, so its quota runs the CPU at a quarter of a core.
    assert per_call[(8, 8)] == pytest.approx(4e-3)
    # One sample of 16 on b: it computes a fraction x of a's step, so it bursts at 0.25 + 0.75 (1 - x).
    x = computing[(15, 1)]["b"] / computing[(15, 1)]["a"]
    assert x < 0.5
    assert per_call[(15, 1)] == pytest.approx(1e-3 / (0.25 + 0.75 * (1 - x)), rel=1e-6)


def test_ranks_sharing_a_small_quota_are_bound_by_the_collective_cpu_they_consume():
    # Two machines of two devices; b shares 0.3 cores. Unfused all-reduces: every tensor is a call of
    # 2(n - 1) steps on every rank, whose measured CPU its machine's quota pays.
    groups = (
        DeviceGroup("a", "CPU", 2, 40.0, peak_flops=160e9 * 0.35, cpu_cores=0.7),
        DeviceGroup("b", "CPU", 2, 40.0, peak_flops=160e9 * 0.15, cpu_cores=0.3),
    )
    base = sim_for("vgg-mini", Topology("quota", groups, 10.0))
    step, call = 300e-6, 50e-6
    plan = data_parallel_plan(
        base, 16, {"a:0": 7, "a:1": 7, "b:0": 1, "b:1": 1}, comm=CommSettings(overlap=False, fusion_bytes=0)
    )
    timed = HostCpu(160e9, collective_step_s=step, collective_call_s=call)
    untaxed = Simulator(base.graph, base.grouping, base.topology, host_cpu=timed)
    taxed = Simulator(
        base.graph,
        base.grouping,
        base.topology,
        host_cpu=dataclasses.replace(timed, collective_step_cpu_s=step, collective_call_cpu_s=call),
    )
    free, bound = untaxed.evaluate(plan, trace=True), taxed.evaluate(plan, trace=True)
    tensors = len(base.graph.params)
    per_rank = tensors * (2 * 3 * step + call)  # a ring of 4 ranks: 6 steps per call
    b_busy = sum(t.end - t.start for t in first_step(free) if t.resource == "b/compute")
    # b's two ranks burst as if alone (b computes little) but cannot beat its quota.
    assert free.iteration_time < b_busy + 2 * per_rank / 0.3
    assert bound.iteration_time == pytest.approx(b_busy + 2 * per_rank / 0.3, rel=1e-6)
    # Each rank's CPU per step counts its collectives.
    assert bound.cpu_seconds["b:0"] == pytest.approx(free.cpu_seconds["b:0"] + per_rank)
    # Without a known quota, the devices' share of a core stands in: 2 x 0.15 cores, the same here.
    unknown = Topology("quota", tuple(dataclasses.replace(g, cpu_cores=0.0) for g in groups), 10.0)
    blind = Simulator(base.graph, base.grouping, unknown, host_cpu=taxed.host_cpu)
    assert blind.evaluate(dataclasses.replace(plan, topology=unknown)).iteration_time == pytest.approx(
        bound.iteration_time
    )


def ps_cpu(result: SimResult) -> dict[str, float]:
    """Seconds of PS CPU on the compute streams of device groups a and b in the first simulated step."""
    return {
        r: sum(t.end - t.start for t in first_step(result) if t.category == "ps-cpu" and t.resource == r)
        for r in ("a/compute", "b/compute")
    }


def test_every_rank_pays_its_push_pull_calls_and_further_ranks_their_local_reduction():
    # a: two devices under half a core, b: one under a quarter; every tensor is one push_pull per rank.
    groups = (
        DeviceGroup("a", "CPU", 2, 40.0, peak_flops=160e9 * 0.25),
        DeviceGroup("b", "CPU", 1, 40.0, peak_flops=160e9 * 0.25),
    )
    base = sim_for("vgg-mini", Topology("ranks", groups, 10.0))  # links fast enough that CPU bounds the step
    call = 1e-3
    costed = Simulator(base.graph, base.grouping, base.topology, host_cpu=HostCpu(160e9, ps_call_s=call))
    plan = BASELINES["byteps-like"](base, 16)
    result = costed.evaluate(plan, trace=True)
    tensors = len(base.graph.params)
    cpu = ps_cpu(result)
    assert cpu["a/compute"] == pytest.approx(2 * tensors * call / 0.5)
    assert cpu["b/compute"] == pytest.approx(tensors * call / 0.25)
    assert result.iteration_time > base.evaluate(plan).iteration_time
    # a's second rank also costs the shared-memory reduction's coordination; b, alone, skips it.
    local = 3e-3
    host = HostCpu(160e9, ps_call_s=call, ps_local_call_s=local)
    reducing = Simulator(base.graph, base.grouping, base.topology, host_cpu=host).evaluate(plan, trace=True)
    cpu = ps_cpu(reducing)
    assert cpu["a/compute"] == pytest.approx(tensors * (2 * call + local) / 0.5)
    assert cpu["b/compute"] == pytest.approx(tensors * call / 0.25)
    assert reducing.iteration_time > result.iteration_time
    # And its root's coordination, once per call of a machine of several ranks.
    shared = 2e-3
    host = HostCpu(160e9, ps_call_s=call, ps_local_call_s=local, ps_shared_call_s=shared)
    rooted = Simulator(base.graph, base.grouping, base.topology, host_cpu=host).evaluate(plan, trace=True)
    cpu = ps_cpu(rooted)
    assert cpu["a/compute"] == pytest.approx(tensors * (2 * call + local + shared) / 0.5)
    assert cpu["b/compute"] == pytest.approx(tensors * call / 0.25)


def test_a_ps_call_pays_its_messages_and_not_a_collectives_launch():
    # A PS call's CPU is its partitions' messages (message_s) and its ranks' calls (ps_call_s);
    # collective_call_s is gloo's launch alone.
    base = sim_for("vgg-mini", cpu_cluster(0.5))
    for fusion in (0, 64 << 20):
        plan = dataclasses.replace(BASELINES["byteps-like"](base, 16), comm=CommSettings(True, fusion))
        times = {}
        for name, host in {
            "messages": HostCpu(160e9, message_s=1e-4),
            "and calls": HostCpu(160e9, message_s=1e-4, collective_call_s=1e-3),
        }.items():
            times[name] = Simulator(base.graph, base.grouping, base.topology, host_cpu=host).evaluate(plan)
        assert times["messages"].iteration_time > base.evaluate(plan).iteration_time
        assert times["and calls"].iteration_time == times["messages"].iteration_time


@pytest.mark.parametrize("fusion_bytes", [0, 64 << 20], ids=["per-tensor", "fused"])
def test_an_all_reduce_takes_the_cpu_of_its_bytes_from_the_members_compute(fusion_bytes: int):
    base = sim_for("vgg-mini", cpu_cluster(0.5))
    comm = CommSettings(overlap=True, fusion_bytes=fusion_bytes)
    plan = dataclasses.replace(BASELINES["dp-nccl"](base, 16), comm=comm)
    copy = 1e-8  # s/B: slower than the 1 Gbit/s wire, so the CPU and not the link sets the pace
    host = HostCpu(160e9, copy_s_per_byte=copy)
    copying = Simulator(base.graph, base.grouping, base.topology, host_cpu=host)
    result = copying.evaluate(plan, trace=True)
    cpu = [t for t in first_step(result) if t.category == "allreduce-cpu"]
    assert {t.resource for t in cpu} == {"a/compute", "b/compute"}
    # Each rank sends and receives S/2 in each half of the ring (reduce-scatter, all-gather): four copies of
    # S/2, on a machine of half a core (the sum is not costed here).
    nbytes = sum(base.graph.params.values())
    assert sum(t.end - t.start for t in cpu) == pytest.approx(2 * nbytes * 0.5 * 4 * copy / 0.5)
    assert result.iteration_time > base.evaluate(plan).iteration_time


def test_an_early_first_bucket_starts_the_sync_during_backward():
    base = sim_for("vgg-mini", cpu_cluster(1.0))
    plan = BASELINES["dp-nccl"](base, 16)
    one = dataclasses.replace(plan, comm=CommSettings(overlap=True, fusion_bytes=64 << 20))
    early = dataclasses.replace(
        plan, comm=CommSettings(overlap=True, fusion_bytes=64 << 20, first_bucket_bytes=1 << 20)
    )
    t_one, t_early = base.evaluate(one, trace=True), base.evaluate(early, trace=True)
    syncs = [t for t in first_step(t_one) if t.category == "allreduce"]
    early_syncs = [t for t in first_step(t_early) if t.category == "allreduce"]
    assert len(syncs) == 1 and len(early_syncs) == 2
    assert early_syncs[0].start < syncs[0].start  # the first bucket goes before backward ends
    assert t_early.iteration_time < t_one.iteration_time
    assert Plan.from_dict(early.to_dict()).comm == early.comm


def pipelined_plan(sim: Simulator, batch: int, first: int) -> Plan:
    """The first ``first`` op groups on the first device group, the rest on the second."""
    names = [g.name for g in sim.dgroups]
    groups = tuple(
        op_group_plan(sim, i, (names[0] if i < first else names[1],), "allreduce")
        for i in range(len(sim.groups))
    )
    gradients = {p: GradientSync(i, "allreduce") for i, g in enumerate(sim.groups) for p in g.param_names}
    shares = {f"{names[0]}:0": batch // 2, f"{names[1]}:0": batch - batch // 2}  # per op group: all
    return Plan(sim.topology, sim.graph.name, batch, groups, gradients, shares).validate()


def test_consecutive_steps_overlap_where_op_groups_sit_on_different_machines():
    graph = deep_mlp_graph(1024, 6)
    topo = topology(("a", "V100-32GB", 1), ("b", "CPU", 1), inter_gbps=10.0)
    one, many = (Simulator(graph, group_ops(graph, 6), topo, steps=k) for k in (1, SIMULATED_STEPS))
    plan = pipelined_plan(many, 64, first=1)
    single, steady = one.evaluate(plan), many.evaluate(plan, trace=True)
    # GPU machine a (one op group) starts the next forward while CPU machine b still runs its much longer
    # optimizer step (five op groups' parameters), so the period is shorter than one step alone, but never
    # shorter than the busiest device's work.
    assert steady.iteration_time < single.iteration_time * (1 - 1e-3)
    assert steady.iteration_time >= max(steady.busy.values()) * (1 - 1e-12)
    assert steady.busy == pytest.approx(single.busy)
    assert {t.step for t in steady.tasks} == set(range(1, SIMULATED_STEPS + 1))
    # A data-parallel plan synchronises every step: the period is the step.
    dp = dp_nccl(many, 64)
    assert many.evaluate(dp).iteration_time == pytest.approx(one.evaluate(dp).iteration_time, rel=1e-9)


def test_simulated_steps_must_be_positive():
    graph = deep_mlp_graph(64, 1)
    with pytest.raises(ValueError, match="steps"):
        Simulator(graph, group_ops(graph, 1), topology(("a", "V100-32GB", 1)), steps=0)
