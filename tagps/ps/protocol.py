"""Wire format of the parameter-server runtime (see ``docs/protocol.md``).

Every message is a ZeroMQ multipart message whose first frame is a fixed 36-byte header and whose
optional second frame is the payload (tensor bytes, sent and received zero-copy, or a small JSON
document on the control plane). The header is little-endian::

    offset size field    meaning
    0      2    magic    b"TP"
    2      1    version  PROTOCOL_VERSION
    3      1    op       an :class:`Op`
    4      1    dtype    a :class:`DType` code (0 for control messages)
    5      1    flags    bit set of ``FLAG_*``
    6      2    reserved must be 0
    8      4    sender   node id of the sender (see :func:`worker_node_id`)
    12     8    key      tensor chunk key, ``(declared_index << 16) + chunk``
    20     8    round    synchronous round of the key (barrier sequence on the control plane)
    28     8    nbytes   byte length of the payload frame

An INIT with :data:`FLAG_WORKERS` declares a key pushed by a subset of the workers: its first payload frame
lists them (:func:`pack_workers`), the optional initial value follows. A node that predates the flag
refuses such an INIT as carrying unknown flags instead of misreading it.

:func:`unpack_header` checks every field; a malformed message raises :class:`ProtocolError`, which the
receiver turns into an :attr:`Op.ERROR` reply to the sender.
"""

from __future__ import annotations

import enum
import itertools
import json
import struct
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "FLAG_ASYNC",
    "FLAG_AVERAGE",
    "FLAG_IPC",
    "FLAG_SERVER_OPTIMIZER",
    "FLAG_WORKERS",
    "HEADER_SIZE",
    "IPC_DESCRIPTOR_SIZE",
    "MAGIC",
    "MAX_CHUNKS",
    "MAX_JSON_BYTES",
    "PROTOCOL_VERSION",
    "SCHEDULER_NODE_ID",
    "DType",
    "Header",
    "Op",
    "ProtocolError",
    "check_workers",
    "describe_node",
    "dtype_code",
    "numpy_dtype",
    "pack_header",
    "pack_json",
    "pack_workers",
    "routing_id",
    "server_node_id",
    "unpack_header",
    "unpack_json",
    "unpack_workers",
    "worker_node_id",
]

PROTOCOL_VERSION = 1
MAGIC = b"TP"
_HEADER = struct.Struct("<2sBBBBHIQQQ")
HEADER_SIZE = _HEADER.size
MAX_CHUNKS = 1 << 16
#: Largest JSON document accepted on the control plane.
MAX_JSON_BYTES = 1 << 20

#: INIT_ACK flag: the server applies an optimizer, so pulls return weights, not sums.
FLAG_SERVER_OPTIMIZER = 1
#: INIT_ACK flag: the server runs in asynchronous mode.
FLAG_ASYNC = 2
#: PUSH flag: the worker wants the mean (the server divides the round's sum by the number of workers).
FLAG_AVERAGE = 4
#: INIT flag: the first payload frame names the workers that push the key (default: every worker).
FLAG_WORKERS = 8
#: Shared memory between a worker and a server on one host (``TAGPS_PS_IPC``; csrc/net/shared_segment.h).
#: INIT: a descriptor frame of :data:`IPC_DESCRIPTOR_SIZE` bytes follows the worker set. INIT_ACK: the server
#: mapped the worker's segment. PUSH and PULL_REPLY: the bytes are in that segment; the message has none.
FLAG_IPC = 16
_FLAGS_MASK = FLAG_SERVER_OPTIMIZER | FLAG_ASYNC | FLAG_AVERAGE | FLAG_WORKERS | FLAG_IPC
#: Bytes of a shared-memory descriptor: pid (u32), descriptor (i32), nonce, segment size, offset (u64 each).
IPC_DESCRIPTOR_SIZE = 32
_WORKER_ID = struct.Struct("<I")

SCHEDULER_NODE_ID = 1


class ProtocolError(ValueError):
    """A message does not follow the wire format (the receiver answers with :attr:`Op.ERROR`)."""


class Op(enum.IntEnum):
    """Message types. Data plane (worker ↔ server) first, then the control plane (node ↔ scheduler)."""

    INIT = 1  # worker → server: declare a key (dtype, nbytes); payload: initial value (optional)
    INIT_ACK = 2  # server → worker: every worker declared the key; flags say the server's mode
    PUSH = 3  # worker → server: this worker's contribution to `round` of `key`
    PULL = 4  # worker → server: ask for the result of `round` of `key`
    PULL_REPLY = 5  # server → worker: the result (sum, or weights with a server optimizer)
    ERROR = 6  # any → sender of a bad message; payload: UTF-8 reason
    PUSH_ACK = 7  # server → worker: the push was accepted (returns the worker's credit)
    REGISTER = 10  # node → scheduler; payload: JSON {role, host, port, worker_id, rank, ...}
    ADDRESS_BOOK = 11  # scheduler → node; payload: JSON {node_id, servers, workers}
    BARRIER = 12  # node → scheduler; payload: JSON {group}
    BARRIER_DONE = 13  # scheduler → node
    HEARTBEAT = 14  # node → scheduler and back
    NODE_FAILED = 15  # scheduler → node; payload: JSON {node, reason}
    FINALIZE = 16  # worker → scheduler: this worker is done
    SHUTDOWN = 17  # scheduler → node: every worker is done, exit cleanly


_OPS = frozenset(int(op) for op in Op)


class DType(enum.IntEnum):
    """Element types on the wire. ``BFLOAT16`` travels as ``uint16`` in numpy."""

    FLOAT32 = 1
    FLOAT64 = 2
    FLOAT16 = 3
    BFLOAT16 = 4
    INT32 = 5
    INT64 = 6


