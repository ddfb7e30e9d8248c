"""Monte-Carlo tree search over TAG strategies, guided by a prior (the heterogeneous GNN or uniform).

The tree decides one op group per level, heaviest group first (forward + backward time on the fastest
device type at the full batch). An action is ``(non-empty subset of device groups, option)`` with option
∈ {allreduce, ps, mp, duplicate}, every option on every subset (``ps`` puts one server on each machine of the
subset, the gradient's partitions spread over them; on a topology with server-only machines the search
also costs the servers on those machines, alone or added: :meth:`_Search.place_servers`). A node's partial
plan gives every undecided group the action of the first decided group, so every node below the root is a
complete plan the simulator can cost.
An ``mp`` group carries the split the simulator costs (:meth:`Simulator.mp_assignment`).

The general search first runs the data-parallel search (same budget, same seed), seeds its own tree with
that search's best plan and returns the faster of the two, so it is never predicted slower than the
data-parallel search; the general plan must be predicted :data:`GENERAL_MARGIN` faster to be preferred.

Selection is PUCT:

.. math::
    a^* = \\arg\\max_a\\; Q(s, a) + c\\,P(s, a)\\,\\frac{\\sqrt{N(s)}}{1 + n(s, a)}

with ``Q`` the mean reward of the edge (the node's own reward before its first visit), scaled to [0, 1]
by the least and greatest reward seen so far (:attr:`SearchConfig.normalize_q`), ``P`` the prior,
``N`` the visits of the node and ``n`` those of the edge, taken over the node's admitted actions only
(progressive widening): the

.. math::
    k(N) = \\lceil c_w\\,(N + 1)^{\\alpha} \\rceil

actions of highest prior (``c_w`` = :attr:`SearchConfig.widen_c`, ``α`` = :attr:`SearchConfig.widen_alpha`),
plus any action already taken. Equal priors (all of them under the uniform prior) are admitted in an order
drawn from the search's seed, so the prior decides what is tried and a uniform prior tries a random sample.
At the root an admitted action not yet tried goes first. A node's prior is computed when the search first
selects from it; most nodes stay leaves. A new node is valued by simulating its partial plan:

.. math::
    r = \\frac{t_{baseline}}{t} - 1 \\quad(\\text{feasible}), \\qquad r = -1 \\quad(\\text{OOM})

where the baseline is DP-NCCL over all devices, or model parallelism over all devices when DP-NCCL is
out of memory. While every plan tried so far is out of memory, selection only considers ``mp`` actions and
prefers those over more devices, moving towards more model parallelism until a plan fits.

The budget is a number of iterations and/or seconds; with an iteration budget the search is reproducible
for a given seed (ties are broken by a seeded generator). The best feasible plan seen is kept; at the end
the SFB solver (:mod:`tagps.strategy.sfb`) decides per all-reduced gradient whether sufficient-factor
broadcasting is cheaper. Plans are costed with Horovod-style tensor fusion (64 MiB buffers); the best one
keeps it unless the simulator says it is faster without. They are costed at the PS partition size that makes
``byteps-like`` fastest (:func:`tune_partition`); the best plan's is tuned again.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

import numpy as np

from tagps.strategy.baselines import HOROVOD_FUSION_BYTES, byteps_like, dp_nccl, op_group_plan
from tagps.strategy.layered import layered_paths
from tagps.strategy.plan import (
    SYNC_ALLOWED,
    CommSettings,
    GradientSync,
    OpGroupPlan,
    Plan,
    PlanError,
    Prediction,
)
from tagps.strategy.simulator import SimResult, Simulator, ring_allreduce_time

__all__ = [
    "OPTION_SLOT",
    "OPTION_SLOTS",
    "SEARCH_OPTIONS",
    "Action",
    "NodeSample",
    "PriorModel",
    "SearchConfig",
    "SearchContext",
    "SearchResult",
    "candidate_actions",
    "search",
    "tune_partition",
]

SEARCH_OPTIONS = ("allreduce", "ps", "duplicate", "mp")
REPLICATED = ("allreduce", "ps")  # the options a data-parallel plan may use
# Option slot in the GNN's encoding: one per option.
OPTION_SLOT = {"allreduce": 0, "ps": 1, "mp": 2, "duplicate": 3}
OPTION_SLOTS = 4
# PS chunk sizes the search tries on its best plan (0: BytePS's default): a chunk's pull waits for every
# worker's push of it, so few chunks per server pipeline badly, and each chunk costs messages' CPU (the
# simulator does not price a message's latency: 256 KiB, the best measured on 1 Gbit/s links, is the least).
PARTITION_CHOICES = (0, 1 << 20, 512 << 10, 256 << 10)
# A general plan replaces the data-parallel one only when predicted this much faster: it runs through the
# general executor (parts, activations between them), and a smaller gain lies inside the simulator's error.
# Measured 2026-12-06 (bench/e2e_cluster.py): transformer-mini's general plan, the data-parallel one with
# its embeddings duplicated, predicted 0.13 % faster, ran 16 % slower.
GENERAL_MARGIN = 0.02
MAX_ENUMERATED_GROUPS = 7  # all 2^n - 1 subsets up to here; above, a structured subset family
ROOT_FPU = 1e6  # value of an admitted, untried root action: above any reward, so it is tried next
# Passes of the refinement over every op group; a pass that changes nothing ends it sooner. Most gains come
# in the first pass: the tree decides the heavy groups, the refinement the many light ones below its depth.
REFINE_PASSES = 3

T = TypeVar("T")  # an action or its index: a tree path holds either


@dataclass(frozen=True)
class Action:
    """One decision for an op group.

    Args:
        devices: indices of the device groups (into ``topology.groups``), sorted, non-empty.
        option: one of :data:`SEARCH_OPTIONS`.
    """

    devices: tuple[int, ...]
    option: str


def _subsets(sim: Simulator) -> list[tuple[int, ...]]:
    """Candidate subsets of the device groups with devices (server-only machines run no ops): all of them
    for small topologies, a structured family otherwise."""
    workers = sim.topology.worker_indices
    n = len(workers)
    if n <= MAX_ENUMERATED_GROUPS:
        return [tuple(workers[i] for i in range(n) if mask >> i & 1) for mask in range(1, 1 << n)]
    speed = {i: sim.dgroups[i].count * sim.dtypes[i].peak_flops for i in workers}
    by_speed = sorted(workers, key=lambda i: (-speed[i], i))
    family = {(i,) for i in workers}
    family |= {tuple(sorted(by_speed[:k])) for k in range(2, n + 1)}
    for dev in {sim.dgroups[i].device for i in workers}:
        family.add(tuple(i for i in workers if sim.dgroups[i].device == dev))
    return sorted(family, key=lambda s: (len(s), s))


def candidate_actions(sim: Simulator) -> list[Action]:
    """Every action the search considers on ``sim``'s topology (a stable order: subsets, then options)."""
    return [Action(subset, option) for subset in _subsets(sim) for option in SEARCH_OPTIONS]


