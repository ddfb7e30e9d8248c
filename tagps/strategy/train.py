"""Train the GNN prior the AlphaZero way: cross-entropy to MCTS visit distributions.

``python -m tagps.strategy.train --seed 0`` runs rounds of self-play: each episode searches one reference
model on one topology (seeded random topologies following the TAG paper, plus the paper's two presets)
with the current network as the prior (uniform in the first round), keeps every node the search visited
at least a few times with the distribution of its visits, and then trains the network on all episodes so
far to predict those distributions over the actions the search tried (:math:`T_s`, those with
:math:`n(s, a) > 0`; progressive widening leaves the others untried, which says nothing of their worth):

.. math::
    \\mathcal{L} = -\\sum_{s}\\sum_{a \\in T_s} \\pi_s(a)\\,\\log \\mathrm{softmax}_{T_s}(z_s)_a, \\qquad
    \\pi_s(a) = \\frac{n(s, a)^{1/\\tau}}{\\sum_{b \\in T_s} n(s, b)^{1/\\tau}}

The defaults stay within about ten minutes on two CPU cores and the weights (~150 KB) are written with the
command, seed and figures of the run (``tagps/strategy/weights/tag_gnn.json``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tagps.atomic import write_text_atomic
from tagps.models import MODELS, default_batch_size
from tagps.strategy.gnn import DEFAULT_WEIGHTS, GNNConfig, GNNPrior, TagGNN
from tagps.strategy.graph import model_graph
from tagps.strategy.grouping import Grouping, group_ops
from tagps.strategy.mcts import NodeSample, PriorModel, SearchConfig, SearchContext, search
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import PRESETS, Topology, random_topology

__all__ = ["NearBest", "TrainConfig", "iters_to_near_best", "main", "near_best_means", "train"]

REFERENCE_MODELS = ("vgg19", "resnet101", "inceptionv3", "transformer", "bert-large", "gpt2")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of :func:`train`.

    Args:
        seed: seeds the topologies, the episodes' order, the searches and the network.
        rounds: self-play rounds (default 4).
        episodes: searches per round (default 16).
        iterations: MCTS iterations per search (default 400).
        groups: op groups per model (default 24; fewer than the planner's 60 keeps episodes short).
        epochs: passes over all samples after each round (default 4).
        lr: Adam learning rate (default 3e-3).
        temperature: the targets are visit counts to the power ``1 / temperature`` (default 0.5).
        minutes: stop self-play and training after this much wall time (default 12).
        exclude: reference models left out (for hold-out studies).
    """

    seed: int = 0
    rounds: int = 4
    episodes: int = 16
    iterations: int = 400
    groups: int = 24
    epochs: int = 4
    lr: float = 3e-3
    temperature: float = 0.5
    minutes: float = 12.0
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("rounds", "episodes", "iterations", "groups", "epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be an integer >= 1, got {value!r}")
        if not self.lr > 0 or not self.minutes > 0 or not self.temperature > 0:
            raise ValueError("TrainConfig.lr, .temperature and .minutes must be > 0")
        unknown = set(self.exclude) - set(MODELS)
        if unknown:
            raise ValueError(f"cannot exclude unknown models {sorted(unknown)}")
        if not set(REFERENCE_MODELS) - set(self.exclude):
            raise ValueError("every reference model is excluded: nothing to train on")


def _episode_topology(rng: random.Random, episode: int) -> Topology:
    if episode % 6 == 5:
        return PRESETS[rng.choice(sorted(PRESETS))]()
    return random_topology(rng.randrange(1 << 30))


def _loss(prior: GNNPrior, ctx: SearchContext, sample: NodeSample, temperature: float) -> torch.Tensor:
    # Over the tried actions only: an action widening never admitted (in round one by a random draw) was
    # not judged.
    tried = sample.visits > 0
    logits = prior.logits(ctx, sample.decided, sample.result, sample.legal[tried])
    target = torch.as_tensor(sample.visits[tried], dtype=torch.float32) ** (1.0 / temperature)
    target = target / target.sum()
    return -(target * torch.log_softmax(logits, dim=0)).sum()


def train(config: TrainConfig, log: bool = True) -> tuple[GNNPrior, dict[str, float | int]]:
    """Run self-play and training; return the trained prior and the run's figures."""
    torch.manual_seed(config.seed)
    torch.set_num_threads(1)
    rng = random.Random(config.seed)
    models = [m for m in REFERENCE_MODELS if m not in config.exclude]
    groupings: dict[str, Grouping] = {}
    net = TagGNN(GNNConfig())
    prior = GNNPrior(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=config.lr)
    data: list[tuple[SearchContext, NodeSample]] = []
    start = time.perf_counter()
    deadline = start + 60 * config.minutes
    episodes = 0
    last_loss = float("nan")
    for round_ in range(config.rounds):
        for e in range(config.episodes):
            if time.perf_counter() > deadline:
                break
            model = models[(round_ * config.episodes + e) % len(models)]
            topo = _episode_topology(rng, e)
            graph = model_graph(model)
            if model not in groupings:
                groupings[model] = group_ops(graph, config.groups, config.seed)
            sim = Simulator(graph, groupings[model], topo)
            result = search(
                sim,
                default_batch_size(model),
                # The tree alone: its visit counts are the targets, and a first data-parallel phase
                # would spend half the episode outside the tree.
                SearchConfig(
                    iterations=config.iterations, seed=rng.randrange(1 << 30), sfb=False, dp_first=False
                ),
                model=prior if round_ else None,
                keep_samples=True,
            )
            ctx = result.context
            data += [(ctx, s) for s in result.samples] if ctx is not None else []
            episodes += 1
            if log:
                print(f"round {round_} episode {e}: {model} on {topo.name}: speed-up {result.speedup:.2f}, "
                      f"{len(result.samples)} samples, {time.perf_counter() - start:.0f} s", flush=True)
        net.train()
        for _ in range(config.epochs):
            if time.perf_counter() > deadline:
                break
            order = list(range(len(data)))
            rng.shuffle(order)
            total = 0.0
            for k in range(0, len(order), 16):
                optimizer.zero_grad()
                losses = [_loss(prior, *data[j], config.temperature) for j in order[k : k + 16]]
                loss = torch.stack(losses).mean()
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * len(losses)
            last_loss = total / max(1, len(data))
            if log:
                print(f"round {round_}: {len(data)} samples, loss {last_loss:.4f}", flush=True)
        net.eval()
    figures = {
        "episodes": episodes,
        "samples": len(data),
        "final_loss": last_loss,
        "seconds": round(time.perf_counter() - start, 1),
    }
    return prior, figures


