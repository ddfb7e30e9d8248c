"""Horovod's ``horovod.torch`` API on tagps: every collective, on 3 real processes, checked against values
computed from every rank's input; process sets; autograd; errors raised on every rank; the optimizer's
Horovod arguments. Also the names that need no job.

The module is its own worker: ``run_job`` starts it under ``bpslaunch --local 3`` with the names of the
checks below; each rank runs them in order and writes what each raised (or ``ok``) to ``rank<R>.json``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import tagps.torch as hvd

WORKERS = 3
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
DTYPES = (torch.float32, torch.float64, torch.float16, *INT_DTYPES)
OPS = ("Average", "Sum", "Min", "Max", "Product")
CHECKS: dict[str, Callable[[int, int], None]] = {}
INIT_SET = hvd.ProcessSet([0, 1])  # registered by the worker's init


def check(fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
    CHECKS[fn.__name__] = fn
    return fn


def _value(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: distinct per rank, negative entries for signed dtypes, small enough for int8."""
    base = torch.tensor([1, -2, 3, -4]) * (rank + 1) + (1 if rank == 0 else 0)
    return (base.abs() if dtype in (torch.uint8,) else base).to(dtype)


def _reduce(op: str, size: int, dtype: torch.dtype, ranks: list[int] | None = None) -> torch.Tensor:
    """The reference result: reduce every rank's input in float64, then round like Horovod (truncation)."""
    values = torch.stack([_value(r, dtype).double() for r in (ranks if ranks is not None else range(size))])
    out = {
        "Sum": values.sum(0),
        "Average": values.sum(0) / len(values),
        "Min": values.min(0).values,
        "Max": values.max(0).values,
        "Product": values.prod(0),
    }[op]
    return out.to(dtype)  # float -> int truncates toward zero, as Horovod's C++ scaling


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    tol = 1e-2 if want.dtype == torch.float16 else 1e-6
    assert torch.allclose(got.double(), want.double(), rtol=tol, atol=tol), f"{what}: {got} != {want}"


# ---------------------------------------------------------------------------------------------- checks
@check
def allreduce_every_dtype_and_op(rank: int, size: int) -> None:
    for dtype in DTYPES:
        for op in OPS:
            if op == "Product" and dtype in (torch.uint8, torch.int8):
                continue  # the products overflow 8 bits, and float-to-int8 conversion is then undefined
            want = _reduce(op, size, dtype)
            x = _value(rank, dtype)
            what = f"{dtype} {op}"
            _assert_equal(hvd.allreduce(x, op=getattr(hvd, op)), want, what)
            assert torch.equal(x, _value(rank, dtype)), f"{what}: allreduce changed its input"
            _assert_equal(hvd.synchronize(hvd.allreduce_async(x, op=getattr(hvd, op))), want, f"{what} async")
            y = _value(rank, dtype)
            assert hvd.allreduce_(y, op=getattr(hvd, op)) is y
            _assert_equal(y, want, f"{what} in place")
            z = _value(rank, dtype)
            h = hvd.allreduce_async_(z, op=getattr(hvd, op))
            assert hvd.synchronize(h) is z
            _assert_equal(z, want, f"{what} async in place")


@check
def allreduce_positional_order_and_average_flag(rank: int, size: int) -> None:
    x = _value(rank, torch.float32)
    # Horovod's order: (tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    _assert_equal(
        hvd.allreduce_(x.clone(), False, "pos.sum"), _reduce("Sum", size, torch.float32), "average=False"
    )
    h = hvd.allreduce_async(x, None, "pos.max", hvd.Max, 2.0, 0.5)
    _assert_equal(hvd.synchronize(h), _reduce("Max", size, torch.float32), "op at position 4")
    # allreduce alone has compression at position 4
    out = hvd.allreduce(x, True, "pos.avg", hvd.Compression.fp16)
    _assert_equal(out, _reduce("Average", size, torch.float32), "compression at position 4")
    ints = _value(rank, torch.int64)
    _assert_equal(hvd.allreduce(ints, average=True), _reduce("Average", size, torch.int64), "integer average")


@check
def allreduce_pre_and_postscale(rank: int, size: int) -> None:
    for dtype in (torch.float32, torch.int32):
        x = _value(rank, dtype)
        out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5)
        want = (torch.stack([(_value(r, dtype) * 3).double() for r in range(size)]).sum(0) * 0.5).to(dtype)
        _assert_equal(out, want, f"{dtype} scaled sum")
    avg = hvd.allreduce(
        _value(rank, torch.float64), op=hvd.Average, prescale_factor=2.0, postscale_factor=5.0
    )
    _assert_equal(avg, _reduce("Average", size, torch.float64) * 10, "scaled average")


