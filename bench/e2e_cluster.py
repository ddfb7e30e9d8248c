"""End-to-end on an emulated heterogeneous cluster: tagps plans vs the baselines, measured and predicted.

Usage: python bench/e2e_cluster.py [--quick] [--out FILE]        (needs root: namespaces, tc, cgroups)

The cluster (:data:`BENCH_CLUSTER`): two machines with 2 devices each on 1 Gbit/s links and 0.7 cores
each, one slower machine with 2 devices on 200 Mbit/s and 0.3 cores (every device is one worker process
with one thread; a machine's quota is shared by what it runs). For ``vgg-mini`` (VGG-style: 3x3 convs and
a wide FC classifier, 3.3M parameters) and ``transformer-mini`` (2-layer causal Transformer LM, 0.7M
parameters), each at a global batch of 48, it trains with

- **tagps plan**: MCTS restricted to data-parallel plans (what the runtime executes), on the simulator
  calibrated for this host (``python -m tagps.calibrate``: a calibration set of other models and another
  emulated cluster), executed by ``tagps.torch``;
- **DP all-reduce**: ``torch.nn.parallel.DistributedDataParallel`` over gloo, even shares, every device;
- **DP proportional**: tagps all-reduce with batch shares proportional to device speed (DP-NCCL-P);
- **PS**: tagps with every gradient through a summation server, one per machine (BytePS-like);
- **Horovod** (gloo) when ``horovod.torch`` imports (it is not built here: skipped, said in the JSON);

and records, per run, the median step time of the best of the interleaved rounds (the machine is shared;
the least disturbed round is the fairest) and the calibrated simulator's prediction for the same plan.

JSON figures (targets in ``TARGETS``): ``vgg_plan_vs_dp_allreduce``, ``transformer_plan_vs_dp_allreduce``
(samples/s ratio, target >= 1.3 for VGG), ``*_plan_vs_dp_proportional``, ``*_plan_vs_ps``, and
``sim_abs_rel_error_mean`` / ``sim_abs_rel_error_max`` over every run (targets <= 0.10 / <= 0.20), with
the calibration that ``python -m tagps.calibrate`` writes (fitted on whole jobs too); the same two with the
calibration before that last fit (link micro-benchmarks only) are reported as ``*_links_only``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchlib import machine_info, write_json

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
BATCH, GROUPS = 48, 8
# (figure, target, "min" or "max")
TARGETS: dict[str, tuple[float, str]] = {
    "vgg_plan_vs_dp_allreduce": (1.3, "min"),
    "sim_abs_rel_error_mean": (0.10, "max"),
    "sim_abs_rel_error_max": (0.20, "max"),
}
STRATEGIES = ("tagps plan", "DP all-reduce", "DP proportional", "PS")


def _machine() -> dict[str, Any]:
    return machine_info(cpu_key="cpu", kernel=platform.release())


def _plans(model: str, executor: Any, cal: Any, search_iterations: int) -> dict[str, Any]:
    """The four plans for ``model`` on the executor's measured topology."""
    from tagps.cluster.experiment import ddp_plan
    from tagps.strategy.baselines import byteps_like, data_parallel_plan, proportional_shares
    from tagps.strategy.graph import model_graph
    from tagps.strategy.grouping import group_ops
    from tagps.strategy.mcts import SearchConfig, search
    from tagps.strategy.plan import CommSettings
    from tagps.strategy.simulator import Simulator

    graph = model_graph(model)
    grouping = group_ops(graph, GROUPS)
    measured = Simulator(graph, grouping, executor.topology)
    calibrated = cal.simulator(graph, grouping, executor.topology)
    found = search(calibrated, BATCH, SearchConfig(iterations=search_iterations, data_parallel=True, seed=0))
    if found.plan is None:
        raise RuntimeError(f"the search found no feasible data-parallel plan for {model}")
    # The runtime overlaps every gradient's sync with backward and does not fuse: model the baselines so.
    overlapped = CommSettings(overlap=True)
    plans = {
        "tagps plan": dataclasses.replace(found.plan, topology=executor.topology),
        "DP all-reduce": ddp_plan(measured, BATCH),
        "DP proportional": data_parallel_plan(
            measured, BATCH, proportional_shares(calibrated, BATCH), comm=overlapped
        ),
        "PS": dataclasses.replace(byteps_like(measured, BATCH), comm=overlapped),
    }
    return plans


