"""Graphs and topologies that several strategy test modules build (imported by name: pytest puts this
folder on sys.path, and a helper module, unlike conftest.py, has a name no other folder uses)."""

from __future__ import annotations

import torch
from torch import nn

from tagps.strategy.graph import Graph, extract_graph
from tagps.strategy.topology import DeviceGroup, Topology


def deep_mlp_graph(width: int, depth: int) -> Graph:
    """``depth`` pairs of Linear(width, width) and ReLU."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return extract_graph(nn.Sequential(*layers), (torch.randn(1, width),), f"mlp{width}x{depth}")


def three_groups(name: str, memory: int = 0) -> Topology:
    """Two V100s, two 1080Tis and a P100 in three device groups (``memory``: per device, 0 = the type's)."""
    return Topology(
        name,
        (
            DeviceGroup("fast", "V100-32GB", 2, 1200.0, memory),
            DeviceGroup("slow", "1080Ti", 2, 96.0, memory),
            DeviceGroup("mid", "P100", 1, 96.0, memory),
        ),
        10.0,
    )