@dataclass(frozen=True)
class SearchConfig:
    """Hyperparameters of :func:`search`.

    Args:
        iterations: stop after this many iterations (None: no limit; then ``seconds`` must be set).
        seconds: stop after this many seconds of wall time (None: no limit).
        c_puct: exploration constant ``c`` of PUCT (default 1.5).
        prior_mix: weight of the uniform prior mixed into a model's prior (default 0.25).
        widen_c: progressive widening: a node visited ``N`` times chooses among its
            ``ceil(widen_c * (N + 1) ** widen_alpha)`` actions of highest prior and those already taken
            (default 1.0: one at the first visit, 10 after 99, 39 after 1500; None: among all its actions).
        widen_alpha: growth exponent of the widening (default 0.5).
        seed: seed of the tie-breaking generator and of the order of equal priors.
        data_parallel: only plans the first runtime executes: every group on the root's device groups,
            replicated (allreduce/ps); the plan's kind is ``data-parallel``.
        dp_first: for the general search, run the data-parallel search first (the same iteration
            budget; half of a time budget), seed the tree with its best plan and return the faster of the
            two; False searches with the general tree alone (training labels, studies of the tree).
        sfb: run the SFB solver on the best plan.
        optimizer: the training optimizer the plans assume (``sgd``, ``momentum``, ``adam``).
        normalize_q: PUCT compares ``(Q - min) / (max - min)`` over the rewards the search has seen (as
            MuZero) instead of ``Q``: rewards run from -1 to tens on small models, where raw ``Q`` drowns
            the prior term and ``c_puct`` would need retuning per model and topology (default True).
        refine: after the tree, refine its best plan one op group at a time (:meth:`_Search.refine`);
            False leaves the tree's plan as found (studies of the tree itself, training labels).
    """

    iterations: int | None = 1000
    seconds: float | None = None
    c_puct: float = 1.5
    prior_mix: float = 0.25
    widen_c: float | None = 1.0
    widen_alpha: float = 0.5
    seed: int = 0
    data_parallel: bool = False
    dp_first: bool = True
    sfb: bool = True
    optimizer: str = "adam"
    normalize_q: bool = True
    refine: bool = True

    def __post_init__(self) -> None:
        if self.iterations is None and self.seconds is None:
            raise ValueError("a search needs a budget: iterations, seconds or both")
        if self.iterations is not None and (
            isinstance(self.iterations, bool) or not isinstance(self.iterations, int) or self.iterations < 1
        ):
            raise ValueError(f"iterations must be an integer >= 1, got {self.iterations!r}")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"seconds must be > 0, got {self.seconds!r}")
        if not self.c_puct > 0:
            raise ValueError(f"c_puct must be > 0, got {self.c_puct!r}")
        if not 0 <= self.prior_mix <= 1:
            raise ValueError(f"prior_mix must be in [0, 1], got {self.prior_mix!r}")
        if self.widen_c is not None and not self.widen_c > 0:
            raise ValueError(f"widen_c must be > 0 or None, got {self.widen_c!r}")
        if not 0 <= self.widen_alpha <= 1:
            raise ValueError(f"widen_alpha must be in [0, 1], got {self.widen_alpha!r}")

    @property
    def two_phases(self) -> bool:
        """Whether :func:`search` runs the data-parallel search before the general tree."""
        return self.dp_first and not self.data_parallel

    @property
    def total_iterations(self) -> int | None:
        """Iterations :func:`search` runs at most, over both phases (None: bounded by time only)."""
        if self.iterations is None:
            return None
        return self.iterations * (2 if self.two_phases else 1)