def _describe(plan: Any) -> dict[str, Any]:
    syncs: dict[str, int] = {}
    for g in plan.gradients.values():
        syncs[g.sync] = syncs.get(g.sync, 0) + 1
    return {
        "devices": plan.devices(),
        "shares": [plan.batch_shares[d] for d in plan.devices()],
        "syncs": syncs,
        "ps_servers": list(plan.ps_servers),
    }


def _status(name: str, value: float | None) -> str:
    if value is None:
        return "skipped"
    if name not in TARGETS:
        return "-"
    target, kind = TARGETS[name]
    ok = value >= target if kind == "min" else value <= target
    return "ok" if ok else "MISS"


def _table(runs: list[dict[str, Any]], figures: dict[str, float | None], skipped: dict[str, str]) -> str:
    lines = [
        f"{'model':<17} {'strategy':<16} {'devices/shares':<28} {'measured ms':>11} {'predicted ms':>12} "
        f"{'error':>7} {'samples/s':>9} {'loss first->last':>17}"
    ]
    for r in runs:
        shares = ",".join(str(s) for s in r["plan"]["shares"])
        lines.append(
            f"{r['model']:<17} {r['strategy']:<16} {shares:<28} {r['measured_s'] * 1e3:>11.1f} "
            f"{r['predicted_s'] * 1e3:>12.1f} {r['rel_error']:>+7.1%} {r['samples_per_s']:>9.1f} "
            f"{r['loss_first']:>8.3f}->{r['loss_last']:<7.3f}"
        )
    lines.append("")
    lines.append(f"{'figure':<36} {'value':>8} {'target':>8}  status")
    for name, value in figures.items():
        target = TARGETS.get(name)
        shown = "n/a" if value is None else f"{value:.3f}"
        bound = "" if target is None else f"{'>=' if target[1] == 'min' else '<='} {target[0]}"
        lines.append(f"{name:<36} {shown:>8} {bound:>8}  {_status(name, value)}")
    lines += [f"skipped {part}: {reason}" for part, reason in skipped.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, write the JSON, print the table; return 0 (misses are reported, not errors)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of 10 steps, quick calibration")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "e2e_cluster.json")
    args = parser.parse_args(argv)

    from tagps.calibrate import calibrate_stages
    from tagps.cluster import ClusterError, check_support
    from tagps.cluster.experiment import Executor, run_plan
    from tagps.cluster.run import up
    from tagps.strategy.graph import model_graph
    from tagps.strategy.grouping import group_ops

    try:
        check_support()
    except ClusterError as exc:
        print(f"bench/e2e_cluster.py needs an emulated cluster: {exc}", file=sys.stderr)
        return 1
    rounds, steps = (1, 10) if args.quick else (2, 20)
    started, load_before = time.monotonic(), os.getloadavg()
    commands = [f"{sys.executable} -m tagps.calibrate{' --quick' if args.quick else ''}"]
    print("calibrating the simulator on this host ...", flush=True)
    stages = calibrate_stages(quick=args.quick, log=lambda line: print("  " + line, flush=True))
    cal = stages["jobs"]  # what `python -m tagps.calibrate` writes; "links" is reported beside it
    skipped: dict[str, str] = {}
    if importlib.util.find_spec("horovod") is None:
        skipped["Horovod"] = "horovod is not installed (horovod.torch does not import)"
    else:
        skipped["Horovod"] = "horovod is installed, but this benchmark does not launch horovodrun yet"
    runs: list[dict[str, Any]] = []
    exit_failures: list[dict[str, Any]] = []  # jobs that failed after rank 0 wrote its result
    plans_dir = args.out.parent / f"{args.out.stem}-plans"
    plans_dir.mkdir(parents=True, exist_ok=True)
    with up(BENCH_CLUSTER) as cluster:
        executor = Executor(cluster.topology(), cluster)
        print(executor.topology.describe(), flush=True)
        plans: dict[str, dict[str, Any]] = {}
        for key, model in MODELS.items():
            plans[key] = _plans(model, executor, cal, 100 if args.quick else 300)
        best: dict[tuple[str, str], dict[str, Any]] = {}
        for rnd in range(rounds):
            for key, model in MODELS.items():
                for name in STRATEGIES:
                    plan = plans[key][name]
                    runtime = "ddp" if name == "DP all-reduce" else "tagps"
                    result = run_plan(executor, model, plan, runtime, steps=steps, warmup=3)
                    if result["job_status"] != 0:
                        exit_failures.append(
                            {"round": rnd, "model": model, "strategy": name, "status": result["job_status"],
                             "output_tail": result["job_error"][-1500:]}
                        )  # fmt: skip
                    print(
                        f"round {rnd}: {model:<17} {name:<16} {result['median_step_s'] * 1e3:8.1f} ms/step",
                        flush=True,
                    )
                    held = best.get((key, name))
                    if held is None or result["median_step_s"] < held["median_step_s"]:
                        best[(key, name)] = result
                    if rnd == 0:
                        path = plans_dir / f"{key}-{name.lower().replace(' ', '-')}.json"
                        plan.save(path)
                        worker = [sys.executable, "-m", "tagps.cluster.worker", "--model", model, "--plan",
                                  str(path), "--runtime", runtime, "--steps", str(steps), "--warmup", "3"]
                        commands.append(f"tagps cluster run bench.yaml -- {shlex.join(worker)}")
        for key, model in MODELS.items():
            for name in STRATEGIES:
                result, plan = best[(key, name)], plans[key][name]
                graph = model_graph(model)
                grouping = group_ops(graph, GROUPS)
                predicted, links_predicted = (
                    c.evaluate(c.simulator(graph, grouping, executor.topology), plan)
                    for c in (cal, stages["links"])
                )
                measured = result["median_step_s"]
                runs.append(
                    {
                        "model": model,
                        "strategy": name,
                        "runtime": result["runtime"],
                        "plan": _describe(plan),
                        "measured_s": measured,
                        "predicted_s": predicted,
                        "rel_error": predicted / measured - 1,
                        "predicted_links_only_s": links_predicted,
                        "rel_error_links_only": links_predicted / measured - 1,
                        "samples_per_s": BATCH / measured,
                        "step_times_s": result["step_times_s"],
                        "loss_first": result["losses"][0],
                        "loss_last": result["losses"][-1],
                        "job_status": result["job_status"],
                        "job_error": result.get("job_error", ""),
                    }
                )
        topology = executor.topology.to_dict()
    rate = {(r["model"], r["strategy"]): r["samples_per_s"] for r in runs}
    figures: dict[str, float | None] = {}
    for key, model in MODELS.items():
        plan_rate = rate[(model, "tagps plan")]
        figures[f"{key}_plan_vs_dp_allreduce"] = plan_rate / rate[(model, "DP all-reduce")]
        figures[f"{key}_plan_vs_dp_proportional"] = plan_rate / rate[(model, "DP proportional")]
        figures[f"{key}_plan_vs_ps"] = plan_rate / rate[(model, "PS")]
        figures[f"{key}_plan_vs_horovod"] = None
    errors = [abs(r["rel_error"]) for r in runs]
    figures["sim_abs_rel_error_mean"] = sum(errors) / len(errors)
    figures["sim_abs_rel_error_max"] = max(errors)
    # The same with the calibration before its fit on whole jobs (link micro-benchmarks only).
    links = [abs(r["rel_error_links_only"]) for r in runs]
    figures["sim_abs_rel_error_mean_links_only"] = sum(links) / len(links)
    figures["sim_abs_rel_error_max_links_only"] = max(links)
    result = {
        # Other jobs on the machine skew every figure; the 1-minute load average says how busy it was.
        "machine": {**_machine(), "load_average_1min": {"start": load_before[0], "end": os.getloadavg()[0]}},
        "quick": args.quick,
        "cluster": BENCH_CLUSTER,
        "topology_measured": topology,
        "calibration": cal.to_dict(),
        "calibration_links_only": stages["links"].to_dict(),
        "rounds": rounds,
        "steps": steps,
        "batch_size": BATCH,
        "commands": commands,
        "figures": figures,
        "targets": {k: {"min" if kind == "min" else "max": v} for k, (v, kind) in TARGETS.items()},
        "runs": runs,
        "exit_failures": exit_failures,
        "skipped": skipped,
        "seconds": time.monotonic() - started,
    }
    write_json(args.out, result)
    print(_table(runs, figures, skipped))
    for f in exit_failures:
        print(f"note: round {f['round']} {f['model']} {f['strategy']}: a process failed with status "
              f"{f['status']} after the measurement (while leaving the job); see exit_failures in the JSON")
    print(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
