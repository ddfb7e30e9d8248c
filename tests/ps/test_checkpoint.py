"""Periodic server checkpoints (``--checkpoint-every``): written atomically while serving, at step boundaries,
and a server killed with SIGKILL restores the last one and continues exactly (SGD with momentum); the Python
and C++ engines write the same file and restore each other's."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from bpslaunch_job import PS_ENGINES

from tagps import _core
from tagps.config import ps_config
from tagps.ps.server import SummationServer

SGD = """
import os, time
import numpy as np
from tagps.ps import PSClient

client = PSClient.from_env()
w = client.worker_id
first, steps = int(os.environ["FIRST_STEP"]), int(os.environ["STEPS"])
sizes = {"p": 1000, "q": 20000}  # q spans two 64 KiB partitions: three server keys in all
for name, size in sizes.items():
    client.declare(name, size * 4, np.float32, init=np.linspace(-1, 1, size, dtype=np.float32))
for step in range(first, first + steps):
    for name, size in sizes.items():
        buf = np.sin(np.arange(size, dtype=np.float32) * (step + 1) + w).astype(np.float32)
        client.wait(client.push_pull(name, buf), timeout=30)
        np.save(os.path.join(os.environ["OUT"], f"w{w}-{name}{step}.npy"), buf)  # the weights after it
print("done", flush=True)
if os.environ.get("HANG"):
    time.sleep(600)  # never shut down cleanly: the server's last checkpoint is the periodic one
client.close()
"""

ENV = {
    "TAGPS_SERVER_OPTIMIZER": "sgd",
    "TAGPS_SERVER_LR": "0.05",
    "TAGPS_SERVER_MOMENTUM": "0.9",  # a momentum buffer: state beyond the weights must survive too
    "BYTEPS_PARTITION_BYTES": "65536",
}


def _checkpoint(path: Path) -> tuple[set[int], np.ndarray]:
    """The rounds of the checkpoint's keys and all their weights, sorted (partitioning aside)."""
    with np.load(path) as data:
        meta = json.loads(bytes(data["meta"]))
        values = np.sort(np.concatenate([data[f"value_{k['key']}"] for k in meta["keys"]]))
    return {k["round"] for k in meta["keys"]}, values


@pytest.mark.timeout(150)
def test_a_server_killed_with_sigkill_restores_the_last_periodic_checkpoint(ps_job, tmp_path) -> None:
    ckpt = tmp_path / "ckpt" / "server0.npz"
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    save = [["--checkpoint", str(ckpt), "--checkpoint-every", "2"]]
    with ps_job(num_workers=2, num_servers=1, env=ENV, server_args=save) as job:
        env = {"FIRST_STEP": "0", "STEPS": "5", "HANG": "1", "OUT": str(first)}
        procs = [job.start_worker(w, SGD, env) for w in (0, 1)]
        assert procs[0].stdout is not None
        assert procs[0].stdout.readline() == "done\n", job.output(procs[0])
        # Rounds 2 and 4 were step boundaries: the writer thread saves the copy of round 4 (not 5).
        deadline = time.monotonic() + 20
        while not (ckpt.exists() and _checkpoint(ckpt)[0] == {4}):
            assert time.monotonic() < deadline, "no checkpoint of round 4"
            time.sleep(0.05)
        os.killpg(job.servers[0].pid, signal.SIGKILL)
        assert job.servers[0].wait(timeout=10) == -signal.SIGKILL
    assert [p.name for p in ckpt.parent.iterdir()] == ["server0.npz"]  # no temporary left
    _, saved = _checkpoint(ckpt)
    weights = np.concatenate([np.load(first / "w0-p3.npy"), np.load(first / "w0-q3.npy")])
    np.testing.assert_array_equal(saved, np.sort(weights))
    # A new job restores it: step 4 again gives exactly the weights of the first job's step 4 (momentum
    # buffer, weights and rounds came back).
    restore = [["--restore", str(ckpt)]]
    with ps_job(num_workers=2, num_servers=1, env=ENV, server_args=restore) as job:
        for result in job.run_workers(SGD, env={"FIRST_STEP": "4", "STEPS": "1", "OUT": str(second)}):
            result.check()
    for name in ("w0-p4.npy", "w0-q4.npy", "w1-p4.npy"):
        np.testing.assert_array_equal(np.load(second / name), np.load(first / name))


@pytest.mark.parametrize(
    ("every", "checkpoint", "async_mode"), [(0, "c.npz", False), (2, None, False), (2, "c.npz", True)]
)
def test_checkpoint_every_needs_a_path_sync_mode_and_a_positive_count(
    every: int, checkpoint: str | None, async_mode: bool
) -> None:
    config = ps_config(
        {"DMLC_ROLE": "server", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
         "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9",
         "BYTEPS_ENABLE_ASYNC": str(int(async_mode))}
    )  # fmt: skip
    with pytest.raises(ValueError, match="checkpoint_every"):
        SummationServer(config, checkpoint=checkpoint, checkpoint_every=every)


@pytest.mark.timeout(180)
@pytest.mark.skipif(not _core.HAVE_NET, reason="TAGPS_PS_ENGINE=cpp: tagps._core was built without libzmq")
def test_both_engines_write_the_same_checkpoint_and_restore_each_others(ps_job_class, tmp_path) -> None:
    ckpt = {engine: tmp_path / f"{engine}.npz" for engine in PS_ENGINES}
    outputs = {}
    for engine in PS_ENGINES:
        (tmp_path / engine).mkdir()
        job_args = [["--checkpoint", str(ckpt[engine])]]
        with ps_job_class(num_workers=2, num_servers=1, env=ENV, server_args=job_args, engine=engine) as job:
            env = {"FIRST_STEP": "0", "STEPS": "3", "OUT": str(tmp_path / engine)}
            for result in job.run_workers(SGD, env=env):
                result.check()
            assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0}
    with np.load(ckpt["python"]) as py_data, np.load(ckpt["cpp"]) as cpp_data:
        assert json.loads(bytes(py_data["meta"])) == json.loads(bytes(cpp_data["meta"]))
        assert sorted(py_data.files) == sorted(cpp_data.files)
        for name in py_data.files:
            np.testing.assert_array_equal(py_data[name], cpp_data[name], err_msg=name)
    # Each engine restores the other's checkpoint and continues exactly as the writer would.
    for writer, reader in [("python", "cpp"), ("cpp", "python")]:
        out = tmp_path / f"{writer}-to-{reader}"
        out.mkdir()
        job_args = [["--restore", str(ckpt[writer])]]
        with ps_job_class(num_workers=2, num_servers=1, env=ENV, server_args=job_args, engine=reader) as job:
            for result in job.run_workers(SGD, env={"FIRST_STEP": "3", "STEPS": "2", "OUT": str(out)}):
                result.check()
        outputs[writer] = out
    for name in ("w0-p4.npy", "w0-q4.npy", "w1-q3.npy"):
        np.testing.assert_array_equal(np.load(outputs["python"] / name), np.load(outputs["cpp"] / name))