@dataclass
class SearchContext:
    """What a prior model may look at: the simulator, the batch, the group order and the actions."""

    sim: Simulator
    batch: int
    order: tuple[int, ...]
    actions: list[Action]
    shares_weight: list[float]


class PriorModel(Protocol):
    """Scores candidate actions of the next op group (the GNN implements this)."""

    def priors(
        self, ctx: SearchContext, decided: Sequence[Action], result: SimResult | None, legal: np.ndarray
    ) -> np.ndarray:
        """Return a probability per legal action (``legal`` indexes ``ctx.actions``).

        Args:
            ctx: the search context.
            decided: actions of the first ``len(decided)`` groups of ``ctx.order``.
            result: the simulation of the partial plan of ``decided`` (None at the root).
            legal: indices into ``ctx.actions`` that may be taken.
        """
        ...


@dataclass
class _Node:
    decided: tuple[int, ...]  # action indices of the groups decided so far
    legal: np.ndarray
    value: float
    result: SimResult | None
    prior: np.ndarray | None = None  # set when the search first selects from the node
    rank: np.ndarray | None = None  # positions into ``legal`` in the order widening admits them
    visits: np.ndarray = field(init=False)
    total: np.ndarray = field(init=False)
    children: dict[int, _Node] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.visits = np.zeros(len(self.legal), dtype=np.int64)
        self.total = np.zeros(len(self.legal), dtype=np.float64)


@dataclass(frozen=True)
class NodeSample:
    """A searched node for training the prior: the state, its edges' visits and the best plan below each.

    Args:
        decided: the actions that lead to the node.
        result: the simulation of its partial plan (None at the root).
        legal: its actions (indices into the context's actions).
        visits: visits per legal action.
        best_time: per legal action, the fastest feasible iteration time in the subtree below that edge
            (``inf`` where the edge was not taken or nothing below it fits).
    """

    decided: tuple[Action, ...]
    result: SimResult | None
    legal: np.ndarray
    visits: np.ndarray
    best_time: np.ndarray


@dataclass
class SearchResult:
    """Outcome of :func:`search`.

    Args:
        plan: the best plan found (with its prediction), or None when no feasible plan was found.
        time_s: its simulated iteration time.
        baseline: name of the baseline (``dp-nccl``, or ``mp`` when DP-NCCL is out of memory).
        baseline_time_s: the baseline's simulated iteration time.
        iterations: iterations run (of both phases of a general search, numbered on).
        evaluations: simulations run.
        seconds: wall time of the search.
        iters_to_beat_baseline: first iteration whose best plan was faster than the baseline (None: never).
        history: ``(iteration, best time so far)`` whenever the best improved.
        samples: searched nodes with their visits and the best times below them (for training), when
            requested; of the general tree in a two-phase search.
        context: the search context the samples refer to.
    """

    plan: Plan | None
    time_s: float
    baseline: str
    baseline_time_s: float
    iterations: int
    evaluations: int
    seconds: float
    iters_to_beat_baseline: int | None
    history: list[tuple[int, float]]
    samples: list[NodeSample] = field(default_factory=list)
    context: SearchContext | None = None

    @property
    def speedup(self) -> float:
        """Baseline time over the best plan's time (0 when there is no plan)."""
        return self.baseline_time_s / self.time_s if self.plan is not None and self.time_s > 0 else 0.0


def _group_order(sim: Simulator, batch: int) -> tuple[int, ...]:
    """Op groups heaviest first.

    A group's weight is its forward + backward time on the fastest device type at the full batch plus
    the ring all-reduce of its parameters over every device at the topology's slowest bandwidth.
    """
    fastest = max(sim.topology.worker_indices, key=lambda g: (sim.dtypes[g].peak_flops, -g))
    n = sim.topology.num_devices
    slowest = min(min(row) for row in sim.bw)
    latency = sim.topology.inter_latency_s
    weight = [
        sum(sim.group_time(i, fastest, float(batch)))
        + ring_allreduce_time(g.param_bytes, n, slowest, latency, len(g.param_names))
        for i, g in enumerate(sim.groups)
    ]
    return tuple(sorted(range(len(sim.groups)), key=lambda i: (-weight[i], i)))


