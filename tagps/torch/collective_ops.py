"""Horovod's collectives (``horovod.torch.mpi_ops``) on tagps, with process sets and autograd.

Sums and averages over every worker go through :func:`tagps.torch.ops.start_sum`, so they use the summation
servers when the job has some (for the dtypes they sum: float16/32/64); every other op, dtype and process set
runs on ``torch.distributed`` directly. gloo and NCCL have no int16 kernels, so int16 tensors travel as int32.
The synchronous out-of-place collectives are differentiable as in Horovod: the gradient of an allreduce is
the same allreduce of the gradient; of an allgather or broadcast, the average of the gradients over the set
(the root's, zero elsewhere, for a broadcast); of an alltoall, the alltoall back; of a reducescatter, the
allgather of the gradients.

Integer results of an average or of ``prescale_factor``/``postscale_factor`` are truncated toward zero, as
Horovod's C++ scaling does (the floor, for non-negative values). Before moving data over
``torch.distributed``, the ranks exchange dtype, shape and the arguments that must agree (op, root), so a
mismatch raises ``ValueError`` on every rank instead of corrupting the result or aborting a rank inside
gloo (the summation servers match tensors by key and time out on their own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tagps.comm import collectives
from tagps.comm.handle import CompletedWork, Handle
from tagps.torch import ops, timeline
from tagps.torch.compression import Compressor, NoneCompressor
from tagps.torch.optimizer import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from tagps.torch.process_sets import ProcessSet, global_process_set, group_of

__all__ = [
    "HorovodInternalError",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "wait",
]

_DIST_OPS = {
    Sum: dist.ReduceOp.SUM,
    Average: dist.ReduceOp.SUM,
    Min: dist.ReduceOp.MIN,
    Max: dist.ReduceOp.MAX,
    Product: dist.ReduceOp.PRODUCT,
}
_PS_DTYPES = (torch.float32, torch.float64, torch.float16)  # what the summation servers add
_WIDER = {torch.int16: torch.int32}  # neither gloo nor NCCL has int16 kernels


@dataclass(frozen=True)
class _Reduce:
    """The parameters of an allreduce or reducescatter, kept for its backward pass."""

    op: ReduceOp
    prescale: float
    postscale: float
    process_set: ProcessSet
    compression: type[Compressor] = NoneCompressor
    priority: int = 0


def reduce_spec(
    average: bool | None,
    op: ReduceOp | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    compression: type[Compressor] = NoneCompressor,
    priority: int = 0,
) -> _Reduce:
    """Check an allreduce's arguments the way Horovod does and return them as one record.

    ``average`` is Horovod's deprecated flag: ``True`` is ``op=Average``, ``False`` is ``op=Sum``; without
    either, the op is ``Average``.

    Raises:
        ValueError: both ``average`` and ``op``, ``Adasum``, or an unknown op.
    """
    if average is not None and op is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        op = Sum if average is not None and not average else Average
    if op is Adasum:
        raise ValueError("op=Adasum is not available: tagps has no Adasum; use Average or Sum")
    if op not in _DIST_OPS:
        raise ValueError(f"op must be Average, Sum, Min, Max or Product, got {op!r}")
    if not (isinstance(compression, type) and issubclass(compression, Compressor)):
        raise TypeError(f"compression must be one of Compression.none/fp16/bf16, got {compression!r}")
    return _Reduce(op, float(prescale_factor), float(postscale_factor), process_set, compression, priority)


# ---------------------------------------------------------------------------------------------- helpers
def _check_tensor(tensor: object, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expected a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def _check_tensors(tensors: object, what: str) -> list[torch.Tensor]:
    if not isinstance(tensors, list | tuple):
        raise TypeError(f"{what} expects a list of tensors, got {type(tensors).__name__}")
    return [_check_tensor(t, what) for t in tensors]


class _UnnamedKeys:
    """The keys of unnamed sums: ``noname.<dtype>.<count>.<compression>.<slot>``, reused.

    An unnamed sum takes the lowest slot of its (wire dtype, element count, compression) that no unnamed sum
    in flight holds, and gives it back when its handle is waited for. Both happen in program order, so every
    rank that makes the same calls derives the same keys (as Horovod's and BytePS's call-order names do),
    and a loop of unnamed calls reuses a few keys: the summation servers' key table and the shared-memory
    arenas grow with the shapes in flight at once, not with the number of calls.
    """

    def __init__(self, owner: ops.State) -> None:
        self.owner = owner  # keys restart with each init()
        self._busy: dict[tuple[str, int, str], set[int]] = {}

    def take(self, tensor: torch.Tensor, compression: type[Compressor]) -> tuple[str, Callable[[], None]]:
        """Return a free key for ``tensor`` and the function that gives it back."""
        kind = (str(tensor.dtype).removeprefix("torch."), tensor.numel(), compression.__name__)
        busy = self._busy.setdefault(kind, set())
        slot = min(set(range(len(busy) + 1)) - busy)
        busy.add(slot)
        return f"noname.{kind[0]}.{kind[1]}.{kind[2]}.{slot}", lambda: busy.discard(slot)


_unnamed: _UnnamedKeys | None = None


def _unnamed_keys() -> _UnnamedKeys:
    """Return the unnamed-key slots of the current :func:`tagps.torch.init`."""
    global _unnamed
    st = ops.state()
    if _unnamed is None or _unnamed.owner is not st:
        _unnamed = _UnnamedKeys(st)
    return _unnamed


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` in a dtype the backends can move (itself when it already is)."""
    wider = _WIDER.get(tensor.dtype)
    return tensor if wider is None else tensor.to(wider)


