"""Calibrate the simulator on this host: ``python -m tagps.calibrate [--quick] [--no-cluster] [--out FILE]``.

1. **Profile** the calibration set (``mlp-mini``, ``convnet-mini``, ``encoder-mini``; the benchmarks
   validate on other models) on one thread: a full training step (forward, backward, Adam) at several
   batch sizes, in CPU time, plus this core's float32 matmul rate and copy bandwidth; fit the roofline
   constants.
2. **Measure links**: ``gloo`` all-reduces of several sizes between two devices of one machine and
   between two machines of an emulated calibration cluster (:data:`CALIBRATION_CLUSTER`, unlike the
   benchmark's) whose goodput was measured; fit the ring model's latencies and bandwidth efficiencies.
3. **Fit on whole jobs**: train ``mlp-mini`` and ``encoder-mini`` on that cluster with DDP, tagps
   all-reduce and tagps PS, and refit the communication constants so that the simulator's iteration
   times match (what the runtimes add per message lands in the latencies).

Without root only the loopback ring of step 2 is measured, the inter-machine constants are taken equal to
the intra-machine ones and step 3 is skipped (the output says so). The result is the JSON the simulator
loads (:mod:`tagps.strategy.calibration`; default ``$TAGPS_CACHE_DIR/calibration.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tagps.strategy.calibration import (
    Calibration,
    CommSample,
    ComputeSample,
    RunSample,
    fit_comm,
    fit_compute,
    fit_runs,
)

__all__ = [
    "CALIBRATION_CLUSTER",
    "CALIBRATION_MODELS",
    "calibrate",
    "calibrate_stages",
    "default_path",
    "main",
    "profile_step",
]

# Two emulated machines, neither like the benchmark's: two devices at 1 core, one device at half a core.
CALIBRATION_CLUSTER = {
    "name": "calib",
    "machines": [
        {"name": "ca", "workers": 2, "cpu": 1.0, "rate_mbit": 400},
        {"name": "cb", "workers": 1, "cpu": 0.5, "rate_mbit": 400},
    ],
}
CALIBRATION_MODELS = ("mlp-mini", "convnet-mini", "encoder-mini")
_SIZES = (1 << 16, 1 << 20, 1 << 23)  # bytes of the probed all-reduces
_BATCH = 24


def default_path() -> Path:
    """Where the calibration lives by default: ``$TAGPS_CACHE_DIR/calibration.json``."""
    from tagps.config import strategy_config

    return Path(strategy_config().cache_dir) / "calibration.json"


def profile_step(model: Any, inputs: Sequence[Any], steps: int = 5) -> float:
    """Fastest of ``steps`` training steps (forward, cross-entropy, backward, Adam) on one thread, in CPU
    seconds of that thread (``time.thread_time``: other load on the host does not count)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    with torch.no_grad():
        out = model(*inputs)
    targets = torch.randint(0, out.shape[-1], out.shape[:-1])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 2):
        t = time.thread_time()
        opt.zero_grad()
        F.cross_entropy(model(*inputs).flatten(0, -2), targets.flatten()).backward()
        opt.step()
        if step >= 2:
            times.append(time.thread_time() - t)
    return min(times)


def _compute_samples(batches: Sequence[int], steps: int) -> list[ComputeSample]:
    import torch

    from tagps.models import build_model, example_inputs
    from tagps.strategy.graph import model_graph

    samples = []
    for name in CALIBRATION_MODELS:
        graph = model_graph(name)
        torch.manual_seed(0)
        model = build_model(name)
        for b in batches:
            seconds = profile_step(model, example_inputs(name, b), steps)
            samples.append(ComputeSample(f"{name}@{b}", graph, b, "adam", seconds))
    return samples