@check
def grouped_allreduce_variants(rank: int, size: int) -> None:
    xs = [_value(rank, torch.float32), _value(rank, torch.int32).reshape(2, 2)]
    want = [_reduce("Sum", size, torch.float32), _reduce("Sum", size, torch.int32).reshape(2, 2)]
    for got in (
        hvd.grouped_allreduce(xs, op=hvd.Sum),
        hvd.synchronize(hvd.grouped_allreduce_async(xs, op=hvd.Sum)),
    ):
        for g, w in zip(got, want, strict=True):
            _assert_equal(g, w, "grouped")
    copies = [x.clone() for x in xs]
    assert all(a is b for a, b in zip(hvd.grouped_allreduce_(copies, op=hvd.Sum), copies, strict=True))
    copies2 = [x.clone() for x in xs]
    hvd.synchronize(hvd.grouped_allreduce_async_(copies2, op=hvd.Sum))
    for c, c2, w in zip(copies, copies2, want, strict=True):
        _assert_equal(c, w, "grouped in place")
        _assert_equal(c2, w, "grouped async in place")


@check
def allgather_every_dtype_with_uneven_rows(rank: int, size: int) -> None:
    for dtype in DTYPES:
        x = torch.full((rank + 1, 2), rank + 1).to(dtype)
        want = torch.cat([torch.full((r + 1, 2), r + 1).to(dtype) for r in range(size)])
        _assert_equal(hvd.allgather(x), want, f"{dtype}")
        _assert_equal(hvd.synchronize(hvd.allgather_async(x)), want, f"{dtype} async")
    got = hvd.grouped_allgather([torch.ones(rank + 1), torch.zeros(1, 3, dtype=torch.int16)])
    _assert_equal(got[0], torch.ones(size * (size + 1) // 2), "grouped 0")
    _assert_equal(got[1], torch.zeros(size, 3, dtype=torch.int16), "grouped 1")
    got = hvd.synchronize(hvd.grouped_allgather_async([torch.full((1,), float(rank))]))
    _assert_equal(got[0], torch.arange(size, dtype=torch.float32), "grouped async")


@check
def broadcast_every_dtype(rank: int, size: int) -> None:
    root = size - 1
    for dtype in DTYPES:
        want = _value(root, dtype)
        x = _value(rank, dtype)
        _assert_equal(hvd.broadcast(x, root), want, f"{dtype}")
        assert torch.equal(x, _value(rank, dtype))
        _assert_equal(hvd.synchronize(hvd.broadcast_async(x, root)), want, f"{dtype} async")
        y = _value(rank, dtype)
        assert hvd.broadcast_(y, root) is y
        _assert_equal(y, want, f"{dtype} in place")
        z = _value(rank, dtype)
        hvd.synchronize(hvd.broadcast_async_(z, root))
        _assert_equal(z, want, f"{dtype} async in place")


@check
def alltoall_with_and_without_splits(rank: int, size: int) -> None:
    # Rank r sends j + 1 rows holding 100 r + j to rank j.
    splits = [j + 1 for j in range(size)]
    x = torch.cat([torch.full((j + 1, 2), 100 * rank + j) for j in range(size)])
    out, received = hvd.alltoall(x, splits=splits)
    want = torch.cat([torch.full((rank + 1, 2), 100 * r + rank) for r in range(size)])
    _assert_equal(out, want, "alltoall")
    assert received.tolist() == [rank + 1] * size and received.dtype == torch.int32
    out, received = hvd.synchronize(hvd.alltoall_async(torch.arange(size, dtype=torch.int16) + 10 * rank))
    _assert_equal(out, torch.tensor([10 * r + rank for r in range(size)], dtype=torch.int16), "even splits")
    assert received.tolist() == [1] * size


@check
def sparse_allreduce_gathers_every_rank_entries(rank: int, size: int) -> None:
    # Rank r holds r + 1 at (r, 0) and 1 at (0, 1); rank 1 holds nothing at all.
    entries = [] if rank == 1 else [((rank, 0), rank + 1.0), ((0, 1), 1.0)]
    indices = torch.tensor([e[0] for e in entries], dtype=torch.int64).reshape(-1, 2).t()
    values = torch.tensor([e[1] for e in entries])
    local = torch.sparse_coo_tensor(indices, values, (size, 2), check_invariants=True)
    want = torch.zeros(size, 2)
    for r in range(size):
        if r != 1:
            want[r, 0] += r + 1.0
            want[0, 1] += 1.0
    result = hvd.sparse_allreduce_async(local, name="emb.grad", op=hvd.Sum)()
    assert result.is_sparse
    _assert_equal(result.to_dense(), want, "sum")
    _assert_equal(hvd.sparse_allreduce_async(local, "emb.avg", hvd.Average)().to_dense(), want / size, "avg")


@check
def reducescatter_splits_rows_first_ranks_first(rank: int, size: int) -> None:
    rows = 2 * size + 1  # the first rank gets one more row
    x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (rank + 1)
    total = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * sum(range(1, size + 1))
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    start = sum(counts[:rank])
    mine = total[start : start + counts[rank]]
    _assert_equal(hvd.reducescatter(x, op=hvd.Sum), mine, "sum")
    _assert_equal(hvd.reducescatter(x), mine / size, "average (default)")
    _assert_equal(hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum)), mine, "async")
    _assert_equal(
        hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), mine / 2, "scaled"
    )
    got = hvd.grouped_reducescatter([x, x.double()], op=hvd.Sum)
    _assert_equal(got[1], mine.double(), "grouped")
    got = hvd.synchronize(hvd.grouped_reducescatter_async([x], op=hvd.Sum))
    _assert_equal(got[0], mine, "grouped async")


