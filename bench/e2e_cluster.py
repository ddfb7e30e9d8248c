"""End-to-end on an emulated cluster: TAG's general plan, the best data-parallel plan and the baselines.

Usage: python bench/e2e_cluster.py [--quick] [--cluster SPEC] [--out FILE]   (needs root: netns, tc, cgroups)

The cluster is ``--cluster SPEC`` (a YAML/JSON spec, :mod:`tagps.cluster.spec`; ``bench/clusters/`` holds the
committed ones) or the built-in :data:`BENCH_CLUSTER`: two machines with 2 devices each on 1 Gbit/s links
and 0.7 cores each, one slower machine with 2 devices on 200 Mbit/s and 0.3 cores (every device is one
worker process with one thread; a machine's quota is shared by what it runs). For ``vgg-mini`` (VGG-style:
3x3 convs and a wide FC classifier, 3.3M parameters) and ``transformer-mini`` (2-layer causal Transformer
LM, 0.7M parameters), each at a global batch of 48 (raised to a multiple of the devices: 50 on 5), it trains
with

- **best DP plan**: MCTS restricted to data-parallel plans on the simulator calibrated for this host
  (``python -m tagps.calibrate``: a calibration set of other models and another emulated cluster);
- **general plan**: the same search without that restriction, with the shipped GNN prior (what ``tagps
  plan`` searches), executed by the general-plan executor of ``tagps.torch``;
- **executor overhead**: the best DP plan with ``kind: general``: the same devices and syncs, run through
  the general executor instead of the data-parallel path;
- **DDP best subset**: ``DistributedDataParallel`` with even shares on the subset of machines the calibrated
  simulator predicts fastest (every subset whose devices split the batch evenly is predicted; only the
  best is trained);
- **DP all-reduce**: ``DistributedDataParallel`` over gloo, even shares, every device;
- **DP proportional**: tagps all-reduce with batch shares proportional to device speed (DP-NCCL-P);
- **PS**: tagps with every gradient through a summation server, one per machine (BytePS-like), at the
  partition size the calibrated simulator finds fastest for it (``tune_partition``);
- **Horovod**: the DP all-reduce plan trained by ``horovod.torch.DistributedOptimizer`` over gloo
  (``--runtime horovod``: the job's processes join as a Horovod job, :mod:`tagps.cluster.horovod_gloo`),
  when ``horovod.torch`` imports (``make bench-deps`` builds it; else skipped, with the reason in the JSON);

Before calibrating, it profiles the calibration's models and these two on this host (``tagps profile
--processes 3``: the median of three processes, each of which draws its own speed on a shared host;
written to ``<out>-plans/profiles`` and used through ``TAGPS_CACHE_DIR``: the shipped profiles come from
another host), and records, per run, the mean step time of the best of the interleaved rounds (the
machine is shared; the least disturbed round is the fairest; the mean, ``MEASURED_STEP``, the throughput
the simulator predicts, while the median of a few steps on a quota'd machine moves with where its CFS
periods end; the median is recorded beside it, ``median_s``), the calibrated simulator's prediction for the
same plan and the ``tagps cluster run`` command that trained it. Each round first re-measures the
simulator's inputs (the two models' profiles, into ``<out>-plans/round-<k>/profiles``, and the topology),
and each run is predicted from the median of every measurement, the start's included (``predicted_s``;
the median profiles in ``<out>-plans/median/profiles``), and from the inputs its plan was searched with
(``predicted_start_inputs_s``): one measurement on a shared host is a draw. A job that fails is recorded under
``failed_runs`` with its command and the end of its output; the figures that need it are null.

JSON figures (targets in ``TARGETS``; ratios of samples/s): ``vgg_general_vs_best_dp`` (target >= 1.3) and
``transformer_general_vs_best_dp``, with the simulator's ``*_predicted`` ratio beside them and
``*_general_vs_ddp_best_subset``; ``executor_overhead``, the step time of the general-kind copy of the best
DP plan over the best DP plan's (the larger of ``vgg_`` and ``transformer_executor_overhead``; target <=
1.05); ``*_plan_vs_dp_allreduce`` (target >= 1.3 for VGG), ``*_plan_vs_dp_proportional``, ``*_plan_vs_ps``
and ``*_plan_vs_horovod``, where the plan is the best DP plan (as in earlier results), and
``*_general_vs_horovod``; and ``sim_abs_rel_error_mean`` / ``sim_abs_rel_error_max`` over every run but
Horovod's (the simulator models its plan, not Horovod's fusion and cycle), general plans included, from the
median inputs (targets <= 0.10 / <= 0.20; ``*_start_inputs`` from the search's, ``*_median_steps`` against
the median step times), with the calibration
that ``python -m tagps.calibrate`` writes (fitted on whole jobs too); the same two with the calibration
before that last fit (link micro-benchmarks only) are reported as ``*_links_only``.
``sim_cpu_rel_error_mean`` (signed) and ``sim_cpu_abs_rel_error_max``: per tagps rank, the simulator's compute
CPU per step (``SimResult.cpu_seconds``) against the CPU its process took per step (the worker's
``cpu_s_per_step``; both in each run's record): whether a step-time error comes from the CPU a plan demands
of a machine's quota or from how the model schedules it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchlib import PROFILE_PROCESSES, machine_info, repo_relative, write_json

REPO = Path(__file__).resolve().parent.parent
BENCH_CLUSTER = {
    "name": "bench",
    "machines": [
        {"name": "m0", "workers": 2, "cpu": 0.7, "rate_mbit": 1000},
        {"name": "m1", "workers": 2, "cpu": 0.7, "rate_mbit": 1000},
        {"name": "slow", "workers": 2, "cpu": 0.3, "rate_mbit": 200},
    ],
}
MODELS = {"vgg": "vgg-mini", "transformer": "transformer-mini"}
BATCH, GROUPS = 48, 8  # BATCH: the global batch, raised to a multiple of the spec's devices (_batch)
# (figure, target, "min" or "max")
TARGETS: dict[str, tuple[float, str]] = {
    "vgg_general_vs_best_dp": (1.3, "min"),
    "executor_overhead": (1.05, "max"),
    "vgg_plan_vs_dp_allreduce": (1.3, "min"),
    "sim_abs_rel_error_mean": (0.10, "max"),
    "sim_abs_rel_error_max": (0.20, "max"),
}
# strategy -> the worker's runtime
STRATEGIES = {
    "best DP plan": "tagps",
    "general plan": "tagps",
    "executor overhead": "tagps",
    "DDP best subset": "ddp",
    "DP all-reduce": "ddp",
    "DP proportional": "tagps",
    "PS": "tagps",
}


def _machine() -> dict[str, Any]:
    return machine_info(cpu_key="cpu", kernel=platform.release())


def _batch(spec: Any) -> int:
    """:data:`BATCH` raised to a multiple of the spec's worker devices: DDP and Horovod give every rank the
    same share (48 samples over 5 devices cannot be split so, and those baselines would fail)."""
    devices = sum(m.workers for m in spec.machines)
    return -(-BATCH // devices) * devices


def _plans(
    model: str, topology: Any, cal: Any, search_iterations: int, prior: Any, batch: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The plans of :data:`STRATEGIES` for ``model`` on the measured ``topology``, and the calibrated
    prediction of DDP on every device-group subset that splits the batch evenly."""
    from tagps.cluster.experiment import ddp_plan, ddp_subset_plans
    from tagps.strategy.baselines import byteps_like, data_parallel_plan, proportional_shares
    from tagps.strategy.graph import model_graph
    from tagps.strategy.grouping import group_ops
    from tagps.strategy.mcts import SearchConfig, search, tune_partition
    from tagps.strategy.plan import CommSettings
    from tagps.strategy.simulator import Simulator

    graph = model_graph(model)
    grouping = group_ops(graph, GROUPS)
    measured = Simulator(graph, grouping, topology)
    calibrated = cal.simulator(graph, grouping, topology)

    def searched(data_parallel: bool, prior: Any) -> Any:
        config = SearchConfig(iterations=search_iterations, data_parallel=data_parallel, seed=0)
        found = search(calibrated, batch, config, model=prior)
        if found.plan is None:
            what = "data-parallel plan" if data_parallel else "plan"
            raise RuntimeError(f"the search found no feasible {what} for {model}")
        # The calibrated simulator's topology holds calibrated device speeds; jobs run on the measured one.
        return dataclasses.replace(found.plan, topology=topology)

    best_dp = searched(True, None)
    subsets = ddp_subset_plans(measured, batch)
    subset_times = [cal.evaluate(calibrated, p) for p in subsets]
    # The runtime overlaps every gradient's sync with backward and does not fuse: model the baselines so.
    overlapped = CommSettings(overlap=True)
    # At the partition size the calibrated simulator finds fastest for it, as BytePS users tune it.
    ps, _ = tune_partition(calibrated, dataclasses.replace(byteps_like(measured, batch), comm=overlapped))
    plans = {
        "best DP plan": best_dp,
        "general plan": searched(False, prior),
        "executor overhead": dataclasses.replace(best_dp, kind="general").validate(),
        "DDP best subset": subsets[subset_times.index(min(subset_times))],
        "DP all-reduce": ddp_plan(measured, batch),
        "DP proportional": data_parallel_plan(
            measured, batch, proportional_shares(calibrated, batch), comm=overlapped
        ),
        "PS": ps,
    }
    predictions = [
        {"devices": p.devices(), "predicted_s": t} for p, t in zip(subsets, subset_times, strict=True)
    ]
    return plans, predictions


