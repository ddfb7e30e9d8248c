"""Op grouping with METIS (pymetis): tensor bytes as edge weights, compute time as vertex weights.

Two words, kept apart (glossary in docs/plan.md): an *op group* is a set of ops that a plan places and
syncs as one (the plan's ``groups``, a :class:`Grouping` here); a *METIS part* is one piece of a METIS
split. :func:`group_ops` makes every METIS part of a split of the whole graph an op group;
:func:`split_ops` splits one op group into METIS parts for model parallelism (one device each).

METIS splits the undirected op graph; the parts of a DAG can depend on each other in a cycle, which no
schedule can run part by part. :func:`_partition` therefore repairs the split into an acyclic one: METIS
parts are ranked by the topological position of their first op, and each op (in topological order) moves
to ``max(rank of its METIS part, part of any predecessor)``. Every op stays in exactly one part, edges
between parts only point forward, and the result is deterministic for a given seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tagps.strategy.devices import device_type
from tagps.strategy.graph import Graph

__all__ = ["DEFAULT_GROUPS", "Grouping", "group_ops", "grouping_from_names", "split_ops"]

DEFAULT_GROUPS = 60
REFERENCE_DEVICE = "V100-32GB"
REFERENCE_BATCH = 32


@dataclass(frozen=True)
class Grouping:
    """The op groups of a graph, in topological order.

    Args:
        groups: op indices of each op group (each sorted).
        op_group: op group index of every op.
    """

    groups: tuple[tuple[int, ...], ...]
    op_group: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.groups)


def _vertex_weight(graph: Graph, i: int) -> int:
    op = graph.ops[i]
    dev = device_type(REFERENCE_DEVICE)
    fwd = dev.op_time(
        op.fwd_flops * REFERENCE_BATCH, op.param_bytes + (op.in_bytes + op.out_bytes) * REFERENCE_BATCH
    )
    bwd = dev.op_time(
        op.bwd_flops * REFERENCE_BATCH,
        2 * op.param_bytes + 2 * (op.in_bytes + op.out_bytes) * REFERENCE_BATCH,
    )
    return max(1, round((fwd + bwd) * 1e6))  # microseconds


def _partition(graph: Graph, members: Sequence[int], k: int, seed: int) -> list[int]:
    """Acyclic METIS split of ``members`` (op indices, topologically sorted) into at most ``k`` METIS parts.

    Returns the METIS part index (0..parts-1, topologically ordered) of every member.
    """
    n = len(members)
    if k <= 1 or n <= 1:
        return [0] * n
    k = min(k, n)
    position = {op: j for j, op in enumerate(members)}
    adj: list[dict[int, int]] = [{} for _ in range(n)]
    preds: list[list[int]] = [[] for _ in range(n)]
    for src, dst, nbytes in graph.edges:
        if src in position and dst in position:
            a, b = position[src], position[dst]
            w = max(1, nbytes // 1024)  # KiB keeps METIS's integer weights small
            adj[a][b] = adj[a].get(b, 0) + w
            adj[b][a] = adj[b].get(a, 0) + w
            preds[b].append(a)
    import pymetis

    xadj, adjncy, eweights = [0], [], []
    for row in adj:
        for nb in sorted(row):
            adjncy.append(nb)
            eweights.append(row[nb])
        xadj.append(len(adjncy))
    vweights = [_vertex_weight(graph, op) for op in members]
    # One op heavier than a whole METIS part's share makes the balance infeasible and METIS bisect empty
    # graphs; such an op forms its part alone anyway, so its weight is capped at that share.
    cap = max(1, sum(vweights) // k)
    vweights = [min(w, cap) for w in vweights]
    if not adjncy:  # METIS needs at least one edge; split a graph without edges by position
        labels = [j * k // n for j in range(n)]
    else:
        _, labels = pymetis.part_graph(
            k,
            pymetis.CSRAdjacency(xadj, adjncy),
            vweights=vweights,
            eweights=eweights,
            recursive=True,
            options=pymetis.Options(seed=seed),
        )
    positions: dict[int, list[int]] = {}
    for j, label in enumerate(labels):
        positions.setdefault(label, []).append(j)
    order = sorted(positions, key=lambda lab: (positions[lab][0], lab))
    rank = {lab: r for r, lab in enumerate(order)}
    part = [0] * n
    for j in range(n):  # members are topologically sorted, so predecessors come first
        part[j] = max([rank[labels[j]], *(part[p] for p in preds[j])])
    used = sorted(set(part))
    compact = {r: i for i, r in enumerate(used)}
    return [compact[p] for p in part]


def group_ops(graph: Graph, k: int = DEFAULT_GROUPS, seed: int = 0) -> Grouping:
    """Split ``graph`` into at most ``k`` acyclic op groups with METIS (one op group per METIS part).

    Args:
        graph: the op graph.
        k: number of op groups wanted (default 60); small graphs get at most ``len(ops) // 2``.
        seed: METIS seed; the same seed gives the same op groups.

    Returns:
        The grouping; op group order is topological.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"number of op groups must be an integer >= 1, got {k!r}")
    if not graph.ops:
        raise ValueError(f"graph {graph.name!r} has no ops to group")
    k = min(k, max(1, len(graph.ops) // 2))
    part = _partition(graph, range(len(graph.ops)), k, seed)
    groups: list[list[int]] = [[] for _ in range(max(part) + 1)]
    for op, g in enumerate(part):
        groups[g].append(op)
    return Grouping(tuple(tuple(g) for g in groups), tuple(part))


def split_ops(graph: Graph, ops: Sequence[int], k: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Split one op group into at most ``k`` acyclic METIS parts for model parallelism (one device each)."""
    if k < 1:
        raise ValueError(f"cannot split an op group into {k} METIS parts")
    members = sorted(ops)
    part = _partition(graph, members, k, seed)
    parts: list[list[int]] = [[] for _ in range(max(part, default=0) + 1)]
    for op, p in zip(members, part, strict=True):
        parts[p].append(op)
    return [tuple(p) for p in parts]


def grouping_from_names(graph: Graph, groups: Sequence[Sequence[str]]) -> Grouping:
    """The grouping a plan lists (op names per op group); checks it covers every op once, in topological
    order.

    Raises:
        ValueError: an op is unknown, missing, listed twice, or an op group feeds an earlier op group.
    """
    index = {op.name: i for i, op in enumerate(graph.ops)}
    op_group = [-1] * len(graph.ops)
    for g, names in enumerate(groups):
        for name in names:
            i = index.get(name)
            if i is None:
                raise ValueError(f"op group {g}: op {name!r} is not in graph {graph.name!r}")
            if op_group[i] >= 0:
                raise ValueError(f"op {name!r} is in op groups {op_group[i]} and {g}")
            op_group[i] = g
    missing = [graph.ops[i].name for i, g in enumerate(op_group) if g < 0]
    if missing:
        raise ValueError(f"{len(missing)} ops of graph {graph.name!r} are in no op group, e.g. {missing[:3]}")
    for src, dst, _ in graph.edges:
        if op_group[src] > op_group[dst]:
            raise ValueError(
                f"op group {op_group[src]} feeds the earlier op group {op_group[dst]} "
                f"(op {graph.ops[src].name!r} -> {graph.ops[dst].name!r})"
            )
    members: list[list[int]] = [[] for _ in groups]
    for i, g in enumerate(op_group):
        members[g].append(i)
    return Grouping(tuple(tuple(m) for m in members), tuple(op_group))