def _scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiply ``tensor`` by ``factor`` in place; integers are truncated toward zero, as Horovod's C++."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_(tensor.double().mul_(factor))


class HorovodInternalError(RuntimeError):
    """A collective failed in the communication layer (a peer died, a transfer broke), as in Horovod."""


def wait(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result.

    Raises:
        HorovodInternalError: the communication layer failed (``torch.distributed`` and the PS service
            report failures as ``RuntimeError``); the original error is its cause.
    """
    try:
        return handle.wait()
    except HorovodInternalError:
        raise
    except RuntimeError as exc:
        raise HorovodInternalError(str(exc)) from exc


_in_flight: dict[str, Handle] = {}  # user-named asynchronous operations, by name


def _register(name: str | None, start: Callable[[], Handle]) -> Handle:
    """Start an asynchronous operation and make its handle known to ``poll``/``synchronize``.

    Raises:
        ValueError: an operation with the same ``name`` is still in flight (not synchronised), as in Horovod;
            before anything is sent.
    """
    handles = ops.state().handles
    if name is not None and _in_flight.get(name) in handles:
        raise ValueError(
            f"an operation named {name!r} is still in flight: synchronize() it before reusing the name"
        )
    handle = start()
    handles.add(handle)
    if name is not None:
        _in_flight[name] = handle
    return handle


def _group(handles: list[Handle]) -> Handle:
    """One handle for several; its result is the list of theirs."""
    return Handle(list(handles), lambda: [h.wait() for h in handles])  # type: ignore[arg-type, return-value]


def _set_size(process_set: ProcessSet) -> int:
    size = process_set.size()
    assert size is not None  # group_of() checked the registration
    return size


# ---------------------------------------------------------------------------------------------- starts
def start_allreduce(tensor: torch.Tensor, spec: _Reduce, name: str | None, inplace: bool) -> Handle:
    """Start one allreduce of ``tensor`` (into itself when ``inplace``, else into a new tensor).

    ``name`` is the key on the summation servers; ``None`` takes a reused one (see :class:`_UnnamedKeys`).

    Returns:
        A handle whose ``wait()`` returns the result,
        :math:`\\text{postscale} \\cdot \\bigoplus_r (\\text{prescale} \\cdot t_r)`, divided by the set's
        size for ``Average``.
    """
    st = ops.state()
    _check_tensor(tensor, "allreduce")
    if inplace and not tensor.is_contiguous():
        raise ValueError("in-place allreduce needs a contiguous tensor")
    group = group_of(spec.process_set)
    on_servers = (
        spec.op in (Sum, Average)
        and group is None
        and tensor.dtype in _PS_DTYPES
        and ops.default_method(st.cfg) == "ps"
    )
    out = tensor.detach() if inplace else tensor.detach().clone(memory_format=torch.contiguous_format)
    if not on_servers:  # the servers match tensors by key and time out on their own; gloo would abort
        # Ranks inside join() stand in with zeros of the dtype sent, in a Sum or Average over every worker.
        zeros = None
        if spec.op in (Sum, Average) and group is None:
            zeros = spec.compression.compress(torch.empty(0, dtype=_WIDER.get(out.dtype, out.dtype)))[0].dtype
        op_code = (list(_DIST_OPS).index(spec.op),)
        collectives.check_same_layout(tensor.detach(), group, "allreduce", op_code, zeros=zeros)
    _scale_(out, spec.prescale)
    work = _wire(out)
    inner: Any
    release: Callable[[], None] | None = None
    if spec.op in (Sum, Average) and group is None:
        method = "ps" if on_servers else "allreduce"
        key = name
        if key is None:
            key, release = _unnamed_keys().take(work, spec.compression)
        try:
            inner = ops.start_sum(
                work, method=method, name=key, priority=spec.priority, compression=spec.compression
            )
        except BaseException:
            if release is not None:
                release()
            raise
    else:
        wire, ctx = spec.compression.compress(work)
        inner = collectives.all_reduce_async(wire, group, _DIST_OPS[spec.op])
        if wire is not work:
            inner = Handle([inner], lambda: work.copy_(spec.compression.decompress(wire, ctx)), keep=(wire,))
    post = spec.postscale / _set_size(spec.process_set) if spec.op is Average else spec.postscale

    def finish() -> torch.Tensor:
        inner.wait()
        if release is not None:  # only after a completed round: a failed one may leave its key mid-round
            release()
        if work is not out:
            out.copy_(work)
        _scale_(out, post)
        return tensor if inplace else out  # the caller's object, as Horovod returns it

    return timeline.traced(Handle([inner], finish, keep=(tensor,)), "ALLREDUCE", name or "allreduce")


def _start_grouped_allreduce(
    tensors: Sequence[torch.Tensor], spec: _Reduce, name: str | None, inplace: bool
) -> Handle:
    names: list[str | None]
    if name is None:
        names = [None] * len(tensors)  # each takes a reused key
    elif len(tensors) == 1:  # allreduce() goes through here too and keeps the name as given
        names = [name]
    else:
        names = [f"{name}.{i}" for i in range(len(tensors))]
    return _group([start_allreduce(t, spec, n, inplace) for t, n in zip(tensors, names, strict=True)])


def _start_allgather(tensor: torch.Tensor, process_set: ProcessSet) -> tuple[Handle, list[int]]:
    """Start an allgather; return its handle and the row count of every rank of the set."""
    _check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension")
    group = group_of(process_set)
    src = _wire(tensor.detach().contiguous())
    work, result, counts = collectives.all_gather_rows_async(src, group)

    def finish() -> torch.Tensor:
        rows = result()
        return rows.clone() if rows is src else rows.to(tensor.dtype)

    return timeline.traced(Handle([work], finish, keep=(src,)), "ALLGATHER", "allgather"), counts


def _start_broadcast(tensor: torch.Tensor, root_rank: int, process_set: ProcessSet, inplace: bool) -> Handle:
    _check_tensor(tensor, "broadcast")
    group = group_of(process_set)
    members = process_set.ranks if process_set.process_set_id != 0 else range(ops.state().cfg.size)
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in members:
        raise ValueError(f"root_rank must be a (global) rank of {process_set}, got {root_rank!r}")
    if inplace and not tensor.is_contiguous():
        raise ValueError("in-place broadcast needs a contiguous tensor")
    collectives.check_same_layout(tensor.detach(), group, "broadcast", (root_rank,))
    out = tensor.detach() if inplace else tensor.detach().clone(memory_format=torch.contiguous_format)
    wire = _wire(out)
    work: Any = CompletedWork()
    if _set_size(process_set) > 1:
        work = dist.broadcast(wire, src=root_rank, group=group, async_op=True)

    def finish() -> torch.Tensor:
        if wire is not out:
            out.copy_(wire)
        return tensor if inplace else out

    return timeline.traced(Handle([work], finish, keep=(wire,)), "BROADCAST", "broadcast")


def _start_alltoall(
    tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None, process_set: ProcessSet
) -> Handle:
    _check_tensor(tensor, "alltoall")
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    group = group_of(process_set)
    size, rows = _set_size(process_set), tensor.shape[0]
    if splits is None:
        if rows % size:
            raise ValueError(
                f"alltoall without splits divides the first dimension evenly, but {rows} rows do not "
                f"divide by {size} ranks; pass splits"
            )
        send = [rows // size] * size
    else:
        send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(send) != size or any(s < 0 for s in send) or sum(send) != rows:
            raise ValueError(
                f"splits must be {size} non-negative row counts summing to the first dimension {rows}, "
                f"got {send}"
            )
    src = _wire(tensor.detach().contiguous())
    work, out, counts = collectives.all_to_all_rows_async(src, send, group)
    handle = Handle(
        [work],
        lambda: (out.to(tensor.dtype), torch.tensor(counts, dtype=torch.int32)),  # type: ignore[arg-type, return-value]
        keep=(src, out),
    )
    return timeline.traced(handle, "ALLTOALL", "alltoall")


def _start_reducescatter(tensor: torch.Tensor, spec: _Reduce, name: str | None) -> Handle:
    """Reduce over the set, keep this rank's rows (the first ``rows % size`` ranks get one more).

    It all-reduces the whole tensor and slices: twice a reduce-scatter's traffic, but the same scaling,
    integer handling and summation servers as :func:`allreduce`.
    """
    _check_tensor(tensor, "reducescatter")
    if spec.op not in (Sum, Average):
        raise ValueError(f"reducescatter supports op=Average or Sum, got {spec.op!r}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    full = start_allreduce(tensor, spec, name, inplace=False)
    size, me = _set_size(spec.process_set), spec.process_set.rank()
    assert me is not None
    rows = tensor.shape[0]
    start = me * (rows // size) + min(me, rows % size)
    mine = rows // size + (1 if me < rows % size else 0)
    return Handle([full], lambda: full.wait()[start : start + mine].clone())


def _start_grouped_reducescatter(tensors: Sequence[torch.Tensor], spec: _Reduce, name: str | None) -> Handle:
    names = [None if name is None else f"{name}.{i}" for i in range(len(tensors))]
    return _group([_start_reducescatter(t, spec, n) for t, n in zip(tensors, names, strict=True)])


# ---------------------------------------------------------------------------------------------- autograd
class _AllreduceFunction(torch.autograd.Function):
    """Allreduce of several tensors; the gradient is the same allreduce of the gradients."""

    @staticmethod
    def forward(
        ctx: Any, spec: _Reduce, name: str | None, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.spec = spec
        return tuple(wait(_start_grouped_allreduce(tensors, spec, name, inplace=False)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        spec: _Reduce = ctx.spec
        if spec.op not in (Sum, Average):
            raise RuntimeError(f"the gradient of an allreduce with op={spec.op.name} is not defined in tagps")
        return (None, None, *wait(_start_grouped_allreduce(grads, spec, None, inplace=False)))


def _average_grads(grads: Sequence[torch.Tensor], process_set: ProcessSet) -> list[torch.Tensor]:
    spec = _Reduce(Average, 1.0, 1.0, process_set)
    return wait(_start_grouped_allreduce(grads, spec, None, inplace=False))  # type: ignore[no-any-return]


class _AllgatherFunction(torch.autograd.Function):
    """Allgather of several tensors; the gradient of each is this rank's rows of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        started = [_start_allgather(t, process_set) for t in tensors]
        me = process_set.rank()
        assert me is not None
        ctx.process_set = process_set
        ctx.rows = [(sum(counts[:me]), counts[me]) for _, counts in started]
        return tuple(wait(h) for h, _ in started)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        averaged = _average_grads(grads, ctx.process_set)
        return (None, *(g.narrow(0, start, n) for g, (start, n) in zip(averaged, ctx.rows, strict=True)))


class _BroadcastFunction(torch.autograd.Function):
    """Broadcast; the gradient is the average of the gradients on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return wait(_start_broadcast(tensor, root_rank, process_set, inplace=False))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (averaged,) = _average_grads([grad], ctx.process_set)
        if ops.state().cfg.rank != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None


class _AlltoallFunction(torch.autograd.Function):
    """Alltoall; the gradient travels back with the received splits."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, process_set: ProcessSet
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = wait(_start_alltoall(tensor, splits, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:
        back, _splits = wait(_start_alltoall(grad, ctx.received, ctx.process_set))
        return back, None, None


class _ReducescatterFunction(torch.autograd.Function):
    """Reducescatter of several tensors; the gradient is the scaled allgather of the gradients."""

    @staticmethod
    def forward(
        ctx: Any, spec: _Reduce, name: str | None, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.spec = spec
        return tuple(wait(_start_grouped_reducescatter(tensors, spec, name)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        spec: _Reduce = ctx.spec
        scale = spec.prescale * spec.postscale
        if spec.op is Average:
            scale /= _set_size(spec.process_set)
        gathered = [wait(_start_allgather(g, spec.process_set)[0]) for g in grads]
        for g in gathered:
            _scale_(g, scale)
        return (None, None, *gathered)


# ---------------------------------------------------------------------------------------------- allreduce
def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing ``tensor`` over the set into a new tensor; return the handle for ``synchronize``.

    Args:
        tensor: the local value (unchanged); same dtype and shape on every rank.
        average: deprecated (Horovod): ``True`` for ``Average``, ``False`` for ``Sum``.
        name: the operation's key (the same on every rank; default: a reused key, see docs/torch.md).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiplies each rank's tensor before the reduction.
        postscale_factor: multiplies the result (an ``Average`` also divides it by the set's size).
        process_set: the ranks that take part (every worker by default).

    Returns:
        The handle; ``synchronize(handle)`` returns the result.
    """
    spec = reduce_spec(average, op, prescale_factor, postscale_factor, process_set)
    return _register(name, lambda: start_allreduce(tensor, spec, name, inplace=False))


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Like :func:`allreduce_async`, writing the result into ``tensor`` (contiguous)."""
    spec = reduce_spec(average, op, prescale_factor, postscale_factor, process_set)
    return _register(name, lambda: start_allreduce(tensor, spec, name, inplace=True))


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return the reduction of ``tensor`` over the set (differentiable; see :func:`allreduce_async`).

    Args:
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``: what travels.

    Returns:
        A new tensor of ``tensor``'s shape and dtype.
    """
    spec = reduce_spec(average, op, prescale_factor, postscale_factor, process_set, compression)
    (out,) = _AllreduceFunction.apply(spec, name, _check_tensor(tensor, "allreduce"))
    return out


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` over the set in place and return it (see :func:`allreduce_async`)."""
    spec = reduce_spec(average, op, prescale_factor, postscale_factor, process_set)
    return wait(start_allreduce(tensor, spec, name, inplace=True))  # type: ignore[no-any-return]


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing every tensor of ``tensors`` (see :func:`allreduce_async`); the result is a list."""
    spec = reduce_spec(average, op, prescale_factor, postscale_factor, process_set)
    tensors = _check_tensors(tensors, "grouped_allreduce")
    return _register(name, lambda: _start_grouped_allreduce(tensors, spec, name, False))


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Like :func:`grouped_allreduce_async`, in place."""
    spec = reduce_spec(average, op, prescale_factor, postscale_factor, process_set)
    tensors = _check_tensors(tensors, "grouped_allreduce")
    return _register(name, lambda: _start_grouped_allreduce(tensors, spec, name, True))


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Return the reduction of every tensor of ``tensors`` (differentiable; see :func:`allreduce`)."""
    spec = reduce_spec(average, op, prescale_factor, postscale_factor, process_set, compression)
    return list(_AllreduceFunction.apply(spec, name, *_check_tensors(tensors, "grouped_allreduce")))


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce every tensor of ``tensors`` in place and return them."""
    spec = reduce_spec(average, op, prescale_factor, postscale_factor, process_set)
    handle = _start_grouped_allreduce(_check_tensors(tensors, "grouped_allreduce"), spec, name, True)
    return wait(handle)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------- allgather
def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Handle:
    """Start concatenating along dim 0 every rank's ``tensor`` (first dimensions may differ).

    Args:
        tensor: at least 1-D; dtype and all but the first dimension equal on every rank (checked).
        name: accepted for Horovod compatibility.
        process_set: the ranks that take part.

    Returns:
        The handle; ``synchronize(handle)`` returns the rows of the set's rank 0, then 1, and so on.
    """
    return _register(name, lambda: _start_allgather(tensor, process_set)[0])


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Return every rank's ``tensor`` along dim 0 (differentiable; see :func:`allgather_async`)."""
    (out,) = _AllgatherFunction.apply(process_set, tensor)
    return out


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> Handle:
    """Start an allgather of every tensor of ``tensors``; ``synchronize`` returns a list."""
    tensors = _check_tensors(tensors, "grouped_allgather")
    return _register(name, lambda: _group([_start_allgather(t, process_set)[0] for t in tensors]))


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    """Return the allgather of every tensor of ``tensors`` (differentiable)."""
    return list(_AllgatherFunction.apply(process_set, *_check_tensors(tensors, "grouped_allgather")))


# ---------------------------------------------------------------------------------------------- broadcast
def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start copying ``root_rank``'s ``tensor`` into a new tensor on every rank of the set.

    Args:
        tensor: same dtype and shape on every rank.
        root_rank: the global rank whose value wins (a member of the set).
        name: accepted for Horovod compatibility.
        process_set: the ranks that take part.
    """
    return _register(name, lambda: _start_broadcast(tensor, root_rank, process_set, inplace=False))


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Like :func:`broadcast_async`, overwriting ``tensor`` (contiguous)."""
    return _register(name, lambda: _start_broadcast(tensor, root_rank, process_set, inplace=True))


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` as a new tensor (differentiable; see :func:`broadcast_async`)."""
    return _BroadcastFunction.apply(_check_tensor(tensor, "broadcast"), root_rank, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s value and return it."""
    return wait(_start_broadcast(tensor, root_rank, process_set, inplace=True))  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------- alltoall
def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start sending ``splits[j]`` consecutive rows of ``tensor`` to the set's rank ``j``, for all ``j``.

    Args:
        tensor: at least 1-D; dtype and all but the first dimension equal on every rank (checked).
        splits: rows per destination (default: the first dimension divided evenly).
        name: accepted for Horovod compatibility.
        process_set: the ranks that take part.

    Returns:
        The handle; ``synchronize(handle)`` returns ``(rows received, in rank order; int32 received
        splits)``.
    """
    return _register(name, lambda: _start_alltoall(tensor, splits, process_set))


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rows received, received splits)`` (differentiable; see :func:`alltoall_async`)."""
    return _AlltoallFunction.apply(_check_tensor(tensor, "alltoall"), splits, process_set)


# ---------------------------------------------------------------------------------------------- reducescatter
def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start reducing ``tensor`` over the set and keeping this rank's share of the rows.

    Args:
        tensor: at least 1-D, same dtype and shape on every rank; rows are split in rank order, the first
            ``rows % size`` ranks getting one more.
        name: the operation's key (default: a reused key, see docs/torch.md).
        op: ``Average`` (default) or ``Sum``.
        process_set: the ranks that take part.
        prescale_factor: multiplies each rank's tensor before the reduction.
        postscale_factor: multiplies the result.
    """
    spec = reduce_spec(None, op, prescale_factor, postscale_factor, process_set)
    return _register(name, lambda: _start_reducescatter(tensor, spec, name))


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Return this rank's rows of the reduction (differentiable; see :func:`reducescatter_async`)."""
    spec = reduce_spec(None, op, prescale_factor, postscale_factor, process_set, compression)
    (out,) = _ReducescatterFunction.apply(spec, name, _check_tensor(tensor, "reducescatter"))
    return out


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start a reducescatter of every tensor of ``tensors``; ``synchronize`` returns a list."""
    spec = reduce_spec(None, op, prescale_factor, postscale_factor, process_set)
    tensors = _check_tensors(tensors, "grouped_reducescatter")
    return _register(name, lambda: _start_grouped_reducescatter(tensors, spec, name))


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Return the reducescatter of every tensor of ``tensors`` (differentiable)."""
    spec = reduce_spec(None, op, prescale_factor, postscale_factor, process_set, compression)
    return list(_ReducescatterFunction.apply(spec, name, *_check_tensors(tensors, "grouped_reducescatter")))


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: ReduceOp, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Start summing or averaging a sparse COO tensor over the set, as Horovod does: by allgathering its
    indices and values (every rank's entries, duplicates summed when the result is coalesced).

    Args:
        tensor: a sparse COO tensor of the same shape on every rank (any number of entries).
        name: the operation's name (accepted for Horovod compatibility).
        op: ``Average`` or ``Sum``.
        process_set: the ranks that take part.

    Returns:
        A function (Horovod's contract, not a handle) that waits and returns the sparse result.

    Raises:
        ValueError: a dense tensor, or another op.
    """
    if not _check_tensor(tensor, "sparse_allreduce_async").is_sparse:
        raise ValueError("sparse_allreduce_async needs a sparse COO tensor; use allreduce for dense ones")
    spec = reduce_spec(None, op, 1.0, 1.0, process_set)
    if spec.op not in (Sum, Average):
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, got {spec.op!r}")
    local = tensor.detach().coalesce()
    # Allgather concatenates rows, so the indices travel transposed: one row per entry.
    indices, _ = _start_allgather(local.indices().t().contiguous(), process_set)
    values, _ = _start_allgather(local.values(), process_set)
    post = 1.0 / _set_size(process_set) if spec.op is Average else 1.0

    def result() -> torch.Tensor:
        gathered = wait(values)
        _scale_(gathered, post)
        # Valid by construction: every rank's indices were valid for this shape.
        return torch.sparse_coo_tensor(wait(indices).t(), gathered, tensor.shape, check_invariants=False)

    return result


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the set reached this call."""
    group = group_of(process_set)
    if _set_size(process_set) > 1:
        wait(Handle([dist.barrier(group=group, async_op=True)], lambda: torch.empty(0)))
