"""Servers survive garbage, CURVE keeps out peers without the secret, bad registrations are refused."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tagps.ps import PSClient
from tagps.ps.node import JobFailed, SchedulerLink
from tagps.ps.protocol import DType, Op, pack_header, pack_json, unpack_header, worker_node_id
from tagps.ps.transport import CurveKeys, Security


def _push_pull_ok(client: PSClient, value: float) -> None:
    buf = np.full(300, value, np.float32)
    client.wait(client.push_pull("t", buf, average=False), timeout=20)
    assert np.all(buf == value)  # one worker: the sum is its own push


def _valid_push(key: int, round: int) -> list[bytes]:
    payload = np.ones(300, np.float32).tobytes()
    sender = worker_node_id(0)
    return [
        pack_header(Op.PUSH, sender=sender, key=key, round=round, dtype=DType.FLOAT32, nbytes=1200),
        payload,
    ]


frames_strategy = st.one_of(
    st.lists(st.binary(max_size=80), min_size=1, max_size=4),
    # Truncations and bit flips of a well-formed PUSH (sent from a connection that is not worker 0).
    st.tuples(st.integers(0, 35), st.integers(0, 1199)).map(
        lambda cut: [_valid_push(0, 1)[0][: cut[0]], _valid_push(0, 1)[1][: cut[1]]]
    ),
    st.integers(0, 35 * 8 - 1).map(
        lambda bit: [
            bytes(b ^ (1 << (bit % 8)) if i == bit // 8 else b for i, b in enumerate(_valid_push(0, 1)[0])),
            _valid_push(0, 1)[1],
        ]
    ),
)


@pytest.mark.timeout(120)
def test_random_and_truncated_frames_get_errors_and_never_stop_the_server(ps_job) -> None:
    with ps_job(num_workers=1, num_servers=1) as job:
        client = PSClient(job.client_config(0))
        try:
            client.declare("t", 1200, np.float32)
            _push_pull_ok(client, 1.0)
            host, port = client.servers[0]
            context = zmq.Context()
            fuzzer = context.socket(zmq.DEALER)
            fuzzer.setsockopt(zmq.LINGER, 0)
            fuzzer.connect(f"tcp://{host}:{port}")

            @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
            @given(frames=frames_strategy)
            def fuzz(frames: list[bytes]) -> None:
                fuzzer.send_multipart(frames)
                assert fuzzer.poll(5000), "the server did not answer a bad message"
                reply = fuzzer.recv_multipart()
                assert unpack_header(reply[0]).op == Op.ERROR
                assert reply[1].startswith(b"server 0: ")

            fuzz()
            fuzzer.close()
            context.term()
            assert job.servers[0].poll() is None, job.output(job.servers[0])
            _push_pull_ok(client, 2.0)  # the real worker is still served
        finally:
            client.close()
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0}


@pytest.mark.timeout(120)
def test_curve_rejects_peers_without_the_secret(ps_job) -> None:
    secret = {"TAGPS_PS_SECRET": "correct horse battery staple"}
    with ps_job(num_workers=1, num_servers=1, env=secret) as job:
        client = PSClient(job.client_config(0))
        try:
            client.declare("t", 1200, np.float32)
            _push_pull_ok(client, 1.0)
            host, port = client.servers[0]
            context = zmq.Context()
            # Plain TCP, then CURVE with keys derived from another secret: neither gets an answer.
            wrong = CurveKeys.from_secret("wrong secret")
            for curve in (None, wrong):
                for endpoint in (f"tcp://{host}:{port}", f"tcp://127.0.0.1:{job.port}"):
                    intruder = context.socket(zmq.DEALER)
                    intruder.setsockopt(zmq.LINGER, 0)
                    if curve is not None:
                        intruder.curve_serverkey = curve.server_public
                        intruder.curve_publickey = curve.client_public
                        intruder.curve_secretkey = curve.client_secret
                    intruder.connect(endpoint)
                    for round in range(2):  # pushes and pulls as worker 0 would send them
                        intruder.send_multipart(_valid_push(0, round), zmq.NOBLOCK)
                        intruder.send(
                            pack_header(Op.PULL, sender=worker_node_id(0), key=0, round=round, dtype=1)
                        )
                    assert not intruder.poll(1000), f"{endpoint} answered a peer without the secret"
                    intruder.close()
            # The right server key with an unknown client key: the ZAP handler refuses the handshake.
            right = CurveKeys.from_secret(secret["TAGPS_PS_SECRET"])
            intruder = context.socket(zmq.DEALER)
            intruder.setsockopt(zmq.LINGER, 0)
            intruder.curve_serverkey = right.server_public
            intruder.curve_publickey, intruder.curve_secretkey = wrong.client_public, wrong.client_secret
            intruder.connect(f"tcp://{host}:{port}")
            intruder.send_multipart(_valid_push(0, 1), zmq.NOBLOCK)
            assert not intruder.poll(1000), "the server answered an unknown CURVE client"
            intruder.close()
            context.term()
            _push_pull_ok(client, 3.0)  # the push above never reached the store
        finally:
            client.close()
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0}


@pytest.mark.timeout(60)
def test_worker_with_the_wrong_secret_cannot_register(ps_job) -> None:
    with ps_job(num_workers=1, num_servers=1, env={"TAGPS_PS_SECRET": "s3cret"}) as job:
        config = job.client_config(0, TAGPS_PS_SECRET="guess", PS_REGISTER_TIMEOUT="1.5")
        with pytest.raises(JobFailed, match=r"scheduler .* did not answer within 1\.5 s .*TAGPS_PS_SECRET"):
            PSClient(config)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"DMLC_WORKER_ID": "0"}, "DMLC_WORKER_ID=0 is already registered"),
        ({"DMLC_WORKER_ID": "1", "DMLC_NUM_SERVER": "3"}, "DMLC_NUM_SERVER=3 differs from the scheduler's 1"),
    ],
)
def test_scheduler_rejects_conflicting_registrations(ps_job, override: dict[str, str], message: str) -> None:
    with ps_job(num_workers=2, num_servers=1, server_args=[], env={"PS_HEARTBEAT_TIMEOUT": "2"}) as job:
        # Worker 0 registers by hand; the echo of its heartbeat proves the scheduler has processed it
        # (an unregistered node's heartbeat gets ERROR), so the conflicting registration comes second.
        config = job.client_config(0)
        context = zmq.Context()
        link = SchedulerLink(context, Security(context, None), config, "worker", "127.0.0.1", 0)
        document = {
            "role": "worker",
            "host": "127.0.0.1",
            "port": 0,
            "pid": 1,
            "worker_id": 0,
            "rank": None,
            "num_workers": 2,
            "num_servers": 1,
        }
        link.socket.send_multipart(pack_json(Op.REGISTER, document, sender=0))
        link.beat()
        assert link.socket.poll(20_000) and link.receive() == (Op.HEARTBEAT, 0)
        env = {k: v for k, v in override.items() if k != "DMLC_WORKER_ID"}
        with pytest.raises(JobFailed, match=message):
            PSClient(job.client_config(int(override["DMLC_WORKER_ID"]), **env))
        assert job.scheduler is not None
        job.scheduler.kill()  # the waiting worker then fails within PS_HEARTBEAT_TIMEOUT instead of hanging
        deadline = time.monotonic() + config.heartbeat_timeout + 5
        with pytest.raises(JobFailed, match="sent nothing"):
            while time.monotonic() < deadline:
                link.beat()
                time.sleep(0.05)
        link.close()
        context.term()
