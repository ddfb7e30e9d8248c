"""The SFB MILP: it must win where factors are tiny next to the gradient and lose where they are not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tagps.strategy.baselines import data_parallel_plan, even_shares
from tagps.strategy.graph import extract_graph
from tagps.strategy.grouping import group_ops
from tagps.strategy.plan import CommSettings
from tagps.strategy.sfb_milp import SOLVE_LIMIT_S, apply_sfb, solve_gradient
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import DeviceGroup, Topology

pytest.importorskip("cvxpy", reason="the SFB solver needs cvxpy")


class Expand(nn.Module):
    """A small input tiled to 4096 features (a parameter-free op upstream), then a big Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4096, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(x.repeat(1, 256)))


def _setup(model: nn.Module, features: int, batch: int, gbps: float) -> tuple[Simulator, object]:
    graph = extract_graph(model, (torch.randn(1, features),), "sfb-test")
    groups = (DeviceGroup("a", "1080Ti", 2, 96.0), DeviceGroup("b", "1080Ti", 2, 96.0))
    topo = Topology("sfb", groups, gbps)
    sim = Simulator(graph, group_ops(graph, 1), topo)
    plan = data_parallel_plan(sim, batch, even_shares(sim, batch), comm=CommSettings(overlap=True))
    return sim, plan


def test_sfb_wins_small_batch_big_linear_slow_link() -> None:
    sim, plan = _setup(nn.Sequential(nn.Linear(4096, 4096)), 4096, 8, 1.0)
    decision = solve_gradient(sim, plan, "0.weight")
    assert decision.use_sfb and decision.ops == ("_0",)
    assert decision.sfb_s < decision.allreduce_s
    assert decision.solve_s < SOLVE_LIMIT_S
    with_sfb = apply_sfb(sim, plan)
    assert with_sfb.sync_of("0.weight") == "sfb" and with_sfb.sync_of("0.bias") == "allreduce"
    # The simulator counts the factors: the plan with SFB is faster.
    assert sim.evaluate(with_sfb).iteration_time < sim.evaluate(plan).iteration_time


def test_sfb_loses_large_batch() -> None:
    sim, plan = _setup(nn.Sequential(nn.Linear(4096, 4096)), 4096, 8192, 1.0)
    decision = solve_gradient(sim, plan, "0.weight")
    assert not decision.use_sfb and decision.ops == ()
    assert apply_sfb(sim, plan) is plan


def test_sfb_duplicates_a_cheap_upstream_op_when_its_input_is_smaller() -> None:
    sim, plan = _setup(Expand(), 16, 8, 1.0)
    decision = solve_gradient(sim, plan, "fc.weight")
    assert decision.use_sfb
    assert decision.ops[0] == "fc" and "repeat" in decision.ops
    factor, dup_flops = sim.sfb_factors("fc.weight", decision.ops)
    op = sim.graph.ops[sim.owner_op["fc.weight"]]
    assert factor < op.in_bytes + op.out_bytes  # the 16-feature input travels, not the tiled one
    assert dup_flops >= 0
    with_sfb = apply_sfb(sim, plan)
    assert sim.evaluate(with_sfb).iteration_time < sim.evaluate(plan).iteration_time


def test_sfb_rejects_non_linear_weights_and_unknown_parameters() -> None:
    sim, plan = _setup(nn.Sequential(nn.ReLU(), nn.Linear(64, 64)), 64, 8, 10.0)
    with pytest.raises(ValueError, match="weight of a Linear"):
        solve_gradient(sim, plan, "1.bias")
    with pytest.raises(ValueError, match="not in graph"):
        solve_gradient(sim, plan, "nope")
    with pytest.raises(ValueError, match="SFB solver"):
        solve_gradient(sim, plan, "1.weight", solver="GLPK")
    with pytest.raises(ValueError, match="unknown ops"):
        sim.sfb_factors("1.weight", ("_1", "ghost"))
    with pytest.raises(ValueError, match="must include its op"):
        sim.sfb_factors("1.weight", ("_0",))
