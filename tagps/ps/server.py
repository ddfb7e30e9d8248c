"""The summation server: a store per key, engine threads, sync and async rounds, server-side optimizers.

One I/O thread owns every socket: it validates each data message's header (see ``docs/protocol.md``),
routes the message to the engine thread that owns its key (keys go to the least-loaded thread, by bytes,
when first declared), and forwards the engines' replies. Engine threads own the per-key state and do every
sum with :func:`tagps.kernels.sum_into` (which releases the GIL, so engines really run in parallel).

A key is pushed by every worker unless its INIT named a subset of them (``FLAG_WORKERS``); "every worker"
below means the key's workers, and its mean divides by their number.

Sync mode: pushes of round ``r`` are held (zero-copy) until every worker pushed; then they are summed in
one pass into the first received message buffer (float16/bfloat16 accumulate in float32 and round once),
divided by the number of workers when the pushes ask for the mean, and the pulls waiting for round ``r`` are
answered zero-copy from that buffer; the next round sums into new buffers, so a queued reply never changes.
With a server optimizer the sum is the gradient of one step on the key's weights (updated in place, which
is safe because a worker cannot push round ``r + 1`` before it received round ``r``), and pulls get the
weights.

Async mode (``BYTEPS_ENABLE_ASYNC=1``): each push is added to (or, with an optimizer, applied to) the store
at once; a pull of round ``r`` waits until every worker pushed round ``r - TAGPS_MAX_STALENESS`` when that
bound is set, and is answered with a copy of the store.

A bad message never stops the server: it is logged and answered with :attr:`Op.ERROR` to its sender.

Checkpoints (``checkpoint=``) are written atomically at a clean shutdown and, with ``checkpoint_every=N``
(sync mode), also while the job runs: when some key completed ``N`` rounds since the last checkpoint, the
I/O thread parks every engine at a marker in its queue (so the state is the effect of exactly the messages
dispatched before), and if no round is in progress and every key that moved since the last checkpoint
moved by the same number of rounds (a step boundary of a training loop), it copies the state and a writer
thread saves the copy. Keys that move at different rates (say one declared mid-step) would never line up,
so after ``3 N`` rounds any moment without a round in progress is taken, with a warning.

Two engines run this data plane (``TAGPS_PS_ENGINE``): ``cpp``, the default when ``tagps._core`` was built
with libzmq, is ``tagps._core.PSServer`` (``csrc/net/server.h``): its own ZeroMQ context, I/O thread, engine
threads and ZAP handler, all without the GIL, with the semantics above; Python keeps the control plane
(registration, heartbeats, SHUTDOWN and failure notices) and writes the checkpoints the engine copies.
``python`` is the pyzmq implementation in this module.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from tagps import _core, kernels
from tagps.atomic import atomic_open
from tagps.config import PSConfig, ServerOptimizerConfig
from tagps.heap import keep_freed_buffers
from tagps.ps.node import JobFailed, SchedulerLink
from tagps.ps.optimizer import OptimizerState, ServerOptimizer
from tagps.ps.protocol import (
    FLAG_ASYNC,
    FLAG_AVERAGE,
    FLAG_IPC,
    FLAG_SERVER_OPTIMIZER,
    FLAG_WORKERS,
    IPC_DESCRIPTOR_SIZE,
    DType,
    Op,
    ProtocolError,
    check_workers,
    numpy_dtype,
    pack_header,
    routing_id,
    server_node_id,
    unpack_header,
    unpack_workers,
)
from tagps.ps.transport import Security, bind_random_port, resolve_host

__all__ = ["SummationServer"]

log = logging.getLogger(__name__)

# Version 2 added each key's worker set; version 1 checkpoints (every key on every worker) still restore.
_CHECKPOINT_VERSION = 2
_META_FIELDS = ("key", "dtype", "nbytes", "round", "step", "workers", "counts")  # per key, in this order
_PARK = object()  # engine queue marker: wait at the checkpoint barrier until the I/O thread copied the state


@dataclass
class _Key:
    """Per-key state. ``dtype``/``nbytes``/``engine``/``workers`` are fixed at declaration; the rest is
    engine-owned. Per-worker arrays (``counts``, ``pushed``) are indexed by ``slot[worker]``."""

    key: int
    dtype: int
    nbytes: int
    engine: int
    workers: tuple[int, ...]  # the workers that push and pull this key, ascending
    value: np.ndarray | None = None
    result: Any = None  # sync mode: what pulls of the last completed round get (a Frame or an array)
    average: bool = False  # sync mode: the pushes of the current round ask for the mean
    result_flags: int = 0  # flags of the PULL_REPLY that carries ``result``
    opt: OptimizerState | None = None
    restored: bool = False
    ready: bool = False
    round: int = 0
    cut_round: int = 0  # ``round`` at the last checkpoint (or when declared or restored)
    frames: list[Any] = field(default_factory=list)
    pushed: bytearray = field(default_factory=bytearray)
    pulls: list[tuple[bytes, int, int]] = field(default_factory=list)
    inits: dict[int, Any] = field(default_factory=dict)
    init_waiters: list[tuple[bytes, int]] = field(default_factory=list)
    counts: np.ndarray | None = None
    slot: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.slot = {w: i for i, w in enumerate(self.workers)}

    @property
    def num_workers(self) -> int:
        return len(self.workers)


@dataclass
class _SumCounters:
    """One engine thread's summation counters (see :meth:`SummationServer.stats`); only it writes them."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def add(self, nbytes: int, wall_start: float, cpu_start: float) -> None:
        """Count one summation of ``nbytes`` gradient bytes that started at these clock readings."""
        self.calls += 1
        self.bytes += nbytes
        self.seconds += time.perf_counter() - wall_start
        self.cpu_seconds += time.thread_time() - cpu_start


