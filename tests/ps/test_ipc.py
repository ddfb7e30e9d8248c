"""Shared memory between workers and servers on one host (``TAGPS_PS_IPC``, BytePS's IPC mode).

A cpp worker offers a server that advertises its own address each chunk's bytes in a memfd segment; a cpp
server that sums (sync mode, no server optimizer) maps it, and the PUSH and PULL_REPLY then carry headers
only. Everything else goes over TCP: a worker with ``TAGPS_PS_IPC=0``, an async server, a Python server,
and any offer the server cannot map. Sums must be exact either way, in any mix.
"""

from __future__ import annotations

import dataclasses
import io
import json
import mmap
import os
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tagps import _core
from tagps.launcher import local_job, run_processes
from tagps.ps import PSClient
from tagps.ps.protocol import (
    FLAG_IPC,
    FLAG_WORKERS,
    IPC_DESCRIPTOR_SIZE,
    DType,
    Op,
    pack_header,
    pack_workers,
    unpack_header,
    worker_node_id,
)

pytestmark = pytest.mark.skipif(not _core.HAVE_NET, reason="the IPC path is the cpp engine's (no libzmq)")

WORKER = """
import json, os
import numpy as np
from tagps.ps import PSClient

client = PSClient.from_env()
w, dtype, average = client.worker_id, np.dtype(os.environ["DTYPE"]), os.environ["AVERAGE"] == "1"
sizes = {"big": 50000, "small": 3}  # big: 4 float32 chunks of 64 KiB over both servers
for name, n in sizes.items():
    client.declare(name, n * dtype.itemsize, dtype)
out = {"ipc_chunks": None, "results": {}}
for step in range(3):
    for name, n in sizes.items():
        buf = (np.arange(n) % 7 + w + step).astype(dtype)
        client.wait(client.push_pull(name, buf, average=average), timeout=30)
        out["results"][f"{name}.{step}"] = buf.astype(np.float64).tolist()
out["ipc_chunks"] = client._engine.ipc_chunks if client._engine is not None else 0
client.close()
print(json.dumps(out))
"""
STEPS, WORKERS = 3, 2


def _expected(n: int, step: int, average: bool) -> np.ndarray:
    total = sum(np.arange(n) % 7 + w + step for w in range(WORKERS)).astype(np.float64)
    return total / WORKERS if average else total


