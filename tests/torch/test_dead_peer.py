"""A worker killed with SIGKILL, or stopped, is named on every other rank within ``PS_HEARTBEAT_TIMEOUT``.

The three workers are started directly, as three machines would start them: ``bpslaunch --local`` stops the
whole job at the first exit, so under it the survivors would never show what they do on their own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tagps.launcher import free_ports

REPO = Path(__file__).resolve().parents[2]
WORKERS = 3
HEARTBEAT_TIMEOUT = 3.0
HEARTBEAT_INTERVAL = 0.5
DIST_TIMEOUT = 60

# argv: steps, the step at which the victim sends itself a signal (-1: never), a file where it writes the time
# it did, the step at which rank 1 computes for twice the heartbeat timeout (-1: never), the signal's name
# (another name: the victim raises ValueError instead), the victim's rank, the collective of each step
# (allreduce or allgather_object).
WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import torch
    import tagps.torch as bps

    steps, kill_at, died, slow_at = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    sig, victim, op = getattr(signal, sys.argv[5], None), int(sys.argv[6]), sys.argv[7]
    bps.init()
    expected = sum(range(1, bps.size() + 1))
    try:
        for step in range(steps):
            if bps.rank() == victim and step == kill_at:
                died.write_text(repr(time.time()))
                if sig is None:  # an error this rank does not catch
                    raise ValueError(f"boom at step {step}")
                os.kill(os.getpid(), sig)
            if bps.rank() == 1 and step == slow_at:
                time.sleep(2 * float(os.environ["PS_HEARTBEAT_TIMEOUT"]))
            if op == "allgather_object":  # blocking, with no work to wait for in slices
                if bps.allgather_object(bps.rank()) != list(range(bps.size())):
                    raise SystemExit(f"step {step}: allgather_object is wrong")
                continue
            out = bps.allreduce(torch.full((4096,), float(bps.rank() + 1)), average=False, name="x")
            if float(out[0]) != expected:
                raise SystemExit(f"step {step}: {float(out[0])} != {expected}")
    except RuntimeError as exc:  # HorovodInternalError from a wait, PeerFailed from a layout check
        print(f"raised at {time.time()!r}: {type(exc).__name__}: {exc}", flush=True)
        raise SystemExit(3)
    print(f"done {steps}", flush=True)
    """
)


def _start(
    script: Path, steps: int, kill_at: int, died: Path, *, slow_at: int = -1, sig: str = "SIGKILL",
    victim: int = 2, ranks: Sequence[int] = range(WORKERS), register_timeout: float = DIST_TIMEOUT,
    op: str = "allreduce", stagger: float = 0.0,
) -> list[subprocess.Popen[str]]:  # fmt: skip
    """Start the workers ``ranks``, each as its own machine, on a fresh rendezvous port, ``stagger`` seconds
    apart."""
    port = free_ports(1)[0]
    procs = []
    for rank in ranks:
        if procs:
            time.sleep(stagger)
        env = {
            **os.environ,
            "DMLC_NUM_WORKER": str(WORKERS), "DMLC_WORKER_ID": str(rank), "DMLC_NUM_SERVER": "0",
            "DMLC_PS_ROOT_URI": "127.0.0.1", "TAGPS_DIST_PORT": str(port),
            "TAGPS_DIST_TIMEOUT": str(DIST_TIMEOUT), "PS_REGISTER_TIMEOUT": str(register_timeout),
            "PS_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL), "PS_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
        }  # fmt: skip
        args = (steps, kill_at, died, slow_at, sig, victim, op)
        cmd = [sys.executable, str(script), *map(str, args)]
        pipe, merged = subprocess.PIPE, subprocess.STDOUT
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=pipe, stderr=merged, text=True))
    return procs


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, float]]:
    """Each process's exit status, output and the time it was seen to exit; kills stragglers."""
    results = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        results.append((proc.returncode, out, time.time()))
    return results