@check
def autograd_of_every_differentiable_collective(rank: int, size: int) -> None:
    def grad_of(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        out = fn(x)
        out.backward(torch.full_like(out, float(rank + 1)))
        assert x.grad is not None
        return x.grad

    ranks_sum = float(sum(range(1, size + 1)))
    x = torch.ones(3, 2)
    _assert_equal(
        grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum), x), torch.full((3, 2), ranks_sum), "allreduce"
    )
    _assert_equal(grad_of(lambda t: hvd.allreduce(t), x), torch.full((3, 2), ranks_sum / size), "average")
    g = grad_of(lambda t: hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum)[1], x)
    _assert_equal(g, torch.full((3, 2), 2 * ranks_sum), "grouped allreduce")
    # allgather: this rank's rows of the averaged output gradient
    _assert_equal(
        grad_of(hvd.allgather, torch.ones(rank + 1, 2)),
        torch.full((rank + 1, 2), ranks_sum / size),
        "allgather",
    )
    g = grad_of(lambda t: hvd.grouped_allgather([t])[0], torch.ones(rank + 1, 2))
    _assert_equal(g, torch.full((rank + 1, 2), ranks_sum / size), "grouped allgather")
    root = 1
    want = torch.full((2,), ranks_sum / size if rank == root else 0.0)
    _assert_equal(grad_of(lambda t: hvd.broadcast(t, root), torch.ones(2)), want, "broadcast")
    # alltoall: the gradient goes back to where each row came from; rank j scaled it by j + 1
    g = grad_of(lambda t: hvd.alltoall(t)[0], torch.ones(size, 2))
    _assert_equal(g, torch.arange(1, size + 1, dtype=torch.float32)[:, None].expand(size, 2), "alltoall")
    # reducescatter: the allgather of the gradients, scaled as the forward
    g = grad_of(lambda t: hvd.reducescatter(t, op=hvd.Sum, postscale_factor=2.0), torch.ones(size, 2))
    _assert_equal(
        g, 2 * torch.arange(1, size + 1, dtype=torch.float32)[:, None].expand(size, 2), "reducescatter"
    )


@check
def mismatched_shapes_raise_on_every_rank(rank: int, size: int) -> None:
    with pytest.raises(ValueError, match="all-gather mismatch"):
        hvd.allgather(torch.ones(1, 2 if rank else 3))
    with pytest.raises(ValueError, match="all-gather mismatch"):
        hvd.allgather(torch.ones(2, dtype=torch.float64 if rank == 1 else torch.float32))
    with pytest.raises(ValueError, match="all-to-all mismatch"):
        hvd.alltoall(torch.ones(size, 2 if rank else 3))
    with pytest.raises(
        ValueError, match=r"allreduce mismatch: this rank has dtype torch.float32, shape \(\d,\)"
    ):
        hvd.allreduce(torch.ones(2 if rank else 3))
    with pytest.raises(ValueError, match="allreduce mismatch"):
        hvd.allreduce_(torch.ones(2, dtype=torch.float64 if rank == 2 else torch.float32))
    with pytest.raises(ValueError, match=r"allreduce mismatch: .* and arguments \[\d\]"):
        hvd.allreduce(torch.ones(2), op=hvd.Max if rank else hvd.Min)
    with pytest.raises(ValueError, match="broadcast mismatch"):
        hvd.broadcast(torch.ones(1, 2 if rank else 1), 0)
    with pytest.raises(ValueError, match="broadcast mismatch"):
        hvd.broadcast_(torch.ones(2), rank % 2)
    with pytest.raises(ValueError, match="allreduce mismatch"):
        hvd.push_pull(torch.ones(3 if rank == 1 else 4))
    hvd.barrier()  # the job goes on after the errors


