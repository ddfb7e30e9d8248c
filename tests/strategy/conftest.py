"""Shared fixtures of the strategy tests: small graphs and topologies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tagps.strategy.graph import Graph, extract_graph


def mlp_graph() -> Graph:
    """A 3-op MLP (Linear, ReLU, Linear) with 64->256->10 features."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    return extract_graph(model, (torch.randn(1, 64),), "mlp")


@pytest.fixture(scope="session")
def mlp() -> Graph:
    return mlp_graph()