def _allreduce_probe(out: str, reps: int) -> None:
    """Worker of the link calibration: time gloo all-reduces of ``_SIZES``; rank 0 writes the fastest."""
    import torch
    import torch.distributed as dist

    import tagps.torch as bps

    torch.set_num_threads(1)
    bps.init()
    result = {}
    for size in _SIZES:
        t = torch.ones(size // 4)
        for _ in range(2):
            dist.all_reduce(t)
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        result[str(size)] = min(times)
    if bps.rank() == 0:
        Path(out).write_text(json.dumps(result))
    bps.shutdown()


def _run_logged(run: Callable[[Any], int], what: str) -> None:
    with tempfile.TemporaryFile() as log:
        status = run(log)
        if status != 0:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{what} failed with status {status}:\n{tail}")


def _probe_argv(out: str, reps: int) -> list[str]:
    return [sys.executable, "-m", "tagps.calibrate", "--allreduce-probe", out, "--reps", str(reps)]


def _loopback_allreduces(reps: int) -> list[CommSample]:
    from tagps.cluster.measure import measure_pair
    from tagps.launcher import free_ports, local_job, run_processes

    link = measure_pair(list, list, "127.0.0.1", free_ports(1)[0], 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        _run_logged(
            lambda log: run_processes(local_job(_probe_argv(out, reps), 2, 0, 1), out=log),
            "loopback all-reduce probe",
        )
        data = json.loads(Path(out).read_text())
    return [CommSample(int(s), 2, link.bandwidth_Bps, False, t) for s, t in data.items()]


def _cluster_allreduces(cluster: Any, topology: Any, reps: int) -> list[CommSample]:
    samples = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        for devices, inter in ((["ca:0", "ca:1"], False), (["ca:0", "cb:0"], True)):
            _run_logged(
                lambda log, d=devices: cluster.run(_probe_argv(out, reps), devices=d, out=log),
                f"all-reduce probe on {devices}",
            )
            bandwidth = topology.bandwidth("ca", "cb" if inter else "ca")
            data = json.loads(Path(out).read_text())
            samples += [CommSample(int(s), 2, bandwidth, inter, t) for s, t in data.items()]
    return samples


def _job_samples(executor: Any, models: Sequence[str], steps: int) -> list[RunSample]:
    """Whole training jobs on the calibration cluster: DDP, tagps all-reduce and tagps PS per model."""
    from tagps.cluster.experiment import ddp_plan, run_plan
    from tagps.strategy.baselines import byteps_like, data_parallel_plan, even_shares
    from tagps.strategy.graph import model_graph
    from tagps.strategy.grouping import group_ops
    from tagps.strategy.plan import CommSettings
    from tagps.strategy.simulator import Simulator

    runs = []
    for model in models:
        graph = model_graph(model)
        grouping = group_ops(graph, 4)
        sim = Simulator(graph, grouping, executor.topology)
        overlapped = CommSettings(overlap=True)
        plans = {
            "ddp": (ddp_plan(sim, _BATCH), "ddp"),
            "allreduce": (
                data_parallel_plan(sim, _BATCH, even_shares(sim, _BATCH), comm=overlapped),
                "tagps",
            ),
            "ps": (dataclasses.replace(byteps_like(sim, _BATCH), comm=overlapped), "tagps"),
        }
        for name, (plan, runtime) in plans.items():
            result = run_plan(executor, model, plan, runtime, steps=steps, warmup=2)
            measured = result["median_step_s"]
            runs.append(RunSample(f"{model}/{name}", graph, grouping, executor.topology, plan, measured))
    return runs


def calibrate(
    quick: bool = False,
    use_cluster: bool = True,
    jobs: bool = True,
    log: Callable[[str], None] = print,
) -> Calibration:
    """Measure this host and fit the simulator's constants (see the module docstring).

    Args:
        quick: fewer batch sizes, repetitions and jobs.
        use_cluster: measure inter-machine links on an emulated cluster when root allows.
        jobs: also fit the communication constants to whole training jobs (step 3; needs the cluster).
        log: where progress lines go.

    Returns:
        The calibration after the last stage that ran (see :func:`calibrate_stages`).
    """
    return list(calibrate_stages(quick, use_cluster, jobs, log).values())[-1]


def calibrate_stages(
    quick: bool = False,
    use_cluster: bool = True,
    jobs: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Calibration]:
    """Like :func:`calibrate`, but return the calibration after each stage that ran.

    Returns:
        ``{"links": ...}`` (compute fit plus the all-reduce fit) and, when the job fit ran, ``"jobs"``
        (the same with the communication constants refitted to whole jobs).
    """
    from tagps.cluster import ClusterError, check_support
    from tagps.cluster.measure import measure_core

    batches, steps, reps = ((4, 32), 3, 3) if quick else ((4, 16, 32), 5, 5)
    started = time.monotonic()
    core_flops, memory_bandwidth = measure_core()
    log(f"core: {core_flops / 1e9:.1f} GFLOP/s float32 matmul, {memory_bandwidth / 1e9:.1f} GB/s copy")
    compute = _compute_samples(batches, steps)
    eff, mem_eff, overhead, compute_err = fit_compute(compute, core_flops, memory_bandwidth)
    log(
        f"compute fit on {len(compute)} steps: efficiency {eff:.3f}, memory efficiency {mem_eff:.3f}, "
        f"op overhead {overhead * 1e6:.1f} us, mean error {compute_err:.1%}"
    )
    note = "loopback only (--no-cluster)"
    if use_cluster:
        try:
            check_support()
        except ClusterError as exc:
            use_cluster, note = False, f"loopback only ({exc})"
    names = [s.name for s in compute]
    base = Calibration(core_flops, memory_bandwidth, eff, mem_eff, overhead, 0.0, 0.0, 1.0, 1.0)
    if not use_cluster:
        cal = _comm_fit(base, compute_err, _loopback_allreduces(reps), note, log)
        return {"links": dataclasses.replace(cal, calibration_set=(*names, f"allreduce: {note}"))}
    from tagps.cluster.experiment import Executor
    from tagps.cluster.run import up

    machines = ", ".join(
        f"{m['name']}({m['workers']} devices, {m['cpu']} cpu, {m['rate_mbit']} Mbit/s)"
        for m in CALIBRATION_CLUSTER["machines"]
    )
    note = f"emulated cluster {machines}"
    with up(CALIBRATION_CLUSTER) as cluster:
        topology = cluster.topology()
        cal = _comm_fit(base, compute_err, _cluster_allreduces(cluster, topology, reps), note, log)
        fit_error = dict(cal.fit_error)
        names.append(f"allreduce: {note}")
        stages = {"links": dataclasses.replace(cal, calibration_set=tuple(names))}
        if jobs:
            runs = _job_samples(Executor(topology, cluster), ("mlp-mini", "encoder-mini"), 5 if quick else 10)
            cal, job_err = fit_runs(cal, runs)
            fit_error["jobs"] = job_err
            names += [f"job: {r.name}" for r in runs]
            log(
                f"job fit on {len(runs)} runs: latency inter {cal.inter_latency_s * 1e6:.0f} us, intra "
                f"{cal.intra_latency_s * 1e6:.0f} us, bandwidth efficiency inter "
                f"{cal.inter_bandwidth_efficiency:.2f}, intra {cal.intra_bandwidth_efficiency:.2f}, "
                f"mean error {job_err:.1%}"
            )
            stages["jobs"] = dataclasses.replace(cal, fit_error=fit_error, calibration_set=tuple(names))
    log(f"calibrated in {time.monotonic() - started:.0f} s")
    return stages


def _comm_fit(
    base: Calibration, compute_err: float, comm: list[CommSample], note: str, log: Callable[[str], None]
) -> Calibration:
    """``base`` with the all-reduce fit of ``comm`` and both fit errors."""
    inter_lat, intra_lat, inter_eff, intra_eff, comm_err = fit_comm(comm)
    log(
        f"all-reduce fit on {len(comm)} runs, {note}: latency inter {inter_lat * 1e6:.0f} us, "
        f"intra {intra_lat * 1e6:.0f} us, bandwidth efficiency inter {inter_eff:.2f}, intra {intra_eff:.2f}, "
        f"mean error {comm_err:.1%}"
    )
    return dataclasses.replace(
        base,
        inter_latency_s=inter_lat,
        intra_latency_s=intra_lat,
        inter_bandwidth_efficiency=inter_eff,
        intra_bandwidth_efficiency=intra_eff,
        fit_error={"compute": compute_err, "comm": comm_err},
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the calibration command line; return its exit status."""
    p = argparse.ArgumentParser(prog="python -m tagps.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer batch sizes, repetitions and jobs")
    p.add_argument("--no-cluster", action="store_true", help="measure loopback links only")
    p.add_argument("--no-jobs", action="store_true", help="skip the fit on whole training jobs")
    p.add_argument("--out", help="calibration file (default: $TAGPS_CACHE_DIR/calibration.json)")
    p.add_argument("--allreduce-probe", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.allreduce_probe:
        _allreduce_probe(args.allreduce_probe, args.reps)
        return 0
    cal = calibrate(args.quick, not args.no_cluster, not args.no_jobs)
    path = Path(args.out) if args.out else default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    cal.save(path)
    print(f"calibration written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