_NUMPY = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(np.uint16),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
}
_CODES = {dtype: code for code, dtype in _NUMPY.items()}
_DTYPES = frozenset(int(code) for code in DType)


class Header(NamedTuple):
    """A decoded message header."""

    op: int
    dtype: int
    flags: int
    sender: int
    key: int
    round: int
    nbytes: int


def dtype_code(dtype: Any) -> DType:
    """Return the wire code of a numpy dtype (``uint16`` means bfloat16).

    Raises:
        TypeError: the dtype has no wire code.
    """
    try:
        return _CODES[np.dtype(dtype)]
    except (KeyError, TypeError):
        supported = ", ".join(str(d) for d in _CODES)
        raise TypeError(f"dtype {dtype!r} is not supported by the PS runtime ({supported})") from None


def numpy_dtype(code: int) -> np.dtype:
    """Return the numpy dtype of a wire code."""
    return _NUMPY[DType(code)]


def pack_header(
    op: int, *, sender: int, key: int = 0, round: int = 0, nbytes: int = 0, dtype: int = 0, flags: int = 0
) -> bytes:
    """Encode a header (fields as in the module docstring)."""
    return _HEADER.pack(MAGIC, PROTOCOL_VERSION, op, dtype, flags, 0, sender, key, round, nbytes)


def unpack_header(frame: bytes | memoryview) -> Header:
    """Decode and validate a header frame.

    Raises:
        ProtocolError: wrong length, magic, version, op, dtype, flags or reserved bits.
    """
    if len(frame) != HEADER_SIZE:
        raise ProtocolError(f"header has {len(frame)} bytes, expected {HEADER_SIZE}")
    magic, version, op, dtype, flags, reserved, sender, key, rnd, nbytes = _HEADER.unpack(frame)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, this node speaks {PROTOCOL_VERSION}")
    if op not in _OPS:
        raise ProtocolError(f"unknown op {op}")
    if dtype != 0 and dtype not in _DTYPES:
        raise ProtocolError(f"unknown dtype code {dtype}")
    if flags & ~_FLAGS_MASK or reserved:
        raise ProtocolError(f"unknown flags {flags:#x} or reserved bits {reserved:#x}")
    return Header(op, dtype, flags, sender, key, rnd, nbytes)


def pack_json(op: Op, document: dict[str, Any], *, sender: int, round: int = 0) -> list[bytes]:
    """Build a control-plane message: header plus a JSON payload."""
    payload = json.dumps(document, separators=(",", ":")).encode()
    return [pack_header(op, sender=sender, round=round, nbytes=len(payload)), payload]


def unpack_json(header: Header, frames: list[Any]) -> dict[str, Any]:
    """Decode the JSON payload of a control-plane message.

    Raises:
        ProtocolError: missing, oversized, mis-sized or malformed payload, or not a JSON object.
    """
    if len(frames) != 2:
        raise ProtocolError(f"{Op(header.op).name} needs 1 payload frame, got {len(frames) - 1}")
    payload = bytes(frames[1])
    if len(payload) != header.nbytes or len(payload) > MAX_JSON_BYTES:
        raise ProtocolError(f"payload has {len(payload)} bytes, header says {header.nbytes}")
    try:
        document = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"payload is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ProtocolError("payload is not a JSON object")
    return document


def pack_workers(workers: tuple[int, ...]) -> bytes:
    """Encode the worker set of an INIT with :data:`FLAG_WORKERS`: ascending ids as little-endian uint32."""
    return b"".join(_WORKER_ID.pack(w) for w in workers)


def unpack_workers(frame: bytes | memoryview, num_workers: int) -> tuple[int, ...]:
    """Decode and validate a worker set frame (see :func:`pack_workers`).

    Raises:
        ProtocolError: not a multiple of 4 bytes, or not a valid set (see :func:`check_workers`).
    """
    raw = bytes(frame)
    if len(raw) % _WORKER_ID.size:
        raise ProtocolError(f"worker set frame has {len(raw)} bytes, expected a multiple of 4")
    return check_workers(tuple(w for (w,) in _WORKER_ID.iter_unpack(raw)), num_workers)


def check_workers(workers: tuple[int, ...], num_workers: int) -> tuple[int, ...]:
    """Return ``workers`` if it is a worker set: non-empty, strictly ascending ids in ``[0, num_workers)``.

    Raises:
        ProtocolError: (a ``ValueError``) it is not.
    """
    ascending = all(a < b for a, b in itertools.pairwise(workers))
    if not workers or not ascending or workers[0] < 0 or workers[-1] >= num_workers:
        raise ProtocolError(
            f"worker set {list(workers)} must be non-empty, ascending, in [0, DMLC_NUM_WORKER={num_workers})"
        )
    return workers


def server_node_id(rank: int) -> int:
    """Node id of server ``rank`` (ps-lite numbering: 8, 10, 12, ...)."""
    return 8 + 2 * rank


def worker_node_id(worker_id: int) -> int:
    """Node id of worker machine ``worker_id`` (ps-lite numbering: 9, 11, 13, ...)."""
    return 9 + 2 * worker_id


def routing_id(node_id: int) -> bytes:
    """ZeroMQ routing id a node uses on its data connections; servers check it against ``sender``."""
    return b"tagps-node-%d" % node_id


def describe_node(node_id: int) -> str:
    """Name a node id for error messages: ``"scheduler"``, ``"server 1"``, ``"worker 0"``."""
    if node_id == SCHEDULER_NODE_ID:
        return "scheduler"
    if node_id >= 8:
        return f"{'server' if node_id % 2 == 0 else 'worker'} {(node_id - 8) // 2}"
    return f"unregistered node {node_id}"