class _Reject(Exception):
    """A message that is well-formed but not acceptable now (answered with ERROR)."""


class SummationServer:
    """Run one summation server of a job.

    Args:
        config: the job's settings.
        optimizer: the server-side optimizer (``name="none"``: plain summation).
        checkpoint: write the store and optimizer state here at a clean shutdown.
        restore: start from this checkpoint (same rank, keys, dtypes and optimizer as when it was written).
        checkpoint_every: also write ``checkpoint`` while serving, at the first step boundary after some key
            completed this many rounds since the last one (see the module docstring).

    Raises:
        ValueError: an unreadable or mismatched ``restore``, or ``checkpoint_every`` below 1, without
            ``checkpoint`` or in async mode (its pushes have no rounds to line up).
    """

    def __init__(
        self,
        config: PSConfig,
        optimizer: ServerOptimizerConfig | None = None,
        *,
        checkpoint: str | Path | None = None,
        restore: str | Path | None = None,
        checkpoint_every: int | None = None,
    ) -> None:
        if checkpoint_every is not None and (
            checkpoint_every < 1 or checkpoint is None or config.enable_async
        ):
            raise ValueError(
                f"checkpoint_every={checkpoint_every} needs a value >= 1, a checkpoint path "
                f"({checkpoint}) and sync mode (BYTEPS_ENABLE_ASYNC={int(config.enable_async)})"
            )
        self.config = config
        self.checkpoint_every = checkpoint_every
        # Parallelism comes from the engine threads; OpenMP teams inside each would only oversubscribe the
        # cores and spin between sums (measured: 4 MiB push_pull 20 ms with teams, 6 ms without).
        kernels.set_num_threads(1)
        keep_freed_buffers()
        opt_config = optimizer or ServerOptimizerConfig()
        self.optimizer = ServerOptimizer(opt_config) if opt_config.name != "none" else None
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.flags = (FLAG_SERVER_OPTIMIZER if self.optimizer else 0) | (
            FLAG_ASYNC if config.enable_async else 0
        )
        self.keys: dict[int, _Key] = {}
        self._loads = [0] * config.engine_threads
        self._restored_rank: int | None = None
        requested_rank = self._restore(Path(restore)) if restore is not None else None

        # The native engine has its own context; this one also carries the Python engine's data socket.
        self._context = zmq.Context(io_threads=config.server_io_thread_count())
        self._security = Security(self._context, config.secret)
        host = resolve_host(config)
        self.engine = config.engine
        self._native: Any = None  # tagps._core.PSServer (TAGPS_PS_ENGINE=cpp): it owns the data socket
        if self.engine == "cpp":
            try:
                self._native = self._start_native(host)
            except BaseException:
                self._security.close()
                self._context.term()
                raise
            port = self._native.port
        else:
            self._data = self._security.server(self._context.socket(zmq.ROUTER))
            self._data.setsockopt(zmq.MAXMSGSIZE, max(config.partition_bytes, 1 << 16))
            self._data.setsockopt(zmq.LINGER, 0)
            port = bind_random_port(self._data, host)
            self._replies = self._context.socket(zmq.PULL)
            # No high-water mark on the engines' replies: an engine blocked in send while the I/O thread
            # waits for it at a checkpoint would deadlock (what is queued is bounded by the requests).
            self._replies.setsockopt(zmq.RCVHWM, 0)
            self._replies_endpoint = f"inproc://tagps-server-replies-{id(self)}"
            self._replies.bind(self._replies_endpoint)
        self._link = SchedulerLink(
            self._context, self._security, config, "server", host, port, requested_rank
        )
        self.rank: int | None = None
        self.node_id = 0
        self._queues: list[queue.SimpleQueue[Any]] = [
            queue.SimpleQueue() for _ in range(config.engine_threads)
        ]
        self._engines: list[threading.Thread] = []
        # Rounds completed per engine (each engine counts its own: no lock); the I/O thread tries a
        # checkpoint only when the total moved since its last try.
        self._done = [0] * config.engine_threads
        self._done_tried = 0
        self._sums = [_SumCounters() for _ in range(config.engine_threads)]
        self._received = 0  # data messages (the C++ engine counts its own)
        self._park = threading.Barrier(config.engine_threads + 1)
        self._writer: threading.Thread | None = None
        log.info("server listening on %s:%d (%s engine)", host, port, self.engine)

    def stats(self) -> dict[str, int | float]:
        """Return the data plane's counters since start (either engine, while serving or after).

        Returns:
            ``rounds`` (sync rounds completed), ``messages`` (data messages received), ``ipc_pushes`` (sync
            pushes whose bytes a worker shared through memory, ``TAGPS_PS_IPC``; the cpp engine only), and
            what the engine threads summed: ``sum_calls``, ``sum_bytes`` (every push folded into a sum, the
            first one included; each async push), ``sum_seconds`` (wall clock in the summation kernels) and
            ``sum_cpu_seconds`` (the engine threads' CPU time in them, which leaves out the moments the
            OS ran another thread). ``sum_bytes / sum_cpu_seconds`` is the engine's summation rate.
        """
        if self._native is not None:
            return self._native.stats()
        sums = list(self._sums)
        return {
            "rounds": sum(self._done),
            "messages": self._received,
            "ipc_pushes": 0,
            "sum_calls": sum(c.calls for c in sums),
            "sum_bytes": sum(c.bytes for c in sums),
            "sum_seconds": sum(c.seconds for c in sums),
            "sum_cpu_seconds": sum(c.cpu_seconds for c in sums),
        }

    # -- main loop ----------------------------------------------------------------------------

    def run(self) -> int:
        """Register, serve until the scheduler says SHUTDOWN (returns 0) or the job fails (returns 1)."""
        try:
            book = self._link.register()
            if book.rank is None:
                raise JobFailed("the scheduler's address book gave this server no rank")
            self.rank = book.rank
            self.node_id = server_node_id(book.rank)
            if self._restored_rank is not None and self._restored_rank != self.rank:
                raise JobFailed(f"checkpoint is for server rank {self._restored_rank}, got rank {self.rank}")
            log.info("server rank %s of %d", self.rank, self.config.num_servers)
            if self._native is not None:
                self._native.start(self.rank)
                self._serve_native()
            else:
                self._engines = [
                    threading.Thread(target=self._engine, args=(i,), name=f"tagps-engine-{i}", daemon=True)
                    for i in range(self.config.engine_threads)
                ]
                for thread in self._engines:
                    thread.start()
                self._serve()
        except JobFailed as exc:
            log.error("server stops: %s", exc)
            return 1
        finally:
            self._stop_engines()
            self._close()
            if self._writer is not None:
                self._writer.join()
        if self.checkpoint is not None:
            self.save(self.checkpoint)
        return 0

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self._data, self._replies, self._link.socket):
            poller.register(sock, zmq.POLLIN)
        timeout_ms = max(10, int(self.config.heartbeat_interval * 500))
        while True:
            ready = dict(poller.poll(timeout_ms))
            if self._replies in ready:
                for _ in range(256):
                    try:
                        self._data.send_multipart(
                            self._replies.recv_multipart(zmq.NOBLOCK, copy=False), copy=False
                        )
                    except zmq.Again:
                        break
            if self._data in ready:
                for _ in range(256):
                    try:
                        frames = self._data.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._received += 1
                    self._dispatch(frames)
            if self._link.socket in ready:
                op, _ = self._link.receive()
                if op == Op.SHUTDOWN:
                    log.info("shutdown requested by the scheduler")
                    return
            self._link.beat()
            if self.checkpoint_every is not None:
                self._try_checkpoint(self.checkpoint_every)

    # -- the C++ engine (TAGPS_PS_ENGINE=cpp) -------------------------------------------------------

    def _start_native(self, host: str) -> Any:
        """Bind the C++ engine's data socket and hand it the restored keys (they leave ``self.keys``)."""
        config = self.config
        keys = self._security.keys
        native = _core.PSServer(
            host=host,
            num_workers=config.num_workers,
            partition_bytes=config.partition_bytes,
            engine_threads=config.engine_threads,
            io_threads=config.server_io_thread_count(),
            enable_async=config.enable_async,
            max_staleness=config.max_staleness,
            checkpoint_every=self.checkpoint_every,
            optimizer=dataclasses.asdict(self.optimizer.config) if self.optimizer else None,
            curve_keys=(
                (keys.server_public, keys.server_secret, keys.client_public, keys.client_secret)
                if keys is not None
                else None
            ),
            log_level=log.getEffectiveLevel(),
        )
        try:
            for st in self.keys.values():
                opt = st.opt
                names = self.optimizer.buffer_names() if self.optimizer is not None else ()
                native.restore_key(
                    key=st.key,
                    dtype=st.dtype,
                    nbytes=st.nbytes,
                    workers=list(st.workers),
                    round=st.round,
                    counts=[] if st.counts is None else st.counts.tolist(),
                    step=opt.step if opt is not None else 0,
                    value=st.value,
                    buffers=[(name, opt.buffers[name]) for name in names] if opt is not None else [],
                )
        except ValueError as exc:
            native.stop()
            raise ValueError(f"cannot restore the server checkpoint: {exc}") from None
        self.keys.clear()  # the engine owns them now
        return native

    def _serve_native(self) -> None:
        """Beside the C++ engine: serve the scheduler link, heartbeat, relay logs, write checkpoints."""
        timeout_ms = max(10, int(self.config.heartbeat_interval * 500))
        if self.checkpoint_every is not None:
            timeout_ms = min(timeout_ms, 50)  # hand periodic checkpoints to the writer promptly
        while True:
            if self._link.socket.poll(timeout_ms):
                op, _ = self._link.receive()
                if op == Op.SHUTDOWN:
                    log.info("shutdown requested by the scheduler")
                    return
            self._link.beat()
            self._native_housekeeping()

    def _native_housekeeping(self) -> None:
        """Relay the engine's log records, fail with its I/O thread, start writing its checkpoints."""
        for level, message in self._native.drain_log():
            log.log(level, "%s", message)
        failure = self._native.failure()
        if failure:
            raise JobFailed(failure)
        for _moved, entries in self._native.take_checkpoints():  # the engine logged keys out of step
            self._start_writer(self._native_snapshot(entries))

    def _native_snapshot(self, entries: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The checkpoint's metadata and arrays from the C++ engine's copies of its keys."""
        meta = self._meta()
        arrays: dict[str, np.ndarray] = {}
        for entry in entries:
            key, dtype = entry["key"], numpy_dtype(entry["dtype"])
            meta["keys"].append({name: entry[name] for name in _META_FIELDS})
            if entry["value"] is not None:
                arrays[f"value_{key}"] = entry["value"].view(dtype)
            for name, buf in entry["buffers"].items():
                arrays[f"state_{key}_{name}"] = buf.view(dtype)
        return meta, arrays

    # -- the Python engine (TAGPS_PS_ENGINE=python) -------------------------------------------------

    def _dispatch(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        header = None
        try:
            if len(frames) < 2:
                raise ProtocolError("expected a header frame, got none")
            header = unpack_header(frames[1].buffer)
            # An INIT carries the worker set (FLAG_WORKERS) and a shared-memory descriptor (FLAG_IPC), each
            # when flagged, before its optional initial value.
            subset = header.flags & FLAG_WORKERS
            if subset and header.op != Op.INIT:
                raise ProtocolError(f"FLAG_WORKERS on {Op(header.op).name}; only INIT carries a worker set")
            if header.flags & FLAG_IPC and header.op not in (Op.INIT, Op.PUSH):
                raise ProtocolError(f"FLAG_IPC on {Op(header.op).name}; only INIT and PUSH carry it")
            descriptor = bool(header.flags & FLAG_IPC) and header.op == Op.INIT
            low = 2 + bool(subset) + descriptor
            if not low <= len(frames) <= low + 1:
                raise ProtocolError(
                    f"expected header, {'worker set, ' if subset else ''}"
                    f"{'shared-memory descriptor, ' if descriptor else ''}and at most one payload frame, "
                    f"got {len(frames) - 1} frames"
                )
            if descriptor and len(frames[low - 1].buffer) != IPC_DESCRIPTOR_SIZE:
                raise ProtocolError(
                    f"shared-memory descriptor of {len(frames[low - 1].buffer)} bytes, "
                    f"expected {IPC_DESCRIPTOR_SIZE}"
                )
            worker = self._worker_index(identity, header.sender)
            payload = frames[-1] if len(frames) == low + 1 else None
            size = len(payload.buffer) if payload is not None else 0
            if header.op == Op.INIT:
                declared = (
                    unpack_workers(frames[2].buffer, self.config.num_workers)
                    if subset
                    else tuple(range(self.config.num_workers))
                )
                state = self._declare(header, size, worker, declared)
            elif header.op in (Op.PUSH, Op.PULL):
                state = self.keys.get(header.key)
                if state is None:
                    raise ProtocolError(f"key {header.key} was never declared (send INIT first)")
                if worker not in state.slot:
                    raise ProtocolError(
                        f"worker {worker} is not among the workers {list(state.workers)} of key {header.key}"
                    )
                if header.dtype != state.dtype:
                    raise ProtocolError(f"dtype code {header.dtype} but key {header.key} holds {state.dtype}")
                if header.flags & FLAG_AVERAGE and state.dtype in (DType.INT32, DType.INT64):
                    raise ProtocolError(f"AVERAGE of integer key {header.key}")
                if header.flags & FLAG_IPC:  # this engine maps no memory, so it acknowledged no offer
                    raise ProtocolError(
                        f"PUSH with FLAG_IPC of key {header.key} from worker {worker}, whose shared memory "
                        "this server did not take"
                    )
                expected = state.nbytes if header.op == Op.PUSH else 0
                if size != expected or header.nbytes != expected:
                    raise ProtocolError(
                        f"{Op(header.op).name} of key {header.key} carries {size} bytes "
                        f"(header: {header.nbytes}), expected {expected}"
                    )
            else:
                raise ProtocolError(f"a server does not handle {Op(header.op).name}")
        except ProtocolError as exc:
            self._reply_error(self._data, identity, header, exc)
            return
        self._queues[state.engine].put((header, identity, worker, payload))
        if header.op == Op.PUSH:
            # Return the worker's credit as soon as the bytes are here, whatever the other workers do (so
            # workers that order chunks differently cannot deadlock). A push the engine then rejects
            # still gets its ERROR, which fails that worker.
            ack = pack_header(
                Op.PUSH_ACK, sender=self.node_id, key=header.key, round=header.round, dtype=header.dtype
            )
            self._data.send_multipart([identity, ack])

    def _worker_index(self, identity: bytes, sender: int) -> int:
        worker = (sender - 9) // 2
        if sender < 9 or sender % 2 == 0 or worker >= self.config.num_workers:
            raise ProtocolError(f"sender {sender} is not a worker node id of this job")
        if identity != routing_id(sender):
            raise ProtocolError(f"sender {sender} does not match the connection's identity {identity!r}")
        return worker

    def _declare(self, header: Any, payload_size: int, worker: int, workers: tuple[int, ...]) -> _Key:
        key, dtype = header.key, header.dtype
        if worker not in workers:
            raise ProtocolError(
                f"worker {worker} sent INIT of key {key} for the workers {list(workers)}, which exclude it"
            )
        if dtype == 0:
            raise ProtocolError("INIT needs a dtype")
        itemsize = numpy_dtype(dtype).itemsize
        limit = self.config.partition_bytes
        if not 0 < header.nbytes <= limit or header.nbytes % itemsize:
            raise ProtocolError(
                f"INIT of key {key} declares {header.nbytes} bytes; needs a multiple of {itemsize} "
                f"in [1, BYTEPS_PARTITION_BYTES={limit}]"
            )
        if payload_size not in (0, header.nbytes):
            raise ProtocolError(f"INIT payload of {payload_size} bytes for a {header.nbytes}-byte key")
        if self.optimizer is not None and dtype not in (DType.FLOAT32, DType.FLOAT64):
            raise ProtocolError(
                f"TAGPS_SERVER_OPTIMIZER={self.optimizer.config.name} needs float32 or float64 keys"
            )
        state = self.keys.get(key)
        if state is None:
            engine = min(range(len(self._loads)), key=self._loads.__getitem__)
            self._loads[engine] += header.nbytes
            state = _Key(key, dtype, header.nbytes, engine, workers)
            self.keys[key] = state
        elif (state.dtype, state.nbytes) != (dtype, header.nbytes):
            raise ProtocolError(
                f"key {key} is declared as {state.nbytes} bytes of dtype {state.dtype}; "
                f"this INIT says {header.nbytes} bytes of dtype {dtype}"
            )
        elif state.workers != workers:
            raise ProtocolError(
                f"key {key} is declared for the workers {list(state.workers)}; this INIT from worker "
                f"{worker} says {list(workers)}"
            )
        return state

    # -- engines ------------------------------------------------------------------------------

    def _engine(self, index: int) -> None:
        out = self._context.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, 0)
        out.connect(self._replies_endpoint)
        work = self._queues[index]
        try:
            while True:
                item = work.get()
                if item is None:
                    return
                if item is _PARK:
                    self._park.wait()  # parked: the I/O thread reads every key now
                    self._park.wait()  # released
                    continue
                header, identity, worker, payload = item
                try:
                    if header.op == Op.INIT:
                        self._init(out, self.keys[header.key], identity, worker, payload)
                    elif header.op == Op.PUSH:
                        self._push(out, self.keys[header.key], identity, worker, header, payload)
                    else:
                        self._pull(out, self.keys[header.key], identity, worker, header.round)
                except _Reject as exc:
                    self._reply_error(out, identity, header, exc)
                except Exception as exc:  # a kernel or allocation failure must not kill the engine
                    log.exception("engine %d failed on %s", index, Op(header.op).name)
                    self._reply_error(out, identity, header, exc)
        finally:
            out.close()

    def _init(self, out: zmq.Socket, st: _Key, identity: bytes, worker: int, payload: Any) -> None:
        if st.ready:
            raise _Reject(f"key {st.key} is already declared by every worker")
        if worker in st.inits:
            raise _Reject(f"worker {worker} declared key {st.key} twice")
        st.inits[worker] = payload
        st.init_waiters.append((identity, worker))
        if len(st.inits) < st.num_workers:
            return
        dtype = numpy_dtype(st.dtype)
        if not st.restored:
            if self._keeps_store():
                st.value = np.zeros(st.nbytes // dtype.itemsize, dtype)
                first = next((st.inits[w] for w in sorted(st.inits) if st.inits[w] is not None), None)
                if first is not None:
                    np.copyto(st.value, np.frombuffer(first.buffer, dtype))
                if self.optimizer is not None:
                    st.opt = self.optimizer.new_state(st.value.size, st.value.dtype)
            st.counts = np.zeros(st.num_workers, np.int64)
        st.pushed = bytearray(st.num_workers)
        st.inits.clear()
        st.ready = True
        for ident, w in st.init_waiters:
            round = int(st.counts[st.slot[w]]) if self.config.enable_async else st.round
            head = pack_header(
                Op.INIT_ACK, sender=self.node_id, key=st.key, round=round, dtype=st.dtype, flags=self.flags
            )
            out.send_multipart([ident, head])
        st.init_waiters.clear()

    def _keeps_store(self) -> bool:
        """Async mode and server optimizers keep the weights; sync summation keeps only the last sum."""
        return self.config.enable_async or self.optimizer is not None

    def _push(
        self, out: zmq.Socket, st: _Key, identity: bytes, worker: int, header: Any, payload: Any
    ) -> None:
        round, average = header.round, bool(header.flags & FLAG_AVERAGE)
        slot = st.slot[worker]
        if not st.ready or st.counts is None:
            raise _Reject(f"PUSH of key {st.key} before every worker declared it")
        if self.config.enable_async:
            if round != st.counts[slot]:
                raise _Reject(f"PUSH of key {st.key} round {round}; worker {worker} is at {st.counts[slot]}")
        elif round != st.round:
            raise _Reject(f"PUSH of key {st.key} for round {round} while the key is at round {st.round}")
        elif st.pushed[slot]:
            raise _Reject(f"worker {worker} pushed key {st.key} twice in round {round}")
        elif st.frames and average != st.average:
            raise _Reject(f"workers disagree on average= for key {st.key} round {round}")
        dtype = numpy_dtype(st.dtype)
        if self.config.enable_async and st.value is not None:
            grad = np.frombuffer(payload.buffer, dtype)
            if self.optimizer is not None and st.opt is not None:
                self.optimizer.step(st.value, grad, st.opt)
            else:
                wall_start, cpu_start = time.perf_counter(), time.thread_time()
                kernels.sum_into(st.value, grad)
                self._sums[st.engine].add(st.nbytes, wall_start, cpu_start)
            st.counts[slot] += 1
            self._answer_ready_pulls(out, st)
            return
        st.pushed[slot] = 1
        st.average = average
        st.frames.append(payload)
        if len(st.frames) < st.num_workers:
            return
        # Sum in place into the first received frame (zmq's own buffer): one pass, no extra copy, and
        # the frame itself is then sent zero-copy to every puller.
        # One worker: its push is the sum (no kernel runs, nothing is counted).
        total, *others = [np.frombuffer(frame.buffer, dtype) for frame in st.frames]
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        if others:
            kernels.sum_into(total, *others)
        if self.optimizer is not None and st.opt is not None and st.value is not None:
            if others:
                self._sums[st.engine].add(st.nbytes * len(st.frames), wall_start, cpu_start)
            self.optimizer.step(st.value, total, st.opt)
            st.result = st.value
        else:
            if st.average and others:
                kernels.scale(total, 1.0 / st.num_workers)
            if others:
                self._sums[st.engine].add(st.nbytes * len(st.frames), wall_start, cpu_start)
            st.result = st.frames[0]
        st.result_flags = self.flags | (FLAG_AVERAGE if st.average and self.optimizer is None else 0)
        st.frames.clear()
        st.pushed = bytearray(st.num_workers)
        st.round += 1
        for pull_identity, _, pull_round in st.pulls:
            self._send_value(out, st, pull_identity, pull_round, copy=False)
        st.pulls.clear()
        self._done[st.engine] += 1  # last: when the I/O thread sees it, this key is between rounds

    def _pull(self, out: zmq.Socket, st: _Key, identity: bytes, worker: int, round: int) -> None:
        if not st.ready or st.counts is None:
            raise _Reject(f"PULL of key {st.key} before every worker declared it")
        if self.config.enable_async:
            if round + 1 != st.counts[st.slot[worker]]:
                raise _Reject(
                    f"PULL of key {st.key} round {round} before worker {worker}'s push of that round"
                )
            st.pulls.append((identity, worker, round))
            self._answer_ready_pulls(out, st)
        elif round == st.round - 1:
            self._send_value(out, st, identity, round, copy=False)
        elif round == st.round:
            st.pulls.append((identity, worker, round))
        else:
            raise _Reject(f"PULL of key {st.key} round {round} while the key is at round {st.round}")

    def _answer_ready_pulls(self, out: zmq.Socket, st: _Key) -> None:
        if not st.pulls or st.counts is None:
            return
        staleness = self.config.max_staleness
        slowest = int(st.counts.min())
        waiting = []
        for identity, worker, round in st.pulls:
            if staleness is None or slowest >= round + 1 - staleness:
                self._send_value(out, st, identity, round, copy=True)
            else:
                waiting.append((identity, worker, round))
        st.pulls = waiting

    def _send_value(self, out: zmq.Socket, st: _Key, identity: bytes, round: int, *, copy: bool) -> None:
        head = pack_header(
            Op.PULL_REPLY,
            sender=self.node_id,
            key=st.key,
            round=round,
            dtype=st.dtype,
            nbytes=st.nbytes,
            flags=self.flags if self.config.enable_async else st.result_flags,
        )
        payload = st.value if self.config.enable_async else st.result
        out.send_multipart([identity, head, payload], copy=copy)

    def _reply_error(self, sock: zmq.Socket, identity: bytes, header: Any, exc: Exception) -> None:
        key, round = (header.key, header.round) if header is not None else (0, 0)
        log.warning("rejected a message from %r (key %d round %d): %s", identity, key, round, exc)
        reason = f"server {self.rank}: {exc}".encode()
        head = pack_header(Op.ERROR, sender=self.node_id, key=key, round=round, nbytes=len(reason))
        sock.send_multipart([identity, head, reason])

    # -- lifecycle ----------------------------------------------------------------------------

    def _stop_engines(self) -> None:
        if self._native is not None:
            self._native.stop()
            for level, message in self._native.drain_log():
                log.log(level, "%s", message)
            return
        for work in self._queues:
            work.put(None)
        for thread in self._engines:
            thread.join()
        self._engines = []

    def _close(self) -> None:
        if not self._context.closed:
            self._link.close()
            if self._native is None:
                self._replies.close(linger=0)
                self._data.close(linger=0)
            self._security.close()
            self._context.term()

    def _cut_moved(self, every: int) -> set[int] | None:
        """The rounds that the keys moved since the last checkpoint when it is time for the next one."""
        ready = [st for st in self.keys.values() if st.ready]
        if any(st.frames or st.pulls for st in ready):
            return None  # a round in progress
        moved = {st.round - st.cut_round for st in ready} - {0}
        if not moved or max(moved) < every or (len(moved) > 1 and max(moved) < 3 * every):
            return None
        return moved

    def _try_checkpoint(self, every: int) -> None:
        """Park the engines and, at a step boundary, copy the state for the writer thread (I/O thread)."""
        done = sum(self._done)
        # A first look without parking (the engines may be changing what it reads) spares the engines a
        # stop at nearly every round; the decision is taken again while they are parked.
        if done == self._done_tried:
            return
        self._done_tried = done
        if self._cut_moved(every) is None:
            return
        for work in self._queues:
            work.put(_PARK)
        self._park.wait()
        try:
            moved = self._cut_moved(every)
            if moved is None:
                return
            if len(moved) > 1:
                log.warning("checkpoint with keys at different steps: they moved %s rounds", sorted(moved))
            snapshot = self._snapshot(copy=True)
            for st in self.keys.values():
                st.cut_round = st.round
        finally:
            self._park.wait()
        self._start_writer(snapshot)

    def _start_writer(self, snapshot: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        """Save a periodic checkpoint's copy on the writer thread, after the previous one is written."""
        if self._writer is not None:
            self._writer.join()  # one write at a time, in order
        self._writer = threading.Thread(
            target=self._write_logged, args=(snapshot,), name="tagps-checkpoint", daemon=True
        )
        self._writer.start()

    def _write_logged(self, snapshot: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        """Write a periodic checkpoint; a failure is logged and the server goes on (the old file stays)."""
        assert self.checkpoint is not None
        try:
            self._write(self.checkpoint, snapshot)
        except OSError as exc:
            log.error("periodic checkpoint to %s failed: %s", self.checkpoint, exc)

    def save(self, path: str | Path) -> None:
        """Write every key's store, round and optimizer state to ``path`` (an ``.npz`` file), atomically."""
        self._write(path, self._snapshot(copy=False))

    def _meta(self) -> dict[str, Any]:
        """The checkpoint's metadata without its keys."""
        return {
            "version": _CHECKPOINT_VERSION,
            "rank": self.rank,
            "optimizer": self.optimizer.config.name if self.optimizer else "none",
            "enable_async": self.config.enable_async,
            "keys": [],
        }

    def _snapshot(self, *, copy: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Return the checkpoint's metadata and arrays; ``copy``: arrays that the engines cannot change."""
        if self._native is not None:
            return self._native_snapshot(self._native.snapshot())  # always copies
        meta = self._meta()
        arrays: dict[str, np.ndarray] = {}
        for st in self.keys.values():
            if st.counts is None:
                continue
            meta["keys"].append(
                {
                    "key": st.key,
                    "dtype": st.dtype,
                    "nbytes": st.nbytes,
                    "round": st.round,
                    "step": st.opt.step if st.opt else 0,
                    "workers": list(st.workers),
                    "counts": st.counts.tolist(),
                }
            )
            if st.value is not None:
                arrays[f"value_{st.key}"] = st.value.copy() if copy else st.value
            for name, buf in st.opt.buffers.items() if st.opt else ():
                arrays[f"state_{st.key}_{name}"] = buf.copy() if copy else buf
        return meta, arrays

    @staticmethod
    def _write(path: str | Path, snapshot: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        meta, arrays = snapshot
        with atomic_open(path) as fh:
            np.savez(fh, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        log.info("checkpoint of %d keys written to %s", len(meta["keys"]), path)

    def _restore(self, path: Path) -> int | None:
        try:
            with np.load(path) as data:
                meta = json.loads(bytes(data["meta"]))
                if meta.get("version") not in (1, _CHECKPOINT_VERSION):
                    raise ValueError(
                        f"checkpoint version {meta.get('version')}, expected 1 to {_CHECKPOINT_VERSION}"
                    )
                name = self.optimizer.config.name if self.optimizer else "none"
                if meta["optimizer"] != name or meta["enable_async"] != self.config.enable_async:
                    raise ValueError(
                        f"checkpoint was written with TAGPS_SERVER_OPTIMIZER={meta['optimizer']} and "
                        f"BYTEPS_ENABLE_ASYNC={int(meta['enable_async'])}; this server has {name} and "
                        f"{int(self.config.enable_async)}"
                    )
                for entry in meta["keys"]:
                    key = int(entry["key"])
                    engine = min(range(len(self._loads)), key=self._loads.__getitem__)
                    self._loads[engine] += int(entry["nbytes"])
                    everyone = range(self.config.num_workers)  # version 1 saved no worker sets
                    workers = check_workers(
                        tuple(int(w) for w in entry.get("workers", everyone)), self.config.num_workers
                    )
                    st = _Key(key, int(entry["dtype"]), int(entry["nbytes"]), engine, workers)
                    if self._keeps_store():
                        st.value = np.array(data[f"value_{key}"])
                    st.round = int(entry["round"])
                    st.counts = np.array(entry["counts"], np.int64)
                    if st.counts.size != st.num_workers:
                        raise ValueError(
                            f"key {key} has push counts of {st.counts.size} workers, expected "
                            f"{st.num_workers} (DMLC_NUM_WORKER differs)"
                        )
                    if self.optimizer is not None:
                        st.opt = OptimizerState(
                            int(entry["step"]),
                            {n: np.array(data[f"state_{key}_{n}"]) for n in self.optimizer.buffer_names()},
                        )
                    st.restored = True
                    st.cut_round = st.round
                    self.keys[key] = st
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"cannot restore the server checkpoint {path}: {exc}") from None
        self._restored_rank = meta["rank"]
        log.info("restored %d keys from %s", len(self.keys), path)
        return self._restored_rank
