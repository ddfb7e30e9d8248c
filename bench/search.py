"""Benchmark the strategy creator: predicted speed-ups, search wall time, and the GNN's generality.

Usage: python bench/search.py [--quick] [--out FILE]

Prints a table and writes JSON (default bench/results/search.json) with ``machine``, ``commands``,
``figures``, ``targets`` and ``misses``:

- per reference model and preset (paper-testbed, paper-cloud): the plan's predicted iteration time, its
  speed-up over each baseline (``speedup_<model>_<preset>_<baseline>``) and the search's wall time; the
  search uses the shipped GNN prior and a fixed iteration budget (seeded, so the plans are reproducible);
- ``geomean_speedup_vs_dpnccl_testbed`` and ``vgg19_speedup_vs_dpnccl_testbed``;
- ``plan_seconds_max``: the longest of those searches (target: 120 s on this machine);
- the TAG paper's generality study: on seeded random topologies (100; 20 with --quick), each searched
  for one reference model (in turn), the mean number of MCTS iterations until the best plan beats
  DP-NCCL, with the GNN prior (``iters_to_beat_dp_gnn``) and with a uniform prior
  (``iters_to_beat_dp_uniform``); a search that never beats it within the cap counts as cap + 1, and a
  topology where neither prior beats it (nothing fits in memory) is left out (counted in
  ``generality_topologies_left_out``);
- hold-out (full mode only): a GNN trained without VGG19 (``python -m tagps.strategy.train --exclude
  vgg19`` with a short budget), measured the same way on VGG19 (``holdout_vgg19_iters_gnn`` /
  ``holdout_vgg19_iters_uniform``).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch
from benchlib import machine_info, write_json

from tagps.models import default_batch_size
from tagps.strategy.gnn import GNNPrior, load_prior
from tagps.strategy.graph import model_graph
from tagps.strategy.grouping import group_ops
from tagps.strategy.mcts import SearchConfig, search
from tagps.strategy.planner import plan_model
from tagps.strategy.report import baseline_times
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import PRESETS, random_topology
from tagps.strategy.train import REFERENCE_MODELS, TrainConfig, train

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "search.json"
TARGETS = {
    "geomean_speedup_vs_dpnccl_testbed": (">=", 1.3),
    "vgg19_speedup_vs_dpnccl_testbed": (">=", 2.0),
    "plan_seconds_max": ("<=", 120.0),
    "gnn_over_uniform_iters": ("<=", 1 / 3),
}


def machine() -> dict[str, object]:
    """CPU model, core count, Python and torch versions."""
    return machine_info()


def presets(prior: GNNPrior, iterations: int, models: list[str], figures: dict[str, float]) -> list[str]:
    """Plan every model on both presets; fill ``figures``; return table rows."""
    rows = []
    for preset in PRESETS:
        for model in models:
            topo = PRESETS[preset]()
            batch = default_batch_size(model)
            config = SearchConfig(iterations=iterations, seed=0)
            start = time.perf_counter()
            result, sim = plan_model(model, topo, batch, config, prior)
            wall = time.perf_counter() - start
            key = f"{model}_{preset}"
            figures[f"plan_seconds_{key}"] = round(wall, 2)
            if result.plan is None:
                rows.append(f"{model:<12} {preset:<14} no feasible plan")
                continue
            t = result.time_s
            figures[f"iter_ms_{key}"] = round(t * 1e3, 3)
            cells = []
            for name, base in baseline_times(sim, batch).items():
                speedup = base.iteration_time / t
                figures[f"speedup_{key}_{name}"] = round(speedup, 4)
                cells.append(f"{speedup:>8.2f}")
            rows.append(f"{model:<12} {preset:<14} {t * 1e3:>9.1f} " + " ".join(cells) + f" {wall:>8.1f}")
    return rows


def iterations_to_beat(
    prior: GNNPrior | None, models: list[str], seeds: range, cap: int, groups: int
) -> list[int | None]:
    """Per random topology, the iteration whose best plan first beat DP-NCCL (None: not within ``cap``)."""
    out: list[int | None] = []
    for k, seed in enumerate(seeds):
        model = models[k % len(models)]
        graph = model_graph(model)
        sim = Simulator(graph, group_ops(graph, groups, 0), random_topology(seed))
        result = search(sim, default_batch_size(model), SearchConfig(iterations=cap, seed=seed, sfb=False),
                        model=prior)
        out.append(result.iters_to_beat_baseline)
    return out


def compare(gnn: list[int | None], uniform: list[int | None], cap: int) -> tuple[float, float, int]:
    """Mean iterations of both priors over the topologies where at least one beat DP-NCCL.

    A prior that did not beat it within the cap counts cap + 1 there; a topology where neither did (e.g.
    nothing fits in memory) is left out. Returns ``(gnn mean, uniform mean, topologies left out)``.
    """
    pairs = [(g, u) for g, u in zip(gnn, uniform, strict=True) if g is not None or u is not None]
    if not pairs:
        return math.inf, math.inf, len(gnn)
    g_mean = sum(cap + 1 if g is None else g for g, _ in pairs) / len(pairs)
    u_mean = sum(cap + 1 if u is None else u for _, u in pairs) / len(pairs)
    return g_mean, u_mean, len(gnn) - len(pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller budgets and fewer topologies")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prior = load_prior()
    iterations = 200 if args.quick else 1500
    topologies = 20 if args.quick else 100
    cap = 50 if args.quick else 100
    figures: dict[str, float] = {}

    header = f"{'model':<12} {'preset':<14} {'plan ms':>9} " + " ".join(
        f"{b[:8]:>8}" for b in ("dp-nccl", "dp-nccl-p", "horovod", "byteps")) + f" {'search s':>8}"
    print(f"speed-ups over the baselines ({iterations} MCTS iterations, GNN prior)")
    print(header)
    for row in presets(prior, iterations, list(REFERENCE_MODELS), figures):
        print(row, flush=True)
    testbed = [figures[f"speedup_{m}_paper-testbed_dp-nccl"] for m in REFERENCE_MODELS
               if f"speedup_{m}_paper-testbed_dp-nccl" in figures]
    figures["geomean_speedup_vs_dpnccl_testbed"] = round(
        math.exp(sum(math.log(s) for s in testbed) / len(testbed)), 4) if testbed else 0.0
    figures["vgg19_speedup_vs_dpnccl_testbed"] = figures.get("speedup_vgg19_paper-testbed_dp-nccl", 0.0)
    figures["plan_seconds_max"] = max(v for k, v in figures.items() if k.startswith("plan_seconds_"))

    seeds = range(1000, 1000 + topologies)
    gen_groups = 24
    models = list(REFERENCE_MODELS)
    gnn, uniform, skipped = compare(iterations_to_beat(prior, models, seeds, cap, gen_groups),
                                    iterations_to_beat(None, models, seeds, cap, gen_groups), cap)
    figures["iters_to_beat_dp_gnn"] = round(gnn, 4)
    figures["iters_to_beat_dp_uniform"] = round(uniform, 4)
    figures["generality_topologies_left_out"] = skipped
    figures["gnn_over_uniform_iters"] = round(
        figures["iters_to_beat_dp_gnn"] / figures["iters_to_beat_dp_uniform"], 4)
    print(f"\ngenerality over {topologies} random topologies (cap {cap} iterations, {gen_groups} op groups; "
          f"{skipped} left out where neither prior beat DP-NCCL, e.g. nothing fits in memory):")
    print(f"  iterations to beat DP-NCCL: GNN {gnn:.2f}, uniform {uniform:.2f}")

    if not args.quick:
        held, _ = train(TrainConfig(seed=1, rounds=2, episodes=10, iterations=200, minutes=4.0,
                                    exclude=("vgg19",)), log=False)
        hold = range(2000, 2020)
        held_gnn, held_uniform, _ = compare(iterations_to_beat(held, ["vgg19"], hold, cap, gen_groups),
                                            iterations_to_beat(None, ["vgg19"], hold, cap, gen_groups), cap)
        figures["holdout_vgg19_iters_gnn"] = round(held_gnn, 4)
        figures["holdout_vgg19_iters_uniform"] = round(held_uniform, 4)
        print(f"  hold-out VGG19 (GNN trained without it): GNN {figures['holdout_vgg19_iters_gnn']:.2f}, "
              f"uniform {figures['holdout_vgg19_iters_uniform']:.2f}")

    misses = []
    for name, (op, target) in TARGETS.items():
        value = figures[name]
        ok = value >= target if op == ">=" else value <= target
        print(f"{name:<36} {value:>10.3f}  target {op} {target:.3g}  {'ok' if ok else 'MISS'}")
        if not ok:
            misses.append(name)
    result = {
        "machine": machine(),
        "commands": [shlex.join([sys.executable, *sys.argv])],
        "figures": figures,
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
        "misses": misses,
    }
    write_json(args.out, result, indent=1)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
