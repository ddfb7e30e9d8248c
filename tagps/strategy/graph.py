"""Computation graphs: ``torch.fx`` trace + shape propagation + per-op FLOPs, bytes and parameters.

:func:`extract_graph` traces a module, then interprets the fx graph node by node on *meta* tensors with a
batch of one sample (nothing is allocated and FLOPs are exact: every op here is linear in the batch), under
``torch.utils.flop_counter.FlopCounterMode``. For each op it records the forward FLOPs, the backward FLOPs
(an ``autograd.grad`` of the op's outputs with respect to its inputs and parameters that need gradients),
the bytes of its output and inputs per sample, its parameter bytes and the fully qualified names of the
parameters it owns. Edges carry the bytes of the tensor passed, per sample.

:func:`profile_graph` times every op, forward and backward, on the local CPU or GPU (fastest of 5 runs) at
several batch sizes and caches the result on disk; ``tagps.strategy.profiles`` turns that into the
shippable profiles the simulator uses instead of its roofline.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tagps.atomic import write_text_atomic

if TYPE_CHECKING:
    from tagps.strategy.devices import DeviceType

__all__ = ["Graph", "Op", "calibrate_device", "extract_graph", "model_graph", "profile_graph", "timing_clock"]


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


class _OpCall:
    """One call node of an fx graph, run alone: inputs that carry gradients become fresh leaves.

    ``run(*inputs())`` may be repeated (to time it); the last output is what later ops see.
    """

    __slots__ = (
        "env", "fn", "grad_out", "kind", "module_params", "name", "needs_grad", "node", "out", "owned"
    )

    def __init__(self, node: Any, kind: str, fn: Any, module_params: list[Any], owned: list[str],
                 env: dict[Any, Any], needs_grad: dict[Any, bool], name: str) -> None:
        self.node, self.kind, self.fn, self.module_params, self.owned = node, kind, fn, module_params, owned
        self.env, self.needs_grad, self.name = env, needs_grad, name
        self.out: Any = None
        self.grad_out = False

    def inputs(self) -> tuple[Any, Any, list[Any]]:
        """Fresh arguments: ``(args, kwargs, leaves)``, the leaves being the inputs that carry gradients."""
        import torch
        from torch import fx

        leaves: list[torch.Tensor] = []

        def lift(n: fx.Node) -> Any:
            value = self.env[n]
            if self.needs_grad[n] and isinstance(value, torch.Tensor) and value.is_floating_point():
                leaf = value.detach().requires_grad_()
                leaves.append(leaf)
                return leaf.clone()  # in-place ops (ReLU(inplace=True)) must not touch the leaf
            return value

        return fx.node.map_arg(self.node.args, lift), fx.node.map_arg(self.node.kwargs, lift), leaves

    def run(self, args: Any, kwargs: Any, leaves: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        """Run the op on :meth:`inputs`; return its output, the outputs needing gradients, their sources."""
        import torch
        from torch.utils._pytree import tree_leaves

        node = self.node
        try:
            if node.op == "call_method":
                out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                out = self.fn(*args, **kwargs)
        except Exception as exc:
            raise RuntimeError(f"{self.name}: op {node.name} ({self.kind}) failed: {exc}") from exc
        self.out = out
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        self.grad_out = bool(outs)
        return out, outs, leaves + self.module_params


def _op_calls(model: Any, gm: Any, inputs: Sequence[Any], name: str) -> Iterator[_OpCall]:
    """Yield every call node of ``gm`` as an :class:`_OpCall`, in topological order.

    The caller runs each one (at least once) before asking for the next. Parameters reached through
    ``get_attr`` belong to the first op that consumes them.
    """
    import torch
    from torch.utils._pytree import tree_map

    param_names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    env: dict[Any, Any] = {}
    needs_grad: dict[Any, bool] = {}
    attr_owner: dict[Any, list[str]] = {}
    placeholders = iter(inputs)
    for node in gm.graph.nodes:
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
        module_params: list[torch.nn.Parameter] = []
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            module_params = [p for p in sub.parameters() if id(p) in param_names]
            kind, fn = type(sub).__name__, sub
        elif node.op == "call_function":
            kind, fn = getattr(node.target, "__name__", str(node.target)), node.target
        else:  # call_method
            kind, fn = str(node.target), None
        owned = [param_names[id(p)] for p in module_params]
        for inp in node.all_input_nodes:
            if inp in attr_owner:
                owned += attr_owner.pop(inp)
        call = _OpCall(node, kind, fn, module_params, owned, env, needs_grad, name)
        yield call
        env[node] = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, call.out)
        needs_grad[node] = call.grad_out


def _trace(model: Any, name: str) -> Any:
    """``torch.fx`` GraphModule of ``model``; RuntimeError naming the submodule that cannot be traced."""
    from torch import fx

    tracer = _path_tracer_class()()
    try:
        return fx.GraphModule(model, tracer.trace(model), type(model).__name__)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
        where = tracer.failed_at or ""
        sub = model.get_submodule(where) if where else model
        place = f"submodule {where!r} ({type(sub).__name__})" if where else f"module {type(model).__name__}"
        raise RuntimeError(f"torch.fx cannot trace {name}: {place} failed: {exc}") from exc


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
    from torch.utils.flop_counter import FlopCounterMode

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"extract_graph needs an nn.Module, got {type(model).__name__}")
    gm = _trace(model, name)
    params = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad}
    op_index: dict[Any, int] = {}
    ops: list[Op] = []
    edges: list[tuple[int, int, int]] = []
    counter = FlopCounterMode(display=False)

    def total() -> int:
        return sum(counter.get_flop_counts().get("Global", {}).values())

    for call in _op_calls(model, gm, inputs, name):
        with counter:  # entering resets the counts
            out, outs, wrt = call.run(*call.inputs())
            fwd = total()
            if outs and wrt:
                torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
            bwd = total() - fwd
        idx = len(ops)
        op_index[call.node] = idx
        in_bytes = 0
        for inp in call.node.all_input_nodes:
            nbytes = _nbytes(call.env[inp])
            in_bytes += nbytes
            if inp in op_index:
                edges.append((op_index[inp], idx, nbytes))
        ops.append(
            Op(
                call.node.name,
                call.kind,
                float(fwd),
                float(bwd),
                _nbytes(out),
                in_bytes,
                sum(params[p] for p in call.owned),
                tuple(call.owned),
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


def check_device(device: str) -> None:
    """Raise ValueError unless ``device`` is ``"cpu"`` or ``"cuda"`` with CUDA present."""
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device cuda: CUDA is not available on this machine (torch {torch.__version__}, "
                f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'})"
            )
    elif device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def device_name(device: str) -> str:
    """What the local ``device`` is: the GPU's name, or the CPU's model, core count and torch threads."""
    import platform

    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name"))
        cpu = cpu.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass  # not Linux: platform's answer
    return f"{cpu} x{os.cpu_count()}, {torch.get_num_threads()} threads"


def timing_clock(device: str) -> tuple[Callable[[], None], Callable[[], float]]:
    """``(sync, clock)`` for timing work on ``device``: CUDA synchronises before each reading; one CPU
    thread reads its own CPU time, so that other load on the host is left out (an op longer than a
    scheduler slice is otherwise always preempted on a busy host); else the wall clock."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    clock = time.thread_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    return sync, clock