def _tree_only(iterations: int, seed: int) -> SearchConfig:
    """A search of the general tree alone (no data-parallel phase), without SFB."""
    return SearchConfig(iterations=iterations, seed=seed, sfb=False, dp_first=False)


@dataclass(frozen=True)
class NearBest:
    """Outcome of :func:`iters_to_near_best` on one topology.

    Args:
        topology: the topology's name.
        best_known_s: the best iteration time any of the searches found.
        iters: per prior name, the first iteration whose best plan was within the tolerance of
            ``best_known_s`` (None: not within the cap).
    """

    topology: str
    best_known_s: float
    iters: dict[str, int | None]


def iters_to_near_best(
    priors: dict[str, PriorModel | None],
    model: str,
    topologies: Sequence[Topology],
    cap: int,
    groups: int = 24,
    long_factor: int = 20,
    tolerance: float = 0.02,
) -> list[NearBest]:
    """The study of a prior's worth: MCTS iterations until a plan within ``tolerance`` of the best known.

    On each topology, the best known plan is the best of a uniform search of ``long_factor * cap``
    iterations without progressive widening and of every prior's search; each prior's search (``cap``
    iterations, the general tree alone: ``dp_first=False``, seeded by the topology's position) counts the
    iterations until its best plan is within ``1 + tolerance`` of it. A topology where nothing fits in memory
    is skipped.

    Args:
        priors: the priors to compare by name (None: uniform).
        model: reference model searched on every topology.
        topologies: the (held-out) topologies.
        cap: iterations of each prior's search.
        groups: op groups of the model.
        long_factor: the long uniform search runs ``long_factor * cap`` iterations.
        tolerance: relative distance to the best known time that counts as reached.
    """
    graph = model_graph(model)
    grouping = group_ops(graph, groups, 0)
    batch = default_batch_size(model)
    out = []
    for k, topology in enumerate(topologies):
        sim = Simulator(graph, grouping, topology)
        histories = {name: search(sim, batch, _tree_only(cap, k), p).history for name, p in priors.items()}
        # Another seed than the uniform prior's own search, and no widening: every root action is tried, so
        # the best known does not hang on which actions a random order admitted.
        long_config = replace(_tree_only(long_factor * cap, k + 1_000_000), widen_c=None)
        long = search(sim, batch, long_config).history
        finals = [h[-1][1] for h in (*histories.values(), long) if h]
        if not finals:
            continue
        best = min(finals)
        iters = {
            name: next((it for it, t in history if t <= best * (1 + tolerance)), None)
            for name, history in histories.items()
        }
        out.append(NearBest(topology.name, best, iters))
    return out


def near_best_means(results: Sequence[NearBest], cap: int) -> dict[str, float]:
    """Mean iterations to near-best per prior over ``results``; a search that never got there counts
    ``cap + 1``."""
    if not results:
        return {}
    return {
        name: sum(cap + 1 if r.iters[name] is None else r.iters[name] for r in results) / len(results)
        for name in results[0].iters
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m tagps.strategy.train --seed N [--out FILE] [...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m tagps.strategy.train", description=__doc__.splitlines()[0]
    )
    defaults = TrainConfig()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--episodes", type=int, default=defaults.episodes)
    parser.add_argument("--iterations", type=int, default=defaults.iterations)
    parser.add_argument("--groups", type=int, default=defaults.groups)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--minutes", type=float, default=defaults.minutes)
    parser.add_argument("--exclude", action="append", default=[], help="leave a reference model out")
    parser.add_argument("--out", default=str(DEFAULT_WEIGHTS), help="weights file (a .json note goes beside)")
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(
            seed=args.seed, rounds=args.rounds, episodes=args.episodes, iterations=args.iterations,
            groups=args.groups, epochs=args.epochs, minutes=args.minutes, exclude=tuple(args.exclude),
        )
    except ValueError as exc:
        parser.error(str(exc))
    prior, figures = train(config)
    command = "python -m tagps.strategy.train " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"command": command, "seed": config.seed, "torch": str(torch.__version__), **figures,
            "exclude": list(config.exclude)}
    out = Path(args.out)
    prior.save(out, meta)
    write_text_atomic(out.with_suffix(".json"), json.dumps(meta, indent=1) + "\n")
    print(f"weights written to {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
