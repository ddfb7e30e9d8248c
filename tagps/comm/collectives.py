"""Collectives among the worker processes over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Every worker process of the job (``DMLC_NUM_WORKER`` machines times ``BYTEPS_LOCAL_SIZE``) joins one
process group, ranked machine-major as BytePS ranks them. The rendezvous is a ``TCPStore`` served by rank
0 at ``DMLC_PS_ROOT_URI:TAGPS_DIST_PORT``.

On a host with CUDA the group has one backend per device type (``cpu:gloo,cuda:nccl``): CUDA tensors go
through NCCL, CPU tensors (a metric, the layout checks) through gloo. :func:`bind_device` gives each local
rank its own GPU, as NCCL requires.

A peer that dies leaves the others stalled: only its direct neighbours in gloo's ring see a closed
connection, the rest wait on live peers that gave up, until ``TAGPS_DIST_TIMEOUT``. So every rank of a
multi-process group runs a :class:`PeerWatcher`, which names a dead rank within ``PS_HEARTBEAT_TIMEOUT``
and makes every wait raise :class:`~tagps.comm.handle.PeerFailed` (see :func:`~tagps.comm.handle.wait_work`).
"""

from __future__ import annotations

import datetime
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import torch
import torch.distributed as dist

from tagps.comm.handle import (
    CompletedWork,
    PeerFailed,
    Waitable,
    clear_failure,
    failure,
    report_failure,
    wait_work,
)
from tagps.config import CommConfig, ConfigError

