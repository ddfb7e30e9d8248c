"""The heterogeneous GNN that gives MCTS its prior (PyTorch Geometric ``HeteroConv`` + ``GATConv``).

Nodes are op groups and device groups (:mod:`tagps.strategy.features`); each layer runs one ``GATConv``
with edge features per edge type (op→op both ways, device↔device, op↔device) and sums the messages per
node type, with a residual connection:

.. math::
    h_v^{(l+1)} = h_v^{(l)} + \\mathrm{ELU}\\Big(\\sum_{r} \\mathrm{GAT}_r\\big(h^{(l)}, e_r\\big)_v\\Big)

An action ``(S, o)`` for the op group ``g`` being decided is scored from ``g``'s embedding, the mean and the
max of the embeddings of the device groups in ``S``, the share of device groups it uses, ``o`` and the
action's roofline estimates ``e(S, o)`` (:func:`~tagps.strategy.features.action_features`):

.. math::
    z(S, o) = \\mathrm{MLP}\\big([h_g,\\ \\tfrac{1}{|S|}\\textstyle\\sum_{d \\in S} h_d,\\
        \\max_{d \\in S} h_d,\\ |S|/D,\\ \\mathrm{onehot}(o),\\ e(S, o)]\\big), \\qquad
        P = \\mathrm{softmax}(z)

Nothing depends on the number of op groups or device groups, so the same weights score actions on any
model and any topology. Weights ship in ``tagps/strategy/weights/`` (see ``python -m tagps.strategy.train``).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tagps.strategy.features import (
    ACTION_FEATURES,
    DEV_FEATURES,
    EDGE_FEATURES,
    EDGE_TYPES,
    OP_FEATURES,
    ActionEncoding,
    StateGraph,
    action_features,
    encode_actions,
    state_graph,
)
from tagps.strategy.mcts import OPTION_SLOTS, Action, SearchContext
from tagps.strategy.simulator import SimResult

__all__ = ["DEFAULT_WEIGHTS", "GNNConfig", "GNNPrior", "TagGNN", "load_prior"]

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / "tag_gnn.pt"


@dataclass(frozen=True)
class GNNConfig:
    """Size of the network.

    Args:
        hidden: embedding width (default 32).
        layers: message-passing layers (default 3).
        heads: attention heads per GAT layer; ``hidden`` must be divisible by it (default 2).
    """

    hidden: int = 32
    layers: int = 3
    heads: int = 2

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GNNConfig.{name} must be an integer >= 1, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"GNNConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})")


class TagGNN(nn.Module):
    """Heterogeneous GAT over op groups and device groups with a per-action scoring head.

    Args:
        config: the network's size (default :class:`GNNConfig`).
    """

    def __init__(self, config: GNNConfig | None = None) -> None:
        super().__init__()
        from torch_geometric.nn import GATConv, HeteroConv

        self.config = config = config or GNNConfig()
        h = config.hidden
        self.embed = nn.ModuleDict({"op": nn.Linear(OP_FEATURES, h), "dev": nn.Linear(DEV_FEATURES, h)})
        self.convs = nn.ModuleList(
            HeteroConv(
                {
                    et: GATConv(
                        (h, h), h // config.heads, heads=config.heads, edge_dim=EDGE_FEATURES[et[1]],
                        add_self_loops=False,
                    )
                    for et in EDGE_TYPES
                },
                aggr="sum",
            )
            for _ in range(config.layers)
        )
        width = 3 * h + 1 + OPTION_SLOTS + ACTION_FEATURES
        self.head = nn.Sequential(nn.Linear(width, h), nn.ELU(), nn.Linear(h, h), nn.ELU(), nn.Linear(h, 1))

    def embeddings(self, graph: StateGraph) -> dict[str, torch.Tensor]:
        """Node embeddings ``{"op": [G, h], "dev": [D, h]}`` after message passing."""
        x = {k: self.embed[k](v) for k, v in graph.x.items()}
        edge_index = {et: graph.edge_index[et] for et in EDGE_TYPES}
        edge_attr = {et: graph.edge_attr[et] for et in EDGE_TYPES}
        for conv in self.convs:
            out = conv(x, edge_index, edge_attr_dict=edge_attr)
            x = {k: x[k] + nn.functional.elu(out[k]) if k in out else x[k] for k in x}
        return x

    def forward(
        self, graph: StateGraph, actions: ActionEncoding, estimates: torch.Tensor, legal: torch.Tensor
    ) -> torch.Tensor:
        """Logits of the ``legal`` actions (indices into ``actions``) for the group ``graph.current``, with
        ``estimates`` the ``[A, ACTION_FEATURES]`` features of every action."""
        x = self.embeddings(graph)
        mask = actions.mask[legal]  # [A, D]
        dev = x["dev"]
        mean = mask @ dev
        member = (mask > 0).unsqueeze(-1)  # [A, D, 1]
        big = torch.where(member, dev.unsqueeze(0), torch.full_like(dev, -1e4).unsqueeze(0)).amax(dim=1)
        group = x["op"][graph.current].expand(len(legal), -1)
        option = nn.functional.one_hot(actions.option[legal], OPTION_SLOTS).float()
        size = actions.size[legal].unsqueeze(1)
        features = torch.cat([group, mean, big, size, option, estimates[legal]], dim=1)
        return self.head(features).squeeze(1)


class GNNPrior:
    """The MCTS prior of a trained :class:`TagGNN` (implements :class:`~tagps.strategy.mcts.PriorModel`).

    Args:
        net: the network (put in eval mode).
    """

    def __init__(self, net: TagGNN) -> None:
        self.net = net.eval()

    def logits(
        self, ctx: SearchContext, decided: Sequence[Action], result: SimResult | None, legal: np.ndarray
    ) -> torch.Tensor:
        """Differentiable logits of the legal actions (used by training)."""
        graph = state_graph(ctx, decided, result)
        estimates = torch.from_numpy(action_features(ctx, decided))
        return self.net(graph, encode_actions(ctx), estimates, torch.as_tensor(legal, dtype=torch.long))

    def priors(
        self, ctx: SearchContext, decided: Sequence[Action], result: SimResult | None, legal: np.ndarray
    ) -> np.ndarray:
        """Softmax of the logits: a probability per legal action."""
        threads = torch.get_num_threads()
        # The graphs are tiny: one thread avoids the synchronisation that dominates with several.
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                logits = self.logits(ctx, decided, result, legal)
                return torch.softmax(logits, dim=0).numpy().astype(np.float64)
        finally:
            torch.set_num_threads(threads)

    def save(self, path: str | Path, meta: dict[str, Any] | None = None) -> None:
        """Write the weights and the config (plus ``meta``, e.g. the training command) to ``path``."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"config": asdict(self.net.config), "state_dict": self.net.state_dict(), "meta": meta or {}}, path
        )


def load_prior(path: str | Path = DEFAULT_WEIGHTS) -> GNNPrior:
    """Load a :class:`GNNPrior` from ``path`` (default: the shipped weights).

    Raises:
        FileNotFoundError: there is no such file.
        ValueError: the file is not a TagGNN checkpoint of this version.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"GNN weights {str(path)!r} do not exist (train them: python -m tagps.strategy.train)"
        )
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise ValueError(f"{str(path)!r} is not a TagGNN checkpoint: {exc}") from None
    if not isinstance(data, dict) or not {"config", "state_dict"} <= set(data):
        raise ValueError(f"{str(path)!r} is not a TagGNN checkpoint")
    net = TagGNN(GNNConfig(**data["config"]))
    try:
        net.load_state_dict(data["state_dict"])
    except RuntimeError as exc:
        raise ValueError(f"{str(path)!r} does not match this TagGNN: {exc}") from None
    return GNNPrior(net)

