"""Horovod's ``join``: a rank that ran out of data serves the others' allreduces with zeros until all joined.

Every allreduce that does not go to the summation servers starts with a small all-gather of the ranks'
layouts (:func:`tagps.comm.collectives.check_same_layout`), and every step of a ``DistributedOptimizer``
whose gradients are all-reduced starts with one too (:func:`announce_step`). A rank inside :func:`join` takes
part in those exchanges with a "joined" layout, reads what the others are about to run, and runs the same
collective with zeros: the allreduce of a zero tensor of that shape and wire dtype, or the optimizer's
gradient sync with zero gradients. The others' ``Average`` still divides by the job's size, as in Horovod.
Collectives that zeros cannot stand in for (allgather, broadcast, Min/Max/Product, process sets) raise
``ValueError`` on the ranks that did not join, naming the joined ones, and the joined ranks go on waiting.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tagps.comm import collectives
from tagps.comm.handle import wait_work
from tagps.torch import ops

__all__ = ["announce_step", "join", "register_optimizer"]

_ALLREDUCE = collectives.LAYOUT_KINDS.index("allreduce")
_STEP = collectives.LAYOUT_KINDS.index("step")


class Joinable(Protocol):
    """What :func:`join` needs of a ``DistributedOptimizer``."""

    joinable: str | None  # why it cannot serve a joined rank, or None

    def contribute_zeros(self) -> None: ...


# (the init it belongs to, the optimizer, its layout key), for the optimizers of this process
_optimizers: list[tuple[weakref.ref[Any], weakref.ref[Any], int]] = []


def register_optimizer(optimizer: Joinable, layout: str) -> int:
    """Make ``optimizer`` reachable from :func:`join`; return the key its steps are announced with.

    Args:
        optimizer: a ``DistributedOptimizer``.
        layout: what its gradient sync sends, in order (the same text on every rank for the same
            optimizer): a joined rank serves a step with an optimizer of the same layout.
    """
    key = zlib.crc32(layout.encode())
    _optimizers[:] = [e for e in _optimizers if e[1]() is not None]
    _optimizers.append((weakref.ref(ops.state()), weakref.ref(optimizer), key))
    return key


def _live_optimizers() -> list[tuple[Joinable, int]]:
    st = ops.state()
    found = [(owner(), ref(), key) for owner, ref, key in _optimizers]
    return [(opt, key) for owner, opt, key in found if owner is st and opt is not None]


def announce_step(key: int) -> Callable[[], None]:
    """Tell ranks inside :func:`join` that an optimizer whose layout has ``key`` synchronises its gradients
    now. The exchange is only started: the gradients' all-reduces queue behind it, so backward never waits
    for the other ranks here (a blocking exchange measured 25-65 % of a 3-rank step on 2 cores). The
    returned call waits for it and checks that every other rank stepped one like it; call it once the
    gradients are synchronised."""
    # Any dtype says the joined ranks take part: they step with zero gradients.
    return collectives.start_layout_check(torch.empty(0), None, "step", (key,), zeros=torch.float32)


def join(device: int = -1) -> int:
    """Declare that this rank has no more batches; serve the others' allreduces with zeros until all joined.

    As Horovod's ``hvd.join``: blocks until every rank called it. Meanwhile the other ranks may run
    allreduces (Sum or Average over every worker; an average still divides by the job's size) and
    ``DistributedOptimizer`` steps whose gradients are all-reduced; this rank contributes zeros to each.

    Args:
        device: accepted for Horovod compatibility (the GPU of the joined ops); tagps joins over gloo.

    Returns:
        The rank that joined last (the highest of those that joined last together).

    Raises:
        NotImplementedError: where zeros cannot be served: a job whose sums go to the summation servers
            (the ps method), a job that reduces CUDA tensors over NCCL, or a live ``DistributedOptimizer``
            that uses ps, SFB or a process set (the message says which). Raised on this rank only,
            before anything is exchanged.
    """
    del device
    st = ops.state()
    size = dist.get_world_size() if dist.is_initialized() else 1
    if size == 1:
        return 0
    if ops.default_method(st.cfg) == "ps":
        raise NotImplementedError(
            "join() cannot serve sums that go to the summation servers (the ps method, DMLC_NUM_SERVER > 0): "
            "they are matched by key, not by the layout exchange a joined rank takes part in"
        )
    if collectives.uses_nccl(st.cfg):
        raise NotImplementedError("join() runs over gloo; this job reduces CUDA tensors over NCCL")
    for opt, _ in _live_optimizers():
        if opt.joinable is not None:
            raise NotImplementedError(f"join() cannot serve {opt!r}: {opt.joinable}")
    first = True
    while True:
        everyone = collectives.joined_layouts(first)
        active = [m for m in everyone if m[1] != collectives.JOINED]
        if not active:  # ndim carries "joined since the last exchange"
            return max(r for r, m in enumerate(everyone) if m[2] == 1)
        first = False
        if any(m != active[0] for m in active):
            continue  # the others raise their mismatch
        _serve(active[0])


def _serve(meta: list[int]) -> None:
    """Run with zeros the collective that ``meta`` announces, as the other ranks will after the exchange."""
    kind = meta[3]
    zeros = collectives.layout_zeros(meta)
    if kind == _ALLREDUCE and zeros is not None:
        wait_work(collectives.all_reduce_async(zeros))
    elif kind == _STEP:
        key = collectives.layout_extra(meta)[0]
        opt = next((o for o, k in _live_optimizers() if k == key), None)
        if opt is None:
            raise RuntimeError(
                "the other ranks step a DistributedOptimizer that this rank does not have: create the same "
                "optimizers on every rank"
            )
        opt.contribute_zeros()
    # Anything else: the other ranks raise (see check_same_layout), and nothing is sent.
