"""PSClient argument checking, lifecycle and send order, against real scheduler processes."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import zmq

from tagps.config import PSConfig
from tagps.ps import PSClient
from tagps.ps.node import SchedulerLink
from tagps.ps.protocol import Header, Op, pack_header, server_node_id, unpack_header
from tagps.ps.transport import Security


@pytest.mark.timeout(60)
def test_client_rejects_bad_arguments_with_clear_errors(ps_job) -> None:
    with ps_job(num_workers=1, num_servers=1) as job:
        client = PSClient(job.client_config(0))
        try:
            client.declare("f", 40, np.float32)
            client.declare("i", 16, np.int64)
            client.declare("empty", 0, np.float16)
            with pytest.raises(ValueError, match="already declared"):
                client.declare("f", 40, np.float32)
            with pytest.raises(ValueError, match="multiple of 4"):
                client.declare("g", 41, np.float32)
            with pytest.raises(TypeError, match="integer"):
                client.declare("g", 40.0, np.float32)
            with pytest.raises(TypeError, match="not supported"):
                client.declare("g", 40, np.complex64)
            with pytest.raises(ValueError, match="init for 'g'"):
                client.declare("g", 40, np.float32, init=np.zeros(3, np.float32))
            with pytest.raises(ValueError, match="more than 65536"):
                client.declare("huge", (1 << 16) * job.client_config(0).partition_bytes + 4, np.float32)
            client.barrier()

            with pytest.raises(ValueError, match="not declared"):
                client.push_pull("nope", np.zeros(10, np.float32))
            with pytest.raises(TypeError, match="dtype float64, declared float32"):
                client.push_pull("f", np.zeros(10, np.float64))
            with pytest.raises(ValueError, match="40 bytes"):
                client.push_pull("f", np.zeros(20, np.float32)[::2])
            with pytest.raises(TypeError, match="floating dtype"):
                client.push_pull("i", np.zeros(2, np.int64))
            assert client.poll(client.push_pull("empty", np.zeros(0, np.float16)))

            buf = np.arange(10, dtype=np.float32)
            handle = client.push_pull("f", buf)
            client.wait(handle, timeout=20)
            np.testing.assert_array_equal(buf, np.arange(10, dtype=np.float32))  # one worker: mean = own

            ints = np.array([1, 2], np.int64)
            client.wait(client.push_pull("i", ints, average=False), timeout=20)
            np.testing.assert_array_equal(ints, [1, 2])
            with pytest.raises(ValueError, match="not a handle of this PSClient"):
                client.wait(object())  # type: ignore[arg-type]
        finally:
            client.close()
            client.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            client.push_pull("f", np.zeros(10, np.float32))
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0}


class _ScriptedServer:
    """A data socket the test drives by hand, registered with the real scheduler as server 0.

    A thread owns the scheduler link (registration, heartbeats) until SHUTDOWN or :meth:`close`.
    """

    def __init__(self, config: PSConfig) -> None:
        self.context = zmq.Context()
        self.security = Security(self.context, None)
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.link = SchedulerLink(self.context, self.security, config, "server", "127.0.0.1", port)
        self.node_id = server_node_id(0)
        self._stash: list[tuple[bytes, Header]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._control, daemon=True)
        self._thread.start()

    def _control(self) -> None:
        self.link.register()
        while not self._stop.is_set():
            self.link.beat()
            if self.link.socket.poll(50) and self.link.receive()[0] == Op.SHUTDOWN:
                return

    def receive(self, op: Op) -> tuple[bytes, Header]:
        """Return the next ``op`` message; others arriving meanwhile are kept for later calls."""
        for i, (_, header) in enumerate(self._stash):
            if header.op == op:
                return self._stash.pop(i)
        while True:
            assert self.socket.poll(10_000), f"no {op.name} arrived"
            identity, *frames = self.socket.recv_multipart()
            header = unpack_header(frames[0])
            if header.op == op:
                return identity, header
            self._stash.append((identity, header))

    def reply(self, identity: bytes, op: Op, header: Header, payload: bytes = b"") -> None:
        head = pack_header(
            op,
            sender=self.node_id,
            key=header.key,
            round=header.round,
            dtype=header.dtype,
            nbytes=len(payload),
        )
        self.socket.send_multipart([identity, head, payload] if payload else [identity, head])

    def close(self, shutdown: bool = True) -> None:
        """Stop (after the scheduler's SHUTDOWN when ``shutdown``, which a failed client never causes)."""
        if shutdown:
            self._thread.join(timeout=30)
        self._stop.set()
        self._thread.join()
        self.link.close()
        self.socket.close()
        self.security.close()
        self.context.term()


@pytest.mark.timeout(60)
def test_window_sends_lower_priority_values_first(ps_job) -> None:
    """The scripted server withholds PUSH_ACKs; with BYTEPS_SCHEDULING_CREDIT=1 the send order shows."""
    with ps_job(num_workers=1, num_servers=1, server_args=[]) as job:
        server = _ScriptedServer(job.client_config(0))
        client = PSClient(job.client_config(0, BYTEPS_SCHEDULING_CREDIT="1"))
        try:
            for name in "abcd":
                client.declare(name, 8, np.float32)
            flush = threading.Thread(target=client.flush_declarations)
            flush.start()
            for _ in range(4):
                identity, header = server.receive(Op.INIT)
                server.reply(identity, Op.INIT_ACK, header)
            flush.join(timeout=10)
            keys = {name: index << 16 for index, name in enumerate("abcd")}  # sorted names
            handles = [client.push_pull("a", np.ones(2, np.float32), priority=5)]
            identity, header = server.receive(Op.PUSH)
            with pytest.raises(ValueError, match="has not completed"):  # its PUSH_ACK is withheld
                client.push_pull("a", np.ones(2, np.float32))
            for name, priority in (("b", 9), ("c", 1), ("d", 5)):
                handles.append(client.push_pull(name, np.ones(2, np.float32), priority=priority))
            time.sleep(0.3)  # every submission reaches the client's I/O thread while the credit is used
            order = [header.key]
            for _ in range(3):
                server.reply(identity, Op.PUSH_ACK, header)
                identity, header = server.receive(Op.PUSH)
                order.append(header.key)
            assert order == [keys["a"], keys["c"], keys["d"], keys["b"]]
            server.reply(identity, Op.PUSH_ACK, header)
            for _ in range(4):
                identity, pull = server.receive(Op.PULL)
                server.reply(identity, Op.PULL_REPLY, pull, np.full(2, 7, np.float32).tobytes())
            for handle in handles:
                client.wait(handle, timeout=10)
                assert np.all(handle.buffer == 7)
        finally:
            client.close()
            server.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("elements", [1, 7, 1023, 1024, 1025, 4097])
def test_chunks_are_the_fewest_of_equal_size_within_the_partition(ps_job, elements: int) -> None:
    partition = 4096  # bytes: 1024 float32 elements
    with ps_job(num_workers=1, num_servers=2, env={"BYTEPS_PARTITION_BYTES": str(partition)}) as job:
        with PSClient(job.client_config(0)) as client:
            client.declare("t", 4 * elements, np.float32)
            client.barrier()
            chunks = client._tensors["t"].chunks
            sizes = [c.stop - c.start for c in chunks]
            assert len(chunks) == -(-elements // 1024)
            assert max(sizes) - min(sizes) <= 1 and 4 * max(sizes) <= partition
            assert [c.start for c in chunks] == [0, *(c.stop for c in chunks[:-1])]
            assert chunks[-1].stop == elements
            buf = np.arange(elements, dtype=np.float32)
            client.wait(client.push_pull("t", buf, average=False), timeout=20)
            np.testing.assert_array_equal(buf, np.arange(elements, dtype=np.float32))


@pytest.mark.timeout(60)
def test_server_error_fails_the_handle_and_then_the_client_with_its_text(ps_job) -> None:
    with ps_job(num_workers=1, num_servers=1, server_args=[]) as job:
        server = _ScriptedServer(job.client_config(0))
        client = PSClient(job.client_config(0))
        try:
            client.declare("a", 8, np.float32)
            flush = threading.Thread(target=client.flush_declarations)
            flush.start()
            identity, header = server.receive(Op.INIT)
            server.reply(identity, Op.INIT_ACK, header)
            flush.join(timeout=10)
            handle = client.push_pull("a", np.ones(2, np.float32))
            identity, header = server.receive(Op.PUSH)
            server.reply(identity, Op.ERROR, header, b"server 0: the reason \xff")
            reason = "server 0 rejected a request for key 0 round 0: server 0: the reason \ufffd"
            with pytest.raises(RuntimeError, match=f"push_pull of 'a' failed: {reason}"):
                client.wait(handle, timeout=10)
            with pytest.raises(RuntimeError, match=f"the PS job failed: {reason}"):
                client.push_pull("a", np.ones(2, np.float32))
        finally:
            client.close()
            server.close(shutdown=False)


@pytest.mark.timeout(90)
def test_close_leaves_after_the_register_timeout_when_a_live_worker_never_closes(ps_job, caplog) -> None:
    """A dead peer ends close() through the heartbeats; one that is alive and heartbeating but never closes
    (stuck, or a script that closes on some ranks only) would make it wait for the scheduler's SHUTDOWN
    forever."""
    with ps_job(num_workers=2, num_servers=1) as job:
        job.start_worker(
            1, "import time; from tagps.ps import PSClient; c = PSClient.from_env(); time.sleep(120)"
        )
        client = PSClient(job.client_config(0, PS_REGISTER_TIMEOUT="3"))
        start = time.monotonic()
        with caplog.at_level("WARNING", logger="tagps.ps.client"):
            closer = threading.Thread(target=client.close, daemon=True)
            closer.start()
            closer.join(timeout=30)
        assert not closer.is_alive(), "close() still waits for worker 1 after 30 s"
        assert 3.0 <= time.monotonic() - start < 3.0 + 10.0
        assert "not every worker closed within 3 s (PS_REGISTER_TIMEOUT)" in caplog.text, caplog.text


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("victim", "named"), [("server", "server 0"), ("scheduler", "the scheduler")])
def test_close_with_a_dead_server_or_scheduler_ends_within_the_heartbeat_timeout(
    ps_job, caplog, victim: str, named: str
) -> None:
    """Worker 1 never closes, so only the failure of the killed node can end worker 0's wait for SHUTDOWN."""
    with ps_job(num_workers=2, num_servers=1, env={"PS_HEARTBEAT_TIMEOUT": "2"}) as job:
        job.start_worker(
            1, "import time; from tagps.ps import PSClient; c = PSClient.from_env(); time.sleep(120)"
        )
        client = PSClient(job.client_config(0))
        proc = job.servers[0] if victim == "server" else job.scheduler
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with caplog.at_level("WARNING", logger="tagps.ps.client"):
            client.close()
        # The scheduler names a silent server after the timeout, the client a silent scheduler.
        assert time.monotonic() - start < 2.0 + 5.0
        assert "close: close failed:" in caplog.text and named in caplog.text, caplog.text
