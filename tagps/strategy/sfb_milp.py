"""Sufficient-factor broadcasting (SFB): one small MILP per all-reduced ``nn.Linear`` weight gradient.

The gradient of a Linear weight is :math:`\\nabla W = \\delta^\\top x`: instead of all-reducing
:math:`\\nabla W` (S bytes), the replicas can all-gather the *sufficient factors* (the layer's input
:math:`x` and output gradient :math:`\\delta` of every sample) and each recompute :math:`\\nabla W` for the
whole batch. Duplicating ops upstream of the layer changes which tensors are the factors (their inputs
instead of the layer's) at the price of recomputing them. For a gradient of op :math:`o` replicated over
:math:`n` devices with slowest ring link :math:`B` and latency :math:`\\alpha`, global batch :math:`b` and
candidate set :math:`C` (``o`` and its parameter-free ancestors up to ``depth`` edges away), the program is

.. math::
    \\min_{s, x, y}\\; (1 - s)\\,T_{ar}
        + s\\,\\Big((n-1)\\alpha + \\frac{n-1}{n}\\frac{b\\,D_o}{B} + T_{w}\\Big)
        + \\sum_{(u,v) \\in E_C} y_{uv}\\,\\frac{n-1}{n}\\frac{b\\,S_{uv}}{B}
        + \\sum_{v \\in C \\setminus \\{o\\}} x_v\\,T_v

    \\text{s.t.}\\quad x_o = s, \\qquad
    y_{uv} \\ge x_v - x_u \\;\\; (u \\in C), \\qquad y_{uv} \\ge x_v \\;\\; (u \\notin C), \\qquad
    s, x, y \\in \\{0, 1\\}

where :math:`T_{ar}` is the ring all-reduce of the gradient
(:func:`~tagps.strategy.simulator.ring_allreduce_time`), :math:`E_C` the tensors entering ops of ``C``
(:math:`S_{uv}` bytes per sample; inputs without a producer op count as coming from outside),
:math:`D_o` the bytes per sample of the layer's output gradient, :math:`T_w` the recomputation of
:math:`\nabla W` for the samples of the other devices and :math:`T_v` the forward of :math:`v` for those
samples, both on the slowest device of the ring (roofline times of
:class:`~tagps.strategy.devices.DeviceType`). ``x_v = 1`` duplicates op ``v``; ``y_uv = 1`` sends the
tensor ``u → v`` as a factor. The solver is HiGHS (``highspy``) through cvxpy, or CBC (``cylp``) when
asked for and installed. A gradient whose cheapest conceivable SFB (only :math:`D_o`, latency and
:math:`T_w`) is no cheaper than :math:`T_{ar}` is decided without a solve.

The simulator then costs the plan with the chosen factors (:meth:`Simulator.sfb_factors`).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace
from functools import cache

from tagps.strategy.plan import GradientSync, Plan
from tagps.strategy.simulator import Simulator, ring_allreduce_time

__all__ = ["SFB_KINDS", "SFBDecision", "apply_sfb", "solve_gradient"]

SFB_KINDS = ("Linear",)  # ops whose weight gradient is an outer product of the factors
SOLVE_LIMIT_S = 0.5
_LIMITS = {"HIGHS": {"time_limit": SOLVE_LIMIT_S}, "CBC": {"maximumSeconds": SOLVE_LIMIT_S}}


@dataclass(frozen=True)
class SFBDecision:
    """The solver's answer for one gradient.

    Args:
        param: parameter name.
        use_sfb: whether SFB is cheaper than all-reduce.
        ops: the duplicated ops (owner first) when ``use_sfb``.
        allreduce_s: the all-reduce's cost.
        sfb_s: the best SFB cost found (``inf`` when no SFB is possible).
        solve_s: wall time of the solve (0 when decided without one).
    """

    param: str
    use_sfb: bool
    ops: tuple[str, ...]
    allreduce_s: float
    sfb_s: float
    solve_s: float


def _ring_of(sim: Simulator, plan: Plan, group: int) -> tuple[int, float, float, list[tuple[int, float]]]:
    """Devices, slowest link, latency and ``(device group, local batch)`` of a replicated op group."""
    topo = sim.topology
    per = {
        name: [plan.batch_shares.get(d, 0) for d in topo.group(name).devices()]
        for name in plan.groups[group].placement
    }
    total = sum(sum(shares) for shares in per.values())
    used = {sim.dindex[name]: shares for name, shares in per.items() if any(shares)}
    members = {g: sum(1 for x in shares if x > 0) for g, shares in used.items()}
    local = [(g, plan.batch_size * max(shares) / total) for g, shares in used.items()]
    n = sum(members.values())
    if n <= 1:
        return n, float("inf"), 0.0, local
    bmin, latency = sim.ring_link(members)
    return n, bmin, latency, local


@cache
def _silence_highs_banner() -> None:
    """Create the process's first HiGHS instance with stdout closed: HiGHS prints its banner then, once."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _candidates(sim: Simulator, owner: int, depth: int) -> list[int]:
    """The owner op and its parameter-free ancestors up to ``depth`` edges away (owner first)."""
    preds: dict[int, list[int]] = {}
    for src, dst, _ in sim.graph.edges:
        preds.setdefault(dst, []).append(src)
    found, frontier = [owner], [owner]
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for u in preds.get(v, []):
                if u not in found and not sim.graph.ops[u].params:
                    found.append(u)
                    nxt.append(u)
        frontier = nxt
    return found


