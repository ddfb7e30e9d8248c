"""The worker-side client: declare tensors, push_pull them through the summation servers.

One :class:`PSClient` per worker machine. A background I/O thread owns every socket (one DEALER per
server plus the scheduler link); user threads hand it work through a queue. Tensors are cut into the fewest
chunks of at most ``BYTEPS_PARTITION_BYTES`` (equal in size within one element) with keys
``(declared_index << 16) + chunk``; each chunk goes to the server chosen by ``BYTEPS_KEY_HASH_FN``; at most
``BYTEPS_SCHEDULING_CREDIT`` chunks are in flight and lower ``priority`` values are sent first. A chunk's
PUSH frame is the caller's buffer itself (zero-copy), and its PULL reply is copied straight back into it.

``TAGPS_PS_ENGINE`` picks who moves the data: ``cpp`` (the default when ``tagps._core`` has libzmq) hands
the server sockets to ``tagps._core.PSClientEngine``, whose own I/O thread runs declarations and push_pull
without the GIL; the Python I/O thread then keeps only the scheduler link (heartbeats, barriers, failure
notices). ``python`` keeps every socket on the Python I/O thread.

Keys must agree across workers. :meth:`PSClient.declare` only records a tensor; the pending declarations
are numbered in sorted-name order at the next *declaration point* (the next :meth:`~PSClient.push_pull`,
:meth:`~PSClient.barrier` or :meth:`~PSClient.flush_declarations`), where every worker sends INIT for
each chunk and waits until all workers did. So every worker must declare the same set of names before the
same declaration point; the usual pattern is to declare every tensor, then call :meth:`~PSClient.barrier`.

A tensor declared with ``workers=`` is summed over those workers only, and only they declare it. Its key
cannot come from the shared numbering (the other workers never see it), so its index is a hash of its name
with bit 47 set, disjoint from the numbered indices; a worker that declares it with another worker set thus
gets the same key, and the server reports the disagreement.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import itertools
import json
import logging
import numbers
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from tagps import _core
from tagps.atomic import write_text_atomic
from tagps.config import PSConfig, ps_config
from tagps.heap import keep_freed_buffers
from tagps.ps.node import AddressBook, JobFailed, SchedulerLink, configure_logging
from tagps.ps.protocol import (
    FLAG_AVERAGE,
    FLAG_WORKERS,
    MAX_CHUNKS,
    Op,
    ProtocolError,
    check_workers,
    describe_node,
    dtype_code,
    pack_header,
    pack_workers,
    routing_id,
    unpack_header,
)
from tagps.ps.transport import Security, resolve_host
from tagps.tag_pipe import write_tag

__all__ = ["Handle", "PSClient", "key_to_server"]

log = logging.getLogger(__name__)

#: Bit of a tensor index that marks a key of a worker subset (hashed from its name, see the module doc).
_SUBSET_INDEX = 1 << 47

_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), np.dtype(np.uint16)})


def _djb2(key: int) -> int:
    h = 5381
    for c in str(key).encode():
        h = (h * 33 + c) & 0xFFFFFFFFFFFFFFFF
    return h


def _sdbm(key: int) -> int:
    h = 0
    for c in str(key).encode():
        h = (c + (h << 6) + (h << 16) - h) & 0xFFFFFFFFFFFFFFFF
    return h


def key_to_server(key: int, num_servers: int, hash_fn: str) -> int:
    """Return the server rank of ``key`` under the ``djb2``, ``sdbm`` or ``naive`` hash (as BytePS does).

    ``balanced`` depends on the sizes of the keys declared before, so :class:`PSClient` computes it.
    """
    if hash_fn == "djb2":
        return _djb2(key) % num_servers
    if hash_fn == "sdbm":
        return _sdbm(key) % num_servers
    if hash_fn == "naive":
        return ((key >> 16) + (key % 65536)) * 9973 % num_servers
    raise ValueError(f"BYTEPS_KEY_HASH_FN={hash_fn!r} has no stateless key_to_server")


@dataclass
class _Chunk:
    key: int
    server: int
    start: int  # element offset in the flat buffer
    stop: int
    round: int = 0  # next round of the key; the cpp engine keeps its own and sets this one at declaration


@dataclass
class _Tensor:
    name: str
    nbytes: int
    dtype: np.dtype
    init: np.ndarray | None
    workers: tuple[int, ...] | None  # None: every worker
    index: int = -1
    chunks: list[_Chunk] = field(default_factory=list)
    active: Handle | None = None
    calls: int = 0  # push_pull calls so far: the tensor's step for BYTEPS_TRACE_*


class Handle:
    """An outstanding :meth:`PSClient.push_pull`; pass it to :meth:`PSClient.poll` or :meth:`PSClient.wait`.

    It keeps the buffer alive until the operation completes.
    """

    __slots__ = (
        "_client",
        "_done",
        "_native",
        "_notify",
        "_notify_lock",
        "average",
        "buffer",
        "error",
        "name",
        "priority",
        "remaining",
        "started",
        "step",
    )

    def __init__(self, client: PSClient, name: str, buffer: np.ndarray, average: bool, priority: int) -> None:
        self._client = client
        self.name = name
        self.buffer = buffer
        self.average = average
        self.priority = priority
        self.remaining = 0
        self.started = time.perf_counter()
        self.step = 0
        self.error: str | None = None
        self._done = threading.Event()
        self._native: Any = None  # the engine's PushPullOp (TAGPS_PS_ENGINE=cpp)
        self._notify = (-1, 0)  # (fd, tag) of notify(), without the engine
        self._notify_lock = threading.Lock()

    def __repr__(self) -> str:
        state = "done" if self._is_done() else "pending"
        return f"Handle({self.name!r}, {'failed' if self.error else state})"

    def notify(self, fd: int, tag: int) -> None:
        """Once finished (at once if it is), write the 8 bytes of ``tag`` into the non-blocking pipe ``fd``
        (:class:`~tagps.comm.handle.NotifyingWaitable`); ``fd`` -1 cancels."""
        if self._native is not None:
            self._native.notify(fd, tag)
            return
        with self._notify_lock:
            self._notify = (fd, tag)
            if fd >= 0 and self._done.is_set():
                write_tag(fd, tag)

    def _set_done(self) -> None:
        """Finish it (without the engine): wake its waits and write its notification."""
        with self._notify_lock:  # so that no write reaches an fd after notify(-1, ...) returned
            self._done.set()
            if self._notify[0] >= 0:
                write_tag(*self._notify)

    def _is_done(self) -> bool:
        """Whether it finished; copies the engine's failure reason into ``error``."""
        if self._native is None:
            return self._done.is_set()
        if not self._native.done():
            return False
        self.error = self._native.error
        return True

    def _wait(self, timeout: float | None) -> bool:
        """Block until finished (True) or ``timeout`` s passed (False); the engine waits without the GIL."""
        if self._native is None:
            return self._done.wait(timeout)
        return self._native.wait(timeout) and self._is_done()


