"""Keys pushed by a subset of the workers (``PSClient.declare(..., workers=...)``): sums, errors, restore."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tagps.ps import PSClient
from tagps.ps.protocol import (
    FLAG_WORKERS,
    DType,
    Op,
    ProtocolError,
    pack_header,
    pack_workers,
    unpack_workers,
    worker_node_id,
)

PREAMBLE = """
import json, os, sys
import numpy as np
from tagps.ps import PSClient

client = PSClient.from_env()
w = client.worker_id
"""

SUMS = (
    PREAMBLE
    + """
# Workers 0 and 2 sum "sub.*" over {0, 2} while every worker sums "all.*"; worker 1 never sees "sub.*".
sizes = [1, 7, 1023, 40000]   # elements; 40000 float32 span several 64 KiB partitions
names = [f"all.{n}" for n in sizes] + ([f"sub.{n}" for n in sizes] if w != 1 else [])
for i in np.random.default_rng(w).permutation(len(names)):   # declaration order differs per worker
    n = int(names[i].split(".")[1])
    client.declare(names[i], 4 * n, np.float32, workers=[2, 0] if names[i].startswith("sub") else None)
client.barrier()
for rnd in range(3):
    average = rnd == 2
    bufs, handles = {}, []
    for i, name in enumerate(names):
        n = int(name.split(".")[1])
        bufs[name] = (np.arange(n) % 97 + 1000 * (w + 1) + rnd).astype(np.float32)
        handles.append((name, client.push_pull(name, bufs[name], average=average, priority=i % 3)))
    for name, h in handles:
        client.wait(h, timeout=60)
        n = int(name.split(".")[1])
        members = [0, 2] if name.startswith("sub") else [0, 1, 2]
        expected = sum((np.arange(n) % 97 + 1000 * (k + 1) + rnd).astype(np.float64) for k in members)
        if average:
            expected = expected / len(members)
        if not np.array_equal(bufs[name].astype(np.float64), expected):
            sys.exit(f"{name} round {rnd}: got {bufs[name][:3]}, expected {expected[:3]}")
client.close()
print("sums ok")
"""
)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hash_fn", ["djb2", "balanced"])
def test_subset_keys_sum_over_their_workers_only(ps_job, hash_fn: str) -> None:
    env = {"BYTEPS_PARTITION_BYTES": "65536", "BYTEPS_KEY_HASH_FN": hash_fn}
    with ps_job(num_workers=3, num_servers=2, env=env) as job:
        for result in job.run_workers(SUMS, timeout=120):
            assert "sums ok" in result.check().stdout
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0, "server1": 0}


def test_worker_set_frames() -> None:
    assert unpack_workers(pack_workers((0, 2, 7)), 8) == (0, 2, 7)
    for frame, message in [
        (b"", "must be non-empty"),
        (b"\x00\x00\x00", "3 bytes"),
        (pack_workers((2, 0)), "ascending"),
        (pack_workers((1, 1)), "ascending"),
        (pack_workers((0, 8)), "DMLC_NUM_WORKER=8"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            unpack_workers(frame, 8)


@pytest.mark.timeout(60)
def test_client_checks_the_worker_set(ps_job) -> None:
    with ps_job(num_workers=1, num_servers=1) as job:
        with PSClient(job.client_config(0)) as client:
            for workers, error, message in [
                ([], ValueError, "must be non-empty"),
                ([0, 1], ValueError, r"in \[0, DMLC_NUM_WORKER=1\)"),
                ([-1, 0], ValueError, "in"),
                ("0", TypeError, "sequence of worker ids"),
                ([True], TypeError, "sequence of worker ids"),
            ]:
                with pytest.raises(error, match=message):
                    client.declare("t", 8, np.float32, workers=workers)
            client.declare("t", 8, np.float32, workers=(0, 0))  # duplicates collapse
            buf = np.array([3.0, 4.0], np.float32)
            client.wait(client.push_pull("t", buf), timeout=20)
            np.testing.assert_array_equal(buf, [3.0, 4.0])


@pytest.mark.timeout(60)
def test_server_refuses_outsiders_and_disagreeing_worker_sets(ps_job, hand_worker) -> None:
    with ps_job(num_workers=2, num_servers=1) as job:
        hand = hand_worker(job)
        client = PSClient(job.client_config(0))
        try:
            client.declare("x", 1200, np.float32, workers=[0])
            client.flush_declarations()  # answered at once: worker 0 is the key's only worker
            key = client._tensors["x"].chunks[0].key
            assert key >> 63 == 1  # bit 47 of the index: a subset key, not a numbered one
            buf = np.full(300, 5.0, np.float32)
            client.wait(client.push_pull("x", buf, average=True), timeout=20)
            assert np.all(buf == 5.0)  # the mean over one worker, without waiting for worker 1

            hand.connect(*client.servers[0])
            sender = worker_node_id(1)

            def init(workers: tuple[int, ...] | None) -> list[bytes]:
                flags = 0 if workers is None else FLAG_WORKERS
                head = pack_header(
                    Op.INIT, sender=sender, key=key, dtype=DType.FLOAT32, nbytes=1200, flags=flags
                )
                return [head] if workers is None else [head, pack_workers(workers)]

            assert f"worker 1 sent INIT of key {key} for the workers [0], which exclude it" in hand.refused(
                init((0,))
            )
            for workers, said in [((0, 1), "[0, 1]"), (None, "[0, 1]")]:
                reason = hand.refused(init(workers))
                assert (
                    f"key {key} is declared for the workers [0]; this INIT from worker 1 says {said}"
                    in reason
                )
            push = pack_header(Op.PUSH, sender=sender, key=key, dtype=DType.FLOAT32, nbytes=1200)
            assert f"worker 1 is not among the workers [0] of key {key}" in hand.refused([push, bytes(1200)])
            pull = pack_header(Op.PULL, sender=sender, key=key, dtype=DType.FLOAT32, flags=FLAG_WORKERS)
            assert "only INIT carries a worker set" in hand.refused([pull])
            bad = init((0, 1))
            assert "worker set frame has 3 bytes" in hand.refused([bad[0], b"\x00\x00\x01"])
            assert "expected header, worker set" in hand.refused([bad[0]])

            client.wait(client.push_pull("x", buf, average=False), timeout=20)  # still served
            assert np.all(buf == 5.0)
        finally:
            hand.finish()
            client.close()
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0}


SGD = (
    PREAMBLE
    + """
