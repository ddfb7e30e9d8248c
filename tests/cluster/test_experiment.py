"""Plans run as jobs: servers where the plan puts them, the DDP model plan, a local job end to end."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from tagps.cluster.experiment import (
    DDP_BUCKET_BYTES,
    MEASURED_STEP,
    Executor,
    ddp_plan,
    ddp_subset_plans,
    plan_env,
    plan_servers,
    run_plan,
)
from tagps.strategy.baselines import byteps_like, dp_nccl
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import DeviceGroup, Topology

TOPOLOGY = Topology(
    "two", (DeviceGroup("a", "CPU", 2, 10.0), DeviceGroup("b", "CPU", 1, 10.0)), 1.0, (), 1e-5, 1e-5
)


@pytest.fixture(scope="module")
def sim() -> Simulator:
    return Simulator.for_model("transformer-mini", TOPOLOGY, groups=4)


def test_plan_servers_follow_the_plan(sim: Simulator) -> None:
    assert plan_servers(dp_nccl(sim, 6)) == {}
    assert plan_servers(byteps_like(sim, 6)) == {"a": 1, "b": 1}
    # ps without explicit servers: the servers sit on the placement of the groups that use ps.
    plan = dataclasses.replace(byteps_like(sim, 6, "sgd"), ps_servers=()).validate()
    assert plan_servers(plan) == {"a": 1, "b": 1}
    one = dataclasses.replace(plan, batch_shares={"a:0": 3, "a:1": 3, "b:0": 0})
    one = dataclasses.replace(one, groups=tuple(dataclasses.replace(g, placement=("a",)) for g in one.groups))
    assert plan_servers(one.validate()) == {"a": 1}


def test_a_plan_runs_at_the_partition_size_it_was_costed_with(sim: Simulator) -> None:
    assert plan_env(byteps_like(sim, 6)) == {}  # the runtime's BYTEPS_PARTITION_BYTES, as costed
    comm = dataclasses.replace(byteps_like(sim, 6).comm, partition_bytes=1 << 18)
    assert plan_env(dataclasses.replace(byteps_like(sim, 6), comm=comm)) == {
        "BYTEPS_PARTITION_BYTES": "262144",
        "BYTEPS_KEY_HASH_FN": "balanced",
    }
    assert plan_env(dataclasses.replace(dp_nccl(sim, 6), comm=comm)) == {}  # no ps gradient, no chunks


def test_ddp_plan_models_distributed_data_parallel(sim: Simulator) -> None:
    plan = ddp_plan(sim, 7)
    assert plan.kind == "data-parallel"
    assert plan.comm.overlap and plan.comm.fusion_bytes == DDP_BUCKET_BYTES
    assert sorted(plan.batch_shares.values()) == [2, 2, 3]
    assert {g.sync for g in plan.gradients.values()} == {"allreduce"}


def test_ddp_subset_plans_cover_the_subsets_that_split_the_batch_evenly(sim: Simulator) -> None:
    # a: 2 devices, b: 1 device; batch 6 splits evenly over a (2), b (1) and a+b (3).
    plans = ddp_subset_plans(sim, 6)
    assert [p.batch_shares for p in plans] == [
        {"a:0": 3, "a:1": 3},
        {"b:0": 6},
        {"a:0": 2, "a:1": 2, "b:0": 2},
    ]
    assert all(p.kind == "data-parallel" and p.comm == ddp_plan(sim, 6).comm for p in plans)
    assert plans[1].groups[0].placement == ("b",)
    # batch 4: a+b has 3 devices, which DDP cannot share 4 samples between evenly.
    assert [p.devices() for p in ddp_subset_plans(sim, 4)] == [["a:0", "a:1"], ["b:0"]]


def test_run_plan_rejects_plans_it_cannot_run(sim: Simulator) -> None:
    executor = Executor(Topology("one", (DeviceGroup("x", "CPU", 1, 10.0),), 1.0))
    with pytest.raises(ValueError, match="not all in the executor's topology"):
        run_plan(executor, "transformer-mini", dp_nccl(sim, 6))
    general = dataclasses.replace(dp_nccl(sim, 6), kind="general")
    with pytest.raises(ValueError, match="DistributedDataParallel runs data-parallel plans"):
        run_plan(Executor(TOPOLOGY), "transformer-mini", general, runtime="ddp")


@pytest.mark.timeout(180)
def test_a_ps_plan_trains_as_local_processes() -> None:
    local = Topology("local", (DeviceGroup("local", "CPU", 2, 10.0),), 10.0)
    plan = byteps_like(Simulator.for_model("transformer-mini", local, groups=4), 8)
    plan = dataclasses.replace(plan, comm=dataclasses.replace(plan.comm, partition_bytes=1 << 16))
    result = run_plan(Executor(local), "transformer-mini", plan, steps=2, warmup=1)
    assert result["job_status"] == 0 and "job_error" not in result
    assert result["ps_env"] == {"BYTEPS_PARTITION_BYTES": "65536", "BYTEPS_KEY_HASH_FN": "balanced"}
    assert result["devices"] == ["local:0", "local:1"] and result["batch_size"] == 8
    assert len(result["step_times_s"]) == 2 and len(result["losses"]) == 3
    assert result["samples_per_s"] == pytest.approx(8 / result["mean_step_s"])
    # Each rank's CPU per timed step: positive, and no more than its process's two cores could give.
    cpu = result["cpu_s_per_step"]
    assert set(cpu) == {"local:0", "local:1"}
    assert all(0 < seconds < 2 * max(result["step_times_s"]) + 0.5 for seconds in cpu.values())
    # And its minor page faults per step: counted, and few once init() keeps freed buffers (tagps.heap).
    faults = result["page_faults_per_step"]
    assert set(faults) == {"local:0", "local:1"} and all(0 <= f < 5000 for f in faults.values())
    # What predictions are compared with: the mean of the step times, the throughput.
    assert result[MEASURED_STEP] == pytest.approx(statistics.mean(result["step_times_s"]))


@pytest.mark.timeout(240)
def test_plans_train_on_the_same_global_batch() -> None:
    # The demo compares the losses of a plan and of DDP step by step: both must see the same samples,
    # whatever the batch shares, so uneven tagps shares and even DDP shares give the same losses.
    local = Topology("local", (DeviceGroup("local", "CPU", 2, 10.0),), 10.0)
    even = dp_nccl(Simulator.for_model("mlp-mini", local, groups=2), 8, "sgd")
    uneven = dataclasses.replace(even, batch_shares={"local:0": 5, "local:1": 3}).validate()
    ddp = run_plan(Executor(local), "mlp-mini", even, runtime="ddp", steps=2, warmup=1)
    tagps = run_plan(Executor(local), "mlp-mini", uneven, steps=2, warmup=1)
    assert tagps["losses"][-1] < tagps["losses"][0]
    assert tagps["losses"] == pytest.approx(ddp["losses"], rel=1e-5)


def test_ddp_subset_plans_leave_server_only_machines_out() -> None:
    groups = (DeviceGroup("a", "CPU", 2, 10.0), DeviceGroup("spare", "CPU", 0, 10.0))
    sim = Simulator.for_model("transformer-mini", Topology("spare", groups, 1.0), groups=4)
    assert [p.devices() for p in ddp_subset_plans(sim, 4)] == [["a:0", "a:1"]]
