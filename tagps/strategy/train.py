"""Train the GNN prior to pick the actions of the best plans that long searches find.

``python -m tagps.strategy.train --seed 0`` runs one long search per episode (a training model on a seeded
random topology, or one of the paper's two presets every sixth episode; never a topology seed of the
near-best study, :data:`STUDY_SEEDS`, nor its held-out model): the general tree alone, uniform prior, no
progressive widening (every root action is tried), as the study's reference search. Each node of that
tree on the way to a near-best plan (its best time below within ``tolerance`` of the episode's best) is a
sample; its target ranks the actions tried there by the best iteration time found below each,
:math:`b_s(a)`:

.. math::
    \\mathcal{L} = -\\sum_{s}\\sum_{a \\in T_s} \\pi_s(a)\\,\\log \\mathrm{softmax}_{T_s}(z_s)_a, \\qquad
    \\pi_s(a) \\propto \\exp\\Big(-\\frac{b_s(a) / \\min_b b_s(b) - 1}{\\tau}\\Big)

with :math:`T_s` the actions tried at ``s`` (an action that never fit in memory has :math:`\\pi = 0`). The
searches' visit counts are no target: with a uniform prior they follow the first-play rule as much as
worth, and a prior trained on them only learns to repeat its own search. The targets of the best plans
are what the near-best study rewards. Training is reproducible for a seed (one thread; ``minutes`` only
guards against a run far slower than the defaults, about 20 minutes under load on two cores). The weights
are written with the command, seed and figures of the run (``tagps/strategy/weights/tag_gnn.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from tagps.atomic import write_text_atomic
from tagps.models import MODELS, default_batch_size
from tagps.strategy.gnn import DEFAULT_WEIGHTS, GNNConfig, GNNPrior, TagGNN
from tagps.strategy.graph import model_graph
from tagps.strategy.grouping import Grouping, group_ops
from tagps.strategy.mcts import NodeSample, PriorModel, SearchConfig, SearchContext, search
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import PRESETS, Topology, random_topology

__all__ = [
    "HELD_OUT_MODEL",
    "REFERENCE_MODELS",
    "STUDY_SEEDS",
    "TRAIN_MODELS",
    "NearBest",
    "TrainConfig",
    "iters_to_near_best",
    "main",
    "near_best_means",
    "train",
]

REFERENCE_MODELS = ("vgg19", "resnet101", "inceptionv3", "transformer", "bert-large", "gpt2")
HELD_OUT_MODEL = "vgg-mini"  # the near-best study's model: never trained on
# The reference models and the small ones but the held-out model: the small ones are where a plan's
# details (one machine or several, which subset) matter most, as they do for the held-out model.
TRAIN_MODELS = (*REFERENCE_MODELS, "transformer-mini", "convnet-mini", "encoder-mini", "mlp-mini")
STUDY_SEEDS = range(3000, 3200)  # random-topology seeds kept for studies and tests, never trained on


@dataclass(frozen=True)
class TrainConfig:
    """Settings of :func:`train`.

    Args:
        seed: seeds the topologies, the searches, the order of samples and the network.
        episodes: long searches, one per (model, topology) (default 100).
        iterations: MCTS iterations of each long search (default 2000, the study's reference length).
        groups: op groups per model (default 24, as the near-best study).
        epochs: passes over the samples (default 30).
        lr: Adam learning rate (default 3e-3).
        temperature: ``tau``, in relative iteration time (default 0.01: 1 % slower weighs ``e^-1``).
        tolerance: nodes whose best time below is within this of the episode's best are samples
            (default 0.02, the study's).
        samples_per_episode: at most this many of them, the most visited (default 16).
        minutes: stop collecting and training after this much wall time (default 30).
        exclude: training models left out (for hold-out studies).
    """

    seed: int = 0
    episodes: int = 100
    iterations: int = 2000
    groups: int = 24
    epochs: int = 30
    lr: float = 3e-3
    temperature: float = 0.01
    tolerance: float = 0.02
    samples_per_episode: int = 16
    minutes: float = 30.0
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("episodes", "iterations", "groups", "epochs", "samples_per_episode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be an integer >= 1, got {value!r}")
        if not self.lr > 0 or not self.minutes > 0 or not self.temperature > 0 or not self.tolerance >= 0:
            raise ValueError("TrainConfig.lr, .temperature and .minutes must be > 0 and .tolerance >= 0")
        unknown = set(self.exclude) - set(MODELS)
        if unknown:
            raise ValueError(f"cannot exclude unknown models {sorted(unknown)}")
        if not set(TRAIN_MODELS) - set(self.exclude):
            raise ValueError("every training model is excluded: nothing to train on")


def _episode_topology(rng: random.Random, episode: int) -> Topology:
    if episode % 6 == 5:
        return PRESETS[rng.choice(sorted(PRESETS))]()
    while (seed := rng.randrange(1 << 30)) in STUDY_SEEDS:
        pass
    return random_topology(seed)


def _targets(sample: NodeSample, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The tried actions of ``sample`` (indices into its ``legal``) and their target distribution."""
    tried = np.flatnonzero(sample.visits > 0)
    best = sample.best_time[tried]
    weight = np.exp(-(best / best.min() - 1.0) / temperature)  # exp(-inf) = 0: nothing below fits
    return tried, weight / weight.sum()


def _loss(prior: GNNPrior, ctx: SearchContext, sample: NodeSample, temperature: float) -> torch.Tensor:
    tried, target = _targets(sample, temperature)
    logits = prior.logits(ctx, sample.decided, sample.result, sample.legal[tried])
    return -(torch.as_tensor(target, dtype=torch.float32) * torch.log_softmax(logits, dim=0)).sum()


def near_best_samples(samples: Sequence[NodeSample], tolerance: float, limit: int) -> list[NodeSample]:
    """The ``limit`` most visited samples on the way to a plan within ``tolerance`` of the best of them all.

    Where many plans are near-best (nothing beats the baseline by much), most such nodes are rarely visited
    and their targets nearly flat; the limit keeps every episode's weight alike and the root (the most
    visited node, whose action every group follows) always in.
    """
    best = min((float(s.best_time.min()) for s in samples), default=math.inf)
    if not math.isfinite(best):
        return []
    near = [s for s in samples if float(s.best_time.min()) <= best * (1 + tolerance)]
    return sorted(near, key=lambda s: -int(s.visits.sum()))[:limit]


def train(config: TrainConfig, log: bool = True) -> tuple[GNNPrior, dict[str, float | int]]:
    """Collect the long searches' samples, then train; return the trained prior and the run's figures."""
    torch.manual_seed(config.seed)
    torch.set_num_threads(1)
    rng = random.Random(config.seed)
    models = [m for m in TRAIN_MODELS if m not in config.exclude]
    groupings: dict[str, Grouping] = {}
    net = TagGNN(GNNConfig())
    prior = GNNPrior(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=config.lr)
    data: list[tuple[SearchContext, NodeSample]] = []
    start = time.perf_counter()
    deadline = start + 60 * config.minutes
    episodes = 0
    for e in range(config.episodes):
        if time.perf_counter() > deadline:
            break
        model = models[e % len(models)]
        topo = _episode_topology(rng, e)
        graph = model_graph(model)
        if model not in groupings:
            groupings[model] = group_ops(graph, config.groups, config.seed)
        sim = Simulator(graph, groupings[model], topo)
        label_search = _label_search(config.iterations, rng.randrange(1 << 30))
        result = search(sim, default_batch_size(model), label_search, keep_samples=True)
        kept = near_best_samples(result.samples, config.tolerance, config.samples_per_episode)
        if result.context is not None:
            data += [(result.context, s) for s in kept]
        episodes += 1
        if log:
            print(f"episode {e}: {model} on {topo.name}: speed-up {result.speedup:.2f}, {len(kept)} samples, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    last_loss = math.nan
    net.train()
    for epoch in range(config.epochs):
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
            print(f"epoch {epoch}: {len(data)} samples, loss {last_loss:.4f}, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    net.eval()
    figures = {
        "episodes": episodes,
        "samples": len(data),
        "final_loss": last_loss,
        "seconds": round(time.perf_counter() - start, 1),
    }
    return prior, figures


def _label_search(iterations: int, seed: int) -> SearchConfig:
    """The long search whose tree gives the targets: the general tree alone, no widening, every setting that
    steers it spelled out, so that retuning the search's defaults does not change what a seed trains."""
    return SearchConfig(
        iterations=iterations, seed=seed, sfb=False, dp_first=False, widen_c=None, c_puct=1.5, prior_mix=0.25,
        normalize_q=False, refine=False,
    )


def _tree_only(iterations: int, seed: int) -> SearchConfig:
    """A search of the general tree alone (no data-parallel phase), without SFB or refinement."""
    return SearchConfig(iterations=iterations, seed=seed, sfb=False, dp_first=False, refine=False)


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
    parser.add_argument("--episodes", type=int, default=defaults.episodes)
    parser.add_argument("--iterations", type=int, default=defaults.iterations)
    parser.add_argument("--groups", type=int, default=defaults.groups)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--minutes", type=float, default=defaults.minutes)
    parser.add_argument("--exclude", action="append", default=[], help="leave a training model out")
    parser.add_argument("--out", default=str(DEFAULT_WEIGHTS), help="weights file (a .json note goes beside)")
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(
            seed=args.seed, episodes=args.episodes, iterations=args.iterations,
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
