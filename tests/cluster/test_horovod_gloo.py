"""Horovod as a baseline inside tagps jobs: horovodrun's slots for the job's ranks, and jobs that train.

The training tests need horovod (``make bench-deps``); the cluster one also root, network namespaces and
a CPU cgroup controller. They skip with the reason otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from tagps.cluster import ClusterError, check_support
from tagps.cluster import cgroup as cg
from tagps.cluster.experiment import Executor, run_plan
from tagps.cluster.horovod_gloo import hosts, slot_env
from tagps.config import CommConfig
from tagps.strategy.baselines import dp_nccl
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import DeviceGroup, Topology

needs_horovod = pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None, reason="horovod is not installed (make bench-deps builds it)"
)
LOCAL = Topology("local", (DeviceGroup("local", "CPU", 2, 10.0),), 10.0)


def _layout(machines: int, local_size: int) -> list[CommConfig]:
    """The CommConfig of every rank of a job, in rank order."""
    return [
        CommConfig(num_worker=machines, worker_id=m, local_rank=r, local_size=local_size, root_uri="10.0.0.1")
        for m in range(machines)
        for r in range(local_size)
    ]


def test_slot_env_numbers_ranks_machine_major() -> None:
    cfgs = _layout(3, 2)
    assert hosts(cfgs[0]) == "node0:2,node1:2,node2:2"
    env = slot_env(cfgs[3], "10.0.0.1", 4242, "eth0")
    assert env == {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "4242",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "eth0",
        "HOROVOD_HOSTNAME": "node1",
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "6",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "3",
    }
    ranks = [int(slot_env(c, "a", 1, "lo")["HOROVOD_RANK"]) for c in cfgs]
    assert ranks == list(range(6))


def test_slot_env_of_machines_of_different_sizes() -> None:
    # Machines of 1, 2 and 2 processes: ranks count the processes before; local rank 1 lives on two.
    cfgs = [
        CommConfig(num_worker=3, worker_id=m, local_rank=r, local_size=n, machine_sizes=(1, 2, 2))
        for m, n in enumerate((1, 2, 2))
        for r in range(n)
    ]
    assert hosts(cfgs[0]) == "node0:1,node1:2,node2:2"
    envs = [slot_env(c, "a", 1, "lo") for c in cfgs]
    assert [e["HOROVOD_RANK"] for e in envs] == ["0", "1", "2", "3", "4"]
    assert {e["HOROVOD_SIZE"] for e in envs} == {"5"}
    assert [(e["HOROVOD_CROSS_RANK"], e["HOROVOD_CROSS_SIZE"]) for e in envs] == [
        ("0", "3"), ("1", "3"), ("0", "2"), ("2", "3"), ("1", "2"),
    ]  # fmt: skip


def test_horovod_refuses_general_plans() -> None:
    plan = dp_nccl(Simulator.for_model("mlp-mini", LOCAL, groups=2), 8, "sgd")
    general = dataclasses.replace(plan, kind="general")
    with pytest.raises(ValueError, match="Horovod runs data-parallel plans"):
        run_plan(Executor(LOCAL), "mlp-mini", general, runtime="horovod")


@needs_horovod
@pytest.mark.parametrize(("machines", "local_size"), [(1, 1), (1, 3), (2, 2), (3, 1)])
def test_slot_env_is_what_horovodrun_gives(machines: int, local_size: int) -> None:
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars

    cfgs = _layout(machines, local_size)
    slots = get_host_assignments(parse_hosts(hosts(cfgs[0])), len(cfgs))
    run_env = {k: str(v) for k, v in create_run_env_vars("10.0.0.1", ["eth0"], 4242).items()}
    del run_env["NCCL_SOCKET_IFNAME"]  # GPU only
    for cfg, slot in zip(cfgs, slots, strict=True):
        assert slot_env(cfg, "10.0.0.1", 4242, "eth0") == {**run_env, **create_slot_env_vars(slot)}


@needs_horovod
@pytest.mark.timeout(300)
def test_horovod_trains_like_ddp() -> None:
    # Horovod averages gradients as DDP does: the same plan and samples give the same losses.
    plan = dp_nccl(Simulator.for_model("mlp-mini", LOCAL, groups=2), 8, "sgd")
    ddp = run_plan(Executor(LOCAL), "mlp-mini", plan, runtime="ddp", steps=2, warmup=1)
    horovod = run_plan(Executor(LOCAL), "mlp-mini", plan, runtime="horovod", steps=2, warmup=1)
    assert horovod["job_status"] == 0 and horovod["runtime"] == "horovod"
    assert horovod["losses"][-1] < horovod["losses"][0]
    assert horovod["losses"] == pytest.approx(ddp["losses"], rel=1e-5)


@needs_horovod
@pytest.mark.timeout(300)
def test_horovod_trains_in_an_emulated_cluster() -> None:
    # Two machines of two devices: Horovod's local and cross rendezvous scopes both have two ranks, and
    # its gloo traffic crosses the namespaces' links.
    from tagps.cluster.run import up

    try:
        check_support()
        cg.cgroup_root()
    except ClusterError as exc:
        pytest.skip(f"needs root, network namespaces and a CPU cgroup controller: {exc}")
    spec = {
        "name": "t-hvd",
        "machines": [
            {"name": "a", "workers": 2, "cpu": 0.8, "rate_mbit": 500},
            {"name": "b", "workers": 2, "cpu": 0.8, "rate_mbit": 500},
        ],
    }
    groups = (DeviceGroup("a", "CPU", 2, 10.0), DeviceGroup("b", "CPU", 2, 10.0))
    topology = Topology("t-hvd", groups, 1.0)
    plan = dp_nccl(Simulator.for_model("mlp-mini", topology, groups=2), 8, "sgd")
    with up(spec) as cluster:
        executor = Executor(topology, cluster)
        ddp = run_plan(executor, "mlp-mini", plan, runtime="ddp", steps=2, warmup=1)
        horovod = run_plan(executor, "mlp-mini", plan, runtime="horovod", steps=2, warmup=1)
    assert horovod["job_status"] == 0 and horovod["devices"] == ["a:0", "a:1", "b:0", "b:1"]
    assert horovod["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
