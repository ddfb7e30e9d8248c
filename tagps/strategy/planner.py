"""Front of the strategy creator used by `tagps plan` / `tagps show` and the benchmarks.

A model is named either by a reference model (:data:`tagps.models.MODELS`) or by a Python path
``pkg.module:factory`` whose ``factory()`` returns ``(model, example_inputs)``: an ``nn.Module`` and a
tuple of input tensors with a batch of ONE sample (meta tensors are fine). A plan records that name, so
`tagps show` can rebuild the graph.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from tagps.strategy.graph import Graph, extract_graph, model_graph
from tagps.strategy.grouping import DEFAULT_GROUPS, group_ops, grouping_from_names
from tagps.strategy.mcts import PriorModel, SearchConfig, SearchResult, search
from tagps.strategy.plan import Plan
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import Topology

__all__ = ["Budget", "graph_for", "parse_budget", "plan_model", "simulator_for_plan"]


def graph_for(spec: str) -> Graph:
    """Graph of a reference model or of ``pkg.module:factory`` (see the module docstring).

    Raises:
        ValueError: the name is neither a reference model nor an importable factory, or the factory
            does not return ``(nn.Module, tuple of tensors)``.
    """
    if ":" not in spec:
        from tagps.models import MODELS

        if spec not in MODELS:
            raise ValueError(f"unknown model {spec!r}; use one of {', '.join(MODELS)} or pkg.module:factory")
        return model_graph(spec)
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import model factory {spec!r}: {exc}") from None
    built = factory()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[1], tuple)):
        raise ValueError(f"model factory {spec!r} must return (nn.Module, tuple of example inputs)")
    return extract_graph(built[0], built[1], spec)


@dataclass(frozen=True)
class Budget:
    """A search budget: iterations or seconds."""

    iterations: int | None
    seconds: float | None


def parse_budget(text: str) -> Budget:
    """Parse ``60s``, ``2m``, ``1.5h`` (wall time) or ``500`` / ``500it`` (iterations)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|it)?\s*", text)
    if not match:
        raise ValueError(f"budget {text!r} is not like 60s, 2m, 1h, 500 or 500it")
    value, unit = float(match.group(1)), match.group(2) or "it"
    if unit == "it":
        if not value.is_integer() or value < 1:
            raise ValueError(f"an iteration budget must be a whole number >= 1, got {text!r}")
        return Budget(int(value), None)
    if value <= 0:
        raise ValueError(f"a time budget must be > 0, got {text!r}")
    return Budget(None, value * {"s": 1, "m": 60, "h": 3600}[unit])


def simulator_for_plan(plan: Plan) -> Simulator:
    """A simulator for a plan file: its model's graph (reference or factory) and its op groups."""
    graph = graph_for(plan.model)
    return Simulator(graph, grouping_from_names(graph, [g.ops for g in plan.groups]), plan.topology)


def plan_model(
    model: str,
    topology: Topology,
    batch: int,
    config: SearchConfig,
    prior: PriorModel | None = None,
    groups: int = DEFAULT_GROUPS,
    progress: Callable[[int, float | None], None] | None = None,
) -> tuple[SearchResult, Simulator]:
    """Group ``model``'s graph with METIS and search a plan for ``topology``.

    Returns:
        The search result and the simulator it used.
    """
    graph = graph_for(model)
    sim = Simulator(graph, group_ops(graph, groups, config.seed), topology, seed=config.seed)
    return search(sim, batch, config, model=prior, progress=progress), sim
