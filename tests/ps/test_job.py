"""End-to-end PS jobs: 1 scheduler + servers + worker machines as real processes on 127.0.0.1."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

PREAMBLE = """
import json, os, sys, time
import numpy as np
from tagps.ps import PSClient

def values(n, dtype, worker, rnd):
    base = (np.arange(n) % 97 + 3 * worker + rnd).astype(np.float32)
    if dtype == "bfloat16":  # small integers: the top 16 bits of their float32 are exact bfloat16
        return (base.view(np.uint32) >> 16).astype(np.uint16)
    return base.astype(dtype)

def as_float(array, dtype):
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return array.astype(np.float64)

client = PSClient.from_env()
w = client.worker_id
"""

SUMS = (
    PREAMBLE
    + """
dtypes = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
sizes = [0, 1, 7, 1023, 40000]   # elements; 40000 spans several 64 KiB partitions for every dtype
names = [f"{d}-{n}" for d in dtypes for n in sizes]
rng = np.random.default_rng(w)   # each worker declares in a different order: keys must still agree
for i in rng.permutation(len(names)):
    d, n = names[i].split("-")
    np_dtype = np.uint16 if d == "bfloat16" else np.dtype(d)
    client.declare(names[i], int(n) * np.dtype(np_dtype).itemsize, np_dtype)
client.barrier()
for rnd in range(3):
    average = rnd == 2
    bufs, handles = {}, []
    for i, name in enumerate(names):
        d, n = name.split("-")
        bufs[name] = values(int(n), d, w, rnd)
        avg = average and not d.startswith("int")
        handles.append((name, avg, client.push_pull(name, bufs[name], average=avg, priority=i % 3)))
    for name, avg, h in handles:
        client.wait(h, timeout=60)
        d, n = name.split("-")
        expected = sum(as_float(values(int(n), d, k, rnd), d) for k in range(client.num_workers))
        if avg:
            expected = expected / client.num_workers
        got = as_float(bufs[name], d)
        if not np.array_equal(got, expected):
            sys.exit(f"{name} round {rnd}: got {got[:5]}, expected {expected[:5]}")
client.close()
print("sums ok")
"""
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hash_fn", ["djb2", "balanced"])
def test_sums_many_keys_sizes_dtypes(ps_job, hash_fn: str, tmp_path) -> None:
    env = {
        "BYTEPS_PARTITION_BYTES": "65536",
        "BYTEPS_KEY_HASH_FN": hash_fn,
        "BYTEPS_SCHEDULING_CREDIT": "4",
        "BYTEPS_TRACE_ON": "1",
        "BYTEPS_TRACE_DIR": str(tmp_path),
        "BYTEPS_TRACE_START_STEP": "1",
        "BYTEPS_TRACE_END_STEP": "1",
    }
    with ps_job(num_workers=2, num_servers=2, env=env) as job:
        for result in job.run_workers(SUMS, timeout=90):
            assert "sums ok" in result.check().stdout
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0, "server1": 0}
    for worker in (0, 1):
        events = json.loads((tmp_path / str(worker) / "comm.json").read_text())["traceEvents"]
        # Step 1 of every non-empty tensor (6 dtypes x 4 non-zero sizes), nothing else.
        assert len(events) == 24 and {e["args"]["step"] for e in events} == {1}
        assert all(e["dur"] > 0 and e["pid"] == worker for e in events)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("module", "env", "variable"),
    [
        ("tagps.server", {"DMLC_ROLE": "worker"}, "DMLC_ROLE"),
        ("tagps.scheduler", {"DMLC_NUM_WORKER": "two"}, "DMLC_NUM_WORKER"),
        ("tagps.server", {"TAGPS_SERVER_OPTIMIZER": "lion"}, "TAGPS_SERVER_OPTIMIZER"),
    ],
)
def test_entry_points_exit_2_naming_a_bad_variable(
    ps_job, module: str, env: dict[str, str], variable: str
) -> None:
    with ps_job(num_workers=1, num_servers=1, start_scheduler=False, server_args=[]) as job:
        proc = job.spawn([sys.executable, "-m", module], env)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and variable in err, err


ASYNC = (
    PREAMBLE
    + """