__all__ = [
    "JOINED",
    "LAYOUT_KINDS",
    "MIXED_BACKEND",
    "PeerWatcher",
    "all_gather_rows_async",
    "all_gather_varlen",
    "all_gather_varlen_async",
    "all_reduce_async",
    "all_to_all_rows_async",
    "backend_for",
    "bind_device",
    "bound_device",
    "check_device",
    "check_same_layout",
    "init_process_group",
    "joined_layouts",
    "layout_extra",
    "layout_tensor",
    "layout_zeros",
    "run_blocking",
    "shutdown_process_group",
    "start_layout_check",
    "uses_nccl",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_owned = False
_watcher: PeerWatcher | None = None  # runs while the group init_process_group() created exists
_bound: torch.device | None = None  # set by bind_device()
MIXED_BACKEND = "cpu:gloo,cuda:nccl"
_MAX_DIMS = 9
# Every layout exchange has one size, whichever collective it precedes, so that a rank that joined
# (tagps.torch.join) can take part in any of them: [first dim, dtype, ndim, kind, zeros, *extra, *other dims].
_MAX_EXTRA = 1
_LAYOUT_WIDTH = 5 + _MAX_EXTRA + _MAX_DIMS - 1
# The collectives that exchange layouts; a joined rank reads from the kind what the others run.
LAYOUT_KINDS = ("allgather", "allreduce", "broadcast", "step")
JOINED = -1  # the dtype code a joined rank sends; its ndim field says whether it joined in this exchange
# Index of a dtype in the metadata that collectives exchange before moving data.
_DTYPE_CODES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip


def backend_for(cfg: CommConfig) -> str:
    """Return the ``torch.distributed`` backend for ``cfg``.

    ``gloo``, ``nccl`` and :data:`MIXED_BACKEND` are taken as given; ``auto`` is the mixed one when CUDA is
    usable (CPU tensors still reduce, through gloo), else gloo.

    Raises:
        ConfigError: NCCL is asked for but this torch has no NCCL or this host no usable GPU.
    """
    if cfg.dist_backend == "auto":
        return MIXED_BACKEND if torch.cuda.is_available() else "gloo"
    if "nccl" in cfg.dist_backend and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise ConfigError(
            f"TAGPS_DIST_BACKEND={cfg.dist_backend} needs NCCL and a GPU, but this torch "
            f"({torch.__version__}) {'sees no usable GPU' if dist.is_nccl_available() else 'has no NCCL'}; "
            "use TAGPS_DIST_BACKEND=gloo or auto"
        )
    return cfg.dist_backend


def uses_nccl(cfg: CommConfig) -> bool:
    """Whether CUDA tensors reduce over NCCL: in the process group, or else in the one ``cfg`` asks for
    (a group the script initialised itself keeps its own backend)."""
    return "nccl" in (str(dist.get_backend()) if dist.is_initialized() else backend_for(cfg))


def bind_device(cfg: CommConfig) -> torch.device | None:
    """Make ``cuda:local_rank`` this process's current device when the job uses NCCL; return it.

    ``local_rank`` indexes the GPUs this process sees, so ``CUDA_VISIBLE_DEVICES`` is honoured. NCCL
    cannot run two ranks on one GPU ("Duplicate GPU detected"), so more local ranks than visible GPUs is
    refused here, before the process group exists. Under gloo nothing is bound: ranks may share GPUs.

    Raises:
        ConfigError: more local ranks than visible GPUs under NCCL (naming both counts), or NCCL without
            a GPU (see :func:`backend_for`).
    """
    global _bound
    if not uses_nccl(cfg):
        _bound = None
        return None
    visible = torch.cuda.device_count()
    if cfg.local_size > visible:
        raise ConfigError(
            f"NCCL needs one GPU per local rank, but BYTEPS_LOCAL_SIZE={cfg.local_size} processes share "
            f"{visible} visible GPU(s) (after CUDA_VISIBLE_DEVICES); start at most {visible} local ranks, "
            "or set TAGPS_DIST_BACKEND=gloo to let them share GPUs"
        )
    _bound = torch.device("cuda", cfg.local_rank)
    torch.cuda.set_device(_bound)
    return _bound


def bound_device() -> torch.device | None:
    """The GPU :func:`bind_device` bound this process to (``None``: none, the job does not use NCCL)."""
    return _bound


def check_device(tensor: torch.Tensor, what: str) -> None:
    """Refuse a CUDA tensor that is not on this process's bound GPU (NCCL would fail or hang on it).

    Args:
        tensor: the tensor about to be reduced.
        what: how to name it in the message, e.g. ``"'fc1.weight'"``.

    Raises:
        ValueError: naming ``what``, its device and the bound one.
    """
    if _bound is not None and tensor.is_cuda and tensor.device != _bound:
        raise ValueError(
            f"{what} is on {tensor.device}, but this process (local rank {_bound.index}) is bound to "
            f"{_bound}: under NCCL each rank's CUDA tensors must live on its own GPU; move it with "
            f".to('{_bound}')"
        )


def init_process_group(cfg: CommConfig) -> None:
    """Join the job's process group, or adopt the one the caller already initialised.

    Args:
        cfg: the job layout; ``cfg.dist_port`` must be set when the job has more than one process.

    Raises:
        ConfigError: when no rendezvous port is known for a multi-process job.
        RuntimeError: when an existing process group disagrees with ``cfg`` about rank or size.
    """
    global _owned, _watcher, _previous_excepthook
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (cfg.rank, cfg.size):
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the DMLC/BYTEPS variables say rank {cfg.rank} of {cfg.size}"
            )
        return
    timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
    if cfg.size == 1:
        store: dist.Store = dist.HashStore()
    else:
        if cfg.dist_port is None:
            raise ConfigError(
                "TAGPS_DIST_PORT (or DMLC_PS_ROOT_PORT, whose successor is the default) is required "
                f"for a job of {cfg.size} worker processes"
            )
        store = _rendezvous_store(cfg, timeout)
    dist.init_process_group(
        backend_for(cfg), store=store, rank=cfg.rank, world_size=cfg.size, timeout=timeout
    )
    _owned = True
    if cfg.size == 1:
        clear_failure()
    else:
        clear_failure(confirm_s=cfg.heartbeat_timeout + cfg.heartbeat_interval)
        _watcher = PeerWatcher(cfg, _prefix())
        if sys.excepthook is not _excepthook:
            _previous_excepthook, sys.excepthook = sys.excepthook, _excepthook