def _speed_weights(sim: Simulator, batch: int) -> list[float]:
    """Relative speed of one device of each device group (inverse of its whole-model compute time)."""
    per_device = max(1.0, batch / sim.topology.num_devices)
    weights = []
    for g in range(len(sim.dgroups)):
        t = sum(sum(sim.group_time(i, g, per_device)) for i in range(len(sim.groups)))
        weights.append(1.0 / t if t > 0 else 1.0)
    return weights


def _shares(sim: Simulator, batch: int, used: Sequence[int], weights: Sequence[float]) -> dict[str, int]:
    """Batch shares over the devices of ``used`` device groups, balanced for speed (greedy min-max).

    The devices of a group run in lockstep at the largest per-device batch among them, so each sample goes
    to the least loaded device of the group whose lockstep time ``max batch / speed`` grows least.
    """
    counts = {g: [0] * sim.dgroups[g].count for g in used}
    for _ in range(batch):
        best_g, best_cost = used[0], math.inf
        for g in used:
            row = counts[g]
            cost = max(max(row), min(row) + 1) / weights[g]
            if cost < best_cost:
                best_g, best_cost = g, cost
        row = counts[best_g]
        row[row.index(min(row))] += 1
    shares = {d: 0 for d in sim.topology.devices()}
    for g, row in counts.items():
        for k, c in enumerate(row):
            shares[f"{sim.dgroups[g].name}:{k}"] = c
    return shares