# SGD with lr 1 on the servers: "all" moves by the gradients of both workers, "sub" by worker 1's only.
steps, sub_workers = int(os.environ["STEPS"]), json.loads(os.environ["SUB_WORKERS"])
client.declare("all", 40, np.float32, init=np.full(10, 100.0, np.float32))
if w in sub_workers:
    client.declare("sub", 40, np.float32, init=np.full(10, 100.0, np.float32), workers=sub_workers)
try:
    client.barrier()
except RuntimeError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(3)
out = {"round": client._tensors["sub"].chunks[0].round if w == 1 else None}
for _ in range(steps):
    weights = {"all": np.full(10, w + 1.0, np.float32), "sub": np.full(10, 2.0, np.float32)}
    for name in weights if w == 1 else ["all"]:
        client.wait(client.push_pull(name, weights[name], average=False), timeout=30)
        out[name] = float(weights[name][0])
client.close()
print(json.dumps(out))
"""
)


@pytest.mark.timeout(150)
def test_checkpoint_keeps_the_worker_set(ps_job, tmp_path) -> None:
    env = {"TAGPS_SERVER_OPTIMIZER": "sgd", "TAGPS_SERVER_LR": "1", "PS_HEARTBEAT_TIMEOUT": "3"}
    ckpt = tmp_path / "server0.npz"
    run = {"STEPS": "2", "SUB_WORKERS": "[1]"}
    with ps_job(num_workers=2, num_servers=1, env=env, server_args=[["--checkpoint", str(ckpt)]]) as job:
        first = [json.loads(r.check().stdout) for r in job.run_workers(SGD, env=run)]
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0}
    assert first[1] == {"round": 0, "all": 100.0 - 2 * 3, "sub": 100.0 - 2 * 2}
    with np.load(ckpt) as data:
        meta = json.loads(bytes(data["meta"]))
    assert meta["version"] == 2
    assert sorted(k["workers"] for k in meta["keys"]) == [[0, 1], [1]]
    with ps_job(num_workers=2, num_servers=1, env=env, server_args=[["--restore", str(ckpt)]]) as job:
        second = [json.loads(r.check().stdout) for r in job.run_workers(SGD, env=run)]
    assert second[1] == {"round": 2, "all": 100.0 - 4 * 3, "sub": 100.0 - 4 * 2}
    # The restored key belongs to worker 1 alone: declaring it for both workers is refused, naming both.
    other = {"STEPS": "1", "SUB_WORKERS": "[0, 1]"}
    with ps_job(num_workers=2, num_servers=1, env=env, server_args=[["--restore", str(ckpt)]]) as job:
        results = job.run_workers(SGD, env=other, timeout=30)
    errors = [json.loads(r.stdout)["error"] for r in results if r.returncode == 3]
    assert errors and all("is declared for the workers [1]; this INIT from worker" in e for e in errors)
    assert all(e.endswith("says [0, 1]") for e in errors), errors


V1_RESTORE = (
    PREAMBLE
    + """
client.declare("t", 40, np.float32)
client.barrier()
start = client._tensors["t"].chunks[0].round
buf = np.full(10, w + 1.0, np.float32)
client.wait(client.push_pull("t", buf, average=False), timeout=30)
client.close()
print(json.dumps({"round": start, "sum": float(buf[0])}))
"""
)


@pytest.mark.timeout(60)
def test_version_1_checkpoint_restores_keys_for_every_worker(ps_job, tmp_path) -> None:
    # Written by hand as a server before worker sets wrote it: no "workers" entry.
    meta = {
        "version": 1,
        "rank": 0,
        "optimizer": "none",
        "enable_async": False,
        "keys": [
            {"key": 0, "dtype": int(DType.FLOAT32), "nbytes": 40, "round": 5, "step": 0, "counts": [5, 5]}
        ],
    }
    ckpt = tmp_path / "v1.npz"
    with open(ckpt, "wb") as fh:
        np.savez(fh, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    with ps_job(num_workers=2, num_servers=1, server_args=[["--restore", str(ckpt)]]) as job:
        results = [json.loads(r.check().stdout) for r in job.run_workers(V1_RESTORE, timeout=40)]
    assert results == [{"round": 5, "sum": 3.0}] * 2