_previous_excepthook = sys.excepthook


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """An uncaught exception ends this rank: make it the job's verdict, so that the other ranks raise naming
    this rank and the error within an interval, and so that leaving skips the barrier, which peers blocked
    in another collective would never reach."""
    _previous_excepthook(kind, value, tb)
    if _watcher is not None and failure() is None:
        _watcher.fail(f"worker rank {dist.get_rank()} failed ({kind.__name__}: {value})")


# One TCPStore per process and rendezvous address, kept across shutdown() and init(): rebinding the master's
# port right after closing it fails with EADDRINUSE now and then (seen 35 times in 60 create/delete cycles of
# a bare TCPStore), and a client could reach the closing store. Each init() gets its own key prefix; every
# rank inits as often as the others, so the generations agree.
_stores: dict[tuple[str, int, int, int], dist.TCPStore] = {}
_generation = 0


def _rendezvous_store(cfg: CommConfig, timeout: datetime.timedelta) -> dist.Store:
    global _generation
    assert cfg.dist_port is not None
    key = (cfg.root_uri, cfg.dist_port, cfg.size, cfg.rank)
    store = _stores.get(key)
    if store is None:
        store = _join(cfg)
        store.set_timeout(timeout)
        _stores[key] = store
    _generation += 1
    return dist.PrefixStore(_prefix(), store)


def _join(cfg: CommConfig) -> dist.TCPStore:
    """Connect to (rank 0: serve) the rendezvous store and wait, ``PS_REGISTER_TIMEOUT`` at most, until every
    rank has; a rank that does not join, or rank 0's store going away, is named instead of timing out after
    ``TAGPS_DIST_TIMEOUT`` with a count.

    The outcome is one store key that the first to decide sets: the last rank to join sets it to ``ok``, a
    rank whose deadline passed first to the names of the missing ranks, so that every rank names the same
    absent ones, late joiners included. After a failure rank 0 keeps serving the store until the ranks that
    joined have read the outcome (at most ``PS_HEARTBEAT_TIMEOUT``): were it to exit at once, they would find
    the store gone and name rank 0 instead."""
    where = f"{cfg.root_uri}:{cfg.dist_port}"
    serving = f"worker rank 0, which serves the rendezvous store at {where},"
    deadline = time.monotonic() + cfg.register_timeout
    try:
        store = dist.TCPStore(
            cfg.root_uri, cfg.dist_port, cfg.size, is_master=cfg.rank == 0, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=cfg.register_timeout),
        )  # fmt: skip
    except (RuntimeError, ValueError) as exc:  # DistNetworkError and DistStoreError are RuntimeErrors
        raise PeerFailed(
            f"{serving} did not answer within {cfg.register_timeout:g} s (PS_REGISTER_TIMEOUT): {exc}"
        ) from None
    keys = [f"tagps/joined/{r}" for r in range(cfg.size)]
    count, outcome, seen = "tagps/joined", "tagps/join-outcome", "tagps/join-outcome-seen"
    try:
        store.set(keys[cfg.rank], "1")
        if store.add(count, 1) == cfg.size:
            store.compare_set(outcome, "", "ok")
        while not store.check([outcome]):
            if time.monotonic() > deadline:
                missing = [str(r) for r, k in enumerate(keys) if not store.check([k])]
                who = f"worker rank{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
                store.compare_set(
                    outcome, "",
                    f"{who} did not join the rendezvous at {where} within {cfg.register_timeout:g} s "
                    "(PS_REGISTER_TIMEOUT)",
                )  # fmt: skip
                break
            time.sleep(0.05)
        verdict = store.get(outcome).decode()
        if verdict == "ok":
            return store
        store.add(seen, 1)
        if cfg.rank == 0:
            until = time.monotonic() + cfg.heartbeat_timeout
            while store.add(seen, 0) < store.add(count, 0) and time.monotonic() < until:
                time.sleep(0.05)
    except RuntimeError as exc:  # the store's connection broke: its server, rank 0, is gone
        raise PeerFailed(f"{serving} failed during the rendezvous: {exc}") from None
    raise PeerFailed(verdict)