class _Search:
    """One tree search (mutable state of :func:`search`)."""

    def __init__(
        self,
        sim: Simulator,
        batch: int,
        config: SearchConfig,
        model: PriorModel | None,
        keep_samples: bool,
        like: _Search | None = None,
    ) -> None:
        """``like``: an earlier phase of the same search, whose partition size and baseline this one takes."""
        self.sim, self.batch, self.config, self.model = sim, batch, config, model
        self.keep_samples = keep_samples
        self.rng = random.Random(config.seed)
        self.np_rng = np.random.default_rng(config.seed)  # orders equal priors
        self.actions = candidate_actions(sim)
        self.order = _group_order(sim, batch)
        self.ctx = SearchContext(sim, batch, self.order, self.actions, _speed_weights(sim, batch))
        self.mp_size = np.array([len(a.devices) if a.option == "mp" else 0 for a in self.actions], float)
        self.evaluations = 0
        self.parts: dict[tuple[int, Action], tuple[OpGroupPlan, dict[str, GradientSync]]] = {}
        self.outcomes: dict[tuple[int, ...], tuple[float, SimResult | None]] = {}  # per op group's action
        self.shares: dict[tuple[int, ...], dict[str, int]] = {}  # per set of replicated device groups
        self.best: tuple[float, Plan, SimResult] | None = None
        self.best_decided: tuple[int, ...] = ()  # the tree path of ``best``
        self.vmin, self.vmax = math.inf, -math.inf  # the rewards seen (to normalise Q)
        if like is not None:
            self.partition_bytes = like.partition_bytes
            self.baseline, self.baseline_time = like.baseline, like.baseline_time
            return
        # Every plan is costed at one PS partition size, BytePS's plan's best: a ps action judged at the 4 MB
        # default would lose to all-reduce where smaller chunks make it win. The best plan's is tuned again.
        reference = byteps_like(sim, batch, config.optimizer)
        self.partition_bytes = tune_partition(sim, reference)[0].comm.partition_bytes
        base = dp_nccl(sim, batch, config.optimizer)
        base_result = sim.evaluate(base)
        self.baseline = "dp-nccl"
        if not base_result.feasible:
            everything = sim.topology.worker_indices
            base = self.plan([Action(everything, "mp")], kind="general")
            base_result = sim.evaluate(base)
            self.baseline = "mp"
        self.baseline_time = base_result.iteration_time

    # ------------------------------------------------------------------ plans
    def plan(self, decided: Sequence[Action], kind: str | None = None) -> Plan:
        """The partial plan of ``decided`` (undecided groups follow the first decided action).

        Gradient sync overlaps the backward pass, with Horovod-style 64 MiB tensor fusion. The plan's
        ``kind`` is the search's unless given.
        """
        sim = self.sim
        groups = []
        gradients: dict[str, GradientSync] = {}
        replicated: set[int] = set()
        for i, action in enumerate(self.per_group(decided)):
            group, syncs = self.group_part(i, action)
            groups.append(group)
            gradients.update(syncs)
            if action.option in REPLICATED:
                replicated.update(action.devices)
        used = sorted(replicated) if replicated else list(sim.topology.worker_indices)
        kind = kind or ("data-parallel" if self.config.data_parallel else "general")
        return Plan(
            sim.topology,
            sim.graph.name,
            self.batch,
            tuple(groups),
            gradients,
            dict(self.shares_of(tuple(used))),
            kind=kind,
            optimizer=self.config.optimizer,
            comm=CommSettings(
                overlap=True, fusion_bytes=HOROVOD_FUSION_BYTES, partition_bytes=self.partition_bytes
            ),
        ).validate()

    def group_part(self, index: int, action: Action) -> tuple[OpGroupPlan, dict[str, GradientSync]]:
        """Op group ``index``'s entry and its parameters' gradient entries under ``action``, made once (a
        search builds thousands of plans from the same few parts)."""
        key = (index, action)
        part = self.parts.get(key)
        if part is None:
            sim = self.sim
            placement = tuple(sim.dgroups[g].name for g in action.devices)
            sync = SYNC_ALLOWED[action.option][0]
            part = self.parts[key] = (
                op_group_plan(sim, index, placement, action.option),
                {name: GradientSync(index, sync) for name in sim.groups[index].param_names},
            )
        return part

    def per_group(self, decided: Sequence[T]) -> list[T]:
        """Each op group's action (or action index) under the tree path ``decided``: undecided groups follow
        the first decided action, so paths that differ only in where they stop can be the same plan."""
        per_group = [decided[0]] * len(self.order)
        for level, action in enumerate(decided):
            per_group[self.order[level]] = action
        return per_group

    def shares_of(self, used: tuple[int, ...]) -> dict[str, int]:
        """:func:`_shares` over ``used``, once per set (the greedy split loops over every sample)."""
        hit = self.shares.get(used)
        if hit is None:
            hit = self.shares[used] = _shares(self.sim, self.batch, used, self.ctx.shares_weight)
        return hit

    def evaluate(self, decided: tuple[int, ...]) -> tuple[float, SimResult | None]:
        """Reward and simulation of a node's partial plan; remembers the best feasible plan.

        A plan is simulated once: a fifth of a search's paths (tree and refinement) repeat an earlier one's
        plan, and the cached outcome is exactly what simulating it again would give.
        """
        key = tuple(self.per_group(decided))
        known = self.outcomes.get(key)
        if known is not None:
            return known
        value, result = self.outcomes[key] = self._evaluate(decided)
        self.vmin, self.vmax = min(self.vmin, value), max(self.vmax, value)
        return value, result

    def _evaluate(self, decided: tuple[int, ...]) -> tuple[float, SimResult | None]:
        try:
            plan = self.plan([self.actions[a] for a in decided])
        except PlanError:  # e.g. a batch too small to give every replicated group a device
            return -1.0, None
        plan, result = self.place_servers(plan)
        if not result.feasible:
            return -1.0, result
        t = result.iteration_time
        if self.best is None or t < self.best[0]:
            self.best = (t, plan, result)
            self.best_decided = decided
        return self.baseline_time / t - 1.0, result

    def place_servers(self, plan: Plan) -> tuple[Plan, SimResult]:
        """Simulate ``plan`` under each PS server placement worth trying; return the fastest and its result.

        By default each ps group's servers sit on the machines of its placement (``ps_servers`` empty).
        When the topology has server-only machines and the plan has ps groups, two more placements are
        costed: the server-only machines alone, and the ps groups' machines plus the server-only ones
        (BytePS: a server on every machine). The first placement wins ties.
        """
        sim = self.sim
        result = sim.evaluate(plan)
        self.evaluations += 1
        spare = sim.topology.server_only
        ps_groups = [g for g in plan.groups if g.option == "ps"]
        if not spare or not ps_groups or not result.feasible:  # servers hold no device memory
            return plan, result
        own = tuple(dict.fromkeys(name for g in ps_groups for name in g.placement))
        for servers in (spare, own + spare):
            other = replace(plan, ps_servers=servers)
            other_result = sim.evaluate(other)
            self.evaluations += 1
            if other_result.iteration_time < result.iteration_time:
                plan, result = other, other_result
        return plan, result

    def seed_layered(self, dp: _Search) -> tuple[int, ...]:
        """Try the two-layout plans (:mod:`tagps.strategy.layered`); return the path the tree starts from:
        the best of them when it beats ``dp``'s best data-parallel plan, else that plan's path."""
        if dp.best is None:
            return dp.best_decided

        @functools.cache
        def dp_time(i: int) -> float:
            _, result = self.evaluate((i,))
            return result.iteration_time if result is not None and result.feasible else math.inf

        pairs = [(a.devices, a.option) for a in self.actions]
        for path in layered_paths(pairs, self.order, dp_time):
            self.evaluate(path)
        return self.best_decided if self.best is not None and self.best[0] < dp.best[0] else dp.best_decided

    # ------------------------------------------------------------------ tree
    def legal(self, decided: tuple[int, ...]) -> np.ndarray:
        """Indices of the actions allowed at the level after ``decided``."""
        if len(decided) >= len(self.order):
            return np.zeros(0, dtype=np.int64)
        if not self.config.data_parallel:
            return np.arange(len(self.actions))
        if not decided:
            return np.array([k for k, a in enumerate(self.actions) if a.option in REPLICATED], dtype=np.int64)
        root = self.actions[decided[0]].devices
        return np.array(
            [k for k, a in enumerate(self.actions) if a.devices == root and a.option in REPLICATED],
            dtype=np.int64,
        )

    def node(self, decided: tuple[int, ...], value: float, result: SimResult | None) -> _Node:
        return _Node(decided, self.legal(decided), value, result)

    def score_actions(self, node: _Node) -> None:
        """Set ``node``'s prior and the order in which widening admits its actions."""
        legal = node.legal
        if self.model is None:
            prior = np.full(len(legal), 1.0 / len(legal))
        else:
            prior = np.asarray(
                self.model.priors(self.ctx, [self.actions[a] for a in node.decided], node.result, legal),
                dtype=float,
            )
            if prior.shape != legal.shape or not np.all(np.isfinite(prior)) or prior.min() < 0:
                raise RuntimeError(f"prior model returned an invalid prior of shape {prior.shape}")
            # Mixed with the uniform prior so that a confident model never starves an action forever.
            prior = (1 - self.config.prior_mix) * prior / prior.sum() + self.config.prior_mix / len(legal)
        # A seeded shuffle before the stable sort: equal priors are admitted in random order, not list order.
        shuffled = self.np_rng.permutation(len(legal))
        node.rank = shuffled[np.argsort(-prior[shuffled], kind="stable")]
        node.prior = prior

    def width(self, node: _Node, visits: int) -> int:
        """Number of actions of highest prior that ``node``, visited ``visits`` times, chooses among."""
        c, actions = self.config.widen_c, len(node.legal)
        return actions if c is None else min(actions, math.ceil(c * (visits + 1) ** self.config.widen_alpha))

    def select(self, node: _Node) -> int:
        """Position (into ``node.legal``) of the PUCT choice among the admitted actions; only mp actions
        while nothing has fit."""
        if node.prior is None:
            self.score_actions(node)
        n = node.visits
        visits = int(n.sum())
        # First-play urgency: below the root an untried edge is assumed as good as the node's own plan.
        # At the root (whole-model actions, the decision that matters most) an admitted action is tried
        # before any is refined.
        fpu = ROOT_FPU if not node.decided else node.value
        q = np.divide(node.total, n, out=np.full_like(node.total, fpu), where=n > 0)
        if self.config.normalize_q and self.vmax > self.vmin:
            q = np.where(q < ROOT_FPU, (q - self.vmin) / (self.vmax - self.vmin), q)
        score = q + self.config.c_puct * node.prior * math.sqrt(visits + 1) / (1 + n)
        width = self.width(node, visits)
        if width < len(n):
            admitted = n > 0
            admitted[node.rank[:width]] = True
            score = np.where(admitted, score, -np.inf)
        if self.best is None and self.evaluations:
            mp = self.mp_size[node.legal]
            if mp.any():
                # Nothing fits yet: among all mp actions, untried ones over more devices first.
                score = np.where(mp > 0, mp / (1 + n) + q, -np.inf)
        top = np.flatnonzero(score >= score.max() - 1e-12)
        return int(top[self.rng.randrange(len(top))]) if len(top) > 1 else int(top[0])

    def descend(self, root: _Node) -> tuple[list[tuple[_Node, int]], float]:
        """One PUCT descent that expands one node: the edges taken and the value to back up."""
        node, path = root, []
        while True:
            if len(node.legal) == 0:  # every group decided: the node's plan is complete
                return path, node.value
            pos = self.select(node)
            path.append((node, pos))
            action = int(node.legal[pos])
            child = node.children.get(action)
            if child is None:
                decided = (*node.decided, action)
                value, result = self.evaluate(decided)
                node.children[action] = self.node(decided, value, result)
                return path, value
            node = child

    def expand_path(self, root: _Node, decided: tuple[int, ...]) -> tuple[list[tuple[_Node, int]], float]:
        """Expand the nodes along ``decided`` from a fresh root: the edges taken and the last node's value."""
        node, path, value = root, [], root.value
        for action in decided:
            path.append((node, int(np.flatnonzero(node.legal == action)[0])))
            child = (*node.decided, action)
            value, result = self.evaluate(child)
            node = node.children[action] = self.node(child, value, result)
        return path, value

    def run(
        self, progress: Callable[[int, float | None], None] | None, seed: tuple[int, ...] = ()
    ) -> SearchResult:
        """Search within the budget; the first iteration expands ``seed`` (a path of action indices)."""
        config = self.config
        start = time.perf_counter()
        root = self.node((), 0.0, None)
        history: list[tuple[int, float]] = []
        beat: int | None = None
        it = 0
        while True:
            if config.iterations is not None and it >= config.iterations:
                break
            if config.seconds is not None and time.perf_counter() - start >= config.seconds:
                break
            it += 1
            path, value = self.expand_path(root, seed) if it == 1 and seed else self.descend(root)
            for parent, pos in path:
                parent.visits[pos] += 1
                parent.total[pos] += value
            if self.best is not None and (not history or self.best[0] < history[-1][1]):
                history.append((it, self.best[0]))
                if beat is None and self.best[0] < self.baseline_time:
                    beat = it
            if progress is not None:
                progress(it, self.best[0] if self.best else None)
        if config.refine and self.refine(start) and self.best is not None:
            history.append((it, self.best[0]))
        plan, t = self.finish()
        samples = self.samples(root) if self.keep_samples else []
        return SearchResult(
            plan,
            t,
            self.baseline,
            self.baseline_time,
            it,
            self.evaluations,
            time.perf_counter() - start,
            beat,
            history,
            samples,
            self.ctx if self.keep_samples else None,
        )

    def refine(self, start: float) -> bool:
        """Coordinate descent from the best plan: for each op group in turn (heaviest first), the fastest of
        :meth:`neighbours` with every other group fixed; up to :data:`REFINE_PASSES` passes. Returns
        whether it found a faster plan.

        The tree's depth-first decisions leave the op groups below the levels it reached following the first
        group's action; one group's move at a time is where a layer's own placement or sync is found
        (a light group off the slow link, a classifier by ``ps`` beside convolutions by all-reduce). A
        time budget (``config.seconds``) also bounds the refinement, counted from ``start``.
        """
        if self.best is None:
            return False
        seconds = self.config.seconds
        index = {a: k for k, a in enumerate(self.actions)}
        first = self.best[0]
        decided = self.best_decided
        path = [*decided, *[decided[0]] * (len(self.order) - len(decided))]
        for _ in range(REFINE_PASSES):
            before = self.best[0]
            for level in range(len(path)):
                if seconds is not None and time.perf_counter() - start >= seconds:
                    return self.best[0] < first
                for k in self.neighbours(path, level, index):
                    trial = (*path[:level], k, *path[level + 1 :])
                    known = self.best[0]
                    self.evaluate(trial)
                    if self.best[0] < known:
                        path = list(trial)
            if not self.best[0] < before:
                break
        return self.best[0] < first

    def neighbours(self, path: Sequence[int], level: int, index: dict[Action, int]) -> list[int]:
        """Actions the refinement tries for the op group at ``level`` of the complete ``path``: the other
        options on its device groups, its option on one device group more or fewer, and every action another
        op group takes; in a data-parallel search only the replicated options on the plan's device groups."""
        current = self.actions[path[level]]
        if self.config.data_parallel:
            tried = [Action(current.devices, option) for option in REPLICATED]
        else:
            tried = [Action(current.devices, option) for option in SEARCH_OPTIONS]
            for g in self.sim.topology.worker_indices:
                moved = tuple(sorted(set(current.devices) ^ {g}))
                if moved:
                    tried.append(Action(moved, current.option))
            tried += [self.actions[k] for k in path]
        out = dict.fromkeys(index[a] for a in tried if a in index and a != current)
        return list(out)

    def finish(self) -> tuple[Plan | None, float]:
        """Polish the best plan (without fusion if faster, its PS partition size, SFB) and attach the
        prediction."""
        if self.best is None:
            return None, math.inf
        t, plan, result = self.best
        sim = self.sim
        unfused = replace(plan, comm=CommSettings(overlap=True, partition_bytes=plan.comm.partition_bytes))
        unfused_result = sim.evaluate(unfused)
        if unfused_result.feasible and unfused_result.iteration_time < t:
            t, plan, result = unfused_result.iteration_time, unfused, unfused_result
        plan, result = tune_partition(sim, plan, result)
        t = result.iteration_time
        if self.config.sfb:
            from tagps.strategy.sfb_milp import apply_sfb

            with_sfb = apply_sfb(sim, plan)  # the solver's choices, costed by the simulator
            if with_sfb is not plan:
                sfb_result = sim.evaluate(with_sfb)
                if sfb_result.feasible and sfb_result.iteration_time < t:
                    t, plan, result = sfb_result.iteration_time, with_sfb, sfb_result
        predicted = Prediction(t, dict(result.peak_memory), self.baseline, self.baseline_time)
        return replace(plan, predicted=predicted).validate(), t

    def samples(self, root: _Node) -> list[NodeSample]:
        """Nodes with at least two tried actions, with their edge visits and the best time below each edge."""
        out: list[NodeSample] = []

        def best_below(node: _Node) -> float:  # post-order: fills out and returns the subtree's best time
            best = np.full(len(node.legal), math.inf)
            for action, child in node.children.items():
                best[int(np.flatnonzero(node.legal == action)[0])] = best_below(child)
            if int((node.visits > 0).sum()) >= 2:
                decided = tuple(self.actions[a] for a in node.decided)
                out.append(NodeSample(decided, node.result, node.legal, node.visits.copy(), best))
            own = node.result.iteration_time if node.result is not None and node.result.feasible else math.inf
            return min(own, float(best.min(initial=math.inf)))

        best_below(root)
        return out