def _describe(plan: Any) -> dict[str, Any]:
    from tagps.cluster.experiment import plan_layout

    syncs: dict[str, int] = {}
    for g in plan.gradients.values():
        syncs[g.sync] = syncs.get(g.sync, 0) + 1
    devices = plan.worker_devices()
    return {
        "kind": plan.kind,
        "devices": devices,
        "shares": [plan.batch_shares.get(d, 0) for d in devices],
        "layout": plan_layout(plan),
        "syncs": syncs,
        "ps_servers": list(plan.ps_servers),
    }


def _status(name: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    if name not in TARGETS:
        return "-"
    target, kind = TARGETS[name]
    ok = value >= target if kind == "min" else value <= target
    return "ok" if ok else "MISS"


def _table(
    runs: list[dict[str, Any]],
    figures: dict[str, float | None],
    skipped: dict[str, str],
    failed: list[dict[str, Any]],
) -> str:
    lines = [
        f"{'model':<17} {'strategy':<17} {'devices/shares':<28} {'measured ms':>11} {'predicted ms':>12} "
        f"{'error':>7} {'samples/s':>9} {'loss first->last':>17} {'CPU/rank ms meas/pred':>21}"
    ]
    for r in runs:
        shares = ",".join(str(s) for s in r["plan"]["shares"])
        measured_cpu, predicted_cpu = r["cpu_s_per_step"], r["predicted_cpu_s_per_step"]
        cpu = "-"
        if measured_cpu and predicted_cpu:
            cpu = f"{statistics.mean(measured_cpu.values()) * 1e3:.1f}/"
            cpu += f"{statistics.mean(predicted_cpu.values()) * 1e3:.1f}"
        lines.append(
            f"{r['model']:<17} {r['strategy']:<17} {shares:<28} {r['measured_s'] * 1e3:>11.1f} "
            f"{r['predicted_s'] * 1e3:>12.1f} {r['rel_error']:>+7.1%} {r['samples_per_s']:>9.1f} "
            f"{r['loss_first']:>8.3f}->{r['loss_last']:<7.3f} {cpu:>21}"
        )
    lines += [f"failed {f['model']} {f['strategy']} (round {f['round']}): see failed_runs" for f in failed]
    lines.append("")
    general = [r for r in runs if r["plan"]["kind"] == "general"]
    lines += [f"{r['model']} {r['strategy']}: {r['plan']['layout']}" for r in general]
    lines.append("")
    lines.append(f"{'figure':<42} {'value':>8} {'target':>8}  status")
    for name, value in figures.items():
        target = TARGETS.get(name)
        shown = "n/a" if value is None else f"{value:.3f}"
        bound = "" if target is None else f"{'>=' if target[1] == 'min' else '<='} {target[0]}"
        lines.append(f"{name:<42} {shown:>8} {bound:>8}  {_status(name, value)}")
    lines += [f"skipped {part}: {reason}" for part, reason in skipped.items()]
    return "\n".join(lines)


def _figures(runs: list[dict[str, Any]], predicted: dict[tuple[str, str], float]) -> dict[str, float | None]:
    """The figures from the runs that trained (a ratio is null when one of its runs failed)."""
    rate = {(r["model"], r["strategy"]): r["samples_per_s"] for r in runs}

    def ratio(model: str, a: str, b: str) -> float | None:
        return rate[(model, a)] / rate[(model, b)] if (model, a) in rate and (model, b) in rate else None

    figures: dict[str, float | None] = {}
    for key, model in MODELS.items():
        figures[f"{key}_general_vs_best_dp"] = ratio(model, "general plan", "best DP plan")
        figures[f"{key}_general_vs_best_dp_predicted"] = (
            predicted[(model, "best DP plan")] / predicted[(model, "general plan")]
        )
        figures[f"{key}_general_vs_ddp_best_subset"] = ratio(model, "general plan", "DDP best subset")
        # samples/s of the data-parallel path over the general executor's: its step time over theirs
        figures[f"{key}_executor_overhead"] = ratio(model, "best DP plan", "executor overhead")
    overheads = [figures[f"{key}_executor_overhead"] for key in MODELS]
    figures["executor_overhead"] = None if None in overheads else max(overheads)  # type: ignore[type-var]
    for key, model in MODELS.items():
        figures[f"{key}_plan_vs_dp_allreduce"] = ratio(model, "best DP plan", "DP all-reduce")
        figures[f"{key}_plan_vs_dp_proportional"] = ratio(model, "best DP plan", "DP proportional")
        figures[f"{key}_plan_vs_ps"] = ratio(model, "best DP plan", "PS")
        figures[f"{key}_plan_vs_horovod"] = ratio(model, "best DP plan", "Horovod")
        figures[f"{key}_general_vs_horovod"] = ratio(model, "general plan", "Horovod")
    for suffix, field in (
        ("", "rel_error"),
        ("_start_inputs", "rel_error_start_inputs"),
        ("_links_only", "rel_error_links_only"),
        ("_median_steps", "rel_error_median"),
    ):
        errors = [abs(r[field]) for r in runs if r["runtime"] != "horovod"]
        figures[f"sim_abs_rel_error_mean{suffix}"] = sum(errors) / len(errors) if errors else None
        figures[f"sim_abs_rel_error_max{suffix}"] = max(errors, default=None)
    # The CPU each tagps rank took per step against the simulator's compute CPU for it (signed: the part of
    # a rank's CPU the model leaves out, such as its collectives' threads, shows as a negative mean).
    cpu_errors = [
        r["predicted_cpu_s_per_step"][d] / seconds - 1
        for r in runs
        if r["runtime"] == "tagps"
        for d, seconds in r["cpu_s_per_step"].items()
        if seconds > 0 and d in r["predicted_cpu_s_per_step"]
    ]
    figures["sim_cpu_rel_error_mean"] = statistics.mean(cpu_errors) if cpu_errors else None
    figures["sim_cpu_abs_rel_error_max"] = max(map(abs, cpu_errors), default=None)
    return figures


def _profile(models: Sequence[str], folder: Path) -> dict[str, Any]:
    """Profile ``models`` on this host into ``folder``/profiles (:data:`PROFILE_PROCESSES` processes each)
    and return them by model; ``TAGPS_CACHE_DIR`` is left as it was."""
    from tagps.strategy.profiles import build_profile, profile_path

    profiles = {}
    cache = os.environ.get("TAGPS_CACHE_DIR")
    with tempfile.TemporaryDirectory() as scratch:  # profiling's op-time cache: not kept, never reused
        os.environ["TAGPS_CACHE_DIR"] = scratch
        try:
            for m in models:
                profiles[m] = build_profile(m, processes=PROFILE_PROCESSES)
                profiles[m].save(profile_path(m, "CPU", folder / "profiles"))
        finally:
            if cache is None:
                del os.environ["TAGPS_CACHE_DIR"]
            else:
                os.environ["TAGPS_CACHE_DIR"] = cache
    return profiles


def _median_inputs(
    topologies: Sequence[Any], profiles: dict[str, Sequence[Any]], folder: Path
) -> tuple[Any, dict[str, Any]]:
    """The median of several measurements of the simulator's inputs: of each device group's matmul rate and
    loopback bandwidth, each link's bandwidth and the latencies over ``topologies`` (one cluster), and of
    each model's ``profiles`` (:func:`~tagps.strategy.profiles.median_profile`, saved to
    ``folder``/profiles)."""
    from tagps.strategy.profiles import median_profile, profile_path

    first = topologies[0]

    def median(values: Any) -> float:
        return statistics.median(list(values))

    groups = tuple(
        dataclasses.replace(
            g,
            intra_bandwidth_gbps=median(t.groups[i].intra_bandwidth_gbps for t in topologies),
            peak_flops=median(t.groups[i].peak_flops for t in topologies),
        )
        if not g.server_only
        else g
        for i, g in enumerate(first.groups)
    )
    links = tuple(
        dataclasses.replace(ln, bandwidth_gbps=median(t.links[i].bandwidth_gbps for t in topologies))
        for i, ln in enumerate(first.links)
    )
    topology = dataclasses.replace(
        first,
        groups=groups,
        links=links,
        inter_bandwidth_gbps=median(t.inter_bandwidth_gbps for t in topologies),
        intra_latency_s=median(t.intra_latency_s for t in topologies),
        inter_latency_s=median(t.inter_latency_s for t in topologies),
    )
    medians = {m: median_profile(ps) for m, ps in profiles.items()}
    for m, p in medians.items():
        p.save(profile_path(m, "CPU", folder / "profiles"))
    return topology, medians


def _inputs_read(topology: Any, profiles: dict[str, Any]) -> dict[str, Any]:
    """What one measurement of the simulator's inputs read: each profile's whole step at its largest batch
    (forward, backward and Adam) and each worker machine's per-device matmul rate."""
    return {
        "profile_step_s": {
            m: p.whole.fwd_s[-1] + p.whole.bwd_s[-1] + p.whole.apply_s["adam"] for m, p in profiles.items()
        },
        "peak_flops": {g.name: g.peak_flops for g in topology.groups if not g.server_only},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, write the JSON, print the table; return 0 (misses are reported, not errors)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of 10 steps, quick calibration")
    parser.add_argument("--cluster", type=Path, help="cluster spec (YAML/JSON); default: the built-in one")
    parser.add_argument(
        "--out", type=Path, help="result JSON (default: bench/results/e2e_cluster.json, or with --cluster "
        "e2e_cluster-<spec name>.json)"
    )  # fmt: skip
    args = parser.parse_args(argv)

    from tagps.calibrate import CALIBRATION_MODELS, calibrate_stages
    from tagps.cluster import ClusterError, check_support
    from tagps.cluster.experiment import MEASURED_STEP, Executor, run_plan
    from tagps.cluster.run import up
    from tagps.cluster.spec import load_spec
    from tagps.strategy.gnn import DEFAULT_WEIGHTS, load_prior
    from tagps.strategy.graph import model_graph
    from tagps.strategy.grouping import group_ops

    try:
        spec = load_spec(BENCH_CLUSTER if args.cluster is None else args.cluster)
        check_support()
    except (ValueError, ClusterError) as exc:
        print(f"bench/e2e_cluster.py: {exc}", file=sys.stderr)
        return 1
    name = "e2e_cluster.json" if args.cluster is None else f"e2e_cluster-{spec.name}.json"
    out = args.out or REPO / "bench" / "results" / name
    rounds, steps = (1, 10) if args.quick else (2, 20)
    batch = _batch(spec)
    started, load_before = time.monotonic(), os.getloadavg()
    plans_dir = out.parent / f"{out.stem}-plans"
    plans_dir.mkdir(parents=True, exist_ok=True)
    # Op profiles of this host, for the calibration's models and the benchmark's: the shipped ones come from
    # another host, whose CPU runs convolutions and optimizer steps at other ratios to its matmul rate.
    # Written beside the plans (TAGPS_CACHE_DIR=<plans>: bench/repredict.py finds them there).
    profiled = (*CALIBRATION_MODELS, *MODELS.values())
    print(f"profiling {', '.join(profiled)} on this host ...", flush=True)
    cache = repo_relative(plans_dir)
    commands = [f"TAGPS_CACHE_DIR={cache} {sys.executable} -m tagps.cli profile --model {m} "
                f"--processes {PROFILE_PROCESSES}"
                for m in profiled]  # fmt: skip
    start_profiles = _profile(profiled, plans_dir)
    os.environ["TAGPS_CACHE_DIR"] = str(plans_dir)
    commands.append(f"TAGPS_CACHE_DIR={cache} {sys.executable} -m tagps.calibrate"
                    f"{' --quick' if args.quick else ''}")  # fmt: skip
    print("calibrating the simulator on this host ...", flush=True)
    stages = calibrate_stages(quick=args.quick, log=lambda line: print("  " + line, flush=True))
    cal = stages["jobs"]  # what `python -m tagps.calibrate` writes; "links" is reported beside it
    prior = load_prior(DEFAULT_WEIGHTS)  # the GNN prior `tagps plan` searches with by default
    skipped: dict[str, str] = {}
    strategies = dict(STRATEGIES)
    if importlib.util.find_spec("horovod") is None:
        skipped["Horovod"] = "horovod.torch does not import (make bench-deps builds it)"
    else:
        strategies["Horovod"] = "horovod"
    exit_failures: list[dict[str, Any]] = []  # jobs that failed after rank 0 wrote its result
    failed: dict[tuple[str, str], dict[str, Any]] = {}  # jobs that failed before it: no measurement
    spec_file = args.cluster
    if spec_file is None:  # the commands below name a file: write the built-in spec beside the plans
        spec_file = plans_dir / "cluster.json"
        write_json(spec_file, spec.to_dict())
    with up(spec) as cluster:
        executor = Executor(cluster.topology(), cluster)
        print(executor.topology.describe(), flush=True)
        plans: dict[str, dict[str, Any]] = {}
        ddp_subsets: dict[str, list[dict[str, Any]]] = {}
        job_commands: dict[tuple[str, str], str] = {}
        for key, model in MODELS.items():
            iterations = 100 if args.quick else 300
            plans[key], ddp_subsets[model] = _plans(model, executor.topology, cal, iterations, prior, batch)
            if "Horovod" in strategies:
                plans[key]["Horovod"] = plans[key]["DP all-reduce"]
            for name, runtime in strategies.items():
                path = plans_dir / f"{key}-{name.lower().replace(' ', '-')}.json"
                plans[key][name].save(path)
                plan_file = repo_relative(path)
                worker = [sys.executable, "-m", "tagps.cluster.worker", "--model", model, "--plan", plan_file,
                          "--runtime", runtime, "--steps", str(steps), "--warmup", "3"]  # fmt: skip
                # --plan: the plan's devices and servers, not every device of the spec
                spec_shown = repo_relative(spec_file)
                job = f"tagps cluster run --plan {plan_file} {spec_shown} -- {shlex.join(worker)}"
                job_commands[(key, name)] = job
                commands.append(job_commands[(key, name)])
        best: dict[tuple[str, str], dict[str, Any]] = {}
        best_round: dict[tuple[str, str], int] = {}
        # Each round re-measures the simulator's inputs before it (the two models' op profiles and the
        # topology). One measurement is a draw: the 0.7-core machines' matmul rate read 31-36 GFLOP/s across
        # three topologies of one run, their loopback 15-19 Gbit/s. Runs are predicted from the median of
        # every measurement, start included (_median_inputs), and also from the inputs of the search.
        round_inputs: list[tuple[Any, dict[str, Any]]] = []
        for rnd in range(rounds):
            print(f"round {rnd}: re-measuring the op profiles and the topology ...", flush=True)
            round_profiles = _profile(list(MODELS.values()), plans_dir / f"round-{rnd}")
            round_inputs.append((cluster.topology(), round_profiles))
            for key, model in MODELS.items():
                for name, runtime in strategies.items():
                    if (key, name) in failed:
                        continue  # the same job again would fail the same way
                    try:
                        result = run_plan(executor, model, plans[key][name], runtime, steps=steps, warmup=3)
                    except RuntimeError as exc:
                        failed[(key, name)] = {
                            "round": rnd,
                            "model": model,
                            "strategy": name,
                            "command": job_commands[(key, name)],
                            "error": str(exc),
                        }
                        print(f"round {rnd}: {model:<17} {name:<17} FAILED: {str(exc).splitlines()[0]}")
                        continue
                    if result["job_status"] != 0:
                        exit_failures.append(
                            {"round": rnd, "model": model, "strategy": name, "status": result["job_status"],
                             "output_tail": result["job_error"][-1500:]}
                        )  # fmt: skip
                    print(
                        f"round {rnd}: {model:<17} {name:<17} {result[MEASURED_STEP] * 1e3:8.1f} ms/step",
                        flush=True,
                    )
                    held = best.get((key, name))
                    if held is None or result[MEASURED_STEP] < held[MEASURED_STEP]:
                        best[(key, name)] = result
                        best_round[(key, name)] = rnd
        runs: list[dict[str, Any]] = []
        predicted: dict[tuple[str, str], float] = {}
        median_topology, median_profiles = _median_inputs(
            [executor.topology, *(t for t, _ in round_inputs)],
            {m: [start_profiles[m], *(r[m] for _, r in round_inputs)] for m in MODELS.values()},
            plans_dir / "median",
        )
        for key, model in MODELS.items():
            graph = model_graph(model)
            grouping = group_ops(graph, GROUPS)
            for name in strategies:
                plan = plans[key][name]
                predicted[(model, name)] = cal.evaluate(
                    cal.simulator(graph, grouping, executor.topology), plan
                )  # the inputs the plans were searched with
                if (key, name) not in best:
                    continue
                result = best[(key, name)]
                measured, median = result[MEASURED_STEP], result["median_step_s"]
                median_cpu = {"CPU": median_profiles[model]}
                sim = cal.simulator(graph, grouping, median_topology, profiles=median_cpu)
                simulated = cal.simulate(sim, plan)
                now = simulated.iteration_time
                links = stages["links"]
                links_predicted = links.evaluate(
                    links.simulator(graph, grouping, median_topology, profiles=median_cpu), plan
                )
                runs.append(
                    {
                        "model": model,
                        "strategy": name,
                        "runtime": result["runtime"],
                        "command": job_commands[(key, name)],
                        "plan": _describe(plan),
                        "measured_s": measured,
                        "round": best_round[(key, name)],
                        "predicted_s": now,
                        "rel_error": now / measured - 1,
                        "median_s": median,
                        "rel_error_median": now / median - 1,
                        "predicted_start_inputs_s": predicted[(model, name)],
                        "rel_error_start_inputs": predicted[(model, name)] / measured - 1,
                        "predicted_links_only_s": links_predicted,
                        "rel_error_links_only": links_predicted / measured - 1,
                        "samples_per_s": batch / measured,
                        "step_times_s": result["step_times_s"],
                        # Per rank: its process's CPU seconds per step, and the simulator's compute CPU.
                        "cpu_s_per_step": result.get("cpu_s_per_step", {}),
                        "page_faults_per_step": result.get("page_faults_per_step", {}),
                        "predicted_cpu_s_per_step": simulated.cpu_seconds,
                        "loss_first": result["losses"][0],
                        "loss_last": result["losses"][-1],
                        "job_status": result["job_status"],
                        "job_error": result.get("job_error", ""),
                    }
                )
        topology = executor.topology.to_dict()
        inputs = [
            {
                "round": rnd,
                "profiles": repo_relative(plans_dir / f"round-{rnd}" / "profiles"),
                **_inputs_read(topo, round_profiles),
                "topology": topo.to_dict(),
            }
            for rnd, (topo, round_profiles) in enumerate(round_inputs)
        ]
        start_inputs = _inputs_read(executor.topology, {m: start_profiles[m] for m in MODELS.values()})
        median_inputs = {
            "profiles": repo_relative(plans_dir / "median" / "profiles"),
            **_inputs_read(median_topology, median_profiles),
            "topology": median_topology.to_dict(),
        }
    figures = _figures(runs, predicted)
    failed_runs = list(failed.values())
    result = {
        # Other jobs on the machine skew every figure; the 1-minute load average says how busy it was.
        "machine": {**_machine(), "load_average_1min": {"start": load_before[0], "end": os.getloadavg()[0]}},
        "quick": args.quick,
        "cluster": spec.to_dict(),
        "cluster_file": repo_relative(spec_file),
        "topology_measured": topology,
        "start_inputs": start_inputs,
        "round_inputs": inputs,
        "median_inputs": median_inputs,
        "calibration": cal.to_dict(),
        "calibration_links_only": stages["links"].to_dict(),
        "rounds": rounds,
        "steps": steps,
        "batch_size": batch,
        "commands": commands,
        "figures": figures,
        "targets": {k: {"min" if kind == "min" else "max": v} for k, (v, kind) in TARGETS.items()},
        "runs": runs,
        "ddp_subsets_predicted": ddp_subsets,
        "failed_runs": failed_runs,
        "exit_failures": exit_failures,
        "skipped": skipped,
        "seconds": time.monotonic() - started,
    }
    write_json(out, result)
    print(_table(runs, figures, skipped, failed_runs))
    for f in exit_failures:
        print(
            f"note: round {f['round']} {f['model']} {f['strategy']}: a process failed with status "
            f"{f['status']} after the measurement (while leaving the job); see exit_failures in the JSON"
        )
    print(f"wrote {out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