n = 1000
client.declare("w", n * 4, np.float32, init=np.full(n, 100.0, np.float32))
client.barrier()
rounds, seen = 6, []
for rnd in range(rounds):
    if w == 1:
        time.sleep(0.05)   # a slow worker: with TAGPS_MAX_STALENESS=0 the fast one must wait for it
    buf = np.full(n, float(w + 1), np.float32)   # the delta of this round
    client.wait(client.push_pull("w", buf, average=False), timeout=30)
    seen.append(float(buf[0]))
client.barrier()
final = np.zeros(n, np.float32)
client.wait(client.push_pull("w", final, average=False), timeout=30)
client.barrier()
print(json.dumps({"seen": seen, "final": float(final[0]), "uniform": bool(np.all(final == final[0]))}))
client.close()
"""
)


@pytest.mark.timeout(120)
def test_async_mode_with_bounded_staleness(ps_job) -> None:
    env = {"BYTEPS_ENABLE_ASYNC": "1", "TAGPS_MAX_STALENESS": "0"}
    with ps_job(num_workers=2, num_servers=2, env=env) as job:
        results = [json.loads(r.check().stdout.strip().splitlines()[-1]) for r in job.run_workers(ASYNC)]
    for worker, result in enumerate(results):
        assert result["uniform"]
        assert result["final"] == 100.0 + 6 * (1 + 2)  # every delta added exactly once
        for rnd, value in enumerate(result["seen"]):
            # Staleness 0: the pull of round r sees every worker's deltas of rounds <= r; the other
            # worker may be one push ahead, never this worker itself.
            low = 100.0 + (rnd + 1) * 3
            other = 2 - worker  # the other worker's delta (worker 0 pushes 1.0, worker 1 pushes 2.0)
            assert low <= value <= low + other, (worker, rnd, value)


ADAM = (
    PREAMBLE
    + """
n, first, steps = 777, int(os.environ["FIRST_STEP"]), int(os.environ["STEPS"])
client.declare("p", n * 4, np.float32, init=np.linspace(-1, 1, n, dtype=np.float32))
client.declare("q", 40000 * 4, np.float32, init=np.linspace(2, 3, 40000, dtype=np.float32))
out = {}
for step in range(first, first + steps):
    for name, size in (("p", n), ("q", 40000)):
        grad = np.sin(np.arange(size, dtype=np.float32) * (step + 1) + w).astype(np.float32)
        client.wait(client.push_pull(name, grad), timeout=30)
        out[name] = grad.tolist()
client.close()
if w == 0:
    print(json.dumps(out))
"""
)


def _torch_adam(steps: int) -> dict[str, np.ndarray]:
    torch = pytest.importorskip("torch")
    result = {}
    for name, init in (
        ("p", np.linspace(-1, 1, 777, dtype=np.float32)),
        ("q", np.linspace(2, 3, 40000, dtype=np.float32)),
    ):
        param = torch.nn.Parameter(torch.from_numpy(init.copy()))
        opt = torch.optim.Adam([param], lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
        for step in range(steps):
            grads = [
                np.sin(np.arange(init.size, dtype=np.float32) * (step + 1) + w).astype(np.float32)
                for w in (0, 1)
            ]
            param.grad = torch.from_numpy(grads[0] + grads[1])
            opt.step()
        result[name] = param.detach().numpy()
    return result


@pytest.mark.timeout(150)
def test_server_adam_matches_torch_and_survives_restore(ps_job, tmp_path) -> None:
    env = {
        "TAGPS_SERVER_OPTIMIZER": "adam",
        "TAGPS_SERVER_LR": "0.01",
        "TAGPS_SERVER_BETAS": "0.9,0.99",
        "TAGPS_SERVER_EPS": "1e-6",
        "TAGPS_SERVER_WEIGHT_DECAY": "0.1",
        "BYTEPS_PARTITION_BYTES": "65536",
    }
    ckpt = [tmp_path / "server0.npz", tmp_path / "server1.npz"]
    save = [["--checkpoint", str(p)] for p in ckpt]
    with ps_job(num_workers=2, num_servers=2, env=env, server_args=save) as job:
        results = job.run_workers(ADAM, env={"FIRST_STEP": "0", "STEPS": "3"})
        first = json.loads(results[0].check().stdout)
        results[1].check()
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0, "server1": 0}
    expected = _torch_adam(3)
    for name in ("p", "q"):
        np.testing.assert_allclose(first[name], expected[name], rtol=1e-5, atol=1e-6)
    assert all(p.exists() for p in ckpt)
    # A new job whose servers restore the checkpoints continues where the first stopped.
    restore = [["--restore", str(p)] for p in ckpt]
    with ps_job(num_workers=2, num_servers=2, env=env, server_args=restore) as job:
        results = job.run_workers(ADAM, env={"FIRST_STEP": "3", "STEPS": "2"})
        second = json.loads(results[0].check().stdout)
        results[1].check()
    expected = _torch_adam(5)
    for name in ("p", "q"):
        np.testing.assert_allclose(second[name], expected[name], rtol=1e-5, atol=1e-6)


KILLED = (
    PREAMBLE
    + """
