"""``DistributedOptimizer``: wrap a torch optimizer so each gradient is synchronised by its own method.

Horovod's protocol (hooks that start a gradient's sync during backward, ``synchronize()``,
``skip_synchronize()``, the ``zero_grad`` guard, ``backward_passes_per_step``, compression), carried out by
``Tensor.register_post_accumulate_grad_hook`` and a wrapper object rather than a generated subclass.

Collective methods (``allreduce``, ``sfb``) must be issued in the same order on every worker, so every
gradient is started in one fixed order (reverse registration, the usual order of backward) as soon as it
and every earlier one are ready; consecutive gradients of the same method (``allreduce`` or ``ps``) are
fused into buckets of up to ``TAGPS_FUSION_BYTES`` (a plan's ``comm.fusion_bytes`` when the strategy is a
plan), cut the same way on every worker. A plan with ``comm.overlap = false`` starts every gradient after
the whole backward, in ``step()``/``synchronize()``.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from tagps.comm.handle import Handle
from tagps.comm.sufficient_factors import SufficientFactors
from tagps.strategy.plan import CommSettings
from tagps.torch import join_ops, ops, timeline
from tagps.torch.buckets import FlatBucket, fused_sum, fusion_units, numel, unit_key
from tagps.torch.compression import Compressor, NoneCompressor
from tagps.torch.process_sets import ProcessSet, global_process_set, group_of
from tagps.torch.strategy import resolve_strategy

if TYPE_CHECKING:
    from tagps.strategy.plan import Plan

__all__ = ["Adasum", "Average", "DistributedOptimizer", "Max", "Min", "Product", "ReduceOp", "Sum"]


class ReduceOp(enum.Enum):
    """How the workers' values are combined; gradients take ``AVERAGE`` or ``SUM``, collectives any but
    ``ADASUM``, which exists for Horovod scripts and is refused."""

    AVERAGE = "average"
    SUM = "sum"
    ADASUM = "adasum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


class _DistributedOptimizer(torch.optim.Optimizer):
    """The wrapper :func:`DistributedOptimizer` returns; an ``Optimizer`` so LR schedulers accept it."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, nn.Parameter]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: object,
        sparse_as_dense: bool,
        process_set: ProcessSet,
        strategy: object,
        batch_share: float | None,
    ) -> None:
        st = ops.state()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, _DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
            )
        if op not in (Average, Sum):
            raise ValueError(f"op must be Average or Sum, got {op!r} (tagps has no Adasum)")
        if not (isinstance(compression, type) and issubclass(compression, Compressor)):
            raise TypeError(f"compression must be one of Compression.none/fp16/bf16, got {compression!r}")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
        if gradient_predivide_factor != 1.0 and op is not Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self._group = group_of(process_set)  # raises for a set that is unknown or excludes this rank
        set_size, set_rank = process_set.size(), process_set.rank()
        assert set_size is not None and set_rank is not None
        self._opt = optimizer
        self._compression = compression
        self._bpps = backward_passes_per_step
        self._params = _optimizer_params(optimizer)
        _check_groups(groups, self._params)
        self._sparse_as_dense = bool(sparse_as_dense)
        if (
            named_parameters is None
            and strategy is not None
            and not (isinstance(strategy, Mapping) and set(strategy) <= {"default"})
        ):
            raise ValueError(
                "a strategy that names parameters needs named_parameters=model.named_parameters()"
            )
        self._names = _names(self._params, named_parameters)
        plan_doc = _plan_of(strategy)
        if plan_doc is not None:
            _check_sfb_ops(plan_doc, list(self._names.values()))
        # The summation servers and SFB serve every worker: a process set's gradients are all-reduced.
        default = ops.default_method(st.cfg) if self._group is None else "allreduce"
        plan = resolve_strategy(
            plan_doc if plan_doc is not None else strategy, list(self._names.values()), default
        )
        # A plan fixes fusion and overlap (the simulator costed them); otherwise TAGPS_FUSION_BYTES decides.
        comm = plan_doc.comm if plan_doc is not None else CommSettings(fusion_bytes=st.cfg.fusion_bytes)
        self._overlap = comm.overlap
        self._method = {p: plan.methods[self._names[p]] for p in self._params}
        if self._group is not None:
            other = sorted(set(self._method.values()) - {"allreduce", "none"})
            if other:
                raise ValueError(
                    f"with a process_set, gradients are all-reduced within the set; the strategy asks for "
                    f"{other}, which serve every worker"
                )
        self._weight = _batch_weight(plan.batch_shares, batch_share, op, set_size, set_rank, self._group)
        # Horovod's gradient_predivide_factor f splits the average into a prescale w_r n / f and a
        # postscale f / n (n: the set's size), so that large sums do not overflow in low precision.
        if gradient_predivide_factor == 1.0:
            self._prescale, self._postscale = self._weight, 1.0
        else:
            self._prescale = self._weight * set_size / gradient_predivide_factor
            self._postscale = gradient_predivide_factor / set_size
        sfb_weights = {p: self._names[p] for p, m in self._method.items() if m == "sfb" and p.dim() != 1}
        # A Linear bias marked sfb is the all-reduced half of SFB.
        for p, m in self._method.items():
            if m == "sfb" and p.dim() == 1:
                self._method[p] = "allreduce"
        self._sfb = SufficientFactors(sfb_weights) if sfb_weights else None
        # PS keys are per optimizer instance: another model's parameter may reuse a name with another shape.
        instance = next(st.optimizers)
        self._keys = {p: f"opt{instance}.{self._names[p]}" for p in self._params}
        # Ranks inside join() stand in with zero gradients only for all-reduced ones over every worker.
        methods = sorted(set(self._method.values()) - {"allreduce", "none"})
        self.joinable = f"its gradients use {methods}" if methods else None
        if self._group is not None:
            self.joinable = "it synchronises over a process set"
        self._serving_join = False
        self._announced: Callable[[], None] | None = None  # the check of this step's announcement
        self._units = fusion_units(
            [p for p in reversed(self._params) if self._method[p] != "none"], self._method, comm
        )
        # What the gradient sync sends, in order: a rank inside join() serves a step with the same.
        wires = [compression.compress(torch.empty(0, dtype=u[0].dtype))[0].dtype for u in self._units]
        sent = [(numel(u), wire) for u, wire in zip(self._units, wires, strict=True)]
        self._join_key = join_ops.register_optimizer(self, repr(sent))
        ps_units = [u for u in self._units if self._method[u[0]] == "ps"]
        if ps_units:
            # Start the service and register the (fused) tensors now, so that a missing server or an
            # unsupported dtype fails before training and no step pays for the registration.
            st.ps_service().declare(
                [
                    (
                        unit_key(u, self._keys),
                        compression.compress(torch.empty(numel(u), dtype=u[0].dtype))[0],
                    )
                    for u in ps_units
                ]
            )
        index = {p: i for i, p in enumerate(self._params)}
        self._priority = {p: -index[p] for p in self._params}  # BytePS: first layers first
        self._flat: dict[int, FlatBucket] = {}
        self._next = 0
        self._ready: set[nn.Parameter] = set()
        self._passes: dict[nn.Parameter, int] = {}
        self._handles: dict[nn.Parameter, Handle] = {}
        self._sync_in_step = True
        self._synchronized = False
        ref = weakref.ref(self)
        hooks = [p.register_post_accumulate_grad_hook(_grad_hook(ref)) for p in self._params]
        weakref.finalize(self, _remove, hooks, self._sfb)

    # ---------------------------------------------------------------- torch.optim.Optimizer surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._opt.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._opt.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._opt.defaults

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._opt!r})"

    def state_dict(self) -> dict[str, Any]:
        """Return the wrapped optimizer's state dict."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict into the wrapped optimizer."""
        self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refuse: the sync methods and hooks are fixed when the optimizer is wrapped."""
        raise RuntimeError(
            "add_param_group after wrapping is not supported: add the group first, then wrap the optimizer"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refuse while a synchronisation is in flight (it would write them back)."""
        # Without overlap, gradients wait in _ready until step(): zeroing them would lose them too.
        if self._handles or self._next or self._ready:
            raise RuntimeError(
                "zero_grad() was called after backward() but before step() or synchronize(); "
                "call it before backward() or after step()"
            )
        self._opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Wait for the gradients still in flight (unless inside :meth:`skip_synchronize`), then step."""
        timeline.mark_cycle()
        if self._sync_in_step:
            self.synchronize()
        self._synchronized = False
        return self._opt.step(closure)

    # ---------------------------------------------------------------- synchronisation
    def synchronize(self) -> None:
        """Finish every gradient's synchronisation; parameters without a gradient contribute zeros."""
        if self._synchronized:
            return
        for unit in self._units[self._next :]:
            self._ready.update(unit)
        self._drain()
        try:
            for handle in self._handles.values():
                handle.wait()
            if self._announced is not None:
                self._announced()
        finally:
            self._announced = None
            self._handles.clear()
            self._ready.clear()
            self._passes.clear()
            self._next = 0
            if self._sfb is not None:
                self._sfb.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make :meth:`step` skip synchronising, after the caller called :meth:`synchronize` itself."""
        self._sync_in_step = False
        try:
            yield
        finally:
            self._sync_in_step = True

    def contribute_zeros(self) -> None:
        """Synchronise zero gradients: what a rank inside :func:`tagps.torch.join` does for each step of the
        others. Its own gradients are left as they were."""
        saved = {p: p.grad for p in self._params}
        for p in self._params:
            p.grad = torch.zeros_like(p)
        self._serving_join, self._synchronized = True, False
        try:
            self.synchronize()
        finally:
            self._serving_join = False
            for p, grad in saved.items():
                p.grad = grad

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is not None and p.grad.is_sparse:
            if not self._sparse_as_dense:
                raise ValueError(
                    f"gradient of {self._names[p]!r} is sparse (e.g. nn.Embedding(sparse=True)); tagps "
                    "synchronises dense gradients only: pass sparse_as_dense=True"
                )
            p.grad = p.grad.to_dense()
        passes = self._passes.get(p, 0) + 1
        if passes > self._bpps or p in self._handles:
            raise RuntimeError(
                f"gradient of {self._names[p]!r} was computed more than backward_passes_per_step="
                f"{self._bpps} times before step(); raise backward_passes_per_step to accumulate locally"
            )
        self._passes[p] = passes
        if passes < self._bpps:
            return
        self._synchronized = False
        if self._method[p] != "none":
            self._ready.add(p)
            if self._overlap:
                self._drain()

    def _drain(self) -> None:
        """Start, in the fixed order, every unit whose gradients are all ready."""
        while self._next < len(self._units) and all(p in self._ready for p in self._units[self._next]):
            if self._next == 0 and self.joinable is None and not self._serving_join:
                # ranks inside join() follow with zeros; checked once the step is synchronised
                self._announced = join_ops.announce_step(self._join_key)
            unit = self._units[self._next]
            handle = self._launch(unit[0]) if len(unit) == 1 else self._launch_fused(self._next, unit)
            handle = timeline.traced(handle, self._method[unit[0]].upper(), unit_key(unit, self._keys))
            for p in unit:
                self._handles[p] = handle
            self._next += 1

    def _launch_fused(self, index: int, unit: list[nn.Parameter]) -> Handle:
        """Sum the gradients of ``unit`` as one flat buffer (kept between steps)."""
        return fused_sum(
            unit,
            self._flat,
            index,
            self._prescale,
            lambda flat: ops.start_sum(
                flat,
                method=self._method[unit[0]],
                name=unit_key(unit, self._keys),
                priority=max(self._priority[p] for p in unit),
                compression=self._compression,
                postscale=self._postscale,
                group=self._group,
            ),
        )

    def _launch(self, p: nn.Parameter) -> Handle:
        method = self._method[p]
        if method == "sfb":
            assert self._sfb is not None
            return self._sfb.start(p, self._weight, backward_ran=p in self._passes)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return ops.start_sum(
            p.grad,
            method=method,
            name=self._keys[p],
            priority=self._priority[p],
            compression=self._compression,
            prescale=self._prescale,
            postscale=self._postscale,
            group=self._group,
        )


def _grad_hook(ref: Callable[[], _DistributedOptimizer | None]) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt._on_grad(p)  # type: ignore[arg-type]

    return hook


def _remove(hooks: list[Any], sfb: SufficientFactors | None) -> None:
    for h in hooks:
        h.remove()
    if sfb is not None:
        sfb.close()


def _plan_of(strategy: object) -> Plan | None:
    """Return ``strategy`` loaded as a plan (validated once), or ``None`` when it is not a plan."""
    if strategy is None or (
        isinstance(strategy, Mapping) and all(isinstance(v, str) for v in strategy.values())
    ):
        return None
    from tagps.strategy import plan as plan_ir

    if not isinstance(strategy, str | os.PathLike | Mapping | plan_ir.Plan):
        return None  # resolve_strategy names the accepted types
    return plan_ir.load(strategy)


def _fx_module_op(module_path: str) -> str:
    """Return the torch.fx node name of a call of the module at ``module_path`` (the plan's op names)."""
    name = re.sub(r"[^0-9a-zA-Z_]+", "_", re.sub(r"(?<=[a-z])([A-Z])", r"_\1", module_path).lower())
    return f"_{name}" if name[:1].isdigit() else name


def _check_sfb_ops(plan: Plan, names: list[str]) -> None:
    """Refuse a plan whose ``sfb_ops`` duplicate more than the ``nn.Linear`` owning the gradient.

    The runtime's SFB rebuilds a weight gradient from the owning layer's input and output gradient, i.e. it
    duplicates exactly the owning op (every call of it: ``fc``, ``fc_1``, ...). Other ops in ``sfb_ops``
    would change which factors travel, so such a plan is refused before step 0 rather than run differently
    from what the simulator costed.
    """
    for name in names:
        grad = plan.gradients.get(name)
        if grad is None or grad.sync != "sfb" or not grad.sfb_ops:
            continue
        owner = _fx_module_op(name.rpartition(".")[0])
        others = [op for op in grad.sfb_ops if not re.fullmatch(rf"{re.escape(owner)}(_\d+)?", op)]
        if others:
            raise ValueError(
                f"the plan gives gradient {name!r} sfb_ops {list(grad.sfb_ops)}, but the runtime's SFB "
                f"duplicates only the nn.Linear that owns it (op {owner!r}) and cannot duplicate {others}; "
                f"make the plan with sfb_ops [] or [{owner!r}] for it, or sync it with allreduce or ps"
            )


def _check_groups(groups: object, params: list[nn.Parameter]) -> None:
    """Check Horovod's ``groups``: ``None``, a count, or lists of the optimizer's parameters.

    Horovod launches each group as one grouped allreduce; tagps fuses by its own buckets instead, which
    gives the same gradients, so the grouping is validated and otherwise a hint.
    """
    if groups is None or (isinstance(groups, int) and not isinstance(groups, bool) and groups >= 0):
        return
    if not (isinstance(groups, list) and all(isinstance(g, list | tuple) for g in groups)):
        raise ValueError(
            f"groups must be a non-negative int or a list of lists of parameters, got {groups!r}"
        )
    known = {id(p) for p in params}
    seen: set[int] = set()
    for g in groups:
        for p in g:
            if id(p) not in known:
                raise ValueError("groups holds a tensor that is not a trainable parameter of the optimizer")
            if id(p) in seen:
                raise ValueError("groups holds a parameter twice")
            seen.add(id(p))


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    seen: set[int] = set()
    params = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _names(
    params: list[nn.Parameter], named_parameters: Iterable[tuple[str, nn.Parameter]] | None
) -> dict[nn.Parameter, str]:
    if named_parameters is None:
        return {p: f"noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not (isinstance(t, tuple) and len(t) == 2) for t in named):
        raise TypeError("named_parameters must yield (name, parameter) pairs, e.g. model.named_parameters()")
    by_id: dict[int, str] = {}
    seen_names: set[str] = set()
    for name, p in named:
        if name in seen_names:
            raise ValueError(f"named_parameters has the name {name!r} twice")
        seen_names.add(name)
        by_id.setdefault(id(p), name)
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        raise ValueError(
            f"{len(unnamed)} parameter(s) of the optimizer are missing from named_parameters "
            f"(first: parameter {unnamed[0]} in optimizer order)"
        )
    return {p: by_id[id(p)] for p in params}


def _batch_weight(
    plan_shares: tuple[float, ...] | None,
    batch_share: float | None,
    op: ReduceOp,
    size: int,
    rank: int,
    group: Any = None,
) -> float:
    """Return this worker's factor: its share of the global batch for an average, 1 for a sum.

    ``size`` and ``rank`` are within ``group`` (the ``torch.distributed`` group that sums; ``None``: all).
    """
    if plan_shares is not None and len(plan_shares) != size:
        raise ValueError(
            f"the strategy has batch shares for {len(plan_shares)} devices but the job has {size} "
            "worker processes"
        )
    if op is Sum:
        return 1.0
    if plan_shares is not None and batch_share is not None:
        raise ValueError("batch_share was given, but the strategy already fixes the batch shares")
    if batch_share is not None:
        if not batch_share > 0:
            raise ValueError(f"batch_share must be positive, got {batch_share!r}")
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, float(batch_share), group=group)
        shares = tuple(float(s) for s in gathered)
    elif plan_shares is not None:
        shares = plan_shares
    else:
        return 1.0 / size
    return shares[rank] / sum(shares)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
    compression: type[Compressor] = NoneCompressor,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: object = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    *,
    strategy: object = None,
    batch_share: float | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients synchronised over every worker.

    Call it on every worker, after :func:`tagps.torch.init` and with the same model. Each gradient starts
    its synchronisation in a hook as soon as backward has accumulated it ``backward_passes_per_step``
    times; ``step()`` waits only for what is still in flight. With ``op=Average`` the result is

    .. math::
        g = \\sum_r \\frac{s_r}{\\sum_q s_q}\\, g_r

    where :math:`s_r` is worker :math:`r`'s batch share (even by default), i.e. the full-batch gradient.

    Args:
        optimizer: the torch optimizer to wrap (its parameters must be those of the model).
        named_parameters: ``model.named_parameters()``; needed when ``strategy`` names parameters.
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``, applied to what travels.
        backward_passes_per_step: backward passes accumulated locally per step (default 1).
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: Horovod's split of the average: gradients are multiplied by ``1/f``
            before the sum and by ``f/size`` after it (default 1: the average in one factor). ``Average``
            only.
        num_groups: Horovod's deprecated spelling of an integer ``groups``.
        groups: Horovod's grouping of gradient allreduces, ``None``, a count or lists of parameters;
            checked, then a hint: tagps fuses gradients into its own buckets, with the same result.
        sparse_as_dense: turn sparse gradients dense before synchronising them (without it, a sparse
            gradient raises: tagps has no sparse allreduce).
        process_set: synchronise among the ranks of this :class:`~tagps.torch.ProcessSet` only (default:
            every worker); the methods are then ``allreduce`` and ``none``.
        strategy: ``None`` (``ps`` when summation servers exist, else ``allreduce``), a dict
            ``{param_name: method, "default": method}`` with methods ``allreduce``, ``ps``, ``sfb``,
            ``none``, or a plan (object or path, see ``tagps.strategy.plan``) with its batch shares;
            a plan's ``comm.fusion_bytes`` replaces ``TAGPS_FUSION_BYTES`` and ``comm.overlap = false``
            starts every gradient after the whole backward.
        batch_share: this worker's share of the global batch (e.g. its local batch size) when shares are
            uneven and the strategy does not fix them; every worker must pass one.

    Returns:
        A ``torch.optim.Optimizer`` with ``synchronize()`` and ``skip_synchronize()``.

    Raises:
        ValueError: an unknown parameter name or method in ``strategy``, ``sfb`` on a non-linear weight,
            plan ``sfb_ops`` other than the owning ``nn.Linear``, bad shares or arguments; before any
            training step.
    """
    return _DistributedOptimizer(
        optimizer,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups if groups is not None or not num_groups else num_groups,
        sparse_as_dense,
        process_set,
        strategy,
        batch_share,
    )