@check
def process_sets(rank: int, size: int) -> None:
    evens = hvd.add_process_set([0, 2])
    odd = hvd.ProcessSet([1])
    assert hvd.add_process_set(odd) is odd and odd.process_set_id != evens.process_set_id
    assert evens.size() == 2 and evens.included() == (rank != 1)
    assert hvd.global_process_set.size() == size and hvd.global_process_set.rank() == rank
    if rank != 1:
        assert evens.rank() == [0, 2].index(rank)
        out = hvd.allreduce(_value(rank, torch.float32), op=hvd.Sum, process_set=evens)
        _assert_equal(out, _reduce("Sum", size, torch.float32, [0, 2]), "set allreduce")
        out = hvd.allreduce(_value(rank, torch.float32), process_set=evens)
        _assert_equal(out, _reduce("Average", size, torch.float32, [0, 2]), "set average")
        out = hvd.allreduce(_value(rank, torch.int16), op=hvd.Max, process_set=evens)
        _assert_equal(out, _reduce("Max", size, torch.int16, [0, 2]), "set max")
        _assert_equal(
            hvd.allgather(torch.full((1,), rank), process_set=evens), torch.tensor([0, 2]), "set gather"
        )
        _assert_equal(
            hvd.broadcast(torch.full((1,), rank), 2, process_set=evens), torch.tensor([2]), "set bcast"
        )
        out, _ = hvd.alltoall(torch.tensor([rank, rank]), process_set=evens)
        _assert_equal(out, torch.tensor([0, 2]), "set alltoall")
        _assert_equal(
            hvd.reducescatter(torch.ones(2), op=hvd.Sum, process_set=evens), torch.full((1,), 2.0), "set rs"
        )
        with pytest.raises(ValueError, match="root_rank must be a"):
            hvd.broadcast(torch.ones(1), 1, process_set=evens)
        assert hvd.allgather_object({"r": rank}, process_set=evens) == [{"r": 0}, {"r": 2}]
        assert hvd.broadcast_object(rank, root_rank=2, process_set=evens) == 2
        params = {"w": torch.full((2,), float(rank))}
        hvd.broadcast_parameters(params, root_rank=2, process_set=evens)
        _assert_equal(params["w"], torch.full((2,), 2.0), "set broadcast_parameters")
        opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1 * (rank + 1))
        hvd.broadcast_optimizer_state(opt, root_rank=0, process_set=evens)
        assert opt.param_groups[0]["lr"] == 0.1
        hvd.barrier(process_set=evens)
    else:
        with pytest.raises(ValueError, match="Process is not part of provided process set"):
            evens.rank()
        with pytest.raises(ValueError, match="is not part of ProcessSet"):
            hvd.allreduce(torch.ones(1), process_set=evens)
        _assert_equal(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=odd), torch.ones(1), "set of one")
    with pytest.raises(ValueError, match="duplicate process set"):
        hvd.add_process_set([0, 2])
    with pytest.raises(ValueError, match="duplicate process set"):
        hvd.add_process_set(list(range(size)))  # the global set
    with pytest.raises(ValueError, match="needs the same ranks on every worker"):
        hvd.add_process_set([0, 1] if rank == 0 else [1, 2])
    assert hvd.remove_process_set(evens) and evens.process_set_id is None and evens.size() is None
    assert not hvd.remove_process_set(evens) and not hvd.remove_process_set(hvd.global_process_set)
    assert hvd.remove_process_set(odd)
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(torch.ones(1), process_set=evens)


@check
def init_registered_its_process_sets(rank: int, size: int) -> None:
    """The worker passed ``INIT_SET`` to ``init(process_sets=...)``."""
    assert INIT_SET.process_set_id is not None and INIT_SET.size() == 2
    assert INIT_SET.included() == (rank < 2)
    if rank < 2:
        out = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=INIT_SET)
        _assert_equal(out, torch.full((1,), 2.0), "set from init")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _step_grads(opt: torch.optim.Optimizer, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.synchronize()  # type: ignore[attr-defined]
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _local_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@check
def optimizer_horovod_arguments(rank: int, size: int) -> None:
    """Horovod's MNIST/ImageNet calls, with gradient_predivide_factor, groups and sparse_as_dense."""
    model = _model(0)
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    want = [torch.stack(gs).mean(0) for gs in zip(*[_local_grads(_model(0), x) for x in xs], strict=True)]
    for kwargs in (
        {"gradient_predivide_factor": 1.0},
        {"gradient_predivide_factor": 4.0, "groups": 2},
        {"groups": [list(model[0].parameters())], "num_groups": 0, "sparse_as_dense": True},
    ):
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.none,
            backward_passes_per_step=1,
            op=hvd.Average,
            **kwargs,
        )
        for got, w in zip(_step_grads(opt, model, xs[rank]), want, strict=True):
            assert torch.allclose(got, w, rtol=1e-5, atol=1e-6), kwargs
        del opt
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum, gradient_predivide_factor=2.0
        )


@check
def broadcast_optimizer_state_initialises_an_empty_state(rank: int, size: int) -> None:
    """Rank 0 never stepped, the others did (rank r took r steps): afterwards every rank holds the state
    of rank 0 initialised as Horovod does (one step on zero gradients), ``step`` included; a
    DistributedOptimizer initialises without synchronising, and the weights do not move."""
    weights = nn.Parameter(torch.full((3,), float(rank + 1)))
    inner = torch.optim.AdamW([weights], lr=0.1 * (rank + 1), weight_decay=0.5)
    for _ in range(rank):
        weights.grad = torch.full((3,), float(rank))
        inner.step()
    weights.grad = None
    before = weights.detach().clone()
    opt = hvd.DistributedOptimizer(inner, named_parameters=[("w", weights)])
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()
    assert state["param_groups"][0]["lr"] == 0.1
    assert float(state["state"][0]["step"]) == 1.0, state["state"][0]
    assert torch.equal(state["state"][0]["exp_avg"], torch.zeros(3))
    assert torch.equal(state["state"][0]["exp_avg_sq"], torch.zeros(3))
    assert torch.equal(weights.detach(), before) and weights.grad is None
    gathered = hvd.allgather_object(state)
    assert all(str(g) == str(gathered[0]) for g in gathered), gathered
    del opt