def tune_partition(sim: Simulator, plan: Plan, result: SimResult | None = None) -> tuple[Plan, SimResult]:
    """``plan`` with the fastest PS partition size of :data:`PARTITION_CHOICES` (``comm.partition_bytes``)
    on ``sim``, and its result; a plan without ``ps`` gradients comes back as it is.

    ``plan`` may be made for another topology of ``sim``'s device groups (a measured one beside a calibrated
    simulator): it is costed on ``sim``'s and comes back on its own.

    Args:
        result: ``plan``'s result on ``sim`` if known (saves one evaluation).
    """
    costed = plan if plan.topology is sim.topology else replace(plan, topology=sim.topology)
    best_comm, best = plan.comm, result if result is not None else sim.evaluate(costed)
    if not plan.ps_groups():
        return plan, best
    for size in PARTITION_CHOICES:
        if size == plan.comm.partition_bytes:
            continue
        comm = replace(plan.comm, partition_bytes=size)
        tried = sim.evaluate(replace(costed, comm=comm))
        if tried.feasible and tried.iteration_time < best.iteration_time:
            best_comm, best = comm, tried
    return (plan if best_comm is plan.comm else replace(plan, comm=best_comm)), best


def search(
    sim: Simulator,
    batch: int,
    config: SearchConfig | None = None,
    model: PriorModel | None = None,
    progress: Callable[[int, float | None], None] | None = None,
    keep_samples: bool = False,
) -> SearchResult:
    """Search a strategy for ``sim``'s model and topology with MCTS.

    A general search (``config.data_parallel`` False) with ``config.dp_first`` runs two phases: the
    data-parallel search, then a general tree seeded with its best plan; the faster plan wins.

    Args:
        sim: the simulator (graph, grouping and topology).
        batch: global batch size (>= 1).
        config: budget and hyperparameters (default :class:`SearchConfig`).
        model: prior over actions (e.g. :class:`tagps.strategy.gnn.GNNPrior`); uniform when None.
        progress: called after every iteration with ``(iteration, best time so far or None)``;
            iterations are numbered on across phases up to ``config.total_iterations``.
        keep_samples: return the searched nodes with their visits and the best time below each edge
            (training data).

    Returns:
        The :class:`SearchResult`; its ``plan`` is None when no feasible plan was found.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    config = config or SearchConfig()
    if not config.two_phases:
        return _Search(sim, batch, config, model, keep_samples).run(progress)
    # The general space holds the data-parallel one: searching that first (its own tree, the same
    # iterations, so exactly the plan `--data-parallel` gives) and seeding the general tree with its best
    # plan makes the general search never predicted slower, and lets the tree refine that plan.
    seconds = None if config.seconds is None else config.seconds / 2
    first = _Search(sim, batch, replace(config, data_parallel=True, seconds=seconds), model, False)
    dp = first.run(progress)

    def shifted(iteration: int, best: float | None) -> None:  # iterations and best over both phases
        known = [t for t in (best, dp.time_s) if t is not None and t < math.inf]
        progress(dp.iterations + iteration, min(known) if known else None)

    tree = _Search(sim, batch, replace(config, seconds=seconds), model, keep_samples, like=first)
    general = tree.run(shifted if progress is not None else None, tree.seed_layered(first))
    return _merge(dp, general)


def _merge(dp: SearchResult, general: SearchResult) -> SearchResult:
    """One result for both phases: the faster plan (the data-parallel one unless the general one is
    :data:`GENERAL_MARGIN` faster), counts summed."""
    faster = general.plan is not None and general.time_s < dp.time_s * (1 - GENERAL_MARGIN)
    best = general if faster or dp.plan is None else dp
    history = list(dp.history)
    for iteration, t in general.history if best is general else ():
        if not history or t < history[-1][1]:
            history.append((dp.iterations + iteration, t))
    beat = dp.iters_to_beat_baseline
    if beat is None and general.iters_to_beat_baseline is not None:
        beat = dp.iterations + general.iters_to_beat_baseline
    return SearchResult(
        best.plan,
        best.time_s,
        general.baseline,
        general.baseline_time_s,
        dp.iterations + general.iterations,
        dp.evaluations + general.evaluations,
        dp.seconds + general.seconds,
        beat,
        history,
        general.samples,
        general.context,
    )
