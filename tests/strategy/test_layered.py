"""The two-layout family of the general search (convolutions everywhere, the classifier on one machine)."""

from __future__ import annotations

import math

from tagps.strategy.graph import model_graph
from tagps.strategy.grouping import group_ops
from tagps.strategy.layered import layered_paths
from tagps.strategy.mcts import SearchConfig, search
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import DeviceGroup, Topology


def test_paths_cut_between_a_front_layout_and_a_different_back_layout() -> None:
    actions = [((0,), "allreduce"), ((1,), "allreduce"), ((0, 1), "allreduce"), ((0, 1), "ps"), ((0,), "mp")]
    times = {0: 1.0, 1: 2.0, 2: 3.0}
    order = (2, 0, 1)
    paths = layered_paths(actions, order, dp_time=lambda i: times.get(i, math.inf), width=3, prefixes=1)
    # prefixes: the fastest subset (0,) and the widest (0, 1), the latter with allreduce and with ps;
    # suffixes: every replicated layout of another subset
    assert len(paths) == len(set(paths)) == (3 + 2 + 2) * 2
    assert (0, 2, 2) in paths  # levels decide op groups 2, 0, 1: front (0, 1) on ((0, 1), allreduce) ...
    assert (0, 3, 3) in paths  # ... and on ((0, 1), ps), back on (0,)
    for path in paths:
        front, back = path[1], path[0]  # op group 0 and op group 2
        assert front != back and actions[front][0] != actions[back][0]
        assert all(actions[a][1] in ("allreduce", "ps") for a in path)


def test_general_search_finds_the_classifier_on_one_machine_where_links_bind() -> None:
    # Three one-device machines on 200 Mbit/s: vgg-mini's 13 MB classifier gradient dominates its
    # all-reduce, its convolutions dominate compute.
    groups = tuple(DeviceGroup(name, "CPU", 1, 100.0, peak_flops=5e10) for name in "abc")
    topology = Topology("slow", groups, 0.2)
    graph = model_graph("vgg-mini")
    sim = Simulator(graph, group_ops(graph, 8), topology)
    dp = search(sim, 48, SearchConfig(iterations=60, data_parallel=True, sfb=False))
    general = search(sim, 48, SearchConfig(iterations=60, sfb=False))
    assert general.plan is not None and dp.plan is not None
    assert general.time_s <= 0.8 * dp.time_s, (general.time_s, dp.time_s)
    front, back = general.plan.groups[0], general.plan.groups[-1]
    assert len(back.placement) < len(front.placement)
