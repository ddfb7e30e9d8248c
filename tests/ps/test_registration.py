"""Registration never hangs: a missing scheduler, server or worker fails every waiting node within
PS_REGISTER_TIMEOUT with an error that names what is missing (real processes on 127.0.0.1)."""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

REGISTER = """
import json, sys, time
from tagps.ps import PSClient
start = time.monotonic()
try:
    client = PSClient.from_env()
except RuntimeError as exc:
    print(json.dumps({"elapsed": time.monotonic() - start, "error": str(exc)}))
    sys.exit(3)
client.close()
print(json.dumps({"elapsed": time.monotonic() - start, "error": None}))
"""

TIMEOUT = 3.0
FAST = {"PS_REGISTER_TIMEOUT": f"{TIMEOUT:g}", "PS_HEARTBEAT_TIMEOUT": "2"}


def _report(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(30)
def test_worker_without_a_scheduler_fails_in_time(ps_job) -> None:
    with ps_job(num_workers=1, num_servers=1, server_args=[], start_scheduler=False, env=FAST) as job:
        result = job.finish(0, job.start_worker(0, REGISTER), timeout=20)
        assert result.returncode == 3, result.stderr
        report = _report(result)
        expected = rf"scheduler at 127\.0\.0\.1:{job.port} did not answer within 3 s \(PS_REGISTER_TIMEOUT\)"
        assert re.search(expected, report["error"]), report
        # Meanwhile it said that it waits, so that a wrong address is not a silent two-minute hang.
        notice = rf"no answer from the scheduler at 127\.0\.0\.1:{job.port} after \d+ s; waiting up to 3 s"
        assert re.search(notice, result.stderr), result.stderr
        # Longer than PS_HEARTBEAT_TIMEOUT (a scheduler may start late), shorter than the register timeout
        # plus a poll interval and slack.
        assert TIMEOUT <= report["elapsed"] < TIMEOUT + 2.0, report


@pytest.mark.timeout(30)
def test_server_without_a_scheduler_exits_1_in_time(ps_job) -> None:
    with ps_job(num_workers=1, num_servers=1, start_scheduler=False, env=FAST) as job:
        start = time.monotonic()
        codes = job.wait_infrastructure(timeout=20)
        elapsed = time.monotonic() - start
        stderr = job.output(job.servers[0])
        assert codes == {"server0": 1}, stderr
        assert re.search(rf"scheduler at 127\.0\.0\.1:{job.port} did not answer within 3 s", stderr), stderr
        assert elapsed < TIMEOUT + 4.0  # interpreter start-up included


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("num_workers", "num_servers", "started_servers", "message"),
    [
        (1, 2, 1, r"only 1 of 2 servers registered within 3 s \(PS_REGISTER_TIMEOUT\); missing: 1 server"),
        (2, 1, 1, r"only 1 of 2 workers registered within 3 s \(PS_REGISTER_TIMEOUT\); missing: worker 1"),
        (2, 2, 0, r"only 1 of 2 workers and 0 of 2 servers registered within 3 s .*: worker 1, 2 servers"),
    ],
)
def test_missing_node_fails_the_waiting_nodes_and_the_scheduler(
    ps_job, num_workers: int, num_servers: int, started_servers: int, message: str
) -> None:
    server_args: list[list[str]] = [[] for _ in range(started_servers)]
    with ps_job(num_workers=num_workers, num_servers=num_servers, server_args=server_args, env=FAST) as job:
        result = job.finish(0, job.start_worker(0, REGISTER), timeout=20)  # worker 1, if any, never starts
        assert result.returncode == 3, result.stderr
        report = _report(result)
        assert re.search(rf"the scheduler gave up: {message}", report["error"]), report
        assert report["elapsed"] < TIMEOUT + 2.0, report
        codes = job.wait_infrastructure(timeout=10)
        assert job.scheduler is not None
        scheduler_err = job.output(job.scheduler)
        assert codes == {"scheduler": 1, **{f"server{i}": 1 for i in range(started_servers)}}, scheduler_err
        assert re.search(rf"registration timed out: {message}", scheduler_err), scheduler_err
        for server in job.servers:
            assert re.search(message, job.output(server))


@pytest.mark.timeout(30)
def test_scheduler_that_starts_late_is_waited_for(ps_job) -> None:
    # The worker and server start first and wait longer than PS_HEARTBEAT_TIMEOUT for the scheduler.
    env = {"PS_REGISTER_TIMEOUT": "15", "PS_HEARTBEAT_TIMEOUT": "1"}
    with ps_job(num_workers=1, num_servers=1, start_scheduler=False, env=env) as job:
        worker = job.start_worker(0, REGISTER)
        time.sleep(2.0)
        job.scheduler = job.spawn([sys.executable, "-m", "tagps.scheduler"], {"DMLC_ROLE": "scheduler"})
        result = job.finish(0, worker, timeout=20).check()
        assert _report(result)["error"] is None
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0}