def solve_gradient(
    sim: Simulator, plan: Plan, param: str, depth: int = 2, solver: str = "HIGHS"
) -> SFBDecision:
    """Decide with the MILP of the module docstring whether ``param`` should use SFB in ``plan``.

    Args:
        sim: the plan's simulator.
        plan: a plan in which ``param``'s op group is replicated (allreduce/ps).
        param: the parameter name (the weight of an ``nn.Linear``).
        depth: how many edges upstream of the layer the candidate ops reach (default 2).
        solver: ``HIGHS`` (default) or ``CBC``.

    Returns:
        The :class:`SFBDecision`.

    Raises:
        ValueError: the parameter is unknown, not a Linear weight, or its group is not replicated.
        RuntimeError: the solver failed. A solve stopped by the 0.5 s limit keeps the all-reduce.
    """
    if solver not in _LIMITS:
        raise ValueError(f"SFB solver must be one of {sorted(_LIMITS)}, got {solver!r}")
    if param not in sim.owner_op:
        raise ValueError(f"parameter {param!r} is not in graph {sim.graph.name!r}")
    owner = sim.owner_op[param]
    op = sim.graph.ops[owner]
    if op.kind not in SFB_KINDS or param != max(op.params, key=lambda p: sim.graph.params[p]):
        raise ValueError(f"SFB applies to the weight of a {'/'.join(SFB_KINDS)} op, not to {param!r}")
    group = plan.gradients[param].group
    if plan.groups[group].option not in ("allreduce", "ps"):
        raise ValueError(f"parameter {param!r}: op group {group} is not replicated")
    n, bmin, lat, members = _ring_of(sim, plan, group)
    size = sim.graph.params[param]
    allreduce = ring_allreduce_time(size, n, bmin, lat) if n > 1 else 0.0
    if n <= 1:
        return SFBDecision(param, False, (), allreduce, float("inf"), 0.0)
    b = float(plan.batch_size)
    per_byte = (n - 1) / n * b / bmin
    wgrad_flops = op.fwd_flops * size / max(op.param_bytes, 1)

    def recompute(flops: float, nbytes: float) -> float:
        # Every device recomputes for the samples of the others; the slowest one sets the pace.
        return max(sim.dtypes[g].op_time(flops * (b - mine), nbytes * b) for g, mine in members)

    t_w = recompute(wgrad_flops, op.in_bytes + op.out_bytes)
    floor = lat * (n - 1) + per_byte * op.out_bytes + t_w
    if floor >= allreduce:
        return SFBDecision(param, False, (), allreduce, floor, 0.0)

    import cvxpy as cp

    cand = _candidates(sim, owner, depth)
    pos = {v: k for k, v in enumerate(cand)}
    ops = sim.graph.ops
    x = cp.Variable(len(cand), boolean=True)
    s = x[0]
    inputs: list[tuple[int | None, int, int]] = []  # (producer or None, consumer position, bytes)
    produced: dict[int, int] = {}
    for src, dst, nbytes in sim.graph.edges:
        if dst in pos:
            inputs.append((src, pos[dst], nbytes))
            produced[dst] = produced.get(dst, 0) + nbytes
    for v in cand:  # tensors without a producer op (model inputs) come from outside
        extra = ops[v].in_bytes - produced.get(v, 0)
        if extra > 0:
            inputs.append((None, pos[v], extra))
    y = cp.Variable(len(inputs), boolean=True)
    cons = []
    for k, (src, c, _) in enumerate(inputs):
        cons.append(y[k] >= x[c] - x[pos[src]] if src in pos else y[k] >= x[c])
    dup_cost = [recompute(ops[v].fwd_flops, ops[v].in_bytes + ops[v].out_bytes) for v in cand]
    objective = (
        (1 - s) * allreduce
        + s * floor
        + per_byte * sum(nbytes * y[k] for k, (_, _, nbytes) in enumerate(inputs))
        + sum(dup_cost[k] * x[k] for k in range(1, len(cand)))
    )
    problem = cp.Problem(cp.Minimize(objective), cons)
    if solver == "HIGHS":
        _silence_highs_banner()
    start = time.perf_counter()
    try:
        # The solver stops at the limit; a problem it could not finish keeps the all-reduce.
        problem.solve(solver=getattr(cp, solver), **_LIMITS[solver])
    except cp.error.SolverError as exc:
        raise RuntimeError(f"SFB MILP of {param!r} failed with {solver}: {exc}") from exc
    elapsed = time.perf_counter() - start
    if problem.status != cp.OPTIMAL or x.value is None:
        return SFBDecision(param, False, (), allreduce, float("inf"), elapsed)
    chosen = [cand[k] for k in range(len(cand)) if x.value[k] > 0.5]
    use = bool(chosen) and chosen[0] == owner
    return SFBDecision(
        param,
        use,
        tuple(ops[v].name for v in chosen) if use else (),
        allreduce,
        float(problem.value) if use else float("inf"),
        elapsed,
    )


def apply_sfb(sim: Simulator, plan: Plan, depth: int = 2, solver: str = "HIGHS") -> Plan:
    """Return ``plan`` with SFB for every all-reduced Linear weight where the MILP says it pays off.

    Args:
        sim: the plan's simulator.
        plan: the plan.
        depth: see :func:`solve_gradient`.
        solver: see :func:`solve_gradient`.

    Returns:
        A new validated plan, or ``plan`` itself when no gradient changes.
    """
    gradients = dict(plan.gradients)
    changed = False
    for name, grad in plan.gradients.items():
        if grad.sync != "allreduce":
            continue
        op = sim.graph.ops[sim.owner_op[name]]
        if op.kind not in SFB_KINDS or name != max(op.params, key=lambda p: sim.graph.params[p]):
            continue
        decision = solve_gradient(sim, plan, name, depth, solver)
        if decision.use_sfb:
            gradients[name] = GradientSync(grad.group, "sfb", decision.ops)
            changed = True
    return replace(plan, gradients=gradients).validate() if changed else plan
