"""Training the GNN prior: the targets of the best plans and the separation from the near-best study."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

pytest.importorskip("torch_geometric", reason="the GNN needs torch-geometric")

from tagps.strategy.mcts import Action, NodeSample
from tagps.strategy.train import (
    HELD_OUT_MODEL,
    STUDY_SEEDS,
    TRAIN_MODELS,
    TrainConfig,
    _episode_topology,
    _targets,
    near_best_samples,
)


def _sample(best: list[float], visits: list[int], depth: int = 0) -> NodeSample:
    decided = (Action((0,), "allreduce"),) * depth
    return NodeSample(decided, None, np.arange(len(best)), np.array(visits), np.array(best))


def test_targets_weigh_tried_actions_by_the_best_plan_below_them() -> None:
    sample = _sample([1.0, 1.01, 1.5, math.inf, math.inf], [5, 3, 2, 1, 0])
    tried, target = _targets(sample, temperature=0.01)
    assert tried.tolist() == [0, 1, 2, 3]  # the untried action is no target either way
    assert target.sum() == pytest.approx(1.0)
    assert target[1] / target[0] == pytest.approx(math.exp(-1.0))  # 1 % slower weighs e^-1
    assert target[2] < 1e-20 and target[3] == 0.0  # far slower; nothing below fits


def test_samples_are_the_most_visited_nodes_on_the_way_to_near_best_plans() -> None:
    samples = [
        _sample([1.0, 2.0], [50, 10]),  # the root: the best plan lies below it
        _sample([1.01, 3.0], [20, 1], 1),  # within 2 %
        _sample([1.5, 1.6], [9, 9], 1),  # a detour
        _sample([1.0, 1.02], [2, 2], 2),
    ]
    kept = near_best_samples(samples, tolerance=0.02, limit=2)
    assert kept == [samples[0], samples[1]]
    assert len(near_best_samples(samples, tolerance=0.02, limit=10)) == 3
    assert near_best_samples([_sample([math.inf, math.inf], [1, 1])], 0.02, 4) == []  # nothing fits


def test_training_never_sees_the_study() -> None:
    assert HELD_OUT_MODEL not in TRAIN_MODELS
    rng = random.Random(0)
    for episode in range(60):
        topology = _episode_topology(rng, episode)
        if topology.name.startswith("random-"):
            assert int(topology.name.split("-")[1]) not in STUDY_SEEDS
    with pytest.raises(ValueError, match="every training model"):
        TrainConfig(exclude=TRAIN_MODELS)
    with pytest.raises(ValueError, match="samples_per_episode"):
        TrainConfig(samples_per_episode=0)