def _run(job: Any, tmp_path: Path, ipc_by_worker: list[bool], dtype: str, average: bool) -> tuple[list, int]:
    """Run WORKER on both workers; return their outputs and the ipc_pushes of both servers."""
    procs = [
        job.start_worker(
            w, WORKER, {"TAGPS_PS_IPC": str(int(on)), "DTYPE": dtype, "AVERAGE": str(int(average))}
        )
        for w, on in enumerate(ipc_by_worker)
    ]
    outs = [json.loads(job.finish(w, p, 60).check().stdout) for w, p in enumerate(procs)]
    assert set(job.wait_infrastructure().values()) == {0}
    pushes = sum(json.loads((tmp_path / f"stats{s}.json").read_text())["ipc_pushes"] for s in range(2))
    return outs, pushes


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("ipc_by_worker", "dtype", "average"),
    [
        ([True, True], "float32", True),
        ([True, True], "float16", False),
        ([True, False], "float32", False),  # one region, one TCP push: the sum goes into the TCP message
        ([False, False], "float32", True),
    ],
)
def test_colocated_workers_share_memory_with_the_servers_and_sums_stay_exact(
    ps_job_class, tmp_path, ipc_by_worker, dtype, average
) -> None:
    args = [["--stats", str(tmp_path / f"stats{s}.json")] for s in range(2)]
    env = {"BYTEPS_PARTITION_BYTES": "65536", "BYTEPS_KEY_HASH_FN": "balanced"}
    with ps_job_class(num_workers=WORKERS, num_servers=2, env=env, server_args=args, engine="cpp") as job:
        outs, pushes = _run(job, tmp_path, ipc_by_worker, dtype, average)
    itemsize = np.dtype(dtype).itemsize
    chunks = -(-50000 * itemsize // 65536) + 1
    for w, out in enumerate(outs):
        assert out["ipc_chunks"] == (chunks if ipc_by_worker[w] else 0)
        for step in range(STEPS):
            for name, n in {"big": 50000, "small": 3}.items():
                np.testing.assert_array_equal(out["results"][f"{name}.{step}"], _expected(n, step, average))
    assert pushes == sum(ipc_by_worker) * chunks * STEPS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("server", ["async", "python"])
def test_servers_that_cannot_share_memory_decline_and_tcp_carries_the_chunks(
    ps_job_class, tmp_path, server
) -> None:
    args = [["--stats", str(tmp_path / f"stats{s}.json")] for s in range(2)]
    env = {"BYTEPS_PARTITION_BYTES": "65536", "BYTEPS_ENABLE_ASYNC": str(int(server == "async"))}
    with ps_job_class(
        num_workers=WORKERS,
        num_servers=2,
        env=env,
        server_args=args,
        engine="cpp",
        server_engine="python" if server == "python" else None,
    ) as job:
        outs, pushes = _run(job, tmp_path, [True, True], "float32", False)
    assert [out["ipc_chunks"] for out in outs] == [0, 0]
    assert pushes == 0
    if server == "python":  # sync: the sums are exact (async results depend on timing)
        for out in outs:
            np.testing.assert_array_equal(out["results"]["big.2"], _expected(50000, 2, False))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers", [1, 2])
def test_local_machines_share_memory_only_with_their_own_servers(tmp_path, servers) -> None:
    """``bpslaunch --local 2``: machine w on 127.0.0.<w+1>, server s on machine s mod 2, as real machines."""
    specs = local_job(
        [sys.executable, "-c", WORKER],
        2,
        servers,
        1,
        {**os.environ, "DTYPE": "float32", "AVERAGE": "0", "BYTEPS_PARTITION_BYTES": "65536"},
    )
    for i, spec in enumerate(specs[1 : 1 + servers], start=1):
        specs[i] = dataclasses.replace(
            spec, argv=(*spec.argv, "--stats", str(tmp_path / f"stats{i - 1}.json"))
        )
    log = io.BytesIO()
    assert run_processes(specs, out=log) == 0, log.getvalue().decode(errors="replace")
    outs = {}
    for line in log.getvalue().decode().splitlines():
        label, _, payload = line.partition("] ")
        if label.startswith("[worker") and payload.startswith("{"):
            outs[int(label.split()[1].split(".")[0])] = json.loads(payload)
    for out in outs.values():
        for step in range(STEPS):
            np.testing.assert_array_equal(out["results"][f"big.{step}"], _expected(50000, step, False))
    chunks = -(-50000 * 4 // 65536) + 1  # each lives on one server, whose machine is one of the two
    shared = [outs[w]["ipc_chunks"] for w in range(2)]
    if servers == 1:
        assert shared == [chunks, 0]
    else:
        assert sum(shared) == chunks and min(shared) > 0
    pushes = sum(json.loads((tmp_path / f"stats{s}.json").read_text())["ipc_pushes"] for s in range(servers))
    assert pushes == chunks * STEPS


def _descriptor(pid: int, fd: int, nonce: int, segment: int, offset: int) -> bytes:
    frame = struct.pack("<IiQQQ", pid, fd, nonce, segment, offset)
    assert len(frame) == IPC_DESCRIPTOR_SIZE
    return frame


@pytest.mark.timeout(60)
def test_server_maps_a_checked_segment_and_refuses_what_it_did_not_take(
    ps_job, ps_engine, hand_worker
) -> None:
    with ps_job(num_workers=2, num_servers=1) as job:
        hand = hand_worker(job)
        client = PSClient(job.client_config(0, TAGPS_PS_IPC="0"))
        segment = os.memfd_create("tagps-test-ipc")
        region = None
        try:
            client.declare("x", 1200, np.float32)
            declared = threading.Thread(target=client.flush_declarations)
            declared.start()
            deadline = time.monotonic() + 20
            while "x" not in client._tensors and time.monotonic() < deadline:
                time.sleep(0.01)
            key = client._tensors["x"].chunks[0].key
            hand.connect(*client.servers[0])
            sender = worker_node_id(1)

            def init(key: int, descriptor: bytes, workers: tuple[int, ...] | None = None) -> list[bytes]:
                flags = FLAG_IPC | (FLAG_WORKERS if workers else 0)
                head = pack_header(
                    Op.INIT, sender=sender, key=key, dtype=DType.FLOAT32, nbytes=1200, flags=flags
                )
                return [head, *([pack_workers(workers)] if workers else []), descriptor]

            # A descriptor of the wrong size is refused; FLAG_IPC belongs to INIT and PUSH only.
            assert "shared-memory descriptor of 5 bytes, expected 32" in hand.refused(init(key, bytes(5)))
            pull = pack_header(Op.PULL, sender=sender, key=key, dtype=DType.FLOAT32, flags=FLAG_IPC)
            assert "only INIT and PUSH carry it" in hand.refused([pull])

            size = 4096 + 1216
            os.ftruncate(segment, size)
            region = mmap.mmap(segment, size)
            region[:8] = struct.pack("<Q", 0x1234)
            # A key of worker 1 alone, offered with the wrong nonce: acknowledged without FLAG_IPC, and a
            # PUSH that says its bytes are shared is refused.
            own = (1 << 63) | 7 << 16
            ack = unpack_header(
                hand.answer(init(own, _descriptor(os.getpid(), segment, 0x999, size, 4096), (1,)))[0]
            )
            assert ack.op == Op.INIT_ACK and not ack.flags & FLAG_IPC
            push = pack_header(Op.PUSH, sender=sender, key=own, dtype=DType.FLOAT32, flags=FLAG_IPC)
            reason = hand.refused([push])
            assert (
                f"PUSH with FLAG_IPC of key {own} from worker 1, whose shared memory this server did not take"
                in reason
            )

            # The right nonce: a cpp server maps the segment; the Python engine never does.
            reply = hand.answer(init(key, _descriptor(os.getpid(), segment, 0x1234, size, 4096)))
            declared.join(timeout=20)
            ack = unpack_header(reply[0])
            assert ack.op == Op.INIT_ACK
            assert bool(ack.flags & FLAG_IPC) == (ps_engine == "cpp")
            if ps_engine == "cpp":
                buf = np.full(300, 1.0, np.float32)
                handle = client.push_pull("x", buf, average=False)
                np.frombuffer(region, np.float32, 300, 4096)[:] = 2.0
                push = pack_header(Op.PUSH, sender=sender, key=key, dtype=DType.FLOAT32, flags=FLAG_IPC)
                assert unpack_header(hand.answer([push])[0]).op == Op.PUSH_ACK
                reply = hand.answer([pack_header(Op.PULL, sender=sender, key=key, dtype=DType.FLOAT32)])
                head = unpack_header(reply[0])
                assert (head.op, head.nbytes, len(reply), bool(head.flags & FLAG_IPC)) == (
                    Op.PULL_REPLY,
                    0,
                    1,
                    True,
                )
                assert np.all(np.frombuffer(region, np.float32, 300, 4096) == 3.0)  # the sum, in the region
                client.wait(handle, timeout=20)
                assert np.all(buf == 3.0)
        finally:
            hand.finish()
            client.close()
            del region
            os.close(segment)
