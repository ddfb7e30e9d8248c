"""What the client's data-plane engines (TAGPS_PS_ENGINE) promise beyond the sums: they mix in one job and
both notify a pipe of each push_pull's end, waits leave the GIL to other threads, and pushed buffers are
released once the engine is done with them."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest

from tagps.ps import PSClient

MIXED = """
import os, select, sys, time
import numpy as np
from tagps.ps import PSClient

client = PSClient.from_env()
pipe_r, pipe_w = os.pipe2(os.O_NONBLOCK)
w = client.worker_id
assert client.config.engine == os.environ["TAGPS_PS_ENGINE"]
names = {"a": 7, "b": 40000, "c": 1}   # elements; b spans several 64 KiB partitions
for name, n in names.items():
    client.declare(name, 4 * n, np.float32)
if w < 2:
    client.declare("sub", 4 * 1023, np.float32, workers=[0, 1])
client.barrier()
for rnd in range(3):
    bufs = {name: (np.arange(n) % 89 + 100 * w + rnd).astype(np.float32) for name, n in names.items()}
    if w < 2:
        bufs["sub"] = np.full(1023, w + rnd, np.float32)
    handles = [(name, client.push_pull(name, buf, priority=-i)) for i, (name, buf) in enumerate(bufs.items())]
    for i, (name, handle) in enumerate(handles):  # each tells the pipe it ended (NotifyingWaitable)
        handle.notify(pipe_w, 100 * rnd + i)
    for name, handle in handles:
        client.wait(handle, timeout=60)
    tags, deadline = b"", time.monotonic() + 10
    while len(tags) < 8 * len(handles) and time.monotonic() < deadline:
        select.select([pipe_r], [], [], 1)
        tags += os.read(pipe_r, 4096) if select.select([pipe_r], [], [], 0)[0] else b""
    got = sorted(int.from_bytes(tags[i : i + 8], sys.byteorder) for i in range(0, len(tags), 8))
    if got != [100 * rnd + i for i in range(len(handles))]:
        sys.exit(f"round {rnd}: notified {got}")
    for name, n in names.items():
        expected = sum((np.arange(n) % 89 + 100 * k + rnd).astype(np.float64) for k in range(3)) / 3
        if not np.allclose(bufs[name], expected, rtol=1e-6):
            sys.exit(f"{name} round {rnd}: got {bufs[name][:3]}, expected {expected[:3]}")
    if w < 2 and not np.all(bufs["sub"] == (0 + 1 + 2 * rnd) / 2):
        sys.exit(f"sub round {rnd}: got {bufs['sub'][:3]}")
client.close()
print("mixed ok")
"""


@pytest.mark.timeout(120)
def test_workers_of_both_engines_sum_together(ps_job) -> None:
    env = {"BYTEPS_PARTITION_BYTES": "65536", "BYTEPS_SCHEDULING_CREDIT": "2"}
    with ps_job(num_workers=3, num_servers=2, env=env) as job:
        engines = ["python", "cpp", "cpp"]
        procs = [job.start_worker(w, MIXED, {"TAGPS_PS_ENGINE": e}) for w, e in enumerate(engines)]
        for w, proc in enumerate(procs):
            assert "mixed ok" in job.finish(w, proc, timeout=90).check().stdout
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0, "server1": 0}


LATE = """
import time
import numpy as np
from tagps.ps import PSClient

client = PSClient.from_env()
client.declare("x", 4000, np.float32)
client.barrier()
time.sleep(1.0)   # worker 0 waits for this push meanwhile
client.wait(client.push_pull("x", np.ones(1000, np.float32), average=False), timeout=30)
client.close()
"""


@pytest.mark.timeout(60)
def test_wait_leaves_the_gil_to_other_threads(ps_job) -> None:
    with ps_job(num_workers=2, num_servers=1) as job:
        late = job.start_worker(1, LATE)
        with PSClient(job.client_config(0)) as client:
            client.declare("x", 4000, np.float32)
            client.barrier()
            samples: list[float] = []  # the counting thread's clock, every 10 ms it gets to run
            stop = threading.Event()

            def count() -> None:
                while not stop.is_set():
                    now = time.monotonic()
                    if not samples or now - samples[-1] >= 0.01:
                        samples.append(now)

            buf = np.full(1000, 2.0, np.float32)
            handle = client.push_pull("x", buf, average=False)
            counter = threading.Thread(target=count)
            counter.start()
            start = time.monotonic()
            client.wait(handle, timeout=30)
            end = time.monotonic()
            stop.set()
            counter.join()
            assert np.all(buf == 3.0)
            assert end - start > 0.3, "worker 1 pushed too early for this test"
            inside = [t for t in samples if start + 0.1 < t < end - 0.1]
            assert len(inside) >= 3, f"the other thread ran {len(inside)} times in a {end - start:.2f} s wait"
        job.finish(1, late, timeout=30).check()


@pytest.mark.timeout(60)
def test_pushed_buffers_are_released(ps_job) -> None:
    with ps_job(num_workers=1, num_servers=1) as job:
        with PSClient(job.client_config(0, BYTEPS_PARTITION_BYTES="4096")) as client:
            client.declare("t", 4 * 10000, np.float32)  # 10 chunks
            client.declare("u", 4 * 10, np.float32)
            first = np.arange(10000, dtype=np.float32)
            handle = client.push_pull("t", first, average=False)
            client.wait(handle, timeout=20)
            released = weakref.ref(handle.buffer)  # the view push_pull took of `first`
            del handle
            client.wait(client.push_pull("t", np.zeros(10000, np.float32)), timeout=20)  # replaces it
            # Only the engine can still hold the view; libzmq frees the frames a moment after sending,
            # and the next call from Python releases them.
            deadline = time.monotonic() + 10
            while released() is not None and time.monotonic() < deadline:
                client.wait(client.push_pull("u", np.zeros(10, np.float32)), timeout=20)
                gc.collect()
            assert released() is None, "the engine never released a pushed buffer"
            np.testing.assert_array_equal(first, np.arange(10000, dtype=np.float32))