def profile_graph(
    name: str,
    batch_sizes: Sequence[int] = (1, 4, 16),
    repeats: int = 5,
    cache_dir: str | Path | None = None,
    device: str = "cpu",
    progress: bool = False,
) -> dict[int, dict[str, tuple[float, float]]]:
    """Time every op of reference model ``name``, forward and backward, on the local ``device``; cached.

    The model runs in training mode. Each op runs alone on the tensors it gets in the model, its inputs that
    carry gradients as fresh leaves (as :func:`extract_graph` does), in one pass over the model to warm up
    and then ``repeats`` passes; its backward is ``autograd.grad`` of its outputs with respect to those
    inputs and its parameters. The fastest run of each is kept: on a shared host, other load only ever adds
    time. With one CPU thread, the thread's CPU time is measured instead of the wall clock.

    Args:
        name: reference model name.
        batch_sizes: batch sizes to profile at (default 1, 4, 16).
        repeats: timed runs per op (default 5).
        cache_dir: where the JSON cache lives (default: ``TAGPS_CACHE_DIR``).
        device: ``"cpu"`` or ``"cuda"`` (default ``"cpu"``).
        progress: show a progress bar on stderr.

    Returns:
        ``{batch size: {op name: (forward seconds, backward seconds)}}``; backward is 0 for ops that
        no gradient flows through.

    Raises:
        ValueError: bad arguments, or ``device="cuda"`` without CUDA.
    """
    import torch
    from tqdm import tqdm

    from tagps.models import build_model, example_inputs

    if repeats < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("profile_graph needs repeats >= 1 and batch sizes >= 1")
    check_device(device)
    folder = Path(cache_dir) if cache_dir is not None else _cache_dir()
    what = ["fwd+bwd", name, sorted(batch_sizes), repeats, torch.__version__, device_name(device)]
    key = hashlib.sha1(json.dumps(what).encode()).hexdigest()[:16]
    path = folder / f"profile-{name}-{key}.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        return {int(b): {op: (fwd, bwd) for op, (fwd, bwd) in row.items()} for b, row in cached.items()}
    sync, clock = timing_clock(device)
    torch.manual_seed(0)
    model = build_model(name).to(device).train()
    gm = _trace(model, name)
    nops = sum(n.op.startswith("call_") for n in gm.graph.nodes)
    result: dict[int, dict[str, tuple[float, float]]] = {}
    with tqdm(total=nops * len(batch_sizes) * (repeats + 1), desc=f"profiling {name} on {device}", unit="op",
              disable=not progress) as bar:
        for batch in sorted(batch_sizes):
            inputs = example_inputs(name, batch, device)
            runs: dict[str, list[tuple[float, float]]] = {}
            # Whole passes over the model rather than runs of one op in a row, so that a burst of other load
            # spoils one sample of every op instead of every sample of one op. Pass 0 warms up.
            for k in range(repeats + 1):
                for call in _op_calls(model, gm, inputs, name):
                    args = call.inputs()
                    sync()
                    start = clock()
                    _, outs, wrt = call.run(*args)
                    sync()
                    mid = clock()
                    grads = [torch.ones_like(t) for t in outs]
                    sync()
                    back = clock()
                    if outs and wrt:
                        torch.autograd.grad(outs, wrt, grads, allow_unused=True)
                    sync()
                    if k:
                        bwd = clock() - back if outs and wrt else 0.0
                        runs.setdefault(call.node.name, []).append((mid - start, bwd))
                    bar.update()
            result[batch] = {op: (min(f for f, _ in ts), min(b for _, b in ts)) for op, ts in runs.items()}
    write_text_atomic(path, json.dumps({str(b): t for b, t in result.items()}))
    return result


def calibrate_device(
    name: str,
    base: str = "CPU",
    batch_sizes: Sequence[int] = (1, 4, 16),
    repeats: int = 5,
    cache_dir: str | Path | None = None,
) -> DeviceType:
    """Fit the roofline constants of device type ``base`` to this CPU's op times for model ``name``.

    Profiles (or reads the cached profile of) every op's forward and backward at ``batch_sizes`` with
    :func:`profile_graph`, then :func:`~tagps.strategy.devices.fit_device` against the roofline's
    forward and backward figures (``docs/simulator.md``).
    """
    from tagps.strategy.devices import device_type, fit_device

    graph = model_graph(name)
    profile = profile_graph(name, batch_sizes, repeats, cache_dir)
    by_name = {op.name: op for op in graph.ops}
    samples = []
    for b, times in profile.items():
        for op_name, (fwd, bwd) in times.items():
            if (op := by_name.get(op_name)) is None:
                continue
            moved = op.param_bytes + (op.in_bytes + op.out_bytes) * b
            samples.append((op.fwd_flops * b, moved, fwd))
            if bwd > 0:
                samples.append((op.bwd_flops * b, 2 * moved, bwd))
    return fit_device(device_type(base), samples)