@check
def join_serves_allreduces_with_zeros(rank: int, size: int) -> None:
    """Rank r has r + 1 batches (rank 0 joins first, rank 2 last): every allreduce averages over the job's
    size with zeros for the joined ranks, as in Horovod; allgather and broadcast raise meanwhile."""
    batches = rank + 1
    for i in range(batches):
        active = [r for r in range(size) if r + 1 > i]
        got = hvd.allreduce(_value(rank, torch.float32), name="join.avg")
        want = torch.stack([_value(r, torch.float32) for r in active]).sum(0) / size
        _assert_equal(got, want, f"average at batch {i}")
        got = hvd.allreduce(_value(rank, torch.int16), op=hvd.Sum)
        want = torch.stack([_value(r, torch.int16).int() for r in active]).sum(0).to(torch.int16)
        _assert_equal(got, want, f"int16 sum at batch {i}")
        if i == 1:  # rank 0 has joined
            with pytest.raises(ValueError, match=r"worker rank\(s\) \[0\] called join"):
                hvd.allgather(torch.ones(1))
            with pytest.raises(ValueError, match=r"called join"):
                hvd.broadcast(torch.ones(1), root_rank=1)
            with pytest.raises(ValueError, match=r"allreduce cannot run: .* Sum or Average"):
                hvd.allreduce(torch.ones(1), op=hvd.Max)
    assert hvd.join() == size - 1
    _assert_equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(size)), "after join")


@check
def join_with_distributed_optimizer_uneven_batches(rank: int, size: int) -> None:
    """Each rank trains on its own r + 1 batches and joins; its weights after its last step equal those of
    one process that averages, at step i, the gradients of the ranks still training over the job's size."""
    xs = [[torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(r + 1)]
          for r in range(size)]  # fmt: skip
    model = _model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for x in xs[rank]:
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    assert hvd.join() == size - 1
    ref = _model(0)
    for i in range(rank + 1):
        grads = [_local_grads(ref, xs[r][i]) for r in range(size) if i < len(xs[r])]
        with torch.no_grad():
            for p, *gs in zip(ref.parameters(), *grads, strict=True):
                p -= 0.1 * torch.stack(gs).sum(0) / size
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
    del opt


@check
def join_refuses_an_optimizer_it_cannot_serve(rank: int, size: int) -> None:
    model = _model(0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), process_set=INIT_SET
    ) if rank < 2 else None  # fmt: skip
    if opt is not None:  # every rank that holds it refuses before exchanging anything
        with pytest.raises(NotImplementedError, match="synchronises over a process set"):
            hvd.join()
    del opt
    assert hvd.join() == size - 1  # every rank joins at once: the highest wins


@check
def optimizer_sparse_as_dense(rank: int, size: int) -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    ids = torch.tensor([rank, rank + 1])
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=0.1), emb.named_parameters(), sparse_as_dense=True
    )
    opt.zero_grad()
    emb(ids).sum().backward()
    opt.synchronize()
    want = torch.zeros(10, 3)
    for r in range(size):
        want[[r, r + 1]] += 1.0 / size
    assert torch.allclose(emb.weight.grad, want)
    del opt
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), emb.named_parameters())
    opt.zero_grad()
    with pytest.raises(ValueError, match="pass sparse_as_dense=True"):
        emb(ids).sum().backward()
    del opt


@check
def optimizer_over_a_process_set(rank: int, size: int) -> None:
    evens = hvd.add_process_set([0, 2])
    if rank != 1:
        model = _model(0)
        xs = {r: torch.randn(5, 4, generator=torch.Generator().manual_seed(r)) for r in (0, 2)}
        want = [
            torch.stack(gs).mean(0)
            for gs in zip(*[_local_grads(_model(0), x) for x in xs.values()], strict=True)
        ]
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), process_set=evens
        )
        for got, w in zip(_step_grads(opt, model, xs[rank]), want, strict=True):
            assert torch.allclose(got, w, rtol=1e-5, atol=1e-6)
        del opt
        with pytest.raises(ValueError, match=re.escape("asks for ['ps', 'sfb'], which serve every worker")):
            hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                model.named_parameters(),
                process_set=evens,
                strategy={"0.weight": "sfb", "default": "ps"},
            )
    else:
        model = _model(0)
        with pytest.raises(ValueError, match="is not part of ProcessSet"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=evens)
    hvd.remove_process_set(evens)