# SIGKILL: the victim's gloo neighbours see its connections close, and wait for the watcher to name it.
# SIGSTOP: its connections stay open, so only the heartbeats can end the survivors' waits.
# Rank 0 serves the rendezvous store: its death is seen as the store's.
# allgather_object blocks without a work to wait for: it runs on a helper thread the caller waits for.
@pytest.mark.parametrize(
    ("victim", "sig", "op"),
    [(2, "SIGKILL", "allreduce"), (2, "SIGSTOP", "allreduce"), (0, "SIGKILL", "allreduce"),
     (2, "SIGSTOP", "allgather_object")],
)  # fmt: skip
def test_a_dead_worker_is_named_on_every_rank_within_the_heartbeat_timeout(
    tmp_path: Path, victim: int, sig: str, op: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    died = tmp_path / "died"
    procs = _start(script, 100_000, 30, died, sig=sig, victim=victim, op=op)
    survivors = [r for r in range(WORKERS) if r != victim]
    results = dict(zip(survivors, _finish([procs[r] for r in survivors], timeout=DIST_TIMEOUT), strict=True))
    procs[victim].kill()  # when it is only stopped
    assert _finish([procs[victim]], timeout=10)[0][0] == -9
    killed_at = float(died.read_text())
    # Detection takes at most the timeout plus one interval; the rest is slack for a loaded machine.
    bound = HEARTBEAT_TIMEOUT + HEARTBEAT_INTERVAL + 3.0
    for rank in survivors:
        status, out, exited_at = results[rank]
        assert status == 3, f"rank {rank} ({status}):\n{out[-3000:]}"
        match = re.search(r"raised at ([0-9.]+): (.*)", out)
        assert match, out[-3000:]
        assert f"worker rank {victim} failed" in match[2], match[2]
        assert float(match[1]) - killed_at < bound, (rank, float(match[1]) - killed_at, match[2])
        # Leaving the dead group waits for neither the handles nor a barrier (TAGPS_DIST_TIMEOUT=60).
        assert exited_at - killed_at < bound + 5.0, (rank, exited_at - killed_at, out[-3000:])


def test_no_false_alarm_when_a_rank_is_merely_late(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # Rank 1 computes for twice the heartbeat timeout at step 100: its watcher thread beats meanwhile.
    results = _finish(_start(script, 200, -1, tmp_path / "died", slow_at=100), timeout=120)
    for rank, (status, out, _) in enumerate(results):
        assert status == 0 and "done 200" in out, f"rank {rank} ({status}):\n{out[-3000:]}"


# Rank 0 serves the rendezvous store: without it the others cannot even connect. With it, every rank names
# the absent one, though rank 0, started 2 s before rank 1, gives up first: it keeps serving the store until
# rank 1 has read its verdict (were it to exit at once, rank 1 would find the store gone and name rank 0).
@pytest.mark.parametrize(
    ("absent", "named"), [(2, "worker rank 2 did not join"), (0, "worker rank 0, which serves")]
)
def test_a_rank_that_never_joins_is_named_within_the_register_timeout(
    tmp_path: Path, absent: int, named: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ranks = [r for r in range(WORKERS) if r != absent]
    start = time.monotonic()
    procs = _start(script, 10, -1, tmp_path / "died", ranks=ranks, register_timeout=5.0, stagger=2.0)
    for rank, (status, out, _) in zip(ranks, _finish(procs, timeout=DIST_TIMEOUT), strict=True):
        assert status != 0 and named in out, f"rank {rank} ({status}):\n{out[-3000:]}"
        assert "within 5 s (PS_REGISTER_TIMEOUT)" in out, out[-3000:]
    # They waited TAGPS_DIST_TIMEOUT (60 s) after starting before; now the register timeout plus start-up.
    assert time.monotonic() - start < DIST_TIMEOUT


def test_an_uncaught_error_on_one_rank_is_named_on_every_other_rank(tmp_path: Path) -> None:
    """Rank 2 raises out of its script while the others wait in an allreduce: they raise naming it and its
    error within an interval or two (its heartbeats go on until it exits), and nobody waits for a barrier."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    died = tmp_path / "died"
    procs = _start(script, 100_000, 30, died, sig="raise")
    results = _finish(procs, timeout=DIST_TIMEOUT)
    raised_at = float(died.read_text())
    assert results[2][0] == 1 and "ValueError: boom at step 30" in results[2][1], results[2][1][-3000:]
    for rank in (0, 1):
        status, out, exited_at = results[rank]
        match = re.search(r"raised at ([0-9.]+): (.*)", out)
        assert status == 3 and match, f"rank {rank} ({status}):\n{out[-3000:]}"
        assert "worker rank 2 failed (ValueError: boom at step 30)" in match[2], match[2]
        assert float(match[1]) - raised_at < HEARTBEAT_TIMEOUT, (rank, float(match[1]) - raised_at)
        assert exited_at - raised_at < HEARTBEAT_TIMEOUT + 5.0, (rank, exited_at - raised_at)