class _ThreadWork:
    """A blocking ``torch.distributed`` call on a daemon thread, as a work that :func:`wait_work` waits for in
    slices: object collectives and gloo's point-to-point receives have no future of their own."""

    def __init__(self, call: Callable[[], object]) -> None:
        self._future: torch.futures.Future[object] = torch.futures.Future()
        threading.Thread(target=self._run, args=(call,), name="tagps-blocking-call", daemon=True).start()

    def _run(self, call: Callable[[], object]) -> None:
        try:
            if _bound is not None:  # the current device is per thread; object collectives use it under NCCL
                torch.cuda.set_device(_bound)
            self._future.set_result(call())
        except BaseException as exc:  # handed to the waiting thread
            self._future.set_exception(exc)

    def get_future(self) -> torch.futures.Future[object]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> object:
        return self._future.wait()


def run_blocking(call: Callable[[], _T]) -> _T:
    """Run a blocking ``torch.distributed`` call so that a dead peer ends it as it ends every wait.

    The call runs on a daemon thread while this one waits in slices: once the watcher names a dead rank,
    :class:`~tagps.comm.handle.PeerFailed` is raised within ``PS_HEARTBEAT_TIMEOUT`` instead of
    ``TAGPS_DIST_TIMEOUT`` (the call stays blocked on its thread until the group is dropped). Without a
    watcher (a job of one process, or a group the caller made) it is called directly.
    """
    if _watcher is None:
        return call()
    return wait_work(_ThreadWork(call))  # type: ignore[return-value]


def _prefix() -> str:
    """The rendezvous store's key prefix of the current init()."""
    return f"tagps/{_generation}/"