@check
def sync_batch_norm_matches_one_process(rank: int, size: int) -> None:
    """Uneven local batches (rank r holds r + 2 rows): outputs, input and parameter gradients and running
    statistics equal those of BatchNorm on the concatenated batch."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(r + 2, 3, 4, generator=gen) * (r + 1) + r for r in range(size)]
    w = [torch.randn(r + 2, 3, 4, generator=gen) for r in range(size)]
    torch.manual_seed(1)
    ref = nn.BatchNorm1d(3, momentum=0.3)
    nn.init.uniform_(ref.weight)
    sync = hvd.SyncBatchNorm(3, momentum=0.3)
    sync.load_state_dict(ref.state_dict())
    whole = torch.cat(xs).requires_grad_()
    (ref(whole) * torch.cat(w)).sum().backward()
    x = xs[rank].clone().requires_grad_()
    out = sync(x)
    (out * w[rank]).sum().backward()
    start = sum(r + 2 for r in range(rank))
    rows = slice(start, start + rank + 2)
    assert torch.allclose(out, nn.functional.batch_norm(
        whole.detach(), None, None, ref.weight.detach(), ref.bias.detach(), True, 0.0, ref.eps
    )[rows], rtol=1e-5, atol=1e-5)  # fmt: skip
    assert whole.grad is not None and x.grad is not None
    assert torch.allclose(x.grad, whole.grad[rows], rtol=1e-4, atol=1e-5)
    for p, q in zip(sync.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(hvd.allreduce(p.grad, op=hvd.Sum), q.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(sync.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
    assert torch.allclose(sync.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
    sync.eval()
    assert torch.allclose(sync(xs[rank]), ref.eval()(xs[rank]), rtol=1e-5, atol=1e-6)


@check
def sync_batch_norm_is_accurate_far_from_zero(rank: int, size: int) -> None:
    """Data with mean 100 and spread 0.01 (where float32 sums of x and x^2 lose every digit of the variance),
    no affine parameters, and an empty batch on the last rank: outputs and input gradients match float64
    BatchNorm on the concatenated batch."""
    gen = torch.Generator().manual_seed(2)
    rows = [0 if r == size - 1 else 3 + r for r in range(size)]
    xs = [100.0 + 0.01 * torch.randn(n, 2, 5, 5, generator=gen, dtype=torch.float64) for n in rows]
    w = [torch.randn(n, 2, 5, 5, generator=gen, dtype=torch.float64) for n in rows]
    whole = torch.cat(xs).requires_grad_()
    ref = nn.functional.batch_norm(whole, None, None, None, None, True, 0.0, 1e-5)
    (ref * torch.cat(w)).sum().backward()
    sync = hvd.SyncBatchNorm(2, affine=False)
    x = xs[rank].float().requires_grad_()
    out = sync(x)
    (out * w[rank].float()).sum().backward()
    start = sum(rows[:rank])
    mine = slice(start, start + rows[rank])
    assert whole.grad is not None and x.grad is not None
    assert torch.allclose(out.double(), ref.detach()[mine], rtol=0, atol=2e-3)
    scale = whole.grad.abs().max()
    assert torch.allclose(x.grad.double() / scale, whole.grad[mine] / scale, rtol=0, atol=2e-3)
    assert torch.allclose(sync.running_mean.double(), 0.1 * whole.detach().mean((0, 2, 3)), rtol=1e-5)


class _Net(nn.Module):
    """The shape of Horovod's MNIST example net, for 8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 3 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return nn.functional.log_softmax(self.fc(h.flatten(1)), dim=1)


@check
def horovod_example_scripts_flow(rank: int, size: int) -> None:
    """The calls of Horovod's pytorch_mnist.py and pytorch_imagenet_resnet50.py, in their order, on
    synthetic data: every replica ends with the same parameters."""
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 1, 8, 8, generator=gen), torch.randint(0, 10, (48,), generator=gen)
    )
    sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank())
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    resume_from_epoch = hvd.broadcast(
        torch.tensor(3 if rank == 0 else 0), root_rank=0, name="resume_from_epoch"
    )
    assert resume_from_epoch.item() == 3
    torch.manual_seed(rank)  # replicas start different; broadcast_parameters makes them equal
    model = _Net()
    lr_scaler = hvd.local_size() if hvd.nccl_built() and torch.cuda.is_available() else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler, momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        backward_passes_per_step=2,
        op=hvd.Average,
        gradient_predivide_factor=1.0,
    )
    total = torch.tensor(0.0)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            for i in range(0, len(x), 4):  # ImageNet's sub-batches, one backward pass each
                loss = nn.functional.nll_loss(model(x[i : i + 4]), y[i : i + 4])
                loss.div_(2)
                loss.backward()
            optimizer.step()
            total += hvd.allreduce(loss.detach().cpu(), name="avg_loss")  # Horovod's Metric
    assert torch.isfinite(total)
    for name, p in model.named_parameters():
        spread = hvd.allreduce(p.detach(), op=hvd.Max) - hvd.allreduce(p.detach(), op=hvd.Min)
        assert float(spread.abs().max()) == 0.0, name


@check
def layout_queries(rank: int, size: int) -> None:
    assert (hvd.cross_rank(), hvd.cross_size()) == (rank, size)  # one process per machine here
    assert hvd.is_homogeneous() and hvd.gloo_enabled() and not hvd.mpi_enabled()


