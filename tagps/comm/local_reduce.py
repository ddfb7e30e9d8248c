"""Intra-machine reduction through shared memory (BytePS's communication service, CPU side).

The participating processes of one machine (its local ranks) each copy a tensor into their own slot of a
shared-memory arena (a file in ``/dev/shm``). When every slot is filled, each participant sums one shard of
the tensor (reduce-scatter style; a tensor of at most :data:`ROOT_SUMS_BYTES` the root sums alone, see
below) in one C++ call (:meth:`tagps.comm.arena.ShmArena.reduce_shard`:
the kernels of :func:`tagps.kernels.sum_into` with the GIL released), following the machine's topology: inside
each group of local ranks (a PCIe switch or a NUMA node, from ``BYTEPS_PCIE_SWITCH_SIZE`` or
``TAGPS_LOCAL_TOPOLOGY``) into the group leader's slot first, then the group results into the arena's result
row. The machine's root (local rank 0) then hands the result row to ``cross`` (the push and pull to the
summation servers) and, when that completed, every participant copies it back into its tensor. (The result has
its own row because the root refills its input slot for the next round while the others may still be copying
the previous result out.) An arena reserves its whole size when it is created, so a full ``/dev/shm`` fails
that tensor's reduction with :class:`tagps.comm.arena.ArenaFull` instead of a SIGBUS. A machine with a single
participant skips all of this: its tensor is the local sum, handed to ``cross`` in place.

Coordination of a tensor above :data:`ROOT_SUMS_BYTES` is a small message protocol over ZeroMQ on loopback,
driven by one service thread per process; the root counts ``ready`` and ``reduced`` messages per tensor
name and answers ``reduce`` and ``done``. Tensor names are the keys, so participants may submit in
different orders. A tensor of at most that size, which the root sums alone, takes no message and no
service thread on the other participants: the submitting thread writes its slot, marks it ready for the
round in the arena's control block and writes a byte into the root's doorbell (a FIFO next to the arenas,
which the root's service thread polls beside its sockets), and ``wait()`` sleeps on a futex until the root
publishes the round. Each message and service-thread wake-up cost hundreds of microseconds of CPU per call
on a quota'd core (the ``ps_local_call_s`` that calibration measures), and small tensors are most calls.

The root's socket listens on loopback, where any local process can connect. Every message to it therefore
starts with a random per-reducer token that the root hands to the participants through the collective
setup (``all_gather_object``), and names its sender; the root answers a participant on the connection that
last sent it an authenticated message. A message without the token, from an unknown participant, or
malformed (too few frames, a bad number, a name with no round) is logged and dropped: the service thread
never dies of one. When the service thread fails for any other reason, the root tells every participant
of each unfinished round (and fails the arenas of small tensors, which wakes their futex waits), so their
``wait()`` raises at once instead of after the timeout.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import os
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import zmq

from tagps.comm.arena import ALL_READY, DONE, FAILED, NOT_READY, ShmArena
from tagps.comm.collectives import run_blocking
from tagps.comm.handle import (
    WAIT_SLICE_S,
    CompletedWork,
    NotifyingWaitable,
    Waitable,
    raise_if_failed,
    timed_out,
    wait_sliced,
)
from tagps.tag_pipe import open_tag_pipe, read_tags

__all__ = ["LocalReducer", "ReductionFuture", "shard_bounds"]

log = logging.getLogger(__name__)

# Up to this size the root sums every slot itself: a shard for each participant costs two more messages
# and wake-ups per participant and call (hundreds of microseconds of CPU on a quota'd core), more than
# summing 256 KiB from a few slots (tens of microseconds).
ROOT_SUMS_BYTES = 256 << 10
_ROUNDS = 1 << 32  # the arena's round counters wrap around here


def _root_sums_alone(nbytes: int) -> bool:
    """Whether a tensor of ``nbytes`` takes the small path: the root sums every slot, no shard messages."""
    return nbytes <= ROOT_SUMS_BYTES


class _Malformed(Exception):
    """A message the service drops: unauthenticated, from an unknown sender, or not of the protocol."""


def shard_bounds(count: int, parts: int, index: int, align: int = 16) -> tuple[int, int]:
    """Return the ``[start, stop)`` element range of shard ``index`` of ``parts`` (aligned starts)."""
    per = -(-count // parts)
    per = -(-per // align) * align
    start = min(count, index * per)
    return start, min(count, start + per)


class ReductionFuture:
    """Completion of one tensor's reduction; ``wait()`` raises what failed, or after ``timeout``, or
    :class:`~tagps.comm.handle.PeerFailed` as soon as a peer process is known dead."""

    def __init__(self, name: str, timeout: float) -> None:
        self._name = name
        self._timeout = timeout
        self._event = threading.Event()
        self._error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        wait_sliced(self._event.wait, self._timeout, self._timed_out)
        self._raise_error()

    def _timed_out(self) -> RuntimeError:
        return timed_out(
            f"reduction of {self._name!r}", self._timeout, "; did another local rank exit or skip it?"
        )

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"reduction of {self._name!r} failed: {self._error}") from self._error


class _SmallRound(ReductionFuture):
    """A participant's round of a tensor the root sums alone: ``wait()`` sleeps on the arena's futex (GIL
    released) and copies the result out; the service thread only ever calls :meth:`set` (a "fail")."""

    def __init__(
        self,
        name: str,
        timeout: float,
        arena: ShmArena,
        seq: int,
        tensor: torch.Tensor,
        on_end: Callable[[], None],
    ) -> None:
        super().__init__(name, timeout)
        self._arena = arena
        self._seq = seq
        self._tensor = tensor
        self._on_end = on_end
        self._finished = False

    def is_completed(self) -> bool:
        return self._finished or self._event.is_set() or self._arena.done(self._seq)

    def wait(self) -> None:
        if self._finished:
            return
        try:
            wait_sliced(self._wait_slice, self._timeout, self._timed_out)
            if not self._finished:
                self._raise_error()
        finally:
            self._on_end()

    def _wait_slice(self, seconds: float) -> bool:
        if self._event.is_set():  # the service thread's "fail"
            return True
        state = self._arena.wait_done(self._seq, seconds)
        if state == DONE:
            self._arena.read_result(self._tensor)
            self._finished = True
            return True
        if state == FAILED:  # the root's "fail", with its reason, follows on the socket
            if not self._event.wait(1.0):
                raise RuntimeError(f"reduction of {self._name!r} failed: the local root failed")
            return True
        return False


@dataclass
class _RootRound:
    """What the root knows about the current round of one tensor name."""

    ready: set[int] = field(default_factory=set)
    reduced: set[int] = field(default_factory=set)
    shape: tuple[str, int] | None = None
    priority: int = 0
    cross: NotifyingWaitable | None = None  # its push and pull, once the local sum is done
    crossing_since: float = 0.0  # time.monotonic() when they started
    seq: int | None = None  # a tensor the root sums alone: the arena round it publishes when done


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(dtype_name: str) -> int:
    """Bytes per element of a dtype named as :func:`_dtype_name` names it; :class:`_Malformed` otherwise."""
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise _Malformed(f"{dtype_name[:32]!r} is not a dtype")
    return dtype.itemsize


def _text(frame: bytes) -> str:
    """A message frame as text; :class:`_Malformed` unless it is UTF-8."""
    try:
        return frame.decode()
    except UnicodeDecodeError:
        raise _Malformed("a frame that is not UTF-8 text") from None


def _number(frame: bytes) -> int:
    """A message frame as a non-negative decimal integer; :class:`_Malformed` otherwise."""
    if not frame.isdigit() or len(frame) > 20:
        raise _Malformed(f"{frame[:32]!r} is not a count")
    return int(frame)


class LocalReducer:
    """Sum tensors over the participating local ranks of this machine, and across machines via ``cross``.

    Construction is collective over the whole ``torch.distributed`` world (the root's endpoint travels by
    ``all_gather_object``); every process of the job must construct it, participant or not. A peer that dies
    before it does is named (:class:`~tagps.comm.handle.PeerFailed`) within ``PS_HEARTBEAT_TIMEOUT``.

    Args:
        participants: local ranks that take part, ascending; the first is the machine's root. Empty when
            none of this machine's processes takes part (a sum over other machines' ranks only).
        groups: topology groups of those local ranks (each reduces into its first rank first).
        local_rank: this process's local rank.
        machine: this process's machine id (``DMLC_WORKER_ID``).
        cross: on the root, called with ``(name, result, priority)`` after the local sum; returns a work
            whose completion means ``result`` holds the sum over every machine, and which notifies the
            service thread of it (:class:`~tagps.comm.handle.NotifyingWaitable`). ``None``: one machine.
        timeout: seconds a reduction may take before ``wait()`` raises.
        shm_dir: where the arenas live (``/dev/shm``).
    """

    def __init__(
        self,
        participants: Sequence[int],
        groups: Sequence[Sequence[int]],
        local_rank: int,
        machine: int,
        cross: Callable[[str, torch.Tensor, int], NotifyingWaitable] | None,
        timeout: float,
        shm_dir: str = "/dev/shm",
    ) -> None:
        self._participants = list(participants)
        self._index = {r: i for i, r in enumerate(self._participants)}
        self._me = self._index.get(local_rank)
        self._root = self._me == 0
        root_rank = self._participants[0] if self._participants else None
        ordered = sorted(
            ([r for r in g if r in self._index] for g in groups), key=lambda g: root_rank not in g
        )
        self._groups = [
            [self._index[r] for r in sorted(g, key=lambda r: r != root_rank)] for g in ordered if g
        ]
        self._cross = cross
        self._timeout = timeout
        self._ctx = zmq.Context.instance()
        endpoint = None
        job = None
        token = None
        self._bell = -1  # the doorbell FIFO: the root reads it, the other participants write it
        self._bell_path = ""
        if self._root:
            self._sock = self._ctx.socket(zmq.ROUTER)
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
            endpoint = f"tcp://127.0.0.1:{port}"
            job = uuid.uuid4().hex[:12]
            token = secrets.token_bytes(16)
            if len(self._participants) > 1:
                self._bell_path = os.path.join(shm_dir, f"tagps-{job}-m{machine}-bell")
                os.mkfifo(self._bell_path, 0o600)
                # Read-write, so that the FIFO never reads as closed while no participant has it open.
                self._bell = os.open(self._bell_path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        everyone: list[Any] = [None] * dist.get_world_size()
        mine = (machine, local_rank, endpoint, job, token)
        try:  # a peer that dies meanwhile is named within PS_HEARTBEAT_TIMEOUT, not TAGPS_DIST_TIMEOUT
            run_blocking(lambda: dist.all_gather_object(everyone, mine))
        except BaseException:
            if self._root:
                self._sock.close(linger=0)
                if self._bell >= 0:
                    os.close(self._bell)
                self._unlink_bell()
            raise
        self._arenas: dict[str, ShmArena] = {}
        self._waiting: dict[str, tuple[torch.Tensor, ReductionFuture]] = {}
        self._rounds: dict[str, _RootRound] = {}
        # Root: the rounds whose push and pull are in flight, by the tag each writes into the notification
        # pipe when it ends (NotifyingWaitable), which the service thread polls beside its sockets.
        self._crossing: dict[int, str] = {}
        self._tags = itertools.count()
        self._notify_r = self._notify_w = -1
        self._next_check = 0.0  # when the service next looks for crossing rounds past their deadline
        self._seq: dict[str, int] = {}  # the last round of each tensor the root sums alone
        self._pending: set[str] = set()  # root: such tensors whose round not every participant marked ready
        self._small: dict[str, _SmallRound] = {}  # other participants: such rounds waited for
        self._tasks: queue.SimpleQueue[tuple[str, torch.Tensor, int, ReductionFuture] | None] = (
            queue.SimpleQueue()
        )
        self._error: BaseException | None = None
        self._routes: dict[int, bytes] = {}  # root: participant -> its connection's routing id
        if self._me is None:
            return
        root_info = next(e for e in everyone if e[0] == machine and e[1] == root_rank)
        self._prefix = os.path.join(shm_dir, f"tagps-{root_info[3]}-m{machine}-")
        self._token: bytes = root_info[4]
        if not self._root:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.connect(root_info[2])
            bell = os.path.join(shm_dir, f"tagps-{root_info[3]}-m{machine}-bell")
            self._bell = os.open(bell, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self._to_root(b"hello")  # so that the root can reach this participant before it sends anything
        self._sock.setsockopt(zmq.LINGER, 0)
        self._wake_addr = f"inproc://tagps-local-reduce-{id(self)}"
        self._wake_pull = self._ctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._wake_push = self._ctx.socket(zmq.PUSH)
        self._wake_push.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        if self._root and cross is not None:
            self._notify_r, self._notify_w = open_tag_pipe()
        self._thread = threading.Thread(target=self._serve, name="tagps-local-reduce", daemon=True)
        self._thread.start()

    @property
    def participating(self) -> bool:
        """Whether this process takes part in the reduction (on GPUs only switch leaders do)."""
        return self._me is not None

    def submit(self, name: str, tensor: torch.Tensor, priority: int = 0) -> Waitable:
        """Start summing the contiguous CPU ``tensor`` in place; the same ``name`` on every participant."""
        if self._me is None:
            raise RuntimeError("this local rank does not take part in the shared-memory reduction")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{name!r}: the shared-memory reduction needs a contiguous CPU tensor")
        if self._error is not None:
            raise RuntimeError(f"the local reduction service failed earlier: {self._error}")
        if len(self._participants) == 1 and tensor.numel() > 0:
            # Alone on this machine the local sum is the tensor itself: push and pull it in place, without
            # the arena's three copies (in, result row, out) and the service thread's round trip.
            return self._cross(name, tensor, priority) if self._cross is not None else CompletedWork()
        future = ReductionFuture(name, self._timeout)
        if tensor.numel() == 0:
            future.set()
            return future
        if not self._root and _root_sums_alone(tensor.numel() * tensor.element_size()):
            return self._submit_small(name, tensor)
        self._tasks.put((name, tensor, priority, future))
        self._wake()
        return future

    def _submit_small(self, name: str, tensor: torch.Tensor) -> Waitable:
        """A participant's round of a tensor the root sums alone, on the calling thread: write the slot,
        mark it ready and ring the root's doorbell."""
        if name in self._small:
            raise RuntimeError(f"{name!r} is already being reduced; wait for it before resubmitting")
        try:
            arena = self._arena(name, tensor.dtype, tensor.numel())
            arena.write(self._me, tensor)  # type: ignore[arg-type]
        except Exception as exc:  # refused before anyone saw it, as the service thread refuses a big one
            refused = ReductionFuture(name, self._timeout)
            refused.set(exc)
            return refused
        seq = self._next_round(name)
        future = _SmallRound(name, self._timeout, arena, seq, tensor, lambda: self._small.pop(name, None))
        self._small[name] = future
        arena.mark_ready(self._me, seq)  # type: ignore[arg-type]
        with contextlib.suppress(BlockingIOError, BrokenPipeError):  # full: the root has bytes to read
            os.write(self._bell, b"\0")  # gone: the wait names the dead root (PeerFailed)
        return future

    def _next_round(self, name: str) -> int:
        seq = (self._seq.get(name, 0) + 1) % _ROUNDS
        self._seq[name] = seq
        return seq

    def close(self) -> None:
        """Stop the service thread and remove this process's view of the arenas."""
        if self._me is None:
            return
        self._tasks.put(None)
        self._wake()
        self._thread.join(timeout=10)
        for name in list(self._crossing.values()):  # no notification may reach the pipe's fds once reused
            self._rounds[name].cross.notify(-1, 0)  # type: ignore[union-attr]  # set while crossing
        for fd in (self._notify_r, self._notify_w):
            if fd >= 0:
                os.close(fd)
        self._notify_r = self._notify_w = -1
        if self._root:
            for arena in self._arenas.values():
                arena.unlink()
            self._unlink_bell()
        if self._bell >= 0:
            os.close(self._bell)
            self._bell = -1
        self._arenas.clear()  # each mapping goes with the last view of it
        for s in (self._sock, self._wake_pull, self._wake_push):
            s.close(linger=0)

    # ----------------------------------------------------------------------------------- service thread
    def _wake(self) -> None:
        with self._wake_lock:
            self._wake_push.send(b"")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        if self._root and self._bell >= 0:
            poller.register(self._bell, zmq.POLLIN)
        if self._notify_r >= 0:
            poller.register(self._notify_r, zmq.POLLIN)
        try:
            while True:
                # While pushes and pulls are in flight, wake in WAIT_SLICE_S slices to look for a dead peer.
                events = dict(poller.poll(WAIT_SLICE_S * 1000 if self._crossing else 1000))
                # One message per socket and poll: draining with ``while sock.poll(0)`` (pyzmq builds a
                # Poller per call) or with non-blocking receives until zmq.Again (an exception per drain)
                # cost the service thread more CPU than the next poll does.
                if self._wake_pull in events:
                    self._wake_pull.recv()
                    while not self._tasks.empty():
                        task = self._tasks.get()
                        if task is None:
                            return
                        self._start(*task)
                if self._sock in events:
                    try:
                        self._on_message(self._sock.recv_multipart())
                    except _Malformed as exc:
                        log.warning("local reduction dropped a message: %s", exc)
                if self._root and self._bell in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._bell, 1 << 16)
                    self._check_pending()
                if self._notify_r >= 0 and self._notify_r in events:
                    self._on_crossed()
                if self._crossing:
                    self._check_crossing()
        except BaseException as exc:  # every pending wait() must see it instead of timing out
            self._error = exc
            log.exception("the local reduction service failed")
            if self._root:  # the other participants' waits too
                for name in list(self._rounds):  # a pending round is among them
                    with contextlib.suppress(Exception):
                        self._broadcast(b"fail", name.encode(), f"the local root failed: {exc!r}".encode())
                for arena in self._arenas.values():  # wakes the waits of the tensors the root sums alone
                    arena.fail()
            for _, future in self._waiting.values():
                future.set(exc)
            self._waiting.clear()
            while not self._tasks.empty():  # submitted but not started: they would wait for the timeout
                task = self._tasks.get()
                if task is not None:
                    task[3].set(exc)

    def _arena(self, name: str, dtype: torch.dtype, count: int) -> ShmArena:
        arena = self._arenas.get(name)
        if arena is not None:
            if (arena.dtype, arena.count) != (dtype, count):
                raise ValueError(
                    f"{name!r} was reduced as {arena.count} x {arena.dtype} before, now {count} x {dtype}"
                )
            return arena
        path = self._prefix + uuid.uuid5(uuid.NAMESPACE_URL, name).hex
        arena = ShmArena(path, dtype, len(self._participants), count)
        self._arenas[name] = arena
        return arena

    def _start(self, name: str, tensor: torch.Tensor, priority: int, future: ReductionFuture) -> None:
        if name in self._waiting:
            future.set(RuntimeError(f"{name!r} is already being reduced; wait for it before resubmitting"))
            return
        try:
            self._arena(name, tensor.dtype, tensor.numel()).write(self._me, tensor)
        except Exception as exc:  # this tensor is refused before anyone saw it; the service goes on
            future.set(exc)
            return
        # From here the round is shared: a failure (the root's own reduction, run inline) fails the service,
        # which tells every participant, as a failure on a socket message does.
        self._waiting[name] = (tensor, future)
        shape = (_dtype_name(tensor.dtype), tensor.numel())
        if self._root and _root_sums_alone(tensor.numel() * tensor.element_size()):
            seq = self._next_round(name)
            self._arenas[name].mark_ready(0, seq)
            self._pending.add(name)
            self._rounds[name] = _RootRound(priority=priority, seq=seq)
            self._check_pending()
        elif self._root:
            self._on_ready(name, 0, shape, priority)
        else:
            self._to_root(b"ready", name.encode(), shape[0].encode(), str(shape[1]).encode())

    def _to_root(self, *parts: bytes) -> None:
        self._sock.send_multipart([self._token, str(self._me).encode(), *parts])

    def _send(self, member: int, *parts: bytes) -> None:
        if member == 0:
            # The root's own copy: a "fail" may name a tensor the root has not submitted yet.
            with contextlib.suppress(_Malformed):
                self._on_command([*parts])
        elif member in self._routes:
            self._sock.send_multipart([self._routes[member], *parts])
        else:  # its hello has not arrived yet (a "fail" to a participant still starting)
            log.warning("local reduction: participant %d has not connected; %r not sent", member, parts[0])

    def _broadcast(self, *parts: bytes) -> None:
        for member in range(1, len(self._participants)):
            self._send(member, *parts)
        self._send(0, *parts)

    def _on_message(self, frames: list[bytes]) -> None:
        """Handle a message from the socket; raises :class:`_Malformed` for one to drop."""
        if not self._root:
            self._on_command(frames)
            return
        # [routing id, token, participant, kind, name, ...]
        if len(frames) < 4 or not hmac.compare_digest(frames[1], self._token):
            raise _Malformed("not authenticated with this reducer's token")
        member = _number(frames[2])
        if not 0 < member < len(self._participants):
            raise _Malformed(f"sender {member} is not a participant")
        kind, args = frames[3], frames[4:]
        if kind == b"hello" and not args:
            self._routes[member] = frames[0]
            if len(self._routes) == len(self._participants) - 1:
                self._unlink_bell()  # every participant has opened it
                self._check_pending()
        elif kind == b"ready" and len(args) == 3:
            name, shape = _text(args[0]), (_text(args[1]), _number(args[2]))
            if _root_sums_alone(shape[1] * _itemsize(shape[0])):
                raise _Malformed(f"{name!r}: a tensor the root sums alone is marked ready in its arena")
            rnd = self._rounds.get(name)
            if rnd is not None and (member in rnd.ready or rnd.reduced):
                raise _Malformed(f"participant {member} is not due to be ready for {name!r}")
            self._routes[member] = frames[0]
            self._on_ready(name, member, shape, 0)
        elif kind == b"reduced" and len(args) == 1:
            name = _text(args[0])
            rnd = self._rounds.get(name)
            if rnd is None or len(rnd.ready) < len(self._participants) or member in rnd.reduced:
                raise _Malformed(f"participant {member} is not due to have reduced {name!r}")
            self._routes[member] = frames[0]
            self._on_reduced(name, member)
        else:
            raise _Malformed(f"unknown message {kind[:32]!r} with {len(args)} arguments")

    def _on_ready(self, name: str, member: int, shape: tuple[str, int], priority: int) -> None:
        rnd = self._rounds.setdefault(name, _RootRound())
        if rnd.shape is None:
            rnd.shape = shape
        elif rnd.shape != shape:
            self._broadcast(
                b"fail", name.encode(), f"local ranks disagree on {name!r}: {rnd.shape} vs {shape}".encode()
            )
            del self._rounds[name]
            return
        if member == 0:
            rnd.priority = priority
        rnd.ready.add(member)
        if len(rnd.ready) == len(self._participants):
            # Every participant has mapped the arena by now: unlink it so that no crash can leak it.
            self._arenas[name].unlink()
            self._broadcast(b"reduce", name.encode())

    def _check_pending(self) -> None:
        """Sum every tensor the root sums alone whose slots are all marked ready for its round."""
        if len(self._routes) < len(self._participants) - 1:
            return  # until every participant's hello: a "fail" could not reach them (this runs again then)
        for name in list(self._pending):
            arena = self._arenas[name]
            state = arena.all_ready(self._rounds[name].seq)  # type: ignore[arg-type]  # set for these rounds
            if state == NOT_READY:
                continue
            self._pending.remove(name)
            arena.unlink()  # every participant has mapped it by now: no crash can leak it
            if state != ALL_READY:
                del self._rounds[name]
                reason = (
                    f"local ranks disagree on {name!r}: not all of them hold {arena.count} x {arena.dtype}"
                )
                self._broadcast(b"fail", name.encode(), reason.encode())
                arena.fail()
                continue
            arena.reduce_shard(self._groups, 0, arena.count)
            self._all_reduced(name)

    def _on_reduced(self, name: str, member: int) -> None:
        rnd = self._rounds[name]
        rnd.reduced.add(member)
        if len(rnd.reduced) == len(self._participants):
            self._all_reduced(name)

    def _all_reduced(self, name: str) -> None:
        """The local sum of ``name`` is in its arena's result row: push and pull it, or finish the round."""
        rnd = self._rounds[name]
        if self._cross is None:
            self._finish(name)
        else:
            rnd.cross = self._cross(name, self._arenas[name].result, rnd.priority)
            rnd.crossing_since = time.monotonic()
            tag = next(self._tags)
            self._crossing[tag] = name
            # The push and pull write the tag into the pipe when they end: no thread of ours waits for
            # them (a waiter thread per round cost the root 70-77 us of CPU per call on a quota'd core).
            rnd.cross.notify(self._notify_w, tag)

    def _on_crossed(self) -> None:
        """Finish the rounds whose push and pull ended, as their tags in the notification pipe say."""
        for tag in read_tags(self._notify_r, len(self._crossing)):
            name = self._crossing.pop(tag)
            self._rounds[name].cross.wait()  # type: ignore[union-attr]  # done: raises its failure
            self._finish(name)

    def _check_crossing(self) -> None:
        """Every WAIT_SLICE_S while pushes and pulls are in flight: raise a peer's reported failure, or a
        push and pull past the timeout, which fails the service and every wait."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + WAIT_SLICE_S
        raise_if_failed()
        for name in self._crossing.values():
            if now - self._rounds[name].crossing_since > self._timeout:
                raise timed_out(f"push_pull of {name!r}", self._timeout)

    def _finish(self, name: str) -> None:
        rnd = self._rounds.pop(name)
        if rnd.seq is None:
            self._broadcast(b"done", name.encode())
            return
        self._arenas[name].publish(rnd.seq)
        self._send(0, b"done", name.encode())

    def _unlink_bell(self) -> None:
        if self._bell_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._bell_path)
            self._bell_path = ""

    def _on_command(self, frames: list[bytes]) -> None:
        """Handle a command of the root (over the socket, or the root's own); raises :class:`_Malformed`."""
        if len(frames) >= 2 and frames[0] == b"fail" and (small := self._small.pop(_text(frames[1]), None)):
            small.set(RuntimeError(frames[2].decode(errors="replace") if len(frames) > 2 else "failed"))
            return
        if len(frames) < 2 or _text(frames[1]) not in self._waiting:
            raise _Malformed("a command for no tensor being reduced here")
        kind, name = frames[0], _text(frames[1])
        tensor, future = self._waiting[name]
        arena = self._arenas[name]
        if kind == b"reduce":
            start, stop = shard_bounds(arena.count, len(self._participants), self._me)  # type: ignore[arg-type]
            arena.reduce_shard(self._groups, start, stop)
            if self._root:
                self._on_reduced(name, 0)
            else:
                self._to_root(b"reduced", name.encode())
        elif kind == b"done":
            arena.read_result(tensor)
            del self._waiting[name]
            future.set()
        elif kind == b"fail":
            del self._waiting[name]
            future.set(RuntimeError(frames[2].decode(errors="replace") if len(frames) > 2 else "failed"))
        else:
            raise _Malformed(f"unknown command {kind[:32]!r}")
