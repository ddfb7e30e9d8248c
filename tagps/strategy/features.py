"""Features of a search state for the heterogeneous GNN: op-group nodes, device-group nodes and their edges.

A state is a partial plan of the MCTS (the actions of the groups decided so far; the others follow the
first) plus the simulator's result for it. Node and edge features (all scaled to roughly unit range):

- op-group node: compute time on the fastest device type at the full batch, parameter and activation
  bytes, its position in the search order, whether it is decided and whether it is the one being decided,
  its current option (one-hot allreduce/ps/mp/duplicate), the share of device groups it uses, and the
  simulator's feedback: when its backward finishes and how much of the iteration is left after it;
- device-group node: device count, memory, peak FLOP/s, intra-group bandwidth, and the feedback: mean
  utilisation and idle share, peak memory over capacity (max over its devices), out-of-memory;
- op → op edges (both directions): bytes of the tensors between the groups at the full batch;
- device ↔ device edges: bandwidth between the groups;
- op ↔ device edges: the group's compute time on that device type at three batch sizes (per device of
  the whole cluster, per device of that group, full batch) and whether the group is placed there now.

Actions are encoded independently of the number of device groups: a mask over device groups (rows sum
to one), the option index and :data:`ACTION_FEATURES` roofline estimates for the groups the action sets
(every group at the root, where the action is the whole model's default; the group being decided below),
each relative to the cheapest data-parallel estimate over the actions so that they read the same on any
model: compute at the replicated share of the batch, compute of the full batch on the slowest and on the
fastest member, the ring all-reduce of the parameters, the parameters over the slowest link (a push and
pull's wire time), memory at the share and at the full batch over the smallest member's memory, the
estimate of the action's own option (compute plus its sync; the full batch on the slowest member for
duplicate; on the fastest for mp) over the best such estimate of any action, whether the action is the
group's current one (it then changes nothing), and the activations that would cross to neighbouring
groups placed elsewhere. This is what lets one trained model serve any topology and tell
apart actions that message passing alone blurs (a subset's slowest link, a no-op).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tagps.strategy.mcts import OPTION_SLOT, Action, SearchContext
from tagps.strategy.simulator import SimResult, ring_allreduce_time

if TYPE_CHECKING:
    import torch

__all__ = [
    "ACTION_FEATURES",
    "DEV_FEATURES",
    "EDGE_FEATURES",
    "EDGE_TYPES",
    "OP_FEATURES",
    "ActionEncoding",
    "StateGraph",
    "action_features",
    "encode_actions",
    "state_graph",
]

OP_FEATURES = 14
DEV_FEATURES = 8
ACTION_FEATURES = 10
_MEMORY_CAP = 4.0  # memory ratios above this say the same thing (does not fit)
EDGE_TYPES: tuple[tuple[str, str, str], ...] = (
    ("op", "feeds", "op"),
    ("op", "fed_by", "op"),
    ("dev", "link", "dev"),
    ("op", "on", "dev"),
    ("dev", "runs", "op"),
)
EDGE_FEATURES = {"feeds": 1, "fed_by": 1, "link": 1, "on": 4, "runs": 4}


def _log(x: float, unit: float) -> float:
    return math.log1p(max(x, 0.0) / unit)


@dataclass
class StateGraph:
    """Tensors of one state: node features, edges and edge features per type, the group being decided."""

    x: dict[str, torch.Tensor]
    edge_index: dict[tuple[str, str, str], torch.Tensor]
    edge_attr: dict[tuple[str, str, str], torch.Tensor]
    current: int


@dataclass
class ActionEncoding:
    """Actions as a ``[A, D]`` device-group mask (rows sum to 1), option indices ``[A]``, sizes ``[A]``."""

    mask: torch.Tensor
    option: torch.Tensor
    size: torch.Tensor


class _Static:
    """The parts of the features that do not depend on the state (cached per search context)."""

    def __init__(self, ctx: SearchContext) -> None:
        import torch

        sim, batch = ctx.sim, ctx.batch
        ngroups, ndg = len(sim.groups), len(sim.dgroups)
        fastest = max(sim.topology.worker_indices, key=lambda g: (sim.dtypes[g].peak_flops, -g))
        position = {g: k for k, g in enumerate(ctx.order)}
        op = np.zeros((ngroups, OP_FEATURES), dtype=np.float32)
        for i, g in enumerate(sim.groups):
            op[i, 0] = _log(sum(sim.group_time(i, fastest, float(batch))), 1e-3)
            op[i, 1] = _log(g.param_bytes, 1 << 20)
            op[i, 2] = _log(g.act_bytes * batch, 1 << 20)
            op[i, 3] = position[i] / max(1, ngroups - 1)
        self.op = op
        dev = np.zeros((ndg, DEV_FEATURES), dtype=np.float32)
        for k, g in enumerate(sim.dgroups):
            dev[k, 0] = g.count / 8
            dev[k, 1] = _log(g.memory_bytes, 1 << 30)
            dev[k, 2] = sim.dtypes[k].peak_flops / 20e12
            dev[k, 3] = _log(sim.bw[k][k], 1e9)
        self.dev = dev
        src, dst, nbytes = [], [], []
        for (a, b), n in sim.edges:
            src.append(a)
            dst.append(b)
            nbytes.append(_log(n * batch, 1 << 20))
        ff = torch.tensor([src, dst], dtype=torch.long).reshape(2, -1)
        fa = torch.tensor(nbytes, dtype=torch.float32).reshape(-1, 1)
        links = [(a, b) for a in range(ndg) for b in range(ndg) if a != b]
        li = torch.tensor(links, dtype=torch.long).reshape(-1, 2).t().contiguous()
        la = torch.tensor([_log(sim.bw[a][b], 1e9) for a, b in links], dtype=torch.float32).reshape(-1, 1)
        per_cluster = max(1.0, batch / sim.topology.num_devices)
        times = np.zeros((ngroups, ndg, 3), dtype=np.float32)
        for i in range(ngroups):
            for k, g in enumerate(sim.dgroups):
                # A server-only group (no devices) gets the full batch's time: it is never placed on.
                for j, b in enumerate((per_cluster, max(1.0, batch / max(1, g.count)), float(batch))):
                    times[i, k, j] = _log(sum(sim.group_time(i, k, b)), 1e-3)
        self.times = times
        on = torch.tensor([[i for i in range(ngroups) for _ in range(ndg)],
                           [k for _ in range(ngroups) for k in range(ndg)]], dtype=torch.long)
        self.edge_index = {
            ("op", "feeds", "op"): ff,
            ("op", "fed_by", "op"): ff.flip(0),
            ("dev", "link", "dev"): li,
            ("op", "on", "dev"): on,
            ("dev", "runs", "op"): on.flip(0),
        }
        self.edge_attr = {("op", "feeds", "op"): fa, ("op", "fed_by", "op"): fa, ("dev", "link", "dev"): la}
        self.actions = _encode(ctx.actions, ndg)
        self.member = self.actions.mask.numpy() > 0  # [A, D]
        self.index = {a: k for k, a in enumerate(ctx.actions)}
        self.neighbours: list[list[tuple[int, float]]] = [[] for _ in range(ngroups)]
        for (a, b), n in sim.edges:
            self.neighbours[a].append((b, n * batch))
            self.neighbours[b].append((a, n * batch))
        self.bw = np.array(sim.bw, dtype=np.float64)
        # Static action features and their reference seconds per group being decided (-1: the root).
        self.affected: dict[int, tuple[np.ndarray, float]] = {}


_STATIC: dict[int, tuple[SearchContext, _Static]] = {}


def _static(ctx: SearchContext) -> _Static:
    hit = _STATIC.get(id(ctx))
    if hit is None or hit[0] is not ctx:
        if len(_STATIC) > 64:
            _STATIC.clear()
        hit = _STATIC[id(ctx)] = (ctx, _Static(ctx))
    return hit[1]


def state_graph(ctx: SearchContext, decided: Sequence[Action], result: SimResult | None) -> StateGraph:
    """Features of the state reached by ``decided`` (see the module docstring).

    Args:
        ctx: the search context.
        decided: actions of the first groups of ``ctx.order``.
        result: the simulation of the partial plan (None at the root: no feedback yet).
    """
    import torch

    if len(decided) >= len(ctx.order):
        raise ValueError("every op group is decided: there is no next group to score actions for")
    st = _static(ctx)
    sim = ctx.sim
    ngroups, ndg = len(sim.groups), len(sim.dgroups)
    op = st.op.copy()
    dev = st.dev.copy()
    placed = np.zeros((ngroups, ndg), dtype=np.float32)
    if decided:
        per_group = [decided[0]] * ngroups
        for level, action in enumerate(decided):
            per_group[ctx.order[level]] = action
            op[ctx.order[level], 4] = 1.0
        for i, action in enumerate(per_group):
            op[i, 6 + OPTION_SLOT[action.option]] = 1.0
            placed[i, list(action.devices)] = 1.0
            op[i, 10] = len(action.devices) / ndg
    current = ctx.order[len(decided)]
    op[current, 5] = 1.0
    if result is not None:
        t = result.iteration_time or 1.0
        for i, finish in enumerate(result.group_finish):
            op[i, 11] = finish / t
            op[i, 12] = 1.0 - finish / t
        op[:, 13] = 1.0 if result.feasible else -1.0
        util = result.utilization()
        for k, g in enumerate(sim.dgroups):
            names = g.devices()
            if not names:  # a server-only group: no devices to report on
                continue
            dev[k, 4] = sum(util[d] for d in names) / len(names)
            dev[k, 5] = sum(result.idle[d] for d in names) / len(names) / t
            dev[k, 6] = max(result.peak_memory[d] for d in names) / g.memory_bytes
            dev[k, 7] = 1.0 if any(d in result.oom_devices for d in names) else 0.0
    on_attr = np.concatenate([st.times.reshape(-1, 3), placed.reshape(-1, 1)], axis=1)
    on = torch.from_numpy(on_attr)
    edge_attr = dict(st.edge_attr)
    edge_attr[("op", "on", "dev")] = on
    edge_attr[("dev", "runs", "op")] = on
    return StateGraph(
        {"op": torch.from_numpy(op), "dev": torch.from_numpy(dev)}, st.edge_index, edge_attr, current
    )


def _estimates(ctx: SearchContext, st: _Static, groups: Sequence[int]) -> tuple[np.ndarray, float]:
    """Static action features ``[A, 8]`` for actions that set ``groups`` (see the module docstring) and the
    seconds they are relative to."""
    sim, batch = ctx.sim, ctx.batch
    param = float(sum(sim.groups[i].param_bytes for i in groups))
    tensors = sum(len(sim.groups[i].param_names) for i in groups)
    act = float(sum(sim.groups[i].act_bytes for i in groups))
    memo: dict[tuple[int, float], float] = {}

    def compute(k: int, b: float) -> float:  # forward + backward of ``groups`` on device group k at batch b
        hit = memo.get((k, b))
        if hit is None:
            hit = memo[(k, b)] = sum(sum(sim.group_time(i, k, b)) for i in groups)
        return hit

    raw = np.zeros((len(ctx.actions), 8))
    for a, action in enumerate(ctx.actions):
        members = action.devices
        n = sum(sim.dgroups[k].count for k in members)
        share = float(math.ceil(batch / n))
        if len(members) == 1:
            (k,) = members
            link, latency = st.bw[k, k], sim.topology.intra_latency_s
        else:
            link = min(st.bw[x, y] for x in members for y in members if x != y)
            link = min([link] + [st.bw[k, k] for k in members if sim.dgroups[k].count > 1])
            latency = sim.topology.inter_latency_s
        full = [compute(k, float(batch)) for k in members]
        memory = min(sim.dgroups[k].memory_bytes for k in members)
        raw[a] = (  # seconds, except the memory ratios
            max(compute(k, share) for k in members),
            max(full),
            min(full) / n,
            ring_allreduce_time(param, n, link, latency, tensors) if n > 1 else 0.0,
            param / link if n > 1 else 0.0,
            (4 * param + act * share) / memory,
            (4 * param + act * batch) / memory,
            min(full),
        )
    ref = max(float((raw[:, 0] + raw[:, 3]).min()), 1e-9)  # the cheapest data-parallel estimate
    # The action's own option read off the columns: compute plus its sync, the full batch with none, or
    # (mp) the full batch on the fastest member as a bound; over the best such estimate of any action.
    estimate = np.array([_OPTION_ESTIMATE[a.option](row) for a, row in zip(ctx.actions, raw, strict=True)])
    out = np.zeros((len(ctx.actions), 8), dtype=np.float32)
    out[:, 0:3] = np.log(np.maximum(raw[:, 0:3], 1e-12) / ref)
    out[:, 3:5] = np.log1p(raw[:, 3:5] / ref)
    out[:, 5:7] = np.minimum(raw[:, 5:7], _MEMORY_CAP)
    out[:, 7] = np.log(np.maximum(estimate, 1e-12) / max(float(estimate.min()), 1e-12))
    return out, ref


# Per option, a roofline estimate of an action's time from the raw columns of ``_estimates``: compute at
# the share, full batch on the slowest member, full batch on the fastest over n, ring all-reduce, bytes
# over the slowest link (a push and a pull each move them), ..., full batch on the fastest member (mp
# runs every op at the full batch, one device after another).
_OPTION_ESTIMATE = {
    "allreduce": lambda r: r[0] + r[3],
    "ps": lambda r: r[0] + 2 * r[4],
    "duplicate": lambda r: r[1],
    "mp": lambda r: r[7],
}


def action_features(ctx: SearchContext, decided: Sequence[Action]) -> np.ndarray:
    """Features ``[A, ACTION_FEATURES]`` of every action of ``ctx`` for the group decided after ``decided``.

    Args:
        ctx: the search context.
        decided: actions of the first groups of ``ctx.order``.
    """
    st = _static(ctx)
    sim = ctx.sim
    level = len(decided)
    current = ctx.order[level]
    key = current if decided else -1
    hit = st.affected.get(key)
    if hit is None:
        hit = st.affected[key] = _estimates(ctx, st, [current] if decided else range(len(sim.groups)))
    static, ref = hit
    out = np.zeros((len(ctx.actions), ACTION_FEATURES), dtype=np.float32)
    out[:, :8] = static
    if decided:
        out[st.index[decided[0]], 8] = 1.0  # an undecided group follows the first decided action
        per_group = [decided[0]] * len(sim.groups)
        for lv, action in enumerate(decided):
            per_group[ctx.order[lv]] = action
        member = st.member
        cut = np.zeros(len(ctx.actions))
        for other, nbytes in st.neighbours[current]:
            there = list(per_group[other].devices)
            # The slowest link between a member of the action and one of the neighbour's device groups.
            link = np.where(member, st.bw[:, there].min(axis=1)[None, :], np.inf).min(axis=1)
            same = (member == member[st.index[per_group[other]]]).all(axis=1)
            cut += np.where(same, 0.0, nbytes / link)
        out[:, 9] = np.log1p(cut / ref)
    return out


def _encode(actions: Sequence[Action], ndg: int) -> ActionEncoding:
    import torch

    mask = torch.zeros(len(actions), ndg)
    for a, action in enumerate(actions):
        mask[a, list(action.devices)] = 1.0 / len(action.devices)
    option = torch.tensor([OPTION_SLOT[a.option] for a in actions], dtype=torch.long)
    size = torch.tensor([len(a.devices) / ndg for a in actions], dtype=torch.float32)
    return ActionEncoding(mask, option, size)


def encode_actions(ctx: SearchContext) -> ActionEncoding:
    """The encoding of ``ctx.actions`` (cached with the context's static features)."""
    return _static(ctx).actions