# ---------------------------------------------------------------------------------------------- worker
def _worker() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    names = json.loads(args.cases.read_text())
    hvd.init(process_sets=[INIT_SET])
    results: dict[str, str] = {}
    for name in names:
        try:
            CHECKS[name](hvd.rank(), hvd.size())
            results[name] = "ok"
        except Exception:  # report every failure by name; the other checks still run
            results[name] = traceback.format_exc(limit=6)
            hvd.barrier()
    (args.out / f"rank{hvd.rank()}.json").write_text(json.dumps(results))
    hvd.shutdown()


# ---------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def job_results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, str]]]:
    import bpslaunch_job

    tmp = tmp_path_factory.mktemp("horovod")
    yield bpslaunch_job.run_job(Path(__file__), tmp, list(CHECKS), workers=WORKERS, timeout=400.0)


@pytest.mark.parametrize("name", list(CHECKS))
def test_horovod_collective_on_every_rank(job_results: list[dict[str, str]], name: str) -> None:
    failures = {r: res[name] for r, res in enumerate(job_results) if res.get(name) != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{msg}" for r, msg in failures.items())


# Horovod 0.28's parameter order, which positional calls rely on.
HOROVOD_SIGNATURES = {
    "allreduce": "tensor average name compression op prescale_factor postscale_factor process_set",
    "allreduce_": "tensor average name op prescale_factor postscale_factor process_set",
    "allreduce_async": "tensor average name op prescale_factor postscale_factor process_set",
    "allreduce_async_": "tensor average name op prescale_factor postscale_factor process_set",
    "grouped_allreduce": "tensors average name compression op prescale_factor postscale_factor process_set",
    "grouped_allreduce_async": "tensors average name op prescale_factor postscale_factor process_set",
    "allgather": "tensor name process_set",
    "grouped_allgather": "tensors name process_set",
    "broadcast": "tensor root_rank name process_set",
    "broadcast_async_": "tensor root_rank name process_set",
    "alltoall": "tensor splits name process_set",
    "sparse_allreduce_async": "tensor name op process_set",
    "broadcast_parameters": "params root_rank process_set",
    "broadcast_optimizer_state": "optimizer root_rank process_set",
    "broadcast_object": "obj root_rank name process_set",
    "allgather_object": "obj name process_set",
    "reducescatter": "tensor name compression op process_set prescale_factor postscale_factor",
    "reducescatter_async": "tensor name op process_set prescale_factor postscale_factor",
    "grouped_reducescatter": "tensors name compression op process_set prescale_factor postscale_factor",
    "DistributedOptimizer": "optimizer named_parameters compression backward_passes_per_step op "
    "gradient_predivide_factor num_groups groups sparse_as_dense process_set",
}


@pytest.mark.parametrize("name", list(HOROVOD_SIGNATURES))
def test_positional_order_is_horovods(name: str) -> None:
    params = inspect.signature(getattr(hvd, name)).parameters.values()
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == HOROVOD_SIGNATURES[name].split()


def test_capabilities_and_absent_backends(world_of_one: None) -> None:
    assert hvd.ccl_built() is False and hvd.ddl_built() is False and hvd.mpi_enabled() is False
    assert hvd.gloo_built() and hvd.gloo_enabled()
    assert hvd.rocm_built() is False and hvd.cuda_built() == torch.backends.cuda.is_built()
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)


class _ScriptState(hvd.elastic.TorchState):
    """A Horovod elastic script's own state class (defining it must work; creating it must not)."""


@pytest.mark.parametrize(
    ("name", "use"),
    [
        ("run", lambda: hvd.elastic.run(lambda state: None)),
        ("TorchState", lambda: hvd.elastic.TorchState(model=None, optimizer=None, batch=0)),
        ("ElasticSampler", lambda: hvd.elastic.ElasticSampler(list(range(8)), shuffle=True)),
        ("ObjectState", lambda: hvd.elastic.ObjectState(epoch=0)),
        ("TorchState", lambda: _ScriptState(model=None)),
    ],
)
def test_every_elastic_name_raises_one_error_saying_what_to_do_instead(
    name: str, use: Callable[[], object]
) -> None:
    with pytest.raises(hvd.elastic.ElasticNotSupported) as info:
        use()
    message = str(info.value)
    assert isinstance(info.value, NotImplementedError)
    assert message.startswith(f"hvd.elastic.{name}: elastic training is not supported by tagps yet"), message
    assert "without hvd.elastic" in message and "--restore PATH" in message, message


def test_synchronize_reports_failed_transfers_as_horovod_internal_error(world_of_one: None) -> None:
    from tagps.comm.handle import CompletedWork, Handle
    from tagps.torch import ops

    def broken() -> torch.Tensor:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    handle = Handle([CompletedWork()], broken)
    ops.state().handles.add(handle)
    with pytest.raises(hvd.HorovodInternalError, match="Connection closed by peer") as err:
        hvd.synchronize(handle)
    assert isinstance(err.value, RuntimeError)


