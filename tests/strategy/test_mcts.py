"""MCTS: budgets, reproducibility, the best plan kept, OOM handling and the data-parallel restriction.

The action space and the general search against the data-parallel one: ``test_search_space.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from strategy_builders import deep_mlp_graph, three_groups

from tagps.strategy.baselines import dp_nccl
from tagps.strategy.grouping import group_ops
from tagps.strategy.mcts import (
    GENERAL_MARGIN,
    Action,
    SearchConfig,
    SearchResult,
    _merge,
    _Search,
    candidate_actions,
    search,
)
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import DeviceGroup, Topology


@pytest.fixture(scope="module")
def sim() -> Simulator:
    graph = deep_mlp_graph(1024, 6)
    return Simulator(graph, group_ops(graph, 6), three_groups("mcts"))


def test_candidate_actions_offer_every_option_on_every_subset(sim: Simulator) -> None:
    actions = candidate_actions(sim)
    assert len(actions) == 7 * 4  # 7 subsets x {allreduce, ps, duplicate, mp}
    assert len(set(actions)) == len(actions)


def test_search_is_reproducible_and_keeps_the_best_plan(sim: Simulator) -> None:
    config = SearchConfig(iterations=150, seed=3, sfb=False)
    a = search(sim, 64, config)
    b = search(sim, 64, config)
    assert a.plan is not None and a.plan == b.plan and a.history == b.history
    assert a.iterations == config.total_iterations == 300  # the data-parallel phase, then the general tree
    # The best plan is the minimum of everything seen (polishing, which drops fusion when that is faster, can
    # only improve it), and its prediction is what the simulator says.
    assert a.time_s <= min(t for _, t in a.history)
    assert sim.evaluate(a.plan).iteration_time == pytest.approx(a.time_s)
    assert a.plan.predicted is not None and a.plan.predicted.baseline == "dp-nccl"
    base = sim.evaluate(dp_nccl(sim, 64)).iteration_time
    assert a.baseline_time_s == pytest.approx(base)
    assert a.time_s < base and a.speedup > 1.0
    assert a.iters_to_beat_baseline is not None and a.iters_to_beat_baseline <= 300


def test_more_iterations_never_give_a_worse_tree_plan(sim: Simulator) -> None:
    # The longer tree sees every plan the shorter one saw (the refinement after it, a local descent, may
    # end in another local optimum from another start, so it is left out here).
    short = search(sim, 64, SearchConfig(iterations=20, seed=1, sfb=False, refine=False))
    long = search(sim, 64, SearchConfig(iterations=200, seed=1, sfb=False, refine=False))
    assert long.time_s <= short.time_s


def test_seconds_budget_stops_the_search(sim: Simulator) -> None:
    result = search(sim, 64, SearchConfig(iterations=None, seconds=0.5, sfb=False))
    assert result.plan is not None
    assert result.seconds < 5.0


def test_progress_reports_every_iteration(sim: Simulator) -> None:
    seen: list[tuple[int, float | None]] = []
    search(sim, 64, SearchConfig(iterations=25, sfb=False), progress=lambda i, t: seen.append((i, t)))
    assert [i for i, _ in seen] == list(range(1, 51))  # both phases, numbered on
    best = [t for _, t in seen if t is not None]
    assert best == sorted(best, reverse=True)


def test_data_parallel_restriction_gives_runtime_plans(sim: Simulator) -> None:
    result = search(sim, 64, SearchConfig(iterations=100, data_parallel=True, sfb=False))
    plan = result.plan
    assert plan is not None and plan.kind == "data-parallel"
    placements = {g.placement for g in plan.groups}
    assert len(placements) == 1
    assert all(g.option in ("allreduce", "ps") for g in plan.groups)
    used = {d.split(":")[0] for d, s in plan.batch_shares.items() if s > 0}
    assert used == set(next(iter(placements)))
    assert result.iterations == 100  # no second phase


def test_out_of_memory_moves_towards_model_parallelism() -> None:
    graph = deep_mlp_graph(4096, 4)  # 4 x 64 MiB of weights: with Adam 1 GiB per replica
    sim = Simulator(graph, group_ops(graph, 4), three_groups("mcts", memory=600 << 20))
    assert not sim.evaluate(dp_nccl(sim, 16)).feasible
    result = search(sim, 16, SearchConfig(iterations=60, sfb=False))
    assert result.baseline == "mp"
    assert result.plan is not None
    assert sim.evaluate(result.plan).feasible
    assert any(g.option == "mp" for g in result.plan.groups)
    # Nothing data-parallel fits in the first phase (60 iterations); the general tree fits one quickly.
    assert 60 < result.history[0][0] <= 60 + 10


def test_search_rejects_bad_budgets_and_batches(sim: Simulator) -> None:
    with pytest.raises(ValueError, match="budget"):
        SearchConfig(iterations=None, seconds=None)
    with pytest.raises(ValueError, match="iterations"):
        SearchConfig(iterations=0)
    with pytest.raises(ValueError, match="seconds"):
        SearchConfig(seconds=-1.0)
    with pytest.raises(ValueError, match="c_puct"):
        SearchConfig(c_puct=0.0)
    with pytest.raises(ValueError, match="batch"):
        search(sim, 0)


def test_polishing_never_makes_the_plan_slower() -> None:
    pytest.importorskip("cvxpy", reason="the SFB solver needs cvxpy")
    graph = deep_mlp_graph(4096, 2)
    topo = Topology("slow", (DeviceGroup("a", "1080Ti", 2, 96.0), DeviceGroup("b", "1080Ti", 2, 96.0)), 1.0)
    sim = Simulator(graph, group_ops(graph, 2), topo)
    plain = search(sim, 8, SearchConfig(iterations=40, sfb=False, data_parallel=True))
    polished = search(sim, 8, SearchConfig(iterations=40, sfb=True, data_parallel=True))
    assert polished.plan is not None and plain.plan is not None
    assert polished.time_s <= plain.time_s
    assert sim.evaluate(polished.plan).iteration_time == pytest.approx(polished.time_s)


class _FavourAction:
    """A prior that puts almost all mass on one action (by devices and option)."""

    def __init__(self, devices: tuple[int, ...], option: str) -> None:
        self.devices, self.option = devices, option

    def priors(self, ctx, decided, result, legal):
        hit = [ctx.actions[k].devices == self.devices and ctx.actions[k].option == self.option for k in legal]
        return np.where(hit, 1.0, 1e-6)


def test_a_confident_prior_is_followed_from_the_first_iteration(sim: Simulator) -> None:
    everything = tuple(range(len(sim.dgroups)))
    prior = _FavourAction(everything, "allreduce")
    config = SearchConfig(iterations=5, sfb=False)
    result = search(sim, 64, config, model=prior)
    assert result.iters_to_beat_baseline == 1
    # The first iteration's plan is the favoured action on every op group.
    favoured = _Search(sim, 64, config, None, False).plan([Action(everything, "allreduce")])
    assert result.history[0] == (1, pytest.approx(sim.evaluate(favoured).iteration_time, rel=1e-12))


def test_an_invalid_prior_is_an_error(sim: Simulator) -> None:
    class Broken:
        def priors(self, ctx, decided, result, legal):
            return np.ones(len(legal) + 1)

    with pytest.raises(RuntimeError, match="invalid prior"):
        search(sim, 64, SearchConfig(iterations=2), model=Broken())


def _root_visits(sim: Simulator, iterations: int, model=None, **config) -> np.ndarray:
    """Visit counts of the root's edges after a search of the general tree alone."""
    config = SearchConfig(iterations=iterations, sfb=False, dp_first=False, **config)
    result = search(sim, 64, config, model, keep_samples=True)
    (root,) = [s for s in result.samples if not s.decided]
    return root.visits


