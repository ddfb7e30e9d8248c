"""Computation graphs: ``torch.fx`` trace + shape propagation + per-op FLOPs, bytes and parameters.

:func:`extract_graph` traces a module, then interprets the fx graph node by node on *meta* tensors with a
batch of one sample (nothing is allocated and FLOPs are exact: every op here is linear in the batch), under
``torch.utils.flop_counter.FlopCounterMode``. For each op it records the forward FLOPs, the backward FLOPs
(an ``autograd.grad`` of the op's outputs with respect to its inputs and parameters that need gradients),
the bytes of its output and inputs per sample, its parameter bytes and the fully qualified names of the
parameters it owns. Edges carry the bytes of the tensor passed, per sample.

:func:`profile_graph` optionally times every op on this CPU (median of 5 runs) at several batch sizes and
caches the result on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tagps.strategy.devices import DeviceType

__all__ = ["Graph", "Op", "calibrate_device", "extract_graph", "model_graph", "profile_graph"]


@dataclass(frozen=True)
class Op:
    """One op of the graph; byte and FLOP figures are per sample of the batch.

    Args:
        name: fx node name (unique).
        kind: the module class or function name (``Conv2d``, ``matmul``).
        fwd_flops: forward FLOPs per sample.
        bwd_flops: backward FLOPs per sample (input and weight gradients).
        out_bytes: bytes of the op's output per sample (the activation kept for backward).
        in_bytes: bytes of the op's tensor inputs per sample.
        param_bytes: bytes of the parameters it owns (independent of the batch).
        params: fully qualified names (``model.named_parameters()``) of the parameters it owns.
    """

    name: str
    kind: str
    fwd_flops: float
    bwd_flops: float
    out_bytes: int
    in_bytes: int
    param_bytes: int
    params: tuple[str, ...] = ()


@dataclass
class Graph:
    """A model's op graph in topological order.

    Args:
        name: model name.
        ops: the ops, topologically sorted.
        edges: ``(src index, dst index, bytes per sample)``.
        params: ``{parameter name: bytes}`` of every trainable parameter, in ``named_parameters()`` order.
    """

    name: str
    ops: list[Op]
    edges: list[tuple[int, int, int]]
    params: dict[str, int] = field(default_factory=dict)

    @property
    def fwd_flops(self) -> float:
        """Forward FLOPs per sample of the whole model."""
        return sum(op.fwd_flops for op in self.ops)

    @property
    def param_bytes(self) -> int:
        """Bytes of all parameters."""
        return sum(self.params.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "ops": [asdict(op) for op in self.ops],
            "edges": [list(e) for e in self.edges],
            "params": dict(self.params),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Graph:
        """Inverse of :meth:`to_dict`."""
        ops = [Op(**{**o, "params": tuple(o["params"])}) for o in data["ops"]]
        return cls(data["name"], ops, [tuple(e) for e in data["edges"]], dict(data["params"]))


@lru_cache(maxsize=1)
def _path_tracer_class() -> type:
    from torch import fx

    class PathTracer(fx.Tracer):
        """An fx tracer that remembers in which submodule tracing failed."""

        def __init__(self) -> None:
            super().__init__()
            self.failed_at: str | None = None

        def call_module(self, m: Any, forward: Any, args: Any, kwargs: Any) -> Any:
            try:
                return super().call_module(m, forward, args, kwargs)
            except Exception:
                if self.failed_at is None:
                    self.failed_at = self.path_of_module(m)
                raise

    return PathTracer


def _nbytes(value: Any) -> int:
    import torch
    from torch.utils._pytree import tree_leaves

    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def extract_graph(model: Any, inputs: Sequence[Any], name: str = "model") -> Graph:
    """Trace ``model`` and return its :class:`Graph`.

    Args:
        model: an ``nn.Module``; it may live on the meta device (recommended for big models).
        inputs: example inputs with a batch of ONE sample (tensors on the model's device, meta allowed).
        name: model name recorded in the graph.

    Returns:
        The graph; figures are per sample.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: torch.fx cannot trace it (the message names the module).
    """
    import torch
    from torch import fx
    from torch.utils._pytree import tree_leaves, tree_map
    from torch.utils.flop_counter import FlopCounterMode

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"extract_graph needs an nn.Module, got {type(model).__name__}")
    tracer = _path_tracer_class()()
    try:
        gm = fx.GraphModule(model, tracer.trace(model), type(model).__name__)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
        where = tracer.failed_at or ""
        sub = model.get_submodule(where) if where else model
        place = f"submodule {where!r} ({type(sub).__name__})" if where else f"module {type(model).__name__}"
        raise RuntimeError(f"torch.fx cannot trace {name}: {place} failed: {exc}") from exc

    param_names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    params = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad}
    nodes = list(gm.graph.nodes)
    env: dict[fx.Node, Any] = {}
    needs_grad: dict[fx.Node, bool] = {}
    op_index: dict[fx.Node, int] = {}
    ops: list[Op] = []
    edges: list[tuple[int, int, int]] = []
    # Parameters reached through get_attr belong to the first op that consumes them.
    attr_owner: dict[fx.Node, list[str]] = {}
    placeholders = iter(inputs)
    counter = FlopCounterMode(display=False)

    def total() -> int:
        return sum(counter.get_flop_counts().get("Global", {}).values())

    for node in nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
            needs_grad[node] = False
            continue
        if node.op == "output":
            continue
        if node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            env[node] = value.detach() if isinstance(value, torch.Tensor) else value
            pname = param_names.get(id(value))
            needs_grad[node] = pname is not None
            if pname is not None:
                attr_owner[node] = [pname]
            continue

        owned: list[str] = []
        module_params: list[torch.nn.Parameter] = []
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            module_params = [p for p in sub.parameters() if id(p) in param_names]
            owned = [param_names[id(p)] for p in module_params]
            kind, fn = type(sub).__name__, sub
        elif node.op == "call_function":
            kind, fn = getattr(node.target, "__name__", str(node.target)), node.target
        else:  # call_method
            kind, fn = str(node.target), None
        for inp in node.all_input_nodes:
            if inp in attr_owner:
                owned += attr_owner.pop(inp)

        # Fresh leaves for the inputs that carry gradients, so that backward stops at this op.
        leaves: list[torch.Tensor] = []

        def lift(n: fx.Node, leaves: list[torch.Tensor] = leaves) -> Any:
            value = env[n]
            if needs_grad[n] and isinstance(value, torch.Tensor) and value.is_floating_point():
                leaf = value.detach().requires_grad_()
                leaves.append(leaf)
                return leaf.clone()
            return value

        args = fx.node.map_arg(node.args, lift)
        kwargs = fx.node.map_arg(node.kwargs, lift)
        with counter:  # entering resets the counts
            try:
                if node.op == "call_method":
                    out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
                else:
                    out = fn(*args, **kwargs)
            except Exception as exc:
                raise RuntimeError(
                    f"{name}: op {node.name} ({kind}) failed during shape propagation: {exc}"
                ) from exc
            fwd = total()
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            wrt = leaves + module_params
            if outs and wrt:
                torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
            bwd = total() - fwd
        env[node] = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
        needs_grad[node] = bool(outs)
        idx = len(ops)
        op_index[node] = idx
        in_bytes = 0
        for inp in node.all_input_nodes:
            nbytes = _nbytes(env[inp])
            in_bytes += nbytes
            if inp in op_index:
                edges.append((op_index[inp], idx, nbytes))
        ops.append(
            Op(
                node.name,
                kind,
                float(fwd),
                float(bwd),
                _nbytes(out),
                in_bytes,
                sum(params[p] for p in owned),
                tuple(owned),
            )
        )
    return Graph(name, ops, edges, params)


@lru_cache(maxsize=16)
def model_graph(name: str) -> Graph:
    """Graph of reference model ``name`` (traced on the meta device; cached in this process)."""
    import torch

    from tagps.models import build_model, example_inputs

    with torch.device("meta"):
        model = build_model(name)
    return extract_graph(model, example_inputs(name, 1, "meta"), name)


def _cache_dir() -> Path:
    from tagps.config import strategy_config

    return Path(strategy_config().cache_dir)


def profile_graph(
    name: str, batch_sizes: Sequence[int] = (1, 4, 16), repeats: int = 5, cache_dir: str | Path | None = None
) -> dict[int, dict[str, float]]:
    """Time every op of reference model ``name`` on this CPU; cached on disk.

    Args:
        name: reference model name.
        batch_sizes: batch sizes to profile at.
        repeats: runs per op; the median is kept.
        cache_dir: where the JSON cache lives (default: ``TAGPS_CACHE_DIR``).

    Returns:
        ``{batch size: {op name: forward seconds}}``.
    """
    import torch
    from torch import fx

    from tagps.models import build_model, example_inputs

    if repeats < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("profile_graph needs repeats >= 1 and batch sizes >= 1")
    folder = Path(cache_dir) if cache_dir is not None else _cache_dir()
    key = hashlib.sha1(
        json.dumps([name, sorted(batch_sizes), repeats, torch.__version__, os.cpu_count()]).encode()
    ).hexdigest()[:16]
    path = folder / f"profile-{name}-{key}.json"
    if path.is_file():
        return {int(b): t for b, t in json.loads(path.read_text()).items()}
    torch.manual_seed(0)
    model = build_model(name).eval()
    gm = fx.symbolic_trace(model)
    result: dict[int, dict[str, float]] = {}

    class Timer(fx.Interpreter):
        def __init__(self, module: fx.GraphModule, times: dict[str, list[float]]) -> None:
            super().__init__(module)
            self.times = times

        def run_node(self, n: fx.Node) -> Any:
            if n.op in ("placeholder", "output", "get_attr"):
                return super().run_node(n)
            start = time.perf_counter()
            out = super().run_node(n)
            self.times.setdefault(n.name, []).append(time.perf_counter() - start)
            return out

    with torch.no_grad():
        for batch in sorted(batch_sizes):
            times: dict[str, list[float]] = {}
            inputs = example_inputs(name, batch)
            Timer(gm, {}).run(*inputs)  # warm-up
            for _ in range(repeats):
                Timer(gm, times).run(*inputs)
            result[batch] = {op: statistics.median(ts) for op, ts in times.items()}
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({str(b): t for b, t in result.items()}))
    return result


def calibrate_device(
    name: str,
    base: str = "CPU",
    batch_sizes: Sequence[int] = (1, 4, 16),
    repeats: int = 5,
    cache_dir: str | Path | None = None,
) -> DeviceType:
    """Fit the roofline constants of device type ``base`` to this CPU's op times for model ``name``.

    Profiles (or reads the cached profile of) every op's forward at ``batch_sizes`` with
    :func:`profile_graph`, then :func:`~tagps.strategy.devices.fit_device`.
    """
    from tagps.strategy.devices import device_type, fit_device

    graph = model_graph(name)
    profile = profile_graph(name, batch_sizes, repeats, cache_dir)
    by_name = {op.name: op for op in graph.ops}
    samples = [
        (op.fwd_flops * b, op.param_bytes + (op.in_bytes + op.out_bytes) * b, seconds)
        for b, times in profile.items()
        for op_name, seconds in times.items()
        if (op := by_name.get(op_name)) is not None
    ]
    return fit_device(device_type(base), samples)
