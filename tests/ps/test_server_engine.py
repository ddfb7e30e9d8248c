"""tagps._core.PSServer in this process: rounds with a server optimizer, snapshot while serving, restore,
log relay (the job tests in this folder run it as ``python -m tagps.server`` with TAGPS_PS_ENGINE=cpp)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import zmq

from tagps import _core
from tagps.config import ServerOptimizerConfig
from tagps.ps.optimizer import ServerOptimizer
from tagps.ps.protocol import (
    FLAG_SERVER_OPTIMIZER,
    DType,
    Op,
    pack_header,
    routing_id,
    unpack_header,
    worker_node_id,
)

pytestmark = pytest.mark.skipif(not _core.HAVE_NET, reason="tagps._core was built without libzmq (HAVE_NET)")

SGD = ServerOptimizerConfig("sgd", lr=0.5, momentum=0.9)
KEY, N = 5, 10
SENDER = worker_node_id(0)


def _server() -> object:
    return _core.PSServer(
        host="127.0.0.1",
        num_workers=1,
        partition_bytes=1 << 16,
        engine_threads=2,
        enable_async=False,
        optimizer=dataclasses.asdict(SGD),
    )


class _Worker:
    """Worker 0's data socket, speaking the wire protocol by hand."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, routing_id(SENDER))
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def request(self, op: Op, round: int, payload: bytes | None = None) -> tuple[int, int, int, bytes]:
        nbytes = 4 * N if op == Op.INIT else len(payload or b"")
        head = pack_header(op, sender=SENDER, key=KEY, round=round, dtype=DType.FLOAT32, nbytes=nbytes)
        self.sock.send_multipart([head] if payload is None else [head, payload])
        assert self.sock.poll(10_000), f"no answer to {op.name}"
        reply = self.sock.recv_multipart()
        header = unpack_header(reply[0])
        return header.op, header.round, header.flags, reply[1] if len(reply) > 1 else b""

    def step(self, round: int, grad: np.ndarray) -> np.ndarray:
        assert self.request(Op.PUSH, round, grad.tobytes())[0] == Op.PUSH_ACK
        op, got_round, flags, payload = self.request(Op.PULL, round)
        assert (op, got_round, flags) == (Op.PULL_REPLY, round, FLAG_SERVER_OPTIMIZER)
        return np.frombuffer(payload, np.float32)

    def close(self) -> None:
        self.sock.close()
        self.context.term()


def test_rounds_snapshot_and_restore_match_the_python_optimizer() -> None:
    init = np.linspace(-1, 1, N, dtype=np.float32)
    grads = [np.sin(np.arange(N, dtype=np.float32) * (s + 1)).astype(np.float32) for s in range(4)]
    optimizer = ServerOptimizer(SGD)
    expected, state = init.copy(), optimizer.new_state(N, np.float32)

    server = _server()
    server.start(0)
    worker = _Worker(server.port)
    try:
        assert worker.request(Op.INIT, 0, init.tobytes())[:3] == (Op.INIT_ACK, 0, FLAG_SERVER_OPTIMIZER)
        for round in range(2):
            optimizer.step(expected, grads[round], state)
            np.testing.assert_array_equal(worker.step(round, grads[round]), expected)
        [entry] = server.snapshot()  # while serving: the engines park meanwhile
        assert (entry["key"], entry["round"], entry["step"], entry["workers"]) == (KEY, 2, 2, [0])
        np.testing.assert_array_equal(entry["value"].view(np.float32), expected)
        momentum = entry["buffers"]["momentum_buffer"].view(np.float32)
        np.testing.assert_array_equal(momentum, state.buffers["momentum_buffer"])
        op, *_ = worker.request(Op.PUSH, 7, grads[0].tobytes())
        assert op == Op.PUSH_ACK  # the credit comes back; the engine then refuses the round
        assert unpack_header(worker.sock.recv_multipart()[0]).op == Op.ERROR
        assert any("while the key is at round 2" in message for _, message in server.drain_log())
    finally:
        worker.close()
        server.stop()
        server.stop()  # idempotent

    restored = _server()
    buffers = [(name, entry["buffers"][name]) for name in optimizer.buffer_names()]
    fields = {k: entry[k] for k in ("key", "dtype", "nbytes", "workers", "round", "counts", "step")}
    with pytest.raises(ValueError, match="must have 40 bytes"):
        restored.restore_key(**fields, value=entry["value"][:-4], buffers=buffers)
    restored.restore_key(**fields, value=entry["value"], buffers=buffers)
    restored.start(0)
    worker = _Worker(restored.port)
    try:
        assert worker.request(Op.INIT, 0)[:2] == (Op.INIT_ACK, 2)  # continues at the saved round
        for round in (2, 3):
            optimizer.step(expected, grads[round], state)
            np.testing.assert_array_equal(worker.step(round, grads[round]), expected)
    finally:
        worker.close()
        restored.stop()