def test_samples_carry_the_best_time_below_each_edge(sim: Simulator) -> None:
    config = SearchConfig(iterations=40, sfb=False, dp_first=False, widen_c=None, refine=False)
    result = search(sim, 64, config, keep_samples=True)
    (root,) = [s for s in result.samples if not s.decided]
    assert root.best_time.min() == result.history[-1][1]  # the best plan the tree found lies below the root
    assert np.isinf(root.best_time[root.visits == 0]).all()  # an edge never taken has nothing below it
    for sample in result.samples:
        assert (sample.visits > 0).sum() >= 2
        assert np.all(sample.best_time[sample.visits > 0] > 0)


def test_widening_admits_root_actions_as_the_root_is_visited(sim: Simulator) -> None:
    actions = candidate_actions(sim)
    for iterations in (8, 24, 60):
        tried = int((_root_visits(sim, iterations) > 0).sum())
        # Before the last visit the root had iterations - 1 visits: ceil(c_w * iterations ** 0.5) admitted.
        assert 1 < tried <= math.ceil(SearchConfig().widen_c * iterations**0.5) < len(actions)
    # Without widening the root tries every action once before it refines any.
    assert list(_root_visits(sim, len(actions), widen_c=None)) == [1] * len(actions)


def test_widening_tries_the_action_of_highest_prior_first(sim: Simulator) -> None:
    everything = tuple(range(len(sim.dgroups)))
    prior = _FavourAction(everything, "ps")
    config = SearchConfig(iterations=1, sfb=False, dp_first=False, refine=False)  # the tree's first plan
    first = search(sim, 64, config, model=prior).plan
    assert first is not None
    assert all(g.option == "ps" and len(g.placement) == len(everything) for g in first.groups)
    assert int((_root_visits(sim, 8, prior) > 0).sum()) <= math.ceil(SearchConfig().widen_c * 8**0.5)


