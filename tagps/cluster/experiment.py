"""Plans against measurements: run a plan's training job (emulated cluster or local processes), predict it.

The pieces the demo (``tagps demo``) and the end-to-end benchmark (``bench/e2e_cluster.py``) share:

- :class:`Executor`: where jobs run, an emulated :class:`~tagps.cluster.run.Cluster` (devices are its
  worker slots) or local processes on this host (one device group ``local``), with the measured topology;
- :func:`run_plan`: start the plan's job (one :mod:`tagps.cluster.worker` worker per device the plan runs
  on, servers where the plan puts them) and return rank 0's measurements;
- :func:`ddp_plan`: the plan that models ``DistributedDataParallel`` (even shares, all-reduce overlapped
  with backward in 25 MiB buckets), so the simulator can predict the DDP baseline too;
  :func:`ddp_subset_plans`: the same on each subset of device groups (DDP on the best subset).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tagps.strategy.plan import CommSettings, Plan
from tagps.strategy.topology import DeviceGroup, Topology

if TYPE_CHECKING:
    from tagps.cluster.run import Cluster
    from tagps.strategy.simulator import Simulator

__all__ = [
    "DDP_BUCKET_BYTES",
    "MEASURED_STEP",
    "Executor",
    "ddp_plan",
    "ddp_subset_plans",
    "local_executor",
    "plan_env",
    "plan_layout",
    "plan_servers",
    "run_plan",
]

# The field of run_plan's result that a prediction is compared with: the mean step time (the throughput).
# The simulator predicts the steady period of consecutive steps, which the mean measures; a median of a
# few steps on a quota'd machine moves with where the CFS periods' ends fall (bimodal steps under the
# kernel's 100 ms period; tagps.cluster.cgroup now uses 10 ms).
MEASURED_STEP = "mean_step_s"
DDP_BUCKET_BYTES = 25 << 20  # DistributedDataParallel's default bucket_cap_mb
# DistributedDataParallel's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES) closes at 1 MiB.
DDP_FIRST_BUCKET_BYTES = 1 << 20
_DDP_COMM = CommSettings(
    overlap=True, fusion_bytes=DDP_BUCKET_BYTES, first_bucket_bytes=DDP_FIRST_BUCKET_BYTES
)


@dataclass
class Executor:
    """Where jobs run, and the topology measured there.

    Args:
        topology: the measured topology (device groups named like the machines, or ``local``).
        cluster: the emulated cluster, or ``None`` for local processes on this host.
    """

    topology: Topology
    cluster: Cluster | None = None

    @property
    def where(self) -> str:
        """A short description for tables."""
        if self.cluster is None:
            return f"{self.topology.num_devices} local processes on this host"
        return f"emulated cluster {self.cluster.spec.name!r} ({len(self.cluster.spec.machines)} namespaces)"


def local_executor(devices: int, probe_seconds: float = 0.3) -> Executor:
    """An executor of ``devices`` local worker processes; measures loopback and this core first.

    Each device is one process with one thread; with more devices than cores they share the cores, so a
    device's ``peak_flops`` is the core's matmul rate times ``min(1, cores / devices)``.
    """
    from tagps.cluster.measure import measure_core, measure_pair
    from tagps.launcher import free_ports

    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    link = measure_pair(list, list, "127.0.0.1", free_ports(1)[0], probe_seconds)
    flops, _ = measure_core()
    share = min(1.0, (os.cpu_count() or 1) / devices)
    gbps = round(link.bandwidth_Bps * 8 / 1e9, 4)
    group = DeviceGroup("local", "CPU", devices, gbps, peak_flops=round(flops * share, -6))
    return Executor(
        Topology("local", (group,), gbps, intra_latency_s=link.rtt_s / 2, inter_latency_s=link.rtt_s / 2)
    )


def plan_servers(plan: Plan) -> dict[str, int]:
    """Summation servers a plan needs: one per device group the plan puts a PS server on (none without ps)."""
    ps_groups = plan.ps_groups()
    if not ps_groups:
        return {}
    names = plan.ps_servers or tuple(
        dict.fromkeys(name for i in sorted(ps_groups) for name in plan.groups[i].placement)
    )
    return {name: 1 for name in names}


#: The variables :func:`plan_env` sets (a job's worker records them, to show what it ran with).
PLAN_ENV_KEYS = ("BYTEPS_PARTITION_BYTES", "BYTEPS_KEY_HASH_FN")


def plan_env(plan: Plan) -> dict[str, str]:
    """The PS settings a plan was costed with, as the environment of its job's processes (servers included).

    A plan with ``ps`` gradients and a ``comm.partition_bytes`` runs its chunks at that size, spread over the
    servers by bytes (``BYTEPS_KEY_HASH_FN=balanced``), as the simulator spreads them; other plans need none.
    """
    if not plan.comm.partition_bytes or not plan.ps_groups():
        return {}
    return dict(zip(PLAN_ENV_KEYS, (str(plan.comm.partition_bytes), "balanced"), strict=True))


def plan_layout(plan: Plan) -> str:
    """Op groups as ``option@placement``, runs of equal ones counted: ``ps@m1 x6, allreduce@m0+m2``."""
    runs: list[list[Any]] = []
    for g in plan.groups:
        text = f"{g.option}@{'+'.join(g.placement)}"
        if runs and runs[-1][0] == text:
            runs[-1][1] += 1
        else:
            runs.append([text, 1])
    return ", ".join(text if n == 1 else f"{text} x{n}" for text, n in runs)


def ddp_plan(sim: Simulator, batch: int, optimizer: str = "adam") -> Plan:
    """The data-parallel plan that ``DistributedDataParallel`` executes (even shares, 25 MiB buckets)."""
    from tagps.strategy.baselines import data_parallel_plan, even_shares

    return data_parallel_plan(sim, batch, even_shares(sim, batch), comm=_DDP_COMM, optimizer=optimizer)


def ddp_subset_plans(sim: Simulator, batch: int, optimizer: str = "adam") -> list[Plan]:
    """:func:`ddp_plan` on every non-empty subset of ``sim``'s device groups whose devices split ``batch``
    evenly (DDP averages gradients as if every rank had the same share), smaller subsets first."""
    from tagps.strategy.baselines import data_parallel_plan

    plans = []
    workers = [g for g in sim.dgroups if g.count > 0]  # server-only machines train nothing
    for size in range(1, len(workers) + 1):
        for subset in itertools.combinations(workers, size):
            devices = [d for g in subset for d in g.devices()]
            if batch % len(devices) == 0:
                shares = {d: batch // len(devices) for d in devices}
                plans.append(data_parallel_plan(sim, batch, shares, comm=_DDP_COMM, optimizer=optimizer))
    return plans


def run_plan(
    executor: Executor,
    model: str,
    plan: Plan,
    runtime: str = "tagps",
    steps: int = 20,
    warmup: int = 3,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Train ``model`` with ``plan`` for ``warmup + steps`` steps and return rank 0's JSON result.

    Args:
        executor: where to run.
        model: registry model name (the plan's model).
        plan: a plan for ``executor.topology``'s devices; rank ``r`` is its ``r``-th worker device
            (:meth:`~tagps.strategy.plan.Plan.worker_devices`).
        runtime: ``tagps`` (the plan as it stands), ``ddp`` (DistributedDataParallel over gloo) or
            ``horovod`` (Horovod's DistributedOptimizer over gloo); the last two data-parallel plans only.
        steps: timed steps.
        warmup: untimed steps first.
        env: extra environment of the processes, over the plan's own (:func:`plan_env`).

    Returns:
        Rank 0's result (:mod:`tagps.cluster.worker`) plus ``job_status``, the job's exit status, and, when
        that is not 0 (a process failed after rank 0 wrote its result, i.e. while leaving the job),
        ``job_error``, the end of the job's output.

    Raises:
        ValueError: a plan that is not data-parallel for ``ddp`` or ``horovod``, or one that names devices
            the executor does not have.
        RuntimeError: the job failed before rank 0 wrote its result (the message holds the end of its
            output).
    """
    from tagps.launcher import local_job, run_processes

    baseline = {"ddp": "DistributedDataParallel", "horovod": "Horovod"}.get(runtime)
    if baseline is not None and plan.kind != "data-parallel":
        raise ValueError(f"{baseline} runs data-parallel plans; this one is {plan.kind!r}")
    # What the runtime cannot execute it refuses by name before step 0; the job's output says why.
    devices = plan.worker_devices()
    known = executor.topology.devices()
    if any(d not in known for d in devices):
        raise ValueError(f"plan devices {devices} are not all in the executor's topology {known}")
    servers = plan_servers(plan)
    full_env = {**os.environ, **plan_env(plan), **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        plan_path, out = Path(tmp) / "plan.json", Path(tmp) / "result.json"
        plan.save(plan_path)
        command = [
            sys.executable, "-m", "tagps.cluster.worker", "--model", model, "--plan", str(plan_path),
            "--runtime", runtime, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out),
        ]  # fmt: skip
        with tempfile.TemporaryFile() as log:
            if executor.cluster is None:
                job = local_job(command, len(devices), sum(servers.values()), 1, full_env)
                status = run_processes(job, out=log)
            else:
                status = executor.cluster.run(
                    command, devices=devices, servers=servers, env=full_env, out=log
                )
            log.seek(0)
            tail = log.read().decode(errors="replace")[-4000:]
        if not out.is_file():
            raise RuntimeError(f"training job of {model} ({runtime}) failed with status {status}:\n{tail}")
        result = json.loads(out.read_text())
        result["job_status"] = status
        if status != 0:  # after every timed step and the loss gather: a failure while leaving the job
            result["job_error"] = tail
        return result