class PeerWatcher:
    """Name a dead worker process within ``PS_HEARTBEAT_TIMEOUT``, on every rank, gloo or not.

    A daemon thread with its own client of the rendezvous store (a blocked store call of the main thread
    must not delay it) adds 1 to this rank's counter ``<prefix>hb/<rank>`` every ``PS_HEARTBEAT_INTERVAL``
    and reads every rank's counter in one request. A counter that has not moved for the timeout names its
    rank; a store that cannot be reached names rank 0, which serves it. Either sets the failure flag of
    :mod:`tagps.comm.handle`, and the thread ends.

    The first rank to name a dead one writes the verdict to the store (``<prefix>failed``), and the others
    take it from there within an interval, so that every rank names the same one. Rank 0 keeps serving the
    store until the other live ranks have read it (``<prefix>failed-seen``), at most the heartbeat timeout:
    were it to exit at once, they would find the store gone and name rank 0.

    Args:
        cfg: the job layout and heartbeat settings.
        prefix: this process group's key prefix in the store.
    """

    def __init__(self, cfg: CommConfig, prefix: str) -> None:
        self._cfg = cfg
        self._keys = [f"{prefix}hb/{r}" for r in range(cfg.size)]
        self._verdict = f"{prefix}failed"
        self._seen = f"{prefix}failed-seen"
        self._stop = threading.Event()
        self._seen_lock = threading.Lock()
        self._seen_marked = False
        self._thread = threading.Thread(target=self._run, name="tagps-peer-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the group is being left: peers that exit now are not failures); on rank 0 after a
        failure, once the other ranks have read the verdict."""
        self._stop.set()
        self._thread.join(timeout=self._cfg.heartbeat_timeout + self._cfg.heartbeat_interval)

    def fail(self, message: str) -> None:
        """Make ``message`` the job's verdict, unless another rank's came first, and this process's failure;
        on rank 0, keep serving the store until the other ranks have read it (at most the heartbeat
        timeout)."""
        cfg = self._cfg
        try:
            store = dist.TCPStore(
                cfg.root_uri, cfg.dist_port, is_master=False, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=cfg.heartbeat_timeout),
            )  # fmt: skip
            report_failure(store.compare_set(self._verdict, "", message).decode() or message)
            self._mark_seen(store)
            if cfg.rank == 0:
                self._serve_until_seen(store)
        except RuntimeError:  # the store is gone with rank 0: the others name it on their own
            report_failure(message)

    def _run(self) -> None:
        cfg = self._cfg
        try:
            # A silent store answers within the heartbeat timeout or counts as dead.
            store = dist.TCPStore(
                cfg.root_uri, cfg.dist_port, is_master=False, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=cfg.heartbeat_timeout),
            )  # fmt: skip
            # Every key exists, so multi_get never waits for one.
            for key in self._keys:
                store.add(key, 0)
            store.compare_set(self._verdict, "", "")
            last = [-1] * cfg.size
            moved = [time.monotonic()] * cfg.size
            while True:
                store.add(self._keys[cfg.rank], 1)
                *counts, verdict = store.multi_get([*self._keys, self._verdict])
                now = time.monotonic()
                for r, count in enumerate(counts):
                    if int(count) != last[r]:
                        last[r], moved[r] = int(count), now
                # Every silent rank, longest silent first: a machine's launcher stops the other local ranks
                # of a dead one at once, and naming only the first would often name one of those.
                silent = [r for r in range(cfg.size) if now - moved[r] > cfg.heartbeat_timeout]
                dead = sorted(silent, key=moved.__getitem__)
                if dead and not verdict:
                    ranks = ", ".join(map(str, dead))
                    verdict = store.compare_set(
                        self._verdict, "",
                        f"worker rank{'s' if len(dead) > 1 else ''} {ranks} failed (sent no heartbeat for "
                        f"{now - moved[dead[0]]:.0f} s, PS_HEARTBEAT_TIMEOUT={cfg.heartbeat_timeout:g})",
                    )  # fmt: skip
                if verdict:
                    report_failure(verdict.decode())
                    self._mark_seen(store)
                    if cfg.rank == 0:
                        self._serve_until_seen(store)
                    return
                if self._stop.wait(cfg.heartbeat_interval):
                    return
        except Exception as exc:  # the store's connection broke or timed out
            if not self._stop.is_set():
                report_failure(
                    f"worker rank 0 failed (the rendezvous store it serves at {cfg.root_uri}:{cfg.dist_port} "
                    f"is unreachable: {exc})"
                )

    def _mark_seen(self, store: dist.TCPStore) -> None:
        """Count this rank among those that read the verdict, once (both threads may read it)."""
        with self._seen_lock:
            if not self._seen_marked:
                store.add(self._seen, 1)
                self._seen_marked = True

    def _serve_until_seen(self, store: dist.TCPStore) -> None:
        """Return once every rank but the dead one has read the verdict, or after the heartbeat timeout."""
        deadline = time.monotonic() + self._cfg.heartbeat_timeout
        while store.add(self._seen, 0) < self._cfg.size - 1 and time.monotonic() < deadline:
            time.sleep(self._cfg.heartbeat_interval / 10)


def shutdown_process_group() -> None:
    """Leave the process group, together with the other ranks, if :func:`init_process_group` created it."""
    global _owned, _bound, _watcher
    _bound = None
    if failure() is not None:  # every rank's output names what ended the job
        log.error("tagps: the job failed: %s", failure())
    if _owned and dist.is_initialized():
        # Leave together: a gloo rank that tears down its pairs and store while a peer is still closing
        # makes that peer abort in std::terminate (exit 134; 2 of 8 two-worker runs of
        # examples/train_synthetic.py before this barrier, 0 of 12 after). Bounded by TAGPS_DIST_TIMEOUT,
        # and skipped once a peer is known dead: it could only wait for that timeout.
        try:
            if failure() is None:
                wait_work(dist.barrier(async_op=True))
        finally:
            if _watcher is not None:
                _watcher.stop()
                _watcher = None
            _destroy_process_group()
    _owned = False


def _destroy_process_group() -> None:
    """Destroy the default group; after a failure, without waiting for its stuck transfers.

    The group's destructor joins gloo's worker threads, and one blocked on a hung peer returns only at
    ``TAGPS_DIST_TIMEOUT``. After a failure the last reference is therefore dropped on a daemon thread,
    which the process's exit does not wait for once the destructor took more than a second.
    """
    if failure() is None:
        dist.destroy_process_group()
        return
    box = [dist.group.WORLD]
    dist.destroy_process_group()
    dropper = threading.Thread(target=box.clear, name="tagps-drop-failed-group", daemon=True)
    dropper.start()
    # An exit while the destructor stops its threads aborts in std::terminate: let a prompt one finish.
    dropper.join(timeout=1.0)


def all_reduce_async(
    tensor: torch.Tensor, group: object | None = None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> Waitable:
    """Start reducing ``tensor`` in place with ``op`` (default: a sum) over ``group`` (``None``: everyone).

    Raises:
        ValueError: ``tensor`` is on another GPU than the bound one (see :func:`check_device`).
    """
    check_device(tensor, f"the {tuple(tensor.shape)} tensor to all-reduce")
    if dist.get_world_size(group) == 1:
        return CompletedWork()
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    assert work is not None
    return work


def all_gather_rows_async(
    tensor: torch.Tensor, group: object | None = None
) -> tuple[Waitable, Callable[[], torch.Tensor], list[int]]:
    """Start concatenating along dim 0 the ``tensor`` of every rank; first dimensions may differ.

    The row counts travel first, with each rank's dtype and row shape (one small blocking all-gather), so
    that a mismatch raises on every rank instead of corrupting or aborting the transfer; then the rows,
    padded to the longest, in an asynchronous all-gather.

    Returns:
        The work to wait for; a function that, after it completed, returns the rows of rank 0, then rank 1,
        and so on; and the row count of every rank.

    Raises:
        ValueError: ranks disagree on dtype or on the shape of a row (on every rank).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return CompletedWork(), lambda: tensor, [tensor.shape[0]]
    everyone = _layouts(tensor, group, "allgather")
    _refuse_joined(everyone, "allgather")
    mine = everyone[dist.get_rank(group)]
    differing = [r for r, m in enumerate(everyone) if m[1:] != mine[1:]]
    if differing:
        raise ValueError(
            f"all-gather mismatch: this rank has {_layout_text(mine)}, group rank {differing[0]} has "
            f"{_layout_text(everyone[differing[0]])}; all ranks must agree except on the first dimension"
        )
    counts = [m[0] for m in everyone]
    longest = max(counts)
    padded = tensor.contiguous()
    if tensor.shape[0] < longest:
        padded = torch.cat([padded, padded.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in range(world)]
    work = dist.all_gather(parts, padded, group=group, async_op=True)
    assert work is not None
    return work, lambda: torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)]), counts