def test_equal_priors_are_admitted_in_an_order_drawn_from_the_seed(sim: Simulator) -> None:
    tried = [frozenset(np.flatnonzero(_root_visits(sim, 8, seed=seed))) for seed in range(4)]
    assert tried[0] == frozenset(np.flatnonzero(_root_visits(sim, 8, seed=0)))  # reproducible
    assert len(set(tried)) > 1  # not the first k actions in list order
    assert any(min(t) > 0 for t in tried)


def test_widening_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="widen_c"):
        SearchConfig(widen_c=0.0)
    with pytest.raises(ValueError, match="widen_alpha"):
        SearchConfig(widen_alpha=1.5)


def test_refinement_moves_single_op_groups_to_a_faster_plan(sim: Simulator) -> None:
    # Five iterations leave most op groups on the first group's action; moving them one at a time finds
    # a faster plan, every step of it costed by the simulator.
    tree = search(sim, 64, SearchConfig(iterations=5, seed=3, sfb=False, refine=False))
    refined = search(sim, 64, SearchConfig(iterations=5, seed=3, sfb=False))
    assert tree.plan is not None and refined.plan is not None
    assert refined.time_s < 0.95 * tree.time_s
    assert sim.evaluate(refined.plan).iteration_time == pytest.approx(refined.time_s)
    assert refined.history[-1] == (refined.iterations, pytest.approx(refined.time_s))
    assert refined.evaluations > tree.evaluations


def test_refinement_of_a_data_parallel_search_stays_data_parallel(sim: Simulator) -> None:
    result = search(sim, 64, SearchConfig(iterations=10, seed=3, sfb=False, data_parallel=True))
    assert result.plan is not None and result.plan.kind == "data-parallel"
    assert len({g.placement for g in result.plan.groups}) == 1
    assert {g.option for g in result.plan.groups} <= {"allreduce", "ps"}


def _phase(plan: str, time_s: float, iterations: int = 10) -> SearchResult:
    return SearchResult(plan, time_s, "dp-nccl", 1.0, iterations, iterations, 0.1, 1, [(1, time_s)])


def test_a_general_plan_needs_the_margin_to_replace_the_data_parallel_one() -> None:
    dp = _phase("dp", 0.100)
    close = _merge(dp, _phase("general", 0.100 * (1 - GENERAL_MARGIN / 2)))
    assert close.plan == "dp" and close.time_s == 0.100 and close.history == [(1, 0.100)]
    assert close.iterations == 20  # both phases counted
    faster = _merge(dp, _phase("general", 0.100 * (1 - 2 * GENERAL_MARGIN)))
    assert faster.plan == "general" and faster.history == [(1, 0.100), (11, pytest.approx(0.096))]
    assert _merge(_phase(None, math.inf), _phase("general", 0.5)).plan == "general"