client.declare("x", 4000, np.float32)
client.barrier()
buf = np.ones(1000, np.float32)
client.wait(client.push_pull("x", buf), timeout=30)
if w == 1:
    os.kill(os.getpid(), 9)
start = time.monotonic()
try:
    for _ in range(100):
        client.wait(client.push_pull("x", buf))   # no timeout: only the failure notice can end this
except RuntimeError as exc:
    print(json.dumps({"elapsed": time.monotonic() - start, "error": str(exc)}))
    sys.exit(3)
"""
)


@pytest.mark.timeout(60)
def test_killed_worker_fails_the_job_fast_naming_it(ps_job) -> None:
    with ps_job(num_workers=2, num_servers=2, env={"PS_HEARTBEAT_TIMEOUT": "2"}) as job:
        survivor, killed = job.run_workers(KILLED, timeout=30)
        assert killed.returncode == -9
        assert survivor.returncode == 3, survivor.stderr
        report = json.loads(survivor.stdout.strip().splitlines()[-1])
        assert re.search(r"worker 1 \(pid \d+ on 127\.0\.0\.1\) failed", report["error"]), report
        assert report["elapsed"] < 2 + 2.0  # PS_HEARTBEAT_TIMEOUT plus a poll interval and slack
        codes = job.wait_infrastructure()
        assert codes == {"scheduler": 1, "server0": 1, "server1": 1}


STEADY = (
    PREAMBLE
    + """
client.declare("x", 4000, np.float32)
client.barrier()
buf = np.ones(1000, np.float32)
client.wait(client.push_pull("x", buf), timeout=30)
print("running", flush=True)
start = None
try:
    while True:
        start = time.monotonic()
        client.wait(client.push_pull("x", buf))   # no timeout: only the failure notice can end this
except RuntimeError as exc:
    print(json.dumps({"elapsed": time.monotonic() - start, "error": str(exc)}))
    sys.exit(3)
"""
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("victim", "message"),
    [
        ("server", r"server \d \(pid {pid} on 127\.0\.0\.1\) failed"),
        ("scheduler", r"the scheduler at 127\.0\.0\.1:\d+ sent nothing for 2 s"),
    ],
)
def test_killed_server_or_scheduler_fails_the_workers_naming_it(ps_job, victim: str, message: str) -> None:
    with ps_job(num_workers=2, num_servers=2, env={"PS_HEARTBEAT_TIMEOUT": "2"}) as job:
        workers = [job.start_worker(i, STEADY) for i in range(2)]
        for proc in workers:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "running"
        process = job.servers[1] if victim == "server" else job.scheduler
        assert process is not None
        process.kill()
        for worker_id, proc in enumerate(workers):
            result = job.finish(worker_id, proc, timeout=20)
            assert result.returncode == 3, result.stderr
            report = json.loads(result.stdout.strip().splitlines()[-1])
            assert re.search(message.format(pid=process.pid), report["error"]), report
            assert report["elapsed"] < 2 + 2.0


@pytest.mark.parametrize("role", ["scheduler", "server"])
def test_a_service_starts_without_torch(role: str) -> None:
    # Importing torch costs a scheduler or server a second to start and another to exit, which every
    # failure of a job waits on (a server's import of the PS client pulled it in once).
    import subprocess

    code = f"import sys, tagps.{role}; print(sorted(m for m in ('torch', 'tagps.comm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