def _layouts(
    tensor: torch.Tensor, group: object | None, kind: str, extra: tuple[int, ...] = (), zeros: int = -1
) -> list[list[int]]:
    """Every group rank's ``[first dim, dtype, ndim, kind, zeros, *extra, *other dims]`` (-1 padded)."""
    return _start_layouts(tensor, group, kind, extra, zeros)()


def _start_layouts(
    tensor: torch.Tensor, group: object | None, kind: str, extra: tuple[int, ...] = (), zeros: int = -1
) -> Callable[[], list[list[int]]]:
    """Start :func:`_layouts`' exchange; the returned call waits for it and returns the layouts."""
    check_device(tensor, f"the {tuple(tensor.shape)} tensor to exchange")
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"collectives support tensors of up to {_MAX_DIMS} dimensions, got {tensor.dim()}")
    assert len(extra) <= _MAX_EXTRA
    shape = list(tensor.shape)
    dtype, first = _DTYPE_CODES.index(tensor.dtype), shape[0] if shape else -1
    head = [first, dtype, len(shape), LAYOUT_KINDS.index(kind), zeros]
    meta = [*head, *extra, *[-1] * (_MAX_EXTRA - len(extra)), *shape[1:]]
    return _start_exchange(meta, group, tensor.device)


def _exchange(meta: list[int], group: object | None, device: torch.device) -> list[list[int]]:
    return _start_exchange(meta, group, device)()


