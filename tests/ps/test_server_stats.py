"""``SummationServer.stats()`` (``python -m tagps.server --stats PATH``): the rounds, messages and summation
counters of a job's server, on both engines, in sync and async mode."""

from __future__ import annotations

import json

import pytest

WORKER = """
import os
import numpy as np
from tagps.ps import PSClient

client = PSClient.from_env()
average = os.environ["AVERAGE"] == "1"
client.declare("g", 20000 * 4, np.float32)  # two 64 KiB partitions: 65536 + 14464 bytes
for step in range(3):
    buf = np.full(20000, client.worker_id + step, dtype=np.float32)
    client.wait(client.push_pull("g", buf, average=average), timeout=30)
client.close()
"""
NBYTES, CHUNKS, STEPS, WORKERS = 20000 * 4, 2, 3, 2


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("async_mode", "average"), [(False, False), (False, True), (True, False)])
def test_stats_count_every_round_message_and_summed_byte(ps_job, tmp_path, async_mode, average) -> None:
    path = tmp_path / "stats.json"
    env = {"BYTEPS_PARTITION_BYTES": "65536", "BYTEPS_ENABLE_ASYNC": str(int(async_mode))}
    with ps_job(num_workers=WORKERS, num_servers=1, env=env, server_args=[["--stats", str(path)]]) as job:
        for result in job.run_workers(WORKER, env={"AVERAGE": str(int(average))}):
            result.check()
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0}
    stats = json.loads(path.read_text())
    # Per worker and key: one INIT, then a PUSH and a PULL per step.
    assert stats["messages"] == WORKERS * CHUNKS * (1 + 2 * STEPS)
    # Sync: a round per key and step folds both pushes; async: every push is added into the store.
    assert stats["rounds"] == (0 if async_mode else CHUNKS * STEPS)
    assert stats["sum_calls"] == CHUNKS * STEPS * (WORKERS if async_mode else 1)
    assert stats["sum_bytes"] == WORKERS * STEPS * NBYTES
    assert stats["sum_seconds"] > 0
    assert 0 < stats["sum_cpu_seconds"] <= stats["sum_seconds"] * 1.5 + 1e-3