def test_blocking_collectives_report_failed_transfers_as_horovod_internal_error(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tagps.comm import collectives

    class Broken:
        def is_completed(self) -> bool:
            return True

        def wait(self) -> None:
            raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(collectives, "all_reduce_async", lambda *args: Broken())
    with pytest.raises(hvd.HorovodInternalError, match="Connection closed by peer"):
        hvd.allreduce(torch.ones(2), op=hvd.Max)
    with pytest.raises(hvd.HorovodInternalError):
        hvd.allreduce_(torch.ones(2), op=hvd.Min)


def test_argument_errors(world_of_one: None) -> None:
    x = torch.ones(4)
    with pytest.raises(ValueError, match="op parameter supersedes average"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="tagps has no Adasum"):
        hvd.allreduce_async(x, op=hvd.Adasum)
    with pytest.raises(ValueError, match="reducescatter supports op=Average or Sum"):
        hvd.reducescatter(x, op=hvd.Max)
    with pytest.raises(ValueError, match=re.escape("splits must be 1 non-negative row counts")):
        hvd.alltoall(x, splits=[3])
    with pytest.raises(TypeError, match="expects a list of tensors"):
        hvd.grouped_allreduce(x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.allgather(torch.tensor(1.0))
    with pytest.raises(ValueError, match="needs a sparse COO tensor"):
        hvd.sparse_allreduce_async(x, "dense", hvd.Sum)
    with pytest.raises(ValueError, match="ranks must be a non-empty subset"):
        hvd.add_process_set([0, 1])
    with pytest.raises(ValueError, match=re.escape("init(comm=...) is not supported")):
        hvd.init(comm=[0])
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="groups must be a non-negative int or a list of lists"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=-1)
    with pytest.raises(ValueError, match="not a trainable parameter of the optimizer"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=[[torch.ones(1)]])
    with pytest.raises(RuntimeError, match="op=MAX is not defined"):
        hvd.allreduce(torch.ones(2, requires_grad=True), op=hvd.Max).sum().backward()


def test_a_name_in_flight_cannot_be_reused(world_of_one: None) -> None:
    first = hvd.allreduce_async(torch.ones(2), name="grad.w")
    with pytest.raises(ValueError, match=re.escape("named 'grad.w' is still in flight")):
        hvd.allreduce_async_(torch.ones(2), name="grad.w")
    with pytest.raises(ValueError, match=re.escape("named 'grad.w' is still in flight")):
        hvd.broadcast_async(torch.ones(2), 0, name="grad.w")
    hvd.synchronize(first)
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="grad.w"))  # free again


def test_timeline_records_every_collective_and_gradient(world_of_one: None, tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    hvd.start_timeline(str(path), mark_cycles=True)
    hvd.allreduce(torch.ones(2), name="loss")
    hvd.synchronize(hvd.allgather_async(torch.ones(2)))
    hvd.broadcast(torch.ones(2), 0)
    hvd.alltoall(torch.ones(2))
    model = nn.Linear(2, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert not path.exists()  # written when recording stops
    hvd.stop_timeline()
    events = json.loads(path.read_text())
    names = [(e["name"], e.get("args", {}).get("tensor")) for e in events]
    assert ("ALLREDUCE", "loss") in names and ("CYCLE_START", None) in names
    assert {"ALLGATHER", "BROADCAST", "ALLTOALL"} <= {n for n, _ in names}
    assert any(n == "ALLREDUCE" and t.startswith("opt") for n, t in names if t)  # the optimizer's bucket
    assert all(e["ph"] in ("X", "i") and e["ts"] >= 0 and e["pid"] == 0 for e in events)
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    hvd.allreduce(torch.ones(2))
    hvd.stop_timeline()  # stopping twice is harmless; nothing more is recorded
    assert json.loads(path.read_text()) == events


@pytest.mark.usefixtures("no_job_layout")
def test_horovod_timeline_variable_records_from_init_to_shutdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "timeline.json"
    monkeypatch.setenv("HOROVOD_TIMELINE", str(path))
    monkeypatch.setenv("HOROVOD_TIMELINE_MARK_CYCLES", "1")
    hvd.init()
    try:
        model = nn.Linear(2, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        hvd.allreduce(torch.ones(2), name="loss")
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    finally:
        hvd.shutdown()
    names = {e["name"] for e in json.loads(path.read_text())}
    assert {"ALLREDUCE", "CYCLE_START"} <= names
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")  # only start_timeline records then
    path.unlink()
    hvd.init()
    hvd.shutdown()
    assert not path.exists()


@pytest.mark.usefixtures("no_job_layout")
def test_init_refuses_a_copy_of_the_global_set() -> None:
    try:
        with pytest.raises(ValueError, match="duplicate process set"):
            hvd.init(process_sets=[hvd.ProcessSet([0])])  # in a job of one, rank 0 is every rank
    finally:
        hvd.shutdown()


if __name__ == "__main__":
    _worker()
