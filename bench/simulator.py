"""Benchmark the TAG simulator: strategies evaluated per second, and the baselines' simulated times.

Usage: python bench/simulator.py [--quick] [--out FILE]

Prints a table and writes JSON (default bench/results/simulator.json) with a ``machine`` object, the
``commands`` that produced it, the ``figures`` and their ``targets``:

- sim_evals_per_s_vgg19_testbed, sim_evals_per_s_bert_testbed: plans simulated per second on
  paper-testbed with (up to) 60 op groups, with op profiles in use for every device type (made from the
  roofline, as no V100 is at hand to measure; the evaluation path is the profile's), over a stream of
  distinct tree-search-like partial plans (the first d groups, d uniform, get a random device subset and
  option in {allreduce, ps, mp}; the others copy group 0) after a warm-up of 50 other plans; the best of
  3 passes over the stream, so a noisy neighbour does not count. ``*_cold`` figures time the first pass;
  ``*_random`` ones fully random plans (every group its own placement, options including duplicate, 10%
  SFB gradients); ``sim_evals_per_cpu_s_*`` divide by this process's CPU time instead of the wall clock
  (robust to other jobs on the machine); ``*_roofline`` ones cost compute with the roofline instead.
- iter_ms_<model>_<baseline>: simulated iteration time of each baseline (dp-nccl, dp-nccl-p,
  horovod-like, byteps-like) for each reference model at its default batch size on paper-testbed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from benchlib import command_line, machine_info, write_json

from tagps.models import MODELS, default_batch_size
from tagps.strategy.baselines import BASELINES, random_plan
from tagps.strategy.plan import Plan
from tagps.strategy.profiles import ModelTimes, Profile
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import paper_testbed

TARGETS = {"sim_evals_per_s_vgg19_testbed": 1000.0, "sim_evals_per_s_bert_testbed": 200.0}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "simulator.json"
SEARCH_OPTIONS = ("allreduce", "ps", "mp")
PROFILE_BATCHES = (1, 8, 32)


def _rate(sim: Simulator, plans: list[Plan], passes: int) -> tuple[float, float, float]:
    """Evaluations per second: first pass and best pass by the wall clock, best pass by CPU time."""
    rates, cpu_rates = [], []
    for _ in range(passes):
        start, cpu = time.perf_counter(), time.process_time()
        for plan in plans:
            sim.evaluate(plan)
        rates.append(len(plans) / (time.perf_counter() - start))
        cpu_rates.append(len(plans) / max(time.process_time() - cpu, 1e-9))
    return rates[0], max(rates), max(cpu_rates)


def roofline_profiles(sim: Simulator) -> dict[str, Profile]:
    """Profiles of ``sim``'s model for each device type of its topology, from the roofline's op times."""
    profiles: dict[str, Profile] = {}
    for dtype in sim.dtypes:
        if dtype.name not in profiles:
            times = {
                b: {op.name: sim.ops_time((i,), dtype, float(b)) for i, op in enumerate(sim.graph.ops)}
                for b in PROFILE_BATCHES
            }
            whole = ModelTimes(  # the ops' own sums: profiles that leave the roofline's times as they are
                tuple(sum(f for f, _ in times[b].values()) for b in PROFILE_BATCHES),
                tuple(sum(w for _, w in times[b].values()) for b in PROFILE_BATCHES),
                {},
                sim.graph.param_bytes,
            )
            profiles[dtype.name] = Profile.from_times(sim.graph, dtype.name, PROFILE_BATCHES, times, whole)
    return profiles


def bench_rate(model: str, count: int, seed: int = 0, profiled: bool = True) -> dict[str, float]:
    """Evaluation rates of ``model`` on paper-testbed (see the module docstring)."""
    start = time.perf_counter()
    sim = Simulator.for_model(model, paper_testbed())
    if profiled:
        sim = Simulator(sim.graph, sim.grouping, sim.topology, profiles=roofline_profiles(sim))
        if set(sim.compute_sources.values()) != {"profile"}:
            raise RuntimeError(f"profiles not in use: {sim.compute_sources}")
    setup = time.perf_counter() - start
    batch = default_batch_size(model)
    rng = random.Random(seed)
    ngroups = len(sim.groups)

    def search_like() -> Plan:
        return random_plan(sim, batch, rng, SEARCH_OPTIONS, sfb_fraction=0.0, decided=rng.randint(0, ngroups))

    for plan in [search_like() for _ in range(50)]:
        sim.evaluate(plan)
    cold, best, cpu = _rate(sim, [search_like() for _ in range(count)], 3)
    cold_random, best_random, cpu_random = _rate(sim, [random_plan(sim, batch, rng) for _ in range(count)], 3)
    return {
        "groups": ngroups,
        "setup_seconds": setup,
        "cold": cold,
        "best": best,
        "cpu": cpu,
        "random_cold": cold_random,
        "random_best": best_random,
        "random_cpu": cpu_random,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer plans (under a minute)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    count = 60 if args.quick else 200
    start = time.perf_counter()
    rates = {
        "vgg19": bench_rate("vgg19", count),
        "bert": bench_rate("bert-large", count),
        "vgg19_roofline": bench_rate("vgg19", count, profiled=False),
    }
    figures: dict[str, float] = {}
    for key, r in rates.items():
        name, _, source = key.partition("_")
        suffix = f"_{source}" if source else ""
        figures[f"sim_evals_per_s_{name}_testbed{suffix}"] = r["best"]
        figures[f"sim_evals_per_s_{name}_testbed{suffix}_cold"] = r["cold"]
        figures[f"sim_evals_per_s_{name}_testbed{suffix}_random"] = r["random_best"]
        figures[f"sim_evals_per_cpu_s_{name}_testbed{suffix}"] = r["cpu"]
    times: dict[str, dict[str, float]] = {}
    for model in MODELS:
        sim = Simulator.for_model(model, paper_testbed())
        batch = default_batch_size(model)
        times[model] = {}
        for name, baseline in BASELINES.items():
            result = sim.evaluate(baseline(sim, batch))
            times[model][name] = result.iteration_time * 1e3
            figures[f"iter_ms_{model}_{name}"] = result.iteration_time * 1e3
            if not result.feasible:
                figures[f"oom_{model}_{name}"] = 1.0
    result = {
        "machine": machine_info(),
        "commands": {"run": command_line()},
        "quick": args.quick,
        "plans_per_pass": count,
        "seconds": round(time.perf_counter() - start, 1),
        "measurements": rates,
        "figures": figures,
        "targets": TARGETS,
        "met": {k: figures[k] >= v for k, v in TARGETS.items()},
    }
    write_json(args.out, result)

    header = ("model", "groups", "setup s", "cold/s", "best/s", "cpu/s", "random/s")
    print(f"{header[0]:14s} " + " ".join(f"{h:>8s}" for h in header[1:]))
    for key, r in rates.items():
        print(
            f"{key:14s} {r['groups']:8d} {r['setup_seconds']:8.2f} {r['cold']:8.0f} {r['best']:8.0f} "
            f"{r['cpu']:8.0f} {r['random_best']:8.0f}"
        )
    names = list(BASELINES)
    print(
        f"\nsimulated iteration time on paper-testbed (ms)\n{'model':17s} {'batch':>5s} "
        + " ".join(f"{n:>13s}" for n in names)
    )
    for model, row in times.items():
        print(f"{model:17s} {default_batch_size(model):5d} " + " ".join(f"{row[n]:13.1f}" for n in names))
    print(f"\n{'figure':34s} {'value':>8s} {'target':>8s}  met")
    for key, target in TARGETS.items():
        print(f"{key:34s} {figures[key]:8.0f} {target:8.0f}  {'yes' if figures[key] >= target else 'NO'}")
    print(f"\nwrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
