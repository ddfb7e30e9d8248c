"""The node side of the control plane: registration, heartbeats, barriers and failure notices.

Both the summation server and the worker client own one :class:`SchedulerLink` and poll its socket in
their I/O loop next to their data sockets.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import zmq

from tagps.config import PSConfig
from tagps.ps.protocol import (
    Op,
    ProtocolError,
    pack_header,
    pack_json,
    unpack_header,
    unpack_json,
)
from tagps.ps.transport import Security

__all__ = ["AddressBook", "JobFailed", "SchedulerLink", "configure_logging"]

log = logging.getLogger(__name__)

#: Seconds between the notices of a node still waiting for the scheduler's first answer (at most a quarter
#: of PS_REGISTER_TIMEOUT).
_WAIT_NOTICE_S = 10.0


class JobFailed(RuntimeError):
    """Another node of the job died, stopped heartbeating, or the scheduler went silent."""


@dataclass(frozen=True)
class AddressBook:
    """What the scheduler tells a node once the whole job has registered."""

    node_id: int
    rank: int | None
    servers: tuple[tuple[str, int], ...]
    num_workers: int


def configure_logging(config: PSConfig, role: str) -> None:
    """Send ``tagps`` log records at ``BYTEPS_LOG_LEVEL`` to stderr with a role prefix."""
    logging.basicConfig(
        level=config.log_level,
        format=f"[%(asctime)s {role} %(process)d] %(levelname)s %(name)s: %(message)s",
    )


class SchedulerLink:
    """A node's DEALER connection to the scheduler.

    Args:
        context: the node's ZeroMQ context.
        security: CURVE settings of the job.
        config: the node's settings.
        role: ``"worker"`` or ``"server"``.
        host: the address the node advertises.
        port: the node's data port (0 for workers).
        rank: a server rank to ask for (restoring a checkpoint), else ``None``.
    """

    def __init__(
        self,
        context: zmq.Context,
        security: Security,
        config: PSConfig,
        role: str,
        host: str,
        port: int,
        rank: int | None = None,
    ) -> None:
        self.config = config
        self.host = host
        self.socket = security.client(context.socket(zmq.DEALER))
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.SNDTIMEO, int(config.heartbeat_timeout * 1000))
        self.socket.connect(f"tcp://{config.root_uri}:{config.root_port}")
        self._registration = {
            "role": role,
            "host": host,
            "port": port,
            "pid": os.getpid(),
            "worker_id": config.worker_id,
            "rank": rank,
            "num_workers": config.num_workers,
            "num_servers": config.num_servers,
        }
        self.node_id = 0
        self._last_heard = time.monotonic()
        self._last_beat = 0.0
        self._barrier_rounds: dict[str, int] = {}

    def register(self) -> AddressBook:
        """Register and block until the scheduler sends the address book.

        Waits at most ``PS_REGISTER_TIMEOUT`` seconds for the scheduler's first answer (it may start after
        this node). Once it answered, the scheduler bounds the wait: it sends NODE_FAILED naming the missing
        nodes when the job is not complete within ``PS_REGISTER_TIMEOUT`` of its start.

        Raises:
            JobFailed: the scheduler did not answer, rejected the registration, gave up waiting for the
                rest of the job, went silent or reported a failed node.
        """
        where = f"{self.config.root_uri}:{self.config.root_port}"
        limit = self.config.register_timeout
        try:
            self.socket.send_multipart(pack_json(Op.REGISTER, self._registration, sender=0))
        except zmq.Again:
            raise JobFailed(
                f"cannot reach the scheduler at {where} within "
                f"PS_HEARTBEAT_TIMEOUT={self.config.heartbeat_timeout:g} s (wrong address, or "
                "TAGPS_PS_SECRET differs)"
            ) from None
        start = time.monotonic()
        answered: float | None = None  # when the scheduler first answered
        # A silent wait of up to PS_REGISTER_TIMEOUT (2 minutes by default) looks like a hang: say so.
        notice_every = min(_WAIT_NOTICE_S, limit / 4)
        next_notice = start + notice_every
        while True:
            now = time.monotonic()
            if answered is None:
                if now - start > limit:
                    raise JobFailed(
                        f"the scheduler at {where} did not answer within {limit:g} s (PS_REGISTER_TIMEOUT): "
                        "it is not running, not reachable there, or TAGPS_PS_SECRET differs"
                    )
                if now >= next_notice:
                    log.warning(
                        "no answer from the scheduler at %s after %.0f s; waiting up to %g s "
                        "(PS_REGISTER_TIMEOUT)",
                        where,
                        now - start,
                        limit,
                    )
                    next_notice += notice_every
                self._send_beat(now)
            else:
                # The scheduler's own deadline comes first; this one only bounds a scheduler that is alive
                # but never answers the registration.
                if now - answered > limit + self.config.heartbeat_timeout:
                    raise JobFailed(
                        f"the scheduler at {where} sent no address book within {limit:g} s "
                        "(PS_REGISTER_TIMEOUT) of answering"
                    )
                self.beat()
            if not self.socket.poll(int(self.config.heartbeat_interval * 1000)):
                continue
            op, document = self.receive()
            if answered is None:
                answered = time.monotonic()
            if op == Op.ADDRESS_BOOK:
                return self._address_book(document)

    def beat(self) -> None:
        """Send a heartbeat when one is due; raise :class:`JobFailed` when the scheduler went silent."""
        now = time.monotonic()
        if now - self._last_heard > self.config.heartbeat_timeout:
            raise JobFailed(
                f"the scheduler at {self.config.root_uri}:{self.config.root_port} sent nothing for "
                f"{self.config.heartbeat_timeout:g} s (PS_HEARTBEAT_TIMEOUT); it is gone or unreachable"
            )
        self._send_beat(now)

    def _send_beat(self, now: float) -> None:
        if now - self._last_beat >= self.config.heartbeat_interval:
            try:
                self.socket.send(pack_header(Op.HEARTBEAT, sender=self.node_id), zmq.NOBLOCK)
            except zmq.Again:
                pass  # not connected (yet): the caller's deadline decides when to give up
            self._last_beat = now

    def receive(self) -> tuple[Op, dict[str, Any] | int]:
        """Receive one scheduler message and return ``(op, document or barrier round)``.

        Heartbeat echoes come back as ``(Op.HEARTBEAT, 0)``.

        Raises:
            JobFailed: a NODE_FAILED notice or an ERROR reply from the scheduler.
        """
        frames = self.socket.recv_multipart()
        self._last_heard = time.monotonic()
        try:
            header = unpack_header(frames[0])
            if header.op == Op.NODE_FAILED:
                doc = unpack_json(header, frames)
                if doc.get("node") is None:  # the job never completed its registration
                    raise JobFailed(f"the scheduler gave up: {doc.get('reason')}; the job is stopping")
                raise JobFailed(f"{doc.get('node')} failed ({doc.get('reason')}); the job is stopping")
            if header.op == Op.ERROR:
                reason = bytes(frames[1]).decode(errors="replace") if len(frames) > 1 else "?"
                raise JobFailed(f"the scheduler rejected this node: {reason}")
            if header.op == Op.ADDRESS_BOOK:
                return Op.ADDRESS_BOOK, unpack_json(header, frames)
            if header.op in (Op.HEARTBEAT, Op.SHUTDOWN, Op.BARRIER_DONE):
                return Op(header.op), header.round
            raise ProtocolError(f"unexpected {Op(header.op).name} from the scheduler")
        except ProtocolError as exc:
            raise JobFailed(f"bad message from the scheduler: {exc}") from None

    def request_barrier(self, group: str) -> int:
        """Send a barrier request for ``group`` (workers, servers or all) and return its round."""
        round = self._barrier_rounds.get(group, 0)
        self._barrier_rounds[group] = round + 1
        self.socket.send_multipart(pack_json(Op.BARRIER, {"group": group}, sender=self.node_id, round=round))
        return round

    def finalize(self) -> None:
        """Tell the scheduler that this worker is done."""
        self.socket.send(pack_header(Op.FINALIZE, sender=self.node_id))

    def close(self) -> None:
        """Close the socket."""
        self.socket.close()

    def _address_book(self, doc: dict[str, Any] | int) -> AddressBook:
        if not isinstance(doc, dict):
            raise JobFailed("malformed address book from the scheduler")
        try:
            servers = tuple((str(s["host"]), int(s["port"])) for s in doc["servers"])
            book = AddressBook(int(doc["node_id"]), doc.get("rank"), servers, int(doc["workers"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise JobFailed(f"malformed address book from the scheduler: {exc!r}") from None
        if len(servers) != self.config.num_servers or book.num_workers != self.config.num_workers:
            raise JobFailed("the scheduler's address book does not match DMLC_NUM_SERVER/DMLC_NUM_WORKER")
        self.node_id = book.node_id
        return book
