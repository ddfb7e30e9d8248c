"""Shared fixtures of the strategy tests: small graphs and topologies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tagps.strategy.graph import Graph, extract_graph
from tagps.strategy.topology import DeviceGroup, Topology


def mlp_graph() -> Graph:
    """A 3-op MLP (Linear, ReLU, Linear) with 64->256->10 features."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    return extract_graph(model, (torch.randn(1, 64),), "mlp")


def topology(
    *groups: tuple[str, str, int], inter_gbps: float = 100.0, intra_gbps: float = 96.0, memory: int = 0
) -> Topology:
    """A topology from ``(name, device type, count)`` triples."""
    return Topology("test", tuple(DeviceGroup(n, d, c, intra_gbps, memory) for n, d, c in groups), inter_gbps)


@pytest.fixture(scope="session")
def mlp() -> Graph:
    return mlp_graph()
