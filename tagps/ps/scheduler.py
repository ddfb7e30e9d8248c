"""The scheduler: registration, the address book, barriers, heartbeats and job shutdown.

Every server and worker machine registers with the scheduler, which answers once the whole job is
present with an address book (server addresses by rank, and the node's own id). Afterwards the scheduler
answers barriers, echoes heartbeats and watches them: a node silent for ``PS_HEARTBEAT_TIMEOUT`` seconds
makes the scheduler send :attr:`Op.NODE_FAILED` naming it to every other node and exit with status 1.
A job that is not complete ``PS_REGISTER_TIMEOUT`` seconds after the scheduler started fails the same way,
the notice naming the roles still missing.
When every worker has sent :attr:`Op.FINALIZE`, it sends :attr:`Op.SHUTDOWN` to all and exits with 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq

from tagps.config import PSConfig
from tagps.ps.protocol import (
    SCHEDULER_NODE_ID,
    Op,
    ProtocolError,
    pack_header,
    pack_json,
    server_node_id,
    unpack_header,
    unpack_json,
    worker_node_id,
)
from tagps.ps.transport import Security

__all__ = ["Scheduler"]

log = logging.getLogger(__name__)

_GROUPS = ("workers", "servers", "all")


@dataclass
class _Node:
    identity: bytes
    role: str
    host: str
    port: int
    pid: int
    worker_id: int
    rank: int | None
    last_seen: float
    node_id: int = 0
    finalized: bool = False

    def name(self) -> str:
        if self.role == "worker":
            who = f"worker {self.worker_id}"
        else:  # a server gets its rank with the address book, once the job is complete
            who = "server" if self.rank is None else f"server {self.rank}"
        return f"{who} (pid {self.pid} on {self.host})"


class Scheduler:
    """Run the scheduler of one job.

    Args:
        config: the job's settings (``DMLC_PS_ROOT_URI``/``DMLC_PS_ROOT_PORT`` is where it binds).
    """

    def __init__(self, config: PSConfig) -> None:
        self.config = config
        self._context = zmq.Context()
        self._security = Security(self._context, config.secret)
        self._socket = self._security.server(self._context.socket(zmq.ROUTER))
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        endpoint = f"tcp://{config.root_uri}:{config.root_port}"
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise RuntimeError(
                f"scheduler cannot bind DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT = {endpoint}: {exc}"
            ) from None
        self._nodes: dict[bytes, _Node] = {}
        self._ready = False
        self._barriers: dict[str, set[bytes]] = {group: set() for group in _GROUPS}
        self._barrier_rounds: dict[str, int] = dict.fromkeys(_GROUPS, 0)

    def run(self) -> int:
        """Serve until every worker finalized (returns 0), a node failed or the job did not assemble within
        ``PS_REGISTER_TIMEOUT`` (returns 1)."""
        poll_ms = max(10, int(self.config.heartbeat_interval * 500))
        register_deadline = time.monotonic() + self.config.register_timeout
        try:
            while True:
                if not self._ready and time.monotonic() > register_deadline:
                    return self._fail_registration()
                if self._socket.poll(poll_ms):
                    identity, *frames = self._socket.recv_multipart()
                    status = self._handle(identity, frames)
                    if status is not None:
                        return status
                failed = self._find_silent_node()
                if failed is not None:
                    return self._fail(failed, f"sent no heartbeat for {self.config.heartbeat_timeout:g} s")
        finally:
            self.close()

    def close(self) -> None:
        """Release the sockets (queued messages get two seconds to leave)."""
        if not self._context.closed:
            self._socket.close(linger=2000)
            self._security.close()
            self._context.term()

    # -- messages -----------------------------------------------------------------------------

    def _handle(self, identity: bytes, frames: list[bytes]) -> int | None:
        try:
            header = unpack_header(frames[0]) if frames else None
            if header is None:
                raise ProtocolError("empty message")
            node = self._nodes.get(identity)
            if node is not None:
                node.last_seen = time.monotonic()
            if header.op == Op.REGISTER:
                self._register(identity, unpack_json(header, frames))
                return None
            if node is None:
                raise ProtocolError(f"{Op(header.op).name} from a node that has not registered")
            if header.op == Op.HEARTBEAT:
                self._send(identity, [pack_header(Op.HEARTBEAT, sender=SCHEDULER_NODE_ID)])
            elif header.op == Op.BARRIER:
                self._barrier(node, header.round, unpack_json(header, frames))
            elif header.op == Op.FINALIZE:
                return self._finalize(node)
            else:
                raise ProtocolError(f"the scheduler does not handle {Op(header.op).name}")
        except ProtocolError as exc:
            log.error("bad message from %r: %s", identity, exc)
            message = str(exc).encode()
            self._send(
                identity, [pack_header(Op.ERROR, sender=SCHEDULER_NODE_ID, nbytes=len(message)), message]
            )
        return None

    def _register(self, identity: bytes, doc: dict[str, Any]) -> None:
        if self._ready or identity in self._nodes:
            raise ProtocolError("registration is closed: the job is complete")
        role = doc.get("role")
        host, port, pid = doc.get("host"), doc.get("port"), doc.get("pid")
        if role not in ("worker", "server"):
            raise ProtocolError(f"role must be worker or server, got {role!r}")
        if not isinstance(host, str) or not host or not _is_int(port) or not _is_int(pid):
            raise ProtocolError("registration needs host (str), port (int) and pid (int)")
        for field_name, mine in (
            ("num_workers", self.config.num_workers),
            ("num_servers", self.config.num_servers),
        ):
            if doc.get(field_name) != mine:
                variable = "DMLC_NUM_WORKER" if field_name == "num_workers" else "DMLC_NUM_SERVER"
                raise ProtocolError(f"{variable}={doc.get(field_name)} differs from the scheduler's {mine}")
        members = [n for n in self._nodes.values() if n.role == role]
        limit = self.config.num_workers if role == "worker" else self.config.num_servers
        if len(members) >= limit:
            raise ProtocolError(f"the job already has its {limit} {role}s")
        worker_id, rank = doc.get("worker_id", 0), doc.get("rank")
        if role == "worker":
            if not _is_int(worker_id) or not 0 <= worker_id < self.config.num_workers:
                raise ProtocolError(f"DMLC_WORKER_ID={worker_id!r} is not in [0, {self.config.num_workers})")
            if any(n.worker_id == worker_id for n in members):
                raise ProtocolError(f"DMLC_WORKER_ID={worker_id} is already registered")
            rank = None
        elif rank is not None:
            if not _is_int(rank) or not 0 <= rank < self.config.num_servers:
                raise ProtocolError(f"server rank {rank!r} is not in [0, {self.config.num_servers})")
            if any(n.rank == rank for n in members):
                raise ProtocolError(f"server rank {rank} is already taken")
        node = _Node(identity, role, host, port, pid, worker_id, rank, time.monotonic())
        self._nodes[identity] = node
        log.info("registered %s (%d/%d nodes)", node.name(), len(self._nodes), self._job_size())
        if len(self._nodes) == self._job_size():
            self._publish_address_book()

    def _publish_address_book(self) -> None:
        servers = [n for n in self._nodes.values() if n.role == "server"]
        free = iter(sorted(set(range(self.config.num_servers)) - {n.rank for n in servers}))
        for server in servers:
            if server.rank is None:
                server.rank = next(free)
            server.node_id = server_node_id(server.rank)
        servers.sort(key=lambda n: n.rank or 0)
        book = [{"host": n.host, "port": n.port} for n in servers]
        workers = sorted((n for n in self._nodes.values() if n.role == "worker"), key=lambda n: n.worker_id)
        for worker in workers:
            worker.node_id = worker_node_id(worker.worker_id)
        for node in self._nodes.values():
            document = {"node_id": node.node_id, "rank": node.rank, "servers": book, "workers": len(workers)}
            self._send(node.identity, pack_json(Op.ADDRESS_BOOK, document, sender=SCHEDULER_NODE_ID))
        self._ready = True
        log.info("job complete: %d servers, %d workers", len(servers), len(workers))

    def _barrier(self, node: _Node, round: int, doc: dict[str, Any]) -> None:
        group = doc.get("group")
        if group not in _GROUPS:
            raise ProtocolError(f"barrier group must be one of {_GROUPS}, got {group!r}")
        if not self._ready:
            raise ProtocolError("barrier before the job is complete")
        if round != self._barrier_rounds[group]:
            raise ProtocolError(f"barrier {group} round {round}, expected {self._barrier_rounds[group]}")
        members = [n for n in self._nodes.values() if group == "all" or n.role + "s" == group]
        if node not in members:
            raise ProtocolError(f"a {node.role} cannot join the {group} barrier")
        arrived = self._barriers[group]
        arrived.add(node.identity)
        if len(arrived) == len(members):
            for member in members:
                self._send(
                    member.identity, [pack_header(Op.BARRIER_DONE, sender=SCHEDULER_NODE_ID, round=round)]
                )
            arrived.clear()
            self._barrier_rounds[group] += 1

    def _finalize(self, node: _Node) -> int | None:
        if node.role != "worker":
            raise ProtocolError("only workers finalize")
        node.finalized = True
        if all(n.finalized for n in self._nodes.values() if n.role == "worker") and self._ready:
            for other in self._nodes.values():
                self._send(other.identity, [pack_header(Op.SHUTDOWN, sender=SCHEDULER_NODE_ID)])
            log.info("every worker finalized; job done")
            return 0
        return None

    # -- failures -----------------------------------------------------------------------------

    def _find_silent_node(self) -> _Node | None:
        deadline = time.monotonic() - self.config.heartbeat_timeout
        for node in self._nodes.values():
            if not node.finalized and node.last_seen < deadline:
                return node
        return None

    def _fail(self, node: _Node, reason: str) -> int:
        log.error("%s failed: %s; stopping the job", node.name(), reason)
        document = {"node": node.name(), "reason": reason}
        for other in self._nodes.values():
            if other is not node:
                self._send(other.identity, pack_json(Op.NODE_FAILED, document, sender=SCHEDULER_NODE_ID))
        return 1

    def _fail_registration(self) -> int:
        counts, missing = self._missing()
        reason = (
            f"only {' and '.join(counts)} registered within {self.config.register_timeout:g} s "
            f"(PS_REGISTER_TIMEOUT); missing: {', '.join(missing)}"
        )
        log.error("registration timed out: %s; stopping the job", reason)
        document = {"node": None, "reason": reason}
        for node in self._nodes.values():
            self._send(node.identity, pack_json(Op.NODE_FAILED, document, sender=SCHEDULER_NODE_ID))
        return 1

    def _missing(self) -> tuple[list[str], list[str]]:
        """Return the count of each incomplete role (``1 of 2 servers``) and who is missing (``worker 1``)."""
        workers = {n.worker_id for n in self._nodes.values() if n.role == "worker"}
        servers = sum(n.role == "server" for n in self._nodes.values())
        counts, missing = [], []
        if len(workers) < self.config.num_workers:
            counts.append(f"{len(workers)} of {self.config.num_workers} workers")
            missing += [f"worker {w}" for w in range(self.config.num_workers) if w not in workers]
        if servers < self.config.num_servers:
            absent = self.config.num_servers - servers
            counts.append(f"{servers} of {self.config.num_servers} servers")
            missing.append(f"{absent} server{'s' if absent > 1 else ''}")
        return counts, missing

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        self._socket.send_multipart([identity, *frames])

    def _job_size(self) -> int:
        return self.config.num_workers + self.config.num_servers


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
