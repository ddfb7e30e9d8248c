"""The general-plan executor: train a model the way any plan of the IR says, on the job's worker processes.

:func:`distribute` splits the model with ``torch.fx`` at the plan's op groups (op names are fx node names)
into stages (:mod:`tagps.torch.layout`); each worker builds only the stages placed on its plan device.
One training step (:meth:`DistributedModel.train_step`) then runs, on every worker, the same global
schedule:

- **forward**, stage by stage in plan order: a stage's inputs are assembled from the rows this device holds
  and point-to-point receives from the devices that produced the other rows (re-split by the receiving
  stage's rows); its outputs are sent on as soon as they exist;
- **loss** on the devices of the stage that produces the model's output, each on its rows, weighted by
  ``rows / batch`` so that the contributions add up to the global mean loss (a ``duplicate`` last stage
  counts it once);
- **backward**, stage by stage in reverse: output gradients arrive from the devices that consumed the
  rows (one consumer per row: the first device of a ``duplicate`` consumer) and go to *every* device that
  holds those rows (each ``duplicate`` replica needs the whole gradient, since its copy is never synced);
- **gradient sync** of each replicated stage among its own devices only, with the plan's method per
  gradient (``allreduce`` over a subgroup, ``ps``, ``sfb`` with the plan's ``sfb_ops``), started by
  gradient hooks during backward when ``comm.overlap`` is set, in buckets of ``comm.fusion_bytes``.

Because every device's loss is already a share of the global mean, gradients are *summed* across replicas:
after :meth:`DistributedModel.train_step` every parameter holds the full-batch gradient, as if one process
had trained the global batch. These are the semantics the simulator costs (``docs/simulator.md``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from tagps.comm import collectives
from tagps.comm.handle import Handle
from tagps.comm.sufficient_factors import SufficientFactors
from tagps.config import CommConfig
from tagps.strategy.plan import Plan, PlanError, load
from tagps.torch import ops
from tagps.torch.buckets import FlatBucket, fused_sum, fusion_units, numel, unit_key
from tagps.torch.layout import Stage, plan_stages

__all__ = ["DistributedModel", "distribute"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _ValueInfo:
    """Shape facts of one fx value that crosses stages, at the global batch.

    ``batch_dim`` is the dimension that grows with the batch (``None``: the value does not depend on it and
    every device holds all of it); ``per_sample`` how many entries of that dimension one sample has.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    batch_dim: int | None
    per_sample: int
    requires_grad: bool

    def rows_shape(self, n: int) -> tuple[int, ...]:
        if self.batch_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.batch_dim] = n * self.per_sample
        return tuple(shape)

    def narrow(self, t: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """Samples ``[start, start + n)`` of ``t``, whose first sample is sample 0 of ``t``."""
        if self.batch_dim is None:
            return t
        return t.narrow(self.batch_dim, start * self.per_sample, n * self.per_sample)


@dataclass(frozen=True)
class _Piece:
    """One point-to-point move of samples ``[lo, hi)`` of a value (``lo == hi == -1``: all of it)."""

    src: int
    dst: int
    lo: int
    hi: int
    tag: int


@dataclass(frozen=True)
class _StageSync:
    """The gradient sync of one replicated stage this rank runs: buckets, methods, PS keys and priorities
    (BytePS: the model's first layers first, since the next forward needs them first), SFB weights."""

    stage: int
    units: list[list[nn.Parameter]]
    method: dict[nn.Parameter, str]
    keys: dict[nn.Parameter, str]
    priority: dict[nn.Parameter, int]
    sfb: dict[nn.Parameter, str]


class _Bucketer:
    """Gradient sync of one replicated stage: fixed-order buckets launched as their gradients arrive.

    Args:
        sync: the stage's buckets, methods and PS keys.
        group: the replicas' ``torch.distributed`` subgroup (``None``: every worker).
        ps: the summation service (or its subset) of the replicas, for ``ps`` buckets.
        sfb: the SFB recorder of the stage's ``sfb`` weights.
        overlap: launch buckets from gradient hooks during backward (else after the stage's backward).
    """

    def __init__(
        self, sync: _StageSync, group: Any, ps: Any, sfb: SufficientFactors | None, overlap: bool
    ) -> None:
        self.units, self.method, self.keys, self.priority = sync.units, sync.method, sync.keys, sync.priority
        self.group, self.ps, self.sfb, self.overlap = group, ps, sfb, overlap
        self.ready: set[nn.Parameter] = set()
        self.arrived: set[nn.Parameter] = set()  # parameters whose backward ran this step
        self.next = 0
        self.handles: list[Handle] = []
        self.flat: dict[int, FlatBucket] = {}

    def on_grad(self, p: nn.Parameter) -> None:
        self.arrived.add(p)
        self.ready.add(p)
        if self.overlap:
            self._drain()

    def finish_backward(self) -> None:
        """Launch whatever is left (parameters without a gradient contribute zeros), in the same order."""
        for unit in self.units[self.next :]:
            self.ready.update(unit)
        self._drain()

    def wait(self) -> None:
        try:
            for h in self.handles:
                h.wait()
        finally:
            self.handles.clear()
            self.ready.clear()
            self.arrived.clear()
            self.next = 0
            if self.sfb is not None:
                self.sfb.clear()

    def _drain(self) -> None:
        while self.next < len(self.units) and all(p in self.ready for p in self.units[self.next]):
            self.handles.append(self._launch(self.next, self.units[self.next]))
            self.next += 1

    def _sum(self, tensor: torch.Tensor, unit: list[nn.Parameter]) -> Handle:
        """Start summing ``tensor`` (the gradient of ``unit``) in place over the replicas."""
        method, key = self.method[unit[0]], unit_key(unit, self.keys)
        priority = max(self.priority[p] for p in unit)
        if method == "ps":
            return Handle([self.ps.push_pull_async(key, tensor, priority)], lambda: tensor, keep=(tensor,))
        return ops.start_sum(tensor, method=method, name=key, group=self.group)

    def _launch(self, index: int, unit: list[nn.Parameter]) -> Handle:
        method = self.method[unit[0]]
        if method == "sfb":
            assert self.sfb is not None
            p = unit[0]
            # p.grad cannot tell: a factored Linear leaves it as it was (sufficient_factors.py)
            return self.sfb.start(p, 1.0, backward_ran=p in self.arrived, group=self.group)
        if len(unit) == 1:
            p = unit[0]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            return self._sum(p.grad, unit)
        return fused_sum(unit, self.flat, index, 1.0, lambda flat: self._sum(flat, unit))


class DistributedModel(nn.Module):
    """The stages of a model that one worker runs under a plan; built by :func:`distribute`."""

    def __init__(self, model: nn.Module, plan: Plan, loss_fn: LossFn | None = None) -> None:
        super().__init__()
        st = ops.state()
        self.plan = plan
        self.loss_fn = loss_fn
        self.rank = st.cfg.rank
        self._module = model  # registered: parameters() and state_dict() work as for the original
        self._infos: dict[fx.Node, _ValueInfo] | None = None
        # Every check runs before anything collective; the ranks then agree, so that a plan one rank refuses
        # fails on every rank before step 0 instead of leaving the others waiting in a collective.
        error = None
        try:
            syncs = self._build(model, st.cfg)
        except ValueError as exc:  # PlanError, and SFB's refusal of a weight that is not a Linear's
            error = f"rank {self.rank}: {exc}"
        errors: list[str | None] = [error]
        if dist.get_world_size() > 1:
            errors = [None] * dist.get_world_size()
            collectives.run_blocking(lambda: dist.all_gather_object(errors, error))
        failed = [e for e in errors if e]
        if failed:
            raise PlanError(
                f"the job refuses the plan: {failed[0]}"
                + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
            )
        self._connect(syncs)

    def _build(self, model: nn.Module, cfg: CommConfig) -> list[_StageSync]:
        """Everything that needs no other rank: stages, this rank's device, the split, the sync plan."""
        plan = self.plan
        self.stages = plan_stages(plan)
        devices = plan.worker_devices()
        if cfg.size != len(devices):
            raise PlanError(
                f"the plan runs on {len(devices)} devices ({', '.join(devices)}) but the job has "
                f"{cfg.size} worker processes"
            )
        self.device = devices[self.rank]
        if cfg.device is not None and cfg.device != self.device:
            raise PlanError(
                f"rank {self.rank} is plan device {self.device!r} but was launched as TAGPS_DEVICE="
                f"{cfg.device!r}: the job's ranks are mapped to the wrong machines"
            )
        self._rank_of = {d: r for r, d in enumerate(devices)}
        self._check_ps(cfg)
        gm = fx.GraphModule(model, fx.Tracer().trace(model))
        self._gm = [gm]  # a list: not a submodule, so parameters are listed once
        self._split(gm)
        return self._plan_syncs(model)

    # ------------------------------------------------------------------ construction
    def _ps_stages(self) -> list[int]:
        """Stages whose gradients sync (partly) by ps over more than one device, in order (every rank)."""
        ps_groups = self.plan.ps_groups()
        return [
            s for s, st in enumerate(self.stages) if len(st.devices) > 1 and ps_groups & set(st.op_groups)
        ]

    def _check_ps(self, cfg: CommConfig) -> None:
        """Refuse ps layouts the summation service cannot sum (it needs servers and each machine's pusher)."""
        from tagps.comm.ps_service import check_subset_ranks

        stages = self._ps_stages()
        if stages and cfg.num_worker > 1 and cfg.num_server == 0:
            raise PlanError(
                f"groups[{self.stages[stages[0]].op_groups[0]}] syncs by ps but the job has no summation "
                "servers (DMLC_NUM_SERVER=0): start servers (bpslaunch --servers S) or use allreduce"
            )
        for s in stages:
            try:
                check_subset_ranks(cfg, [self._rank_of[d] for d in self.stages[s].devices])
            except ValueError as exc:
                raise PlanError(f"groups[{self.stages[s].op_groups[0]}]: {exc}") from None

    def _split(self, gm: fx.GraphModule) -> None:
        nodes = list(gm.graph.nodes)
        calls = [n for n in nodes if n.op in ("call_module", "call_function", "call_method")]
        by_name = {n.name: n for n in calls}
        stage_of: dict[fx.Node, int] = {}
        for s, stage in enumerate(self.stages):
            for op in stage.ops:
                if op not in by_name:
                    raise PlanError(
                        f"the plan's op {op!r} (groups[{stage.op_groups[0]}]) is not an op of the traced "
                        f"model {type(self._module).__name__}: was the plan made for another model?"
                    )
                stage_of[by_name[op]] = s
        missing = [n.name for n in calls if n not in stage_of]
        if missing:
            raise PlanError(
                f"the plan places no op group on the model's ops {missing[:5]} ({len(missing)} in all)"
            )
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        out_node = next(n for n in nodes if n.op == "output")
        result = out_node.args[0]
        if not isinstance(result, fx.Node) or result not in stage_of:
            raise PlanError("the executor trains models whose forward returns one tensor computed by an op")
        self.output = result
        self.loss_stage = stage_of[result]
        self.stage_of = stage_of
        self.inputs: list[list[fx.Node]] = []
        self.outputs: list[list[fx.Node]] = [[] for _ in self.stages]
        for s, _ in enumerate(self.stages):
            mine = [n for n in calls if stage_of[n] == s]
            ins: list[fx.Node] = []
            for n in mine:
                for a in n.all_input_nodes:
                    if a.op == "get_attr" or (a in stage_of and stage_of[a] == s) or a in ins:
                        continue
                    if a in stage_of and stage_of[a] > s:
                        raise PlanError(
                            f"op {n.name!r} (groups[{self.stages[s].op_groups[0]}]) uses {a.name!r} of "
                            f"the later groups[{self.stages[stage_of[a]].op_groups[0]}]: op groups must be "
                            "in topological order"
                        )
                    ins.append(a)
                    if a in stage_of and a not in self.outputs[stage_of[a]]:
                        self.outputs[stage_of[a]].append(a)
            self.inputs.append(ins)
        if result not in self.outputs[self.loss_stage]:
            self.outputs[self.loss_stage].append(result)
        self.my_stages = [s for s, st in enumerate(self.stages) if self.device in st.devices]
        self.modules_by_stage: dict[int, fx.GraphModule] = {}
        for s in self.my_stages:
            self.modules_by_stage[s] = self._stage_module(gm, s, [n for n in calls if stage_of[n] == s])

    def _stage_module(self, gm: fx.GraphModule, s: int, mine: list[fx.Node]) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in self.inputs[s]:
            env[n] = graph.placeholder(n.name)
        for n in mine:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and a not in env:
                    env[a] = graph.node_copy(a)
            env[n] = graph.node_copy(n, lambda a: env[a])
        graph.output(tuple(env[n] for n in self.outputs[s]))
        return fx.GraphModule(gm, graph)

    def _params_of(self, s: int) -> list[nn.Parameter]:
        module = self.modules_by_stage[s]
        seen: dict[int, nn.Parameter] = {}
        for p in module.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _plan_syncs(self, model: nn.Module) -> list[_StageSync]:
        """Parameter ownership and the sync buckets of this rank's replicated stages (no communication)."""
        names = {id(p): n for n, p in model.named_parameters()}
        priority = {p: -i for i, p in enumerate(model.parameters())}
        plan = self.plan
        owner: dict[int, int] = {}
        syncs = []
        for s in self.my_stages:
            stage = self.stages[s]
            params = self._params_of(s)
            for p in params:
                if id(p) in owner and owner[id(p)] != s:
                    other = self.stages[owner[id(p)]]
                    if other.devices != stage.devices or other.rows != stage.rows:
                        raise PlanError(
                            f"parameter {names[id(p)]!r} is used by op groups with different layouts "
                            f"(groups[{other.op_groups[0]}] and groups[{stage.op_groups[0]}]): put them "
                            "together"
                        )
                owner[id(p)] = s
                if names[id(p)] not in plan.gradients:
                    raise PlanError(f"the plan has no gradient entry for parameter {names[id(p)]!r}")
            if len(stage.devices) == 1:
                continue
            method = {p: plan.gradients[names[id(p)]].sync for p in params}
            if all(m == "none" for m in method.values()):
                continue
            sfb = self._sfb_weights(params, method, names)
            for p, m in method.items():
                if m == "sfb" and p.dim() == 1:
                    method[p] = "allreduce"  # a Linear bias marked sfb is the all-reduced half of SFB
            order = [p for p in reversed(params) if method[p] != "none"]
            keys = {p: f"general.{names[id(p)]}" for p in params}
            units = fusion_units(order, method, plan.comm)
            syncs.append(_StageSync(s, units, method, keys, priority, sfb))
        self._local_params = [p for p in model.parameters() if id(p) in owner]
        if not self._local_params:
            # A worker whose ops have no parameters (an mp part of activations only) still builds its
            # optimizer like the others: torch refuses an empty parameter list; this one never gets a grad.
            self._local_params = [nn.Parameter(torch.zeros(0))]
        return syncs

    def _connect(self, syncs: list[_StageSync]) -> None:
        """Create the replicas' process subgroups and PS subsets (every rank, same order), keys and hooks."""
        groups: dict[tuple[int, ...], Any] = {}
        for stage in self.stages:
            ranks = tuple(sorted(self._rank_of[d] for d in stage.devices))
            if len(ranks) > 1 and ranks not in groups:
                groups[ranks] = None if len(ranks) == len(self._rank_of) else dist.new_group(list(ranks))
        summers: dict[int, Any] = {}
        ps_stages = self._ps_stages()
        if ps_stages:
            service = ops.state().ps_service()
            for s in ps_stages:
                ranks = tuple(sorted(self._rank_of[d] for d in self.stages[s].devices))
                summers[s] = service if len(ranks) == len(self._rank_of) else service.subset(ranks)
        self._bucketers: dict[int, _Bucketer] = {}
        self._hooks: list[Any] = []
        for sync in syncs:
            ps_units = [u for u in sync.units if sync.method[u[0]] == "ps"]
            if ps_units:
                summers[sync.stage].declare(
                    [(unit_key(u, sync.keys), torch.empty(numel(u), dtype=u[0].dtype)) for u in ps_units]
                )
            ranks = tuple(sorted(self._rank_of[d] for d in self.stages[sync.stage].devices))
            bucketer = _Bucketer(
                sync,
                groups[ranks],
                summers.get(sync.stage),
                SufficientFactors(sync.sfb) if sync.sfb else None,
                self.plan.comm.overlap,
            )
            self._bucketers[sync.stage] = bucketer
            for unit in sync.units:
                for p in unit:
                    self._hooks.append(p.register_post_accumulate_grad_hook(_hook(bucketer)))

    def _sfb_weights(
        self, params: list[nn.Parameter], method: dict[nn.Parameter, str], names: dict[int, str]
    ) -> dict[nn.Parameter, str]:
        weights = {p: names[id(p)] for p in params if method[p] == "sfb" and p.dim() != 1}
        if not weights:
            return weights
        linear_of = {
            id(m.weight): n.name
            for n in self._gm[0].graph.nodes
            if n.op == "call_module" and isinstance(m := self._gm[0].get_submodule(str(n.target)), nn.Linear)
        }
        for p, name in weights.items():
            dup = self.plan.gradients[name].sfb_ops
            owner = linear_of.get(id(p))
            if dup and tuple(dup) != (owner,):
                raise PlanError(
                    f"gradient {name!r}: sfb_ops {list(dup)} asks to duplicate more than its nn.Linear "
                    f"{owner!r}; the runtime's SFB duplicates that op only"
                )
        for p, name in weights.items():
            if p.dim() != 2:
                raise PlanError(
                    f"gradient {name!r} is marked sfb but is not a Linear weight: use allreduce or ps"
                )
        return weights

    # ------------------------------------------------------------------ the user's surface
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        """The parameters this worker holds (those of its stages): give these to the optimizer.

        A worker that holds none gets one empty parameter (it never has a gradient), so that every worker
        can build its optimizer the same way.
        """
        return iter(self._local_params)

    def input_rows(self) -> tuple[int, int]:
        """The block ``[lo, hi)`` of the global batch whose inputs this worker needs (empty: none)."""
        blocks = [
            self.stages[s].rows_of(self.device)
            for s in self.my_stages
            if any(n.op == "placeholder" for n in self.inputs[s])
        ]
        return (min(b[0] for b in blocks), max(b[1] for b in blocks)) if blocks else (0, 0)

    def target_rows(self) -> tuple[int, int]:
        """The block of the global batch whose targets this worker's loss needs (empty: none)."""
        stage = self.stages[self.loss_stage]
        return stage.rows_of(self.device) if self.device in stage.devices else (0, 0)

    def shard(
        self, inputs: Sequence[torch.Tensor], targets: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Cut a global batch (inputs and targets, samples along dim 0) down to what this worker needs."""
        lo, hi = self.input_rows()
        tlo, thi = self.target_rows()
        return tuple(x[lo:hi] for x in inputs), targets[tlo:thi]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a distributed model trains with train_step(inputs, targets): its ops live on several workers"
        )

    def train_step(
        self, inputs: Sequence[torch.Tensor], targets: torch.Tensor, loss_fn: LossFn | None = None
    ) -> torch.Tensor:
        """Run forward, the loss, backward and the gradient sync of one step over the whole job.

        Args:
            inputs: the model's inputs for the samples :meth:`input_rows` (see :meth:`shard`).
            targets: the targets for the samples :meth:`target_rows`.
            loss_fn: ``loss_fn(output, targets)``, the *mean* loss over the given samples (default: the one
                given to :func:`distribute`).

        Returns:
            This worker's share of the global mean loss (0 where it computes none); the shares of all
            workers add up to the loss of the global batch.
        """
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise ValueError("train_step needs a loss_fn (here or in distribute())")
        inputs = tuple(inputs)
        if len(inputs) != len(self.placeholders):
            raise ValueError(f"the model takes {len(self.placeholders)} inputs, got {len(inputs)}")
        if self._infos is None:
            self._infos = self._shape_facts(inputs)
            self._schedule()
        pending: list[Any] = []
        try:
            loss = self._run(inputs, targets, loss_fn, pending)
        finally:
            for work in pending:
                work.wait()
        for b in self._bucketers.values():
            b.wait()
        return loss

    # ------------------------------------------------------------------ shapes and the transfer schedule
    def _shape_facts(self, inputs: tuple[torch.Tensor, ...]) -> dict[fx.Node, _ValueInfo]:
        """Shapes of every cross-stage value at the global batch and one more sample (fake tensors)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        batch = self.plan.batch_size
        lo, hi = self.input_rows()
        for x in inputs:
            if x.shape[0] != hi - lo:
                raise ValueError(
                    f"this worker needs samples [{lo}, {hi}) of the inputs, got {x.shape[0]} rows"
                )
        wanted = {n for ins in self.inputs for n in ins} | {self.output}
        shapes: list[dict[fx.Node, Any]] = []
        for b in (batch, batch + 1):
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake = [mode.from_tensor(torch.empty((b, *x.shape[1:]), dtype=x.dtype)) for x in inputs]
                record = _Recorder(self._gm[0], wanted)
                record.run(*fake)
            shapes.append(record.values)
        infos = {}
        for n in wanted:
            a, c = shapes[0][n], shapes[1][n]
            if not isinstance(a, torch.Tensor):
                raise PlanError(
                    f"value {n.name!r} crosses op groups but is a {type(a).__name__}, not a tensor"
                )
            grown = [d for d in range(a.dim()) if a.shape[d] != c.shape[d]]
            if len(grown) > 1 or (grown and a.shape[grown[0]] % batch):
                raise PlanError(
                    f"value {n.name!r} ({tuple(a.shape)}) crosses op groups with no single batch dimension"
                )
            dim = grown[0] if grown else None
            per = a.shape[dim] // batch if dim is not None else 0
            infos[n] = _ValueInfo(tuple(a.shape), a.dtype, dim, per, bool(a.requires_grad))
        if infos[self.output].batch_dim is None:
            raise PlanError(
                "the model's output does not grow with the batch: the loss needs one row per sample"
            )
        return infos

    def _schedule(self) -> None:
        """Which samples of which value move between which ranks, forward and backward (same everywhere)."""
        assert self._infos is not None
        tags = itertools.count()
        self.fwd_moves: dict[tuple[int, fx.Node], list[_Piece]] = {}
        self.bwd_moves: dict[tuple[int, fx.Node], list[_Piece]] = {}
        for s, stage in enumerate(self.stages):
            for v in self.inputs[s]:
                if v.op == "placeholder":
                    continue
                info = self._infos[v]
                src_stage = self.stages[self.stage_of[v]]
                fwd: list[_Piece] = []
                bwd: list[_Piece] = []
                for k, dev in enumerate(stage.devices):
                    lo, hi = stage.rows[k]
                    dst = self._rank_of[dev]
                    if info.batch_dim is None:
                        src = self._rank_of[_nearest(dev, src_stage.devices)]
                        if src != dst:
                            fwd.append(_Piece(src, dst, -1, -1, next(tags)))
                        if k == 0 or not _is_duplicate(stage):
                            bwd += [
                                _Piece(dst, self._rank_of[h], -1, -1, next(tags))
                                for h in _unbatched_grad_targets(dev, src_stage)
                                if self._rank_of[h] != dst
                            ]
                        continue
                    for plo, phi, holders in _cover(src_stage, lo, hi):
                        src = self._rank_of[_nearest(dev, holders)]
                        if src != dst:
                            fwd.append(_Piece(src, dst, plo, phi, next(tags)))
                        if _primary(stage, k, plo):
                            bwd += [
                                _Piece(dst, self._rank_of[h], plo, phi, next(tags))
                                for h in holders
                                if self._rank_of[h] != dst
                            ]
                self.fwd_moves[(s, v)] = fwd
                self.bwd_moves[(s, v)] = bwd

    # ------------------------------------------------------------------ one step
    def _run(
        self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, loss_fn: LossFn, pending: list[Any]
    ) -> torch.Tensor:
        assert self._infos is not None
        infos = self._infos
        me = self.rank
        in_lo, _ = self.input_rows()
        held: dict[tuple[int, fx.Node], torch.Tensor] = {}  # (producer stage, value) -> my rows of it
        leaves: dict[int, list[torch.Tensor | None]] = {}
        outs: dict[int, tuple[torch.Tensor, ...]] = {}
        loss = torch.zeros(())
        loss_root: torch.Tensor | None = None
        for s, stage in enumerate(self.stages):
            # Sends first: every rank walks the same order, and sends never block, so nothing deadlocks.
            for v in self.inputs[s]:
                for piece in self.fwd_moves.get((s, v), ()):
                    if piece.src == me:
                        pending.append(self._send(held[(self.stage_of[v], v)], v, piece, infos[v]))
            if self.device not in stage.devices:
                continue
            lo, hi = stage.rows_of(self.device)
            args: list[torch.Tensor | None] = []
            for v in self.inputs[s]:
                if v.op == "placeholder":
                    args.append(inputs[self.placeholders.index(v)][lo - in_lo : hi - in_lo])
                    continue
                value = self._gather(s, v, lo, hi, held)
                if infos[v].requires_grad:
                    leaf = value.detach().requires_grad_()
                    args.append(leaf)
                else:
                    args.append(value)
            leaves[s] = [a if a is not None and a.requires_grad and a.is_leaf else None for a in args]
            # Received leaves are cloned: an in-place op of the stage must not write into a leaf.
            result = self.modules_by_stage[s](
                *(a.clone() if a is not None and a.is_leaf and a.requires_grad else a for a in args)
            )
            outs[s] = result
            for v, t in zip(self.outputs[s], result, strict=True):
                held[(s, v)] = t
            if s == self.loss_stage:
                weight = 1.0 if _is_duplicate(stage) else (hi - lo) / self.plan.batch_size
                loss_root = loss_fn(held[(s, self.output)], targets) * weight
                if not _is_duplicate(stage) or stage.devices[0] == self.device:
                    loss = loss_root.detach()
        grads: dict[tuple[int, fx.Node], torch.Tensor] = {}
        for s in range(len(self.stages) - 1, -1, -1):
            stage = self.stages[s]
            roots: list[torch.Tensor] = []
            root_grads: list[torch.Tensor | None] = []
            if self.device in stage.devices:
                if s == self.loss_stage:
                    assert loss_root is not None
                    roots.append(loss_root)
                    root_grads.append(None)
                for v, t in zip(self.outputs[s], outs[s], strict=True):
                    g = self._incoming_grad(s, v, grads)
                    if g is not None and t.requires_grad:
                        roots.append(t)
                        root_grads.append(g)
                if roots:
                    torch.autograd.backward(roots, root_grads)
                if s in self._bucketers:
                    self._bucketers[s].finish_backward()
            # Input gradients go back to every holder of the rows (sends after this stage's backward).
            for i, v in enumerate(self.inputs[s]):
                if v.op == "placeholder" or not infos[v].requires_grad:
                    continue
                leaf = leaves[s][i] if s in leaves else None
                for piece in self.bwd_moves.get((s, v), ()):
                    if piece.src == me:
                        lo, _ = stage.rows_of(self.device)
                        g = leaf.grad if leaf is not None and leaf.grad is not None else None
                        if g is None:
                            assert leaf is not None
                            g = torch.zeros_like(leaf)
                        start = piece.lo - lo if piece.lo >= 0 else 0
                        part = infos[v].narrow(g, start, piece.hi - piece.lo) if piece.lo >= 0 else g
                        pending.append(dist.isend(part.contiguous(), piece.dst, tag=piece.tag))
                if self.device in stage.devices and leaf is not None and leaf.grad is not None:
                    self._keep_local_grad(s, v, leaf.grad, grads)
        return loss

    def _send(self, t: torch.Tensor, v: fx.Node, piece: _Piece, info: _ValueInfo) -> Any:
        if piece.lo < 0:
            part = t
        else:
            plo, _ = self.stages[self.stage_of[v]].rows_of(self.device)
            part = info.narrow(t, piece.lo - plo, piece.hi - piece.lo)
        # A copy: the stage that consumes the value here may change it in place while the send is in flight.
        return dist.isend(
            part.detach().clone(memory_format=torch.contiguous_format), piece.dst, tag=piece.tag
        )

    def _gather(
        self, s: int, v: fx.Node, lo: int, hi: int, held: dict[tuple[int, fx.Node], torch.Tensor]
    ) -> torch.Tensor:
        """My rows ``[lo, hi)`` of value ``v`` for stage ``s``: local blocks and received ones, in order."""
        assert self._infos is not None
        info = self._infos[v]
        p = self.stage_of[v]
        src_stage = self.stages[p]
        me = self.rank
        incoming = {(piece.lo, piece.hi): piece for piece in self.fwd_moves[(s, v)] if piece.dst == me}
        if info.batch_dim is None:
            if (-1, -1) in incoming:
                return self._recv(incoming[(-1, -1)], info)
            return held[(p, v)]
        blocks = []
        for plo, phi, _ in _cover(src_stage, lo, hi):
            piece = incoming.get((plo, phi))
            if piece is not None:
                blocks.append(self._recv(piece, info))
            else:
                mlo, _ = src_stage.rows_of(self.device)
                blocks.append(info.narrow(held[(p, v)], plo - mlo, phi - plo))
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=info.batch_dim)

    def _recv(self, piece: _Piece, info: _ValueInfo) -> torch.Tensor:
        n = piece.hi - piece.lo if piece.lo >= 0 else 0
        buf = torch.empty(info.rows_shape(n), dtype=info.dtype)
        collectives.run_blocking(functools.partial(dist.recv, buf, piece.src, tag=piece.tag))
        return buf

    def _incoming_grad(
        self, s: int, v: fx.Node, grads: dict[tuple[int, fx.Node], torch.Tensor]
    ) -> torch.Tensor | None:
        """The gradient of my rows of output ``v`` of stage ``s``: local consumers' plus received pieces."""
        assert self._infos is not None
        info = self._infos[v]
        me = self.rank
        total = grads.pop((s, v), None)
        lo, hi = self.stages[s].rows_of(self.device)
        for (_, u), pieces in self.bwd_moves.items():
            if u is not v:
                continue
            for piece in pieces:
                if piece.dst != me:
                    continue
                n = piece.hi - piece.lo if piece.lo >= 0 else 0
                buf = torch.empty(info.rows_shape(n), dtype=info.dtype)
                collectives.run_blocking(functools.partial(dist.recv, buf, piece.src, tag=piece.tag))
                if total is None:
                    total = torch.zeros(info.rows_shape(hi - lo), dtype=info.dtype)
                target = info.narrow(total, piece.lo - lo, n) if piece.lo >= 0 else total
                target.add_(buf)
        return total

    def _keep_local_grad(
        self, s: int, v: fx.Node, g: torch.Tensor, grads: dict[tuple[int, fx.Node], torch.Tensor]
    ) -> None:
        """Add the gradient of the rows of ``v`` that stage ``s`` took from this device's own copy."""
        assert self._infos is not None
        info = self._infos[v]
        p = self.stage_of[v]
        src_stage = self.stages[p]
        stage = self.stages[s]
        k = stage.devices.index(self.device)
        if self.device not in src_stage.devices:
            return
        plo, phi = src_stage.rows_of(self.device)
        if info.batch_dim is None:
            if (k == 0 or not _is_duplicate(stage)) and self.device in _unbatched_grad_targets(
                self.device, src_stage
            ):
                _accumulate(grads, (p, v), g, info, phi - plo, 0)
            return
        lo, hi = stage.rows_of(self.device)
        for clo, chi, _ in _cover(src_stage, lo, hi):
            if not (plo <= clo and chi <= phi) or not _primary(stage, k, clo):
                continue
            part = info.narrow(g, clo - lo, chi - clo)
            _accumulate(grads, (p, v), part, info, phi - plo, clo - plo)


class _Recorder(fx.Interpreter):
    """Run a graph (on fake tensors) and keep the values of chosen nodes."""

    def __init__(self, gm: fx.GraphModule, wanted: set[fx.Node]) -> None:
        super().__init__(gm)
        self.wanted = wanted
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.wanted:
            self.values[n] = out
        return out


def _accumulate(
    grads: dict[tuple[int, fx.Node], torch.Tensor],
    key: tuple[int, fx.Node],
    part: torch.Tensor,
    info: _ValueInfo,
    rows: int,
    start: int,
) -> None:
    total = grads.get(key)
    if total is None:
        total = grads[key] = torch.zeros(info.rows_shape(rows), dtype=info.dtype)
    target = (
        info.narrow(total, start, part.shape[info.batch_dim] // info.per_sample)
        if info.batch_dim is not None
        else total
    )
    target.add_(part)


def _is_duplicate(stage: Stage) -> bool:
    """Whether every device of the stage runs the same samples (duplicate, or one device)."""
    return len(set(stage.rows)) == 1


def _primary(stage: Stage, k: int, row: int) -> bool:
    """Whether device ``k`` of ``stage`` is the one that returns the gradient of sample ``row``."""
    return next(j for j, (lo, hi) in enumerate(stage.rows) if lo <= row < hi) == k


def _cover(stage: Stage, lo: int, hi: int) -> list[tuple[int, int, list[str]]]:
    """Cut ``[lo, hi)`` at the block boundaries of ``stage``; each piece with the devices holding it."""
    cuts = sorted({lo, hi, *(b for r in stage.rows for b in r if lo < b < hi)})
    pieces = []
    for a, b in itertools.pairwise(cuts):
        holders = [
            d for d, (rlo, rhi) in zip(stage.devices, stage.rows, strict=True) if rlo <= a and b <= rhi
        ]
        pieces.append((a, b, holders))
    return pieces


def _unbatched_grad_targets(device: str, producer: Stage) -> list[str]:
    """Where the gradient of a batch-independent value goes: every replica of a duplicated producer (each
    needs all of it), else only the copy it was read from (replicas' gradients are summed by the sync)."""
    return list(producer.devices) if _is_duplicate(producer) else [_nearest(device, producer.devices)]


def _nearest(device: str, holders: Sequence[str]) -> str:
    """The holder to read from: this device, else one on the same machine, else the first."""
    if device in holders:
        return device
    machine = device.split(":", 1)[0]
    return next((h for h in holders if h.split(":", 1)[0] == machine), holders[0])


def _hook(bucketer: _Bucketer) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        bucketer.on_grad(p)  # type: ignore[arg-type]

    return hook


def distribute(model: nn.Module, plan: object, loss_fn: LossFn | None = None) -> DistributedModel:
    """Split ``model`` as ``plan`` says and keep the stages this worker runs.

    Call it on every worker, after :func:`tagps.torch.init`, with the same model (same initial weights:
    broadcast them first, or seed identically). Then::

        dmodel = tagps.torch.distribute(model, "plan.json", F.cross_entropy)
        opt = torch.optim.SGD(dmodel.parameters(), lr=0.1)
        x, y = dmodel.shard(global_inputs, global_targets)
        for _ in range(steps):
            opt.zero_grad()
            dmodel.train_step(x, y)
            opt.step()

    Args:
        model: the model (torch.fx must trace it; its forward returns one tensor).
        plan: a plan object, path, JSON text or dict (``tagps.strategy.plan``) of any kind.
        loss_fn: ``loss_fn(output, targets)`` returning the mean loss over its samples (can also be given
            to :meth:`DistributedModel.train_step`).

    Returns:
        The :class:`DistributedModel`.

    Raises:
        PlanError: the plan does not fit the job or the model, or asks for what the runtime cannot do
            (named), before any step.
    """
    return DistributedModel(model, load(plan), loss_fn)  # type: ignore[arg-type]