class PSClient:
    """A worker machine's connection to the parameter servers.

    Args:
        config: the job's settings (role must be ``worker``).
    """

    def __init__(self, config: PSConfig) -> None:
        if config.role != "worker":
            raise ValueError(f"PSClient needs DMLC_ROLE=worker, got {config.role}")
        self.config = config
        self._engine: Any = None  # the C++ data plane (TAGPS_PS_ENGINE=cpp); it owns the server sockets
        self._ipc_warned = False
        self.worker_id = config.worker_id
        self.num_workers = config.num_workers
        keep_freed_buffers()  # pull replies arrive in fresh zmq buffers every round
        self._context = zmq.Context()
        self._security = Security(self._context, config.secret)
        self._link = SchedulerLink(self._context, self._security, config, "worker", resolve_host(config), 0)
        try:
            book = self._link.register()
        except BaseException:
            self._teardown()
            raise
        self.node_id = book.node_id
        #: ``(host, port)`` of every server, by rank.
        self.servers = book.servers
        try:
            if config.engine == "cpp":
                self._engine = self._start_engine()
                self._servers: list[zmq.Socket] = []
            else:
                self._servers = self._connect(book)
        except BaseException:
            self._teardown()
            raise
        self._tensors: dict[str, _Tensor] = {}
        self._pending: list[_Tensor] = []
        self._next_index = 0
        # Bytes per server for BYTEPS_KEY_HASH_FN=balanced, per worker set: every worker of a set sees the
        # same declarations of that set, but not of the sets it is not in.
        self._server_bytes: dict[tuple[int, ...] | None, list[int]] = {}
        self._subset_names: dict[int, str] = {}  # index -> name of the subset tensors: hash collisions
        self._api_lock = threading.Lock()  # serializes declaration points, barriers and close
        # User threads → I/O thread.
        self._commands: collections.deque[tuple[Any, ...]] = collections.deque()
        self._wake_endpoint = f"inproc://tagps-client-wake-{id(self)}"
        self._wake_in = self._context.socket(zmq.PULL)
        self._wake_in.bind(self._wake_endpoint)
        self._wake_out = self._context.socket(zmq.PUSH)
        self._wake_out.connect(self._wake_endpoint)
        self._wake_lock = threading.Lock()
        # I/O-thread state.
        self._queue: list[tuple[int, int, Handle, _Chunk]] = []
        self._seq = itertools.count()
        self._in_flight: dict[int, tuple[Handle, _Chunk]] = {}  # chunks whose pull is outstanding
        self._unacked = 0  # pushes not yet acknowledged: the scheduling credit in use
        self._inits: dict[int, tuple[threading.Event, list[int]]] = {}
        self._chunk_of: dict[int, _Chunk] = {}
        self._barrier_event: threading.Event | None = None
        self._shutdown_event: threading.Event | None = None
        self._fatal: str | None = None
        self._closed = False
        self._epoch = time.perf_counter()
        self._trace: list[dict[str, Any]] | None = [] if config.trace_on else None
        # The engine's push_pulls to trace: (name, step, started, bytes, PushPullOp).
        self._traced: list[tuple[str, int, float, int, Any]] = []
        self._thread = threading.Thread(target=self._io_loop, name="tagps-ps-client", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls) -> PSClient:
        """Read the ``DMLC_*``/``BYTEPS_*`` variables, register with the scheduler, connect to the servers."""
        config = ps_config()
        configure_logging(config, f"worker {config.worker_id}")
        return cls(config)

    # -- public API ---------------------------------------------------------------------------

    def declare(
        self,
        name: str,
        nbytes: int,
        dtype: Any,
        init: np.ndarray | None = None,
        workers: Sequence[int] | None = None,
    ) -> None:
        """Declare a tensor; its keys are assigned at the next declaration point (see the module doc).

        Args:
            name: unique name, the same on every worker that declares it.
            nbytes: size in bytes (a multiple of the element size; 0 makes push_pull a no-op).
            dtype: numpy dtype (``uint16`` holds bfloat16).
            init: initial value kept by the servers (used in async mode and with a server-side
                optimizer, where pulls return the stored weights); the lowest worker's wins. Default: zeros.
            workers: the worker ids (``DMLC_WORKER_ID``) that push and pull the tensor, this one included;
                only they declare it, all with the same set, and ``average`` divides by their number.
                Default ``None``: every worker.

        Raises:
            ValueError: duplicate name, bad size, ``init`` of the wrong size, a worker set that is empty,
                out of range or without this worker, or a name whose subset key is another name's.
            TypeError: unsupported dtype, or a size that is not an integer.
        """
        self._check_open()
        dt = np.dtype(dtype)
        dtype_code(dt)
        if not isinstance(name, str) or not name:
            raise ValueError("tensor name must be a non-empty string")
        if name in self._tensors or any(t.name == name for t in self._pending):
            raise ValueError(f"tensor {name!r} is already declared")
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
            raise TypeError(f"nbytes for {name!r} must be an integer, got {type(nbytes).__name__}")
        nbytes = int(nbytes)
        if nbytes < 0 or nbytes % dt.itemsize:
            raise ValueError(
                f"nbytes={nbytes!r} for {name!r} must be a non-negative multiple of {dt.itemsize}"
            )
        if init is not None:
            init = np.ascontiguousarray(init).reshape(-1)
            if init.dtype != dt or init.nbytes != nbytes:
                raise ValueError(
                    f"init for {name!r} must hold {nbytes} bytes of {dt}, got {init.nbytes} of {init.dtype}"
                )
        subset = None if workers is None else self._check_workers(name, workers)
        tensor = _Tensor(name, nbytes, dt, init, subset)
        count = -(-nbytes // self._chunk_bytes(tensor))
        if count > MAX_CHUNKS:
            raise ValueError(
                f"{name!r} needs {count} chunks of BYTEPS_PARTITION_BYTES={self.config.partition_bytes}, "
                f"more than {MAX_CHUNKS}; raise BYTEPS_PARTITION_BYTES"
            )
        if subset is not None:
            digest = hashlib.blake2b(name.encode(), digest_size=6).digest()
            tensor.index = _SUBSET_INDEX | int.from_bytes(digest, "little") & (_SUBSET_INDEX - 1)
            other = self._subset_names.get(tensor.index)
            if other is not None:
                raise ValueError(f"{name!r} and {other!r} hash to the same subset key; rename one")
            self._subset_names[tensor.index] = name
        self._pending.append(tensor)

    def _check_workers(self, name: str, workers: Sequence[int]) -> tuple[int, ...]:
        """Return ``workers`` as an ascending tuple, checked against the job and this worker."""
        if isinstance(workers, (str, bytes)) or not all(
            isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in workers
        ):
            raise TypeError(f"workers for {name!r} must be a sequence of worker ids, got {workers!r}")
        try:
            subset = check_workers(tuple(sorted({int(w) for w in workers})), self.num_workers)
        except ProtocolError as exc:
            raise ValueError(f"workers for {name!r}: {exc}") from None
        if self.worker_id not in subset:
            raise ValueError(
                f"worker {self.worker_id} declares {name!r} for the workers {list(subset)}: only the "
                "workers that push a tensor declare it"
            )
        return subset

    def flush_declarations(self) -> None:
        """Assign keys to the pending declarations and register them with the servers (collective)."""
        with self._api_lock:
            self._flush_locked()

    def push_pull(self, name: str, buffer: np.ndarray, average: bool = True, priority: int = 0) -> Handle:
        """Start summing ``buffer`` over the tensor's workers; the result lands in ``buffer`` in place.

        Do not touch ``buffer`` until :meth:`wait` returns: its bytes are sent zero-copy.

        Args:
            name: a declared tensor.
            buffer: C-contiguous, writable array of the declared dtype and size.
            average: have the servers divide the sum by the number of its workers (ignored in async mode and
                with a server-side optimizer, where the result is the stored weights).
            priority: lower values are sent first (default 0).

        Returns:
            A :class:`Handle`.

        Raises:
            ValueError: unknown name, wrong buffer, or the previous push_pull of ``name`` is unfinished.
            TypeError: wrong dtype, or ``average`` of an integer tensor.
            RuntimeError: the job failed.
        """
        self._check_open()
        if self._pending:
            self.flush_declarations()
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ValueError(f"tensor {name!r} was not declared")
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"buffer for {name!r} must be a numpy array, got {type(buffer).__name__}")
        if buffer.dtype != tensor.dtype:
            raise TypeError(f"buffer for {name!r} has dtype {buffer.dtype}, declared {tensor.dtype}")
        if buffer.nbytes != tensor.nbytes or not buffer.flags.c_contiguous or not buffer.flags.writeable:
            raise ValueError(
                f"buffer for {name!r} must be a writable C-contiguous array of {tensor.nbytes} bytes"
            )
        if average and tensor.dtype not in _FLOATS:
            raise TypeError(f"average=True needs a floating dtype; {name!r} is {tensor.dtype}")
        if tensor.active is not None and not tensor.active._is_done():
            raise ValueError(f"the previous push_pull of {name!r} has not completed; wait() for it first")
        handle = Handle(self, name, buffer.reshape(-1), average, int(priority))
        handle.remaining = len(tensor.chunks)
        handle.step = tensor.calls
        tensor.calls += 1
        tensor.active = handle
        if not tensor.chunks:
            handle._set_done()
        elif self._engine is not None:
            handle._native = self._engine.push_pull(tensor.index, handle.buffer, average, handle.priority)
            if self._trace is not None and self._traced_step(handle.step):
                self._traced.append((name, handle.step, handle.started, buffer.nbytes, handle._native))
        else:
            self._submit(("push_pull", handle, tensor))
        return handle

    def poll(self, handle: Handle) -> bool:
        """Return whether ``handle`` finished (successfully or not; :meth:`wait` raises on failure)."""
        self._own(handle)
        return handle._is_done()

    def wait(self, handle: Handle, timeout: float | None = None) -> None:
        """Block until ``handle`` finished; the result is then in its buffer.

        Raises:
            TimeoutError: not finished after ``timeout`` seconds.
            RuntimeError: the operation or the job failed (the message names the cause).
        """
        self._own(handle)
        if not handle._wait(timeout):
            raise TimeoutError(f"push_pull of {handle.name!r} did not finish within {timeout} s")
        if handle.error is not None:
            raise RuntimeError(f"push_pull of {handle.name!r} failed: {handle.error}")

    def barrier(self) -> None:
        """Block until every worker reached this barrier (also a declaration point)."""
        with self._api_lock:
            self._check_open()
            self._flush_locked()
            event = threading.Event()
            self._submit(("barrier", event))
            self._wait_event(event, "barrier")

    def close(self) -> None:
        """Finalize: wait until every worker closed, then release the sockets. Idempotent.

        A dead scheduler, server or worker ends the wait within ``PS_HEARTBEAT_TIMEOUT``; a worker that is
        alive but does not close is waited for at most ``PS_REGISTER_TIMEOUT`` (as long as nodes wait for
        the job to assemble), then this one leaves without the scheduler's SHUTDOWN, with a warning.
        """
        with self._api_lock:
            if self._closed:
                return
            self._closed = True
            if self._fatal is None and self._thread.is_alive():
                event = threading.Event()
                self._submit(("close", event))
                limit = self.config.register_timeout
                try:
                    if not self._wait_event(event, "close", limit):
                        log.warning(
                            "close: not every worker closed within %g s (PS_REGISTER_TIMEOUT); leaving "
                            "without the scheduler's SHUTDOWN",
                            limit,
                        )
                except RuntimeError as exc:
                    log.warning("close: %s", exc)
            self._submit(("stop",))
            self._thread.join()
            self._teardown()
            self._write_trace()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- user-thread helpers ------------------------------------------------------------------

    def _check_open(self) -> None:
        fatal = self._fatal or (self._engine.fatal if self._engine is not None else None)
        if fatal is not None:
            raise RuntimeError(f"the PS job failed: {fatal}")
        if self._closed:
            raise RuntimeError("PSClient is closed")

    def _own(self, handle: Handle) -> None:
        if not isinstance(handle, Handle) or handle._client is not self:
            raise ValueError(f"{handle!r} is not a handle of this PSClient")

    def _submit(self, command: tuple[Any, ...]) -> None:
        with self._wake_lock:
            self._commands.append(command)
            self._wake_out.send(b"")

    def _wait_event(self, event: threading.Event, what: str, timeout: float | None = None) -> bool:
        """Wait for ``event`` (at most ``timeout`` s); return whether it was set, or raise
        :class:`RuntimeError` when the client failed meanwhile (a failure sets every event)."""
        done = event.wait(timeout)
        if self._fatal is not None:
            raise RuntimeError(f"{what} failed: {self._fatal}")
        return done

    def _flush_locked(self) -> None:
        if not self._pending:
            return
        self._check_open()
        pending = sorted(self._pending, key=lambda t: t.name)
        self._pending = []
        for tensor in pending:
            count = -(-tensor.nbytes // self._chunk_bytes(tensor))
            if tensor.workers is None:
                tensor.index = self._next_index
                self._next_index += 1
            total = tensor.nbytes // tensor.dtype.itemsize
            for c in range(count):
                # Equal chunks (within one element) rather than full ones plus a remainder: a 4 MiB tensor
                # becomes 2 x 2 MiB, not 4096000 + 98304 bytes, so the server sums and returns the first
                # half while the second arrives (measured 2 workers x 1 server: 4.9 -> 4.3 ms).
                key = (tensor.index << 16) + c
                start, stop = c * total // count, (c + 1) * total // count
                server = self._pick_server(key, (stop - start) * tensor.dtype.itemsize, tensor.workers)
                tensor.chunks.append(_Chunk(key, server, start, stop))
            self._tensors[tensor.name] = tensor
        declared = [t for t in pending if t.chunks]
        if declared and self._engine is not None:
            self._declare_on_engine(declared)
        elif declared:
            event = threading.Event()
            self._submit(("declare", declared, event))
            self._wait_event(event, "declaration")

    def _declare_on_engine(self, tensors: list[_Tensor]) -> None:
        """INIT the chunks of ``tensors`` on the engine (blocking, without the GIL) and take their rounds."""
        specs = []
        for t in tensors:
            size = t.dtype.itemsize
            chunks = [(c.key, c.server, c.start * size, (c.stop - c.start) * size) for c in t.chunks]
            init = b"" if t.init is None else t.init.tobytes()
            specs.append((t.index, int(dtype_code(t.dtype)), list(t.workers or ()), init, chunks))
        try:
            rounds = iter(self._engine.declare(specs))
        except RuntimeError as exc:
            raise RuntimeError(f"declaration failed: {exc}") from None
        if self._engine.ipc_error is not None and not self._ipc_warned:
            self._ipc_warned = True
            log.warning("shared memory with co-located servers failed, using TCP: %s", self._engine.ipc_error)
        log.debug("%d chunks go through shared memory", self._engine.ipc_chunks)
        for t in tensors:
            for chunk in t.chunks:
                chunk.round = next(rounds)

    def _chunk_bytes(self, tensor: _Tensor) -> int:
        """Partition size for ``tensor``: BYTEPS_PARTITION_BYTES aligned down to its element size."""
        itemsize = tensor.dtype.itemsize
        return max(itemsize, self.config.partition_bytes // itemsize * itemsize)

    def _pick_server(self, key: int, nbytes: int, workers: tuple[int, ...] | None) -> int:
        loads = self._server_bytes.setdefault(workers, [0] * len(self.servers))
        if self.config.key_hash_fn == "balanced":
            server = min(range(len(self.servers)), key=lambda s: (loads[s], s))
        else:
            server = key_to_server(key, len(self.servers), self.config.key_hash_fn)
        loads[server] += nbytes
        return server

    # -- I/O thread ---------------------------------------------------------------------------

    def _start_engine(self) -> Any:
        keys = self._security.keys
        curve = None if keys is None else (keys.server_public, keys.client_public, keys.client_secret)
        # A server that advertises this worker's own address runs on this host (the emulated machines of
        # tagps.cluster each have their own): BytePS's IPC mode offers it the bytes in shared memory.
        own = self._link.host
        colocated = [self.config.ipc and host == own for host, _ in self.servers]
        return _core.PSClientEngine(
            self.node_id,
            [f"tcp://{host}:{port}" for host, port in self.servers],
            self.config.scheduling_credit,
            self.config.heartbeat_timeout,
            curve,
            colocated,
        )

    def _connect(self, book: AddressBook) -> list[zmq.Socket]:
        sockets = []
        for host, port in book.servers:
            sock = self._security.client(self._context.socket(zmq.DEALER))
            sock.setsockopt(zmq.ROUTING_ID, routing_id(self.node_id))
            sock.setsockopt(zmq.LINGER, 0)
            # A send that cannot be queued for this long means the server is unreachable: fail, never hang.
            sock.setsockopt(zmq.SNDTIMEO, int(self.config.heartbeat_timeout * 1000))
            sock.connect(f"tcp://{host}:{port}")
            sockets.append(sock)
        return sockets

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        poller.register(self._link.socket, zmq.POLLIN)
        for sock in self._servers:
            poller.register(sock, zmq.POLLIN)
        timeout_ms = max(10, int(self.config.heartbeat_interval * 500))
        try:
            while True:
                ready = dict(poller.poll(timeout_ms))
                if self._wake_in in ready and not self._run_commands():
                    return
                for rank, sock in enumerate(self._servers):
                    if sock in ready:
                        self._drain_server(rank, sock)
                if self._link.socket in ready:
                    self._on_scheduler()
                if self._engine is not None and self._engine.fatal is not None:
                    raise JobFailed(self._engine.fatal)  # a server's ERROR or an unreachable server
                self._pump()
                self._link.beat()
        except JobFailed as exc:
            self._fail_all(str(exc))
        except zmq.Again:
            self._fail_all(
                f"a send blocked for PS_HEARTBEAT_TIMEOUT={self.config.heartbeat_timeout:g} s: "
                "a server or the scheduler is unreachable"
            )
        except Exception as exc:  # never leave a waiter hanging on a bug
            log.exception("PS client I/O thread crashed")
            self._fail_all(f"internal error in the PS client: {exc!r}")
        # After a failure, fail whatever still arrives (a push_pull racing the failure) until "stop".
        while True:
            self._wake_in.recv()
            while self._commands:
                command = self._commands.popleft()
                if command[0] == "stop":
                    return
                self._fail_command(command, self._fatal or "the PS client stopped")

    def _run_commands(self) -> bool:
        while True:
            try:
                self._wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while self._commands:
            command = self._commands.popleft()
            kind = command[0]
            if kind == "push_pull":
                _, handle, tensor = command
                for chunk in tensor.chunks:
                    heapq.heappush(self._queue, (handle.priority, next(self._seq), handle, chunk))
            elif kind == "declare":
                self._send_inits(command[1], command[2])
            elif kind == "barrier":
                self._barrier_event = command[1]
                self._link.request_barrier("workers")
            elif kind == "close":
                self._shutdown_event = command[1]
                self._link.finalize()
            elif kind == "stop":
                return False
        return True

    def _send_inits(self, tensors: list[_Tensor], event: threading.Event) -> None:
        keys = []
        for tensor in tensors:
            code = dtype_code(tensor.dtype)
            flags = 0 if tensor.workers is None else FLAG_WORKERS
            for chunk in tensor.chunks:
                nbytes = (chunk.stop - chunk.start) * tensor.dtype.itemsize
                # The declared size travels in nbytes; the worker set, when given, and the initial value,
                # when given, as payload frames in that order.
                frames: list[Any] = [
                    pack_header(
                        Op.INIT, sender=self.node_id, key=chunk.key, dtype=code, nbytes=nbytes, flags=flags
                    )
                ]
                if tensor.workers is not None:
                    frames.append(pack_workers(tensor.workers))
                if tensor.init is not None:
                    frames.append(tensor.init[chunk.start : chunk.stop])
                self._servers[chunk.server].send_multipart(frames, copy=False)
                self._chunk_of[chunk.key] = chunk
                keys.append(chunk.key)
        pending = (event, [len(keys)])
        for key in keys:
            self._inits[key] = pending

    def _pump(self) -> None:
        credit = self.config.scheduling_credit
        while self._queue and self._unacked < credit:
            _, _, handle, chunk = heapq.heappop(self._queue)
            if handle.error is not None:
                continue
            view = handle.buffer[chunk.start : chunk.stop]
            code = dtype_code(view.dtype)
            flags = FLAG_AVERAGE if handle.average else 0
            push = pack_header(
                Op.PUSH,
                sender=self.node_id,
                key=chunk.key,
                round=chunk.round,
                dtype=code,
                nbytes=view.nbytes,
                flags=flags,
            )
            sock = self._servers[chunk.server]
            sock.send_multipart([push, view], copy=False)
            sock.send(pack_header(Op.PULL, sender=self.node_id, key=chunk.key, round=chunk.round, dtype=code))
            self._in_flight[chunk.key] = (handle, chunk)
            self._unacked += 1

    def _drain_server(self, rank: int, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                header = unpack_header(frames[0].buffer)
            except ProtocolError as exc:
                raise JobFailed(f"bad message from server {rank}: {exc}") from None
            if header.op == Op.PULL_REPLY:
                self._on_pull_reply(header, frames)
            elif header.op == Op.PUSH_ACK:
                self._unacked -= 1
            elif header.op == Op.INIT_ACK:
                self._on_init_ack(rank, header)
            elif header.op == Op.ERROR:
                self._on_error(rank, header, frames)
            else:
                raise JobFailed(f"unexpected {Op(header.op).name} from server {rank}")

    def _on_pull_reply(self, header: Any, frames: list[Any]) -> None:
        entry = self._in_flight.pop(header.key, None)
        if entry is None:
            raise JobFailed(f"PULL_REPLY for key {header.key}, which has no pull in flight")
        handle, chunk = entry
        view = handle.buffer[chunk.start : chunk.stop]
        if len(frames) != 2 or header.round != chunk.round or len(frames[1].buffer) != view.nbytes:
            raise JobFailed(f"malformed PULL_REPLY for key {header.key} round {header.round}")
        np.copyto(view, np.frombuffer(frames[1].buffer, view.dtype))
        chunk.round += 1
        handle.remaining -= 1
        if handle.remaining == 0:
            handle._set_done()
            if self._trace is not None and self._traced_step(handle.step):
                self._trace.append(
                    self._trace_event(
                        handle.name, handle.step, handle.started, time.perf_counter(), handle.buffer.nbytes
                    )
                )

    def _on_init_ack(self, rank: int, header: Any) -> None:
        pending = self._inits.pop(header.key, None)
        if pending is None:
            raise JobFailed(f"INIT_ACK for key {header.key}, which was not declared")
        self._chunk_of[header.key].round = header.round
        event, left = pending
        left[0] -= 1
        if left[0] == 0:
            event.set()

    def _on_error(self, rank: int, header: Any, frames: list[Any]) -> None:
        # A rejected request leaves its key out of step with the other workers: fail the whole client.
        reason = bytes(frames[1].buffer).decode(errors="replace") if len(frames) > 1 else "no reason given"
        raise JobFailed(
            f"server {rank} rejected a request for key {header.key} round {header.round}: {reason}"
        )

    def _on_scheduler(self) -> None:
        while self._link.socket.poll(0):
            op, _ = self._link.receive()
            if op == Op.BARRIER_DONE and self._barrier_event is not None:
                self._barrier_event.set()
                self._barrier_event = None
            elif op == Op.SHUTDOWN and self._shutdown_event is not None:
                self._shutdown_event.set()
                self._shutdown_event = None

    def _fail_all(self, reason: str) -> None:
        self._fatal = reason
        log.error("%s: %s", describe_node(self.node_id), reason)
        if self._engine is not None:
            self._engine.fail(reason)
        for handle, _ in self._in_flight.values():
            handle.error = reason
            handle._set_done()
        for _, _, handle, _ in self._queue:
            handle.error = reason
            handle._set_done()
        for event, _ in self._inits.values():
            event.set()
        for event in (self._barrier_event, self._shutdown_event):
            if event is not None:
                event.set()
        for command in list(self._commands):
            self._fail_command(command, reason)

    @staticmethod
    def _fail_command(command: tuple[Any, ...], reason: str) -> None:
        for item in command[1:]:
            if isinstance(item, threading.Event):
                item.set()
            if isinstance(item, Handle):
                item.error = reason
                item._set_done()

    def _traced_step(self, step: int) -> bool:
        return self.config.trace_start_step <= step <= self.config.trace_end_step

    def _trace_event(
        self, name: str, step: int, started: float, finished: float, nbytes: int
    ) -> dict[str, Any]:
        """A Chrome trace event of a completed push_pull (times from time.perf_counter())."""
        return {
            "name": name,
            "ph": "X",
            "pid": self.worker_id,
            "tid": 0,
            "ts": (started - self._epoch) * 1e6,
            "dur": (finished - started) * 1e6,
            "args": {"step": step, "bytes": nbytes},
        }

    def _write_trace(self) -> None:
        """Write the push_pull timeline (Chrome trace format) to BYTEPS_TRACE_DIR/<worker_id>/comm.json."""
        if self._trace is None:
            return
        for name, step, started, nbytes, op in self._traced:  # successful ones only, as the I/O thread does
            if op.done() and op.error is None:
                self._trace.append(self._trace_event(name, step, started, op.finished_at, nbytes))
        path = Path(self.config.trace_dir) / str(self.worker_id) / "comm.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"traceEvents": self._trace, "displayTimeUnit": "ms"}))
        log.info("push_pull trace of %d events written to %s", len(self._trace), path)

    def _teardown(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._security.close()
        if not self._context.closed:
            self._context.destroy(linger=0)