def _start_exchange(
    meta: list[int], group: object | None, device: torch.device
) -> Callable[[], list[list[int]]]:
    mine = torch.tensor(meta + [-1] * (_LAYOUT_WIDTH - len(meta)), dtype=torch.int64, device=device)
    metas = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(metas, mine, group=group, async_op=True)

    def finish() -> list[list[int]]:
        wait_work(work)
        return [m.tolist() for m in metas]

    return finish


def joined_layouts(first: bool) -> list[list[int]]:
    """Take part, as a rank that joined, in the next layout exchange of the other ranks (every worker, CPU)
    and return every rank's layout; ``first``: this rank joined since the last exchange."""
    return _exchange([0, JOINED, int(first)], None, torch.device("cpu"))


def layout_tensor(meta: list[int]) -> tuple[torch.dtype, list[int]]:
    """The dtype and shape a layout from the exchange describes."""
    ndim = meta[2]
    dims = meta[5 + _MAX_EXTRA : 5 + _MAX_EXTRA + max(ndim - 1, 0)]
    return _DTYPE_CODES[meta[1]], ([meta[0]] if ndim else []) + dims


def layout_extra(meta: list[int]) -> list[int]:
    """The integer arguments of a layout from the exchange (-1 padded)."""
    return meta[5 : 5 + _MAX_EXTRA]


def layout_zeros(meta: list[int]) -> torch.Tensor | None:
    """The zeros a joined rank sends for the collective a layout announces (``None``: it cannot take part)."""
    if meta[4] < 0:
        return None
    return torch.zeros(layout_tensor(meta)[1], dtype=_DTYPE_CODES[meta[4]])


def _refuse_joined(everyone: list[list[int]], what: str) -> None:
    joined = [r for r, m in enumerate(everyone) if m[1] == JOINED]
    if joined:
        raise ValueError(
            f"{what} cannot run: worker rank(s) {joined} called join(); until every rank has joined, only "
            "allreduces with Sum or Average over every worker and DistributedOptimizer steps can"
        )


def _layout_text(meta: list[int], n_extra: int = 0) -> str:
    dtype, shape = layout_tensor(meta)
    extra = f" and arguments {layout_extra(meta)[:n_extra]}" if n_extra else ""
    return f"dtype {dtype}, shape {tuple(shape)}{extra}"


def check_same_layout(
    tensor: torch.Tensor,
    group: object | None,
    what: str,
    extra: tuple[int, ...] = (),
    *,
    zeros: torch.dtype | None = None,
) -> None:
    """Raise on every rank of ``group`` unless all of them pass one dtype, one shape and equal ``extra``.

    One small blocking all-gather: a collective over tensors that differ would otherwise corrupt data or
    abort a rank inside gloo. Ranks that called ``tagps.torch.join`` take part in it too.

    Args:
        tensor: this rank's tensor.
        group: the group (``None``: every worker).
        what: the collective, one of :data:`LAYOUT_KINDS`.
        extra: an integer argument that must agree too (e.g. the reduce op).
        zeros: the dtype of the zeros that joined ranks send in this collective in place of a tensor like
            this one (a Sum over every worker); ``None``: they cannot take part, and their presence raises.

    Raises:
        ValueError: naming this rank's and the first differing rank's dtype, shape and arguments; or the
            joined ranks, when ``zeros`` is ``None``.
    """
    start_layout_check(tensor, group, what, extra, zeros=zeros)()


def start_layout_check(
    tensor: torch.Tensor,
    group: object | None,
    what: str,
    extra: tuple[int, ...] = (),
    *,
    zeros: torch.dtype | None = None,
) -> Callable[[], None]:
    """Start :func:`check_same_layout`'s exchange without waiting for it (the collectives that follow queue
    behind it on the group); the returned call waits for it and raises as :func:`check_same_layout` does."""
    if dist.get_world_size(group) == 1:
        return lambda: None
    layouts = _start_layouts(tensor, group, what, extra, -1 if zeros is None else _DTYPE_CODES.index(zeros))

    def finish() -> None:
        everyone = layouts()
        if zeros is None:
            _refuse_joined(everyone, what)
        mine = everyone[dist.get_rank(group)]
        differing = [r for r, m in enumerate(everyone) if m != mine and m[1] != JOINED]
        if differing:
            raise ValueError(
                f"{what} mismatch: this rank has {_layout_text(mine, len(extra))}, group rank {differing[0]} "
                f"has {_layout_text(everyone[differing[0]], len(extra))}; every rank must pass the same"
            )

    return finish


def all_gather_varlen_async(
    tensor: torch.Tensor, group: object | None = None
) -> tuple[Waitable, Callable[[], torch.Tensor]]:
    """Like :func:`all_gather_rows_async`, without the row counts."""
    work, result, _ = all_gather_rows_async(tensor, group)
    return work, result


def all_gather_varlen(tensor: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """Concatenate along dim 0 the ``tensor`` of every rank (first dimensions may differ); blocking."""
    work, result = all_gather_varlen_async(tensor, group)
    work.wait()
    return result()


def all_to_all_rows_async(
    tensor: torch.Tensor, splits: list[int], group: object | None = None
) -> tuple[Waitable, torch.Tensor, list[int]]:
    """Start sending ``splits[j]`` consecutive rows (dim 0) of ``tensor`` to group rank ``j``, for all ``j``.

    The counts travel first, with each rank's dtype and row size (one small blocking all-to-all), so that a
    mismatch raises on every rank instead of corrupting or aborting the transfer.

    Args:
        tensor: contiguous; its rows are sent in order, the first ``splits[0]`` to group rank 0.
        splits: rows per destination, one entry per group rank, summing to ``tensor.shape[0]``.
        group: the group (``None``: every worker).

    Returns:
        The work to wait for, the output tensor it fills (rows from group rank 0 first) and the row count
        received from every group rank.

    Raises:
        ValueError: ranks disagree on dtype or on the size of a row (on every rank).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return CompletedWork(), tensor.clone(), list(splits)
    check_device(tensor, f"the {tuple(tensor.shape)} tensor to send all-to-all")
    row = math.prod(tensor.shape[1:])
    mine = [_DTYPE_CODES.index(tensor.dtype), row]
    send = torch.tensor([[s, *mine] for s in splits], dtype=torch.int64, device=tensor.device)
    recv = torch.empty_like(send)
    wait_work(dist.all_to_all_single(recv, send, group=group, async_op=True))
    theirs = recv.tolist()
    differing = [j for j, m in enumerate(theirs) if m[1:] != mine]
    if differing:
        dtype, size = theirs[differing[0]][1:]
        raise ValueError(
            f"all-to-all mismatch: this rank has dtype {tensor.dtype} and rows of {row} elements, group rank "
            f"{differing[0]} has dtype {_DTYPE_CODES[dtype]} and rows of {size} elements"
        )
    counts = [m[0] for m in theirs]
    out = tensor.new_empty((sum(counts), *tensor.shape[1:]))
    work = dist.all_to_all_single(out, tensor, counts, list(splits), group=group, async_op=True)
    assert work is not None
    return work, out, counts
