"""bpslaunch: environment layout, output prefixes, exit status, and no process left behind.

The children here are small stand-in Python scripts (they record their pid and that of a grandchild they
start in the same process group), so the launcher's process management is tested independently of what
it launches; the end-to-end job with the real scheduler and servers is in tests/ps.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tagps import launcher
from tagps.config import ConfigError, launcher_config
from tagps.launcher import (
    ProcessSpec,
    free_ports,
    local_job,
    machine_hosts,
    main,
    role_job,
    run_processes,
    share_cores,
)

TIMEOUT = 60
BPSLAUNCH = (sys.executable, "-m", "tagps.launcher")

# argv[1]: directory for pid files; argv[2]: behaviour (ok | fail:N | sleep | ignore-term | partial | env |
# kill-self | threads).
# The worker with DMLC_WORKER_ID=1 and BYTEPS_LOCAL_RANK=0 (or a lone process) is the one that acts when
# the behaviour has the form `one-BEHAVIOUR`; the others sleep.
CHILD = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    tag = f"{os.getpid()}"
    with open(os.path.join(out, tag + ".pid"), "w") as f:
        json.dump({"pid": os.getpid(), "grandchild": grandchild.pid}, f)
    me = (os.environ.get("DMLC_WORKER_ID", "1"), os.environ.get("BYTEPS_LOCAL_RANK", "0"))
    if mode.startswith("one-"):
        mode = mode[4:] if me == ("1", "0") else "sleep"
    if mode == "ok":
        print("hello from", os.getpid())
    elif mode.startswith("fail:"):
        time.sleep(0.3)
        sys.exit(int(mode[5:]))
    elif mode == "sleep":
        time.sleep(120)
    elif mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
    elif mode == "partial":
        sys.stdout.write("no newline at the end")
    elif mode == "env":
        keys = [k for k in os.environ if k.startswith(("DMLC_", "BYTEPS_", "TAGPS_DIST"))]
        print(json.dumps({k: os.environ[k] for k in keys}))
    elif mode == "kill-self":
        # Only once every process of the job wrote its pid file: the test counts them all afterwards.
        size = int(os.environ.get("DMLC_NUM_WORKER", "1")) * int(os.environ.get("BYTEPS_LOCAL_SIZE", "1"))
        deadline = time.monotonic() + 30
        while len([f for f in os.listdir(out) if f.endswith(".pid")]) < size and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "threads":
        print("OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "unset"))
    """
)


@pytest.fixture
def child(tmp_path: Path) -> tuple[Path, Path]:
    """Return (script, pid directory)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    pids = tmp_path / "pids"
    pids.mkdir()
    return script, pids


def _recorded(pids: Path) -> list[int]:
    found = []
    for f in pids.glob("*.pid"):
        try:
            rec = json.loads(f.read_text())
        except ValueError:  # being written right now
            continue
        found += [rec["pid"], rec["grandchild"]]
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _still_alive(pids: list[int], seconds: float) -> list[int]:
    """Those of ``pids`` that are still alive after up to ``seconds`` of waiting for all to die."""
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _assert_all_gone(pids: Path, expected: int) -> None:
    recorded = _recorded(pids)
    assert len(recorded) == 2 * expected, f"expected {expected} children to start, pid files: {recorded}"
    # The launcher has returned, so everything must already be dead; allow only for /proc to catch up.
    assert _still_alive(recorded, 2) == []


def _wait_recorded(pids: Path, count: int, proc: subprocess.Popen[str]) -> None:
    """Wait (up to TIMEOUT) until ``count`` pids are recorded or bpslaunch has ended."""
    deadline = time.monotonic() + TIMEOUT
    while len(_recorded(pids)) < count and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)


def _local(
    local: int, servers: int, *command: str, local_size: int | None = None, grace: int | None = None
) -> list[str]:
    """bpslaunch arguments for a local job (``local`` workers, ``servers`` servers) that runs ``command``."""
    args = ["--local", str(local), "--servers", str(servers)]
    if local_size is not None:
        args += ["--local-size", str(local_size)]
    if grace is not None:
        args += ["--grace", str(grace)]
    return [*args, "--", *command]


def _child_argv(child: tuple[Path, Path], mode: str) -> list[str]:
    """The command line of the stand-in child script in ``mode``."""
    script, pids = child
    return [sys.executable, str(script), str(pids), mode]


def _bpslaunch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*BPSLAUNCH, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env if env is not None else _clean_env(),
    )


@contextlib.contextmanager
def _bpslaunch_running(
    *args: str, env: dict[str, str] | None = None, output: bool = True
) -> Iterator[subprocess.Popen[str]]:
    """Start bpslaunch with ``args`` (output merged on a pipe, or discarded); kill it on the way out."""
    proc = subprocess.Popen(
        [*BPSLAUNCH, *args],
        stdout=subprocess.PIPE if output else subprocess.DEVNULL,
        stderr=subprocess.STDOUT if output else subprocess.DEVNULL,
        text=True,
        env=env if env is not None else _clean_env(),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DMLC_", "BYTEPS_", "TAGPS_DIST"))
        and k not in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
    }
    env.update(extra)
    return env


def test_local_sets_the_layout_of_every_worker(child: tuple[Path, Path]) -> None:
    _, pids = child
    res = _bpslaunch(*_local(2, 0, *_child_argv(child, "env"), local_size=2))
    assert res.returncode == 0, res.stdout + res.stderr
    seen = {}
    for line in res.stdout.splitlines():
        label, _, payload = line.partition("] ")
        seen[label.lstrip("[")] = json.loads(payload)
    assert sorted(seen) == ["worker 0.0", "worker 0.1", "worker 1.0", "worker 1.1"]
    ports = {(e["DMLC_PS_ROOT_PORT"], e["TAGPS_DIST_PORT"]) for e in seen.values()}
    assert len(ports) == 1 and len(set(next(iter(ports)))) == 2
    for label, env in seen.items():
        w, r = label.split()[1].split(".")
        assert env == {
            "DMLC_ROLE": "worker",
            "DMLC_NUM_WORKER": "2",
            "DMLC_NUM_SERVER": "0",
            "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": env["DMLC_PS_ROOT_PORT"],
            "DMLC_NODE_HOST": f"127.0.0.{int(w) + 1}",
            "DMLC_WORKER_ID": w,
            "BYTEPS_LOCAL_RANK": r,
            "BYTEPS_LOCAL_SIZE": "2",
            "TAGPS_DIST_PORT": env["TAGPS_DIST_PORT"],
        }
    _assert_all_gone(pids, 4)


def _threads_seen(res: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """Each worker's OMP_NUM_THREADS, by label, from the output of children in ``threads`` mode."""
    seen = {}
    for line in res.stdout.splitlines():
        label, _, payload = line.partition("] ")
        if payload.startswith("OMP_NUM_THREADS="):
            seen[label.lstrip("[")] = payload.split("=", 1)[1]
    return seen


def test_workers_share_the_cores_unless_omp_num_threads_is_set(child: tuple[Path, Path]) -> None:
    """torch's default of a thread per core in every worker oversubscribes a machine that runs several."""
    cores = len(os.sched_getaffinity(0))
    unset = {k: v for k, v in _clean_env().items() if k != "OMP_NUM_THREADS"}
    res = _bpslaunch(*_local(2, 1, *_child_argv(child, "threads"), local_size=2), env=unset)
    assert res.returncode == 0, res.stdout + res.stderr
    share = str(max(1, cores // 4))
    workers = ["worker 0.0", "worker 0.1", "worker 1.0", "worker 1.1"]
    assert _threads_seen(res) == dict.fromkeys(workers, share)
    assert f"each worker here gets {share} of the {cores} cores" in res.stderr
    chosen = _bpslaunch(*_local(2, 0, *_child_argv(child, "threads")), env=_clean_env(OMP_NUM_THREADS="3"))
    assert chosen.returncode == 0, chosen.stdout + chosen.stderr
    assert _threads_seen(chosen) == {"worker 0.0": "3", "worker 1.0": "3"}
    assert "OMP_NUM_THREADS is unset" not in chosen.stderr
    alone = _bpslaunch(*_local(1, 0, *_child_argv(child, "threads")), env=unset)
    assert _threads_seen(alone) == {"worker 0.0": "unset"} and "OMP_NUM_THREADS" not in alone.stderr


def test_share_cores_splits_among_workers_and_leaves_services_alone() -> None:
    specs = local_job(["python", "train.py"], 3, 2, 2, env={})
    shared, threads = share_cores(specs, 16)
    assert threads == 2
    assert [s.env.get("OMP_NUM_THREADS") for s in shared] == [None] * 3 + ["2"] * 6
    assert [s.label for s in shared] == [s.label for s in specs]
    assert share_cores(specs, 4)[1] == 1  # never below one thread
    lone = local_job(["python", "train.py"], 1, 1, 1, env={})
    assert share_cores(lone, 16) == (lone, None)


def test_local_job_describes_scheduler_servers_and_workers() -> None:
    specs = local_job(["train"], num_workers=2, num_servers=3, local_size=2, env={"DMLC_WORKER_ID": "7"})
    assert [s.label for s in specs] == [
        "scheduler",
        "server 0",
        "server 1",
        "server 2",
        "worker 0.0",
        "worker 0.1",
        "worker 1.0",
        "worker 1.1",
    ]
    assert [s.service for s in specs] == [True] * 4 + [False] * 4
    assert specs[0].argv == (sys.executable, "-m", "tagps.scheduler")
    assert specs[1].argv == (sys.executable, "-m", "tagps.server")
    assert specs[1].env["DMLC_ROLE"] == "server" and "DMLC_WORKER_ID" not in specs[1].env
    assert specs[1].env["DMLC_NUM_SERVER"] == "3" and specs[1].env["DMLC_NUM_WORKER"] == "2"
    assert specs[-1].env["DMLC_WORKER_ID"] == "1" and specs[-1].env["BYTEPS_LOCAL_RANK"] == "1"
    assert specs[-1].argv == ("train",)
    # Each machine on its own loopback address, its servers beside it; the scheduler on 127.0.0.1.
    hosts = {s.label: s.env["DMLC_NODE_HOST"] for s in specs}
    assert hosts == {
        "scheduler": "127.0.0.1",
        "server 0": "127.0.0.1",
        "server 1": "127.0.0.2",
        "server 2": "127.0.0.1",
        "worker 0.0": "127.0.0.1",
        "worker 0.1": "127.0.0.1",
        "worker 1.0": "127.0.0.2",
        "worker 1.1": "127.0.0.2",
    }
    assert {s.env["DMLC_PS_ROOT_URI"] for s in specs} == {"127.0.0.1"}
    assert machine_hosts(2, "10.0.0.5") == ["10.0.0.5", "10.0.0.5"]
    with pytest.raises(ValueError, match="at most 254 machines"):
        machine_hosts(255)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, 0, 1, []), "command"),
        ((0, 1, 1, ["x"]), "--local must be >= 1"),
        ((1, -1, 1, ["x"]), "--servers must be >= 0"),
        ((1, 1, 0, ["x"]), "--local-size must be >= 1"),
    ],
)
def test_local_job_rejects_bad_arguments(args: tuple, message: str) -> None:
    w, s, size, command = args
    with pytest.raises(ValueError, match=message):
        local_job(command, w, s, size)


@pytest.mark.parametrize("raw", ["x", "1,,2", "2.5"])
def test_bad_local_size_names_what_it_expects(raw: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--local", "2", "--local-size", raw, "--", "true"])
    assert exc.value.code == 2
    assert f"--local-size: expected a process count, or one per machine such as 1,2; got {raw!r}" in (
        capsys.readouterr().err
    )


def test_success_leaves_nothing_behind(child: tuple[Path, Path]) -> None:
    _, pids = child
    res = _bpslaunch(*_local(2, 0, *_child_argv(child, "ok"), local_size=2))
    assert res.returncode == 0, res.stderr
    assert sorted(line.split("]")[0] for line in res.stdout.splitlines()) == [
        "[worker 0.0",
        "[worker 0.1",
        "[worker 1.0",
        "[worker 1.1",
    ]
    _assert_all_gone(pids, 4)


def test_failing_worker_stops_the_job_with_its_status(child: tuple[Path, Path]) -> None:
    _, pids = child
    start = time.monotonic()
    res = _bpslaunch(*_local(2, 0, *_child_argv(child, "one-fail:7"), local_size=2, grace=2))
    assert res.returncode == 7, res.stdout + res.stderr
    assert "worker 1.0 exited with status 7; stopping the job" in res.stdout
    assert time.monotonic() - start < 20  # the sleepers (120 s) were stopped, not waited for
    _assert_all_gone(pids, 4)


def test_a_main_that_fails_between_two_looks_still_fails_the_job(
    child: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The supervisor looks at its children more than once a round. Here each child's exit is hidden from the
    # first look that could see it, as if it exited just after that look: a scheduler that failed so was
    # reported as a success (status 0) in the fault-injection tests.
    script, pids = child
    observe = launcher._Child.exited
    hidden: set[int] = set()

    def late(self: launcher._Child) -> bool:
        exited = observe(self)
        if exited and id(self) not in hidden:
            hidden.add(id(self))
            self.status = None
            return False
        return exited

    monkeypatch.setattr(launcher._Child, "exited", late)
    out = io.BytesIO()
    assert run_processes([_spec("scheduler", script, pids, "fail:3")], out=out, grace=1) == 3
    assert b"scheduler exited with status 3; stopping the job" in out.getvalue()


def test_worker_killed_by_a_signal_gives_128_plus_signal(child: tuple[Path, Path]) -> None:
    _, pids = child
    res = _bpslaunch(*_local(2, 0, *_child_argv(child, "one-kill-self")))
    assert res.returncode == 128 + signal.SIGKILL, res.stdout + res.stderr
    _assert_all_gone(pids, 2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_bpslaunch_tears_everything_down(child: tuple[Path, Path], sig: signal.Signals) -> None:
    _, pids = child
    with _bpslaunch_running(*_local(2, 0, *_child_argv(child, "sleep"), local_size=2, grace=2)) as proc:
        _wait_recorded(pids, 8, proc)
        assert len(_recorded(pids)) == 8
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + sig, out
    assert f"received {sig.name}" in out
    _assert_all_gone(pids, 4)


def test_sigkill_of_bpslaunch_still_kills_the_workers(child: tuple[Path, Path], tmp_path: Path) -> None:
    _, pids = child
    env = _clean_env(TAGPS_SHM_DIR=str(tmp_path))  # the job directory it leaves is not /dev/shm's
    args = _local(1, 0, *_child_argv(child, "sleep"), local_size=2)
    with _bpslaunch_running(*args, env=env, output=False) as proc:
        _wait_recorded(pids, 4, proc)
        proc.kill()
        proc.wait(timeout=TIMEOUT)
    workers = [json.loads(f.read_text())["pid"] for f in pids.glob("*.pid")]
    assert _still_alive(workers, 5) == []  # PR_SET_PDEATHSIG: the direct children die with it
    for rec in map(json.loads, (f.read_text() for f in pids.glob("*.pid"))):
        if _alive(rec["grandchild"]):  # out of bpslaunch's reach once it is SIGKILLed; clean up
            os.kill(rec["grandchild"], signal.SIGKILL)


def _spec(label: str, script: Path, pids: Path, mode: str, service: bool = False) -> ProcessSpec:
    return ProcessSpec(label, tuple(_child_argv((script, pids), mode)), _clean_env(), service=service)


def test_services_are_stopped_after_the_workers_succeed(child: tuple[Path, Path]) -> None:
    script, pids = child
    out = io.BytesIO()
    specs = [
        _spec("scheduler", script, pids, "sleep", service=True),
        _spec("server 0", script, pids, "ignore-term", service=True),
        _spec("worker 0.0", script, pids, "ok"),
    ]
    start = time.monotonic()
    assert run_processes(specs, out=out, grace=0.5) == 0
    # grace to exit on their own, SIGTERM, grace again, then SIGKILL for the one that ignores SIGTERM
    assert time.monotonic() - start < 15
    assert b"[worker 0.0] hello from" in out.getvalue()
    _assert_all_gone(pids, 3)


def test_a_failing_service_fails_the_job(child: tuple[Path, Path]) -> None:
    script, pids = child
    out = io.BytesIO()
    specs = [
        _spec("server 0", script, pids, "fail:5", service=True),
        _spec("worker 0.0", script, pids, "sleep"),
    ]
    assert run_processes(specs, out=out, grace=1) == 5
    assert b"[bpslaunch] server 0 exited with status 5; stopping the job" in out.getvalue()
    _assert_all_gone(pids, 2)


def test_a_service_failing_while_the_others_are_stopped_still_counts(child: tuple[Path, Path]) -> None:
    script, pids = child
    out = io.BytesIO()
    specs = [
        _spec("scheduler", script, pids, "sleep", service=True),
        _spec("server 0", script, pids, "fail:6", service=True),  # exits 6 after the worker is done
        _spec("worker 0.0", script, pids, "ok"),
    ]
    assert run_processes(specs, out=out, grace=2) == 6
    assert b"[bpslaunch] server 0 exited with status 6" in out.getvalue()
    _assert_all_gone(pids, 3)


def test_second_sigint_skips_the_grace_period(child: tuple[Path, Path]) -> None:
    _, pids = child
    argv = _local(1, 0, *_child_argv(child, "ignore-term"), local_size=2, grace=60)
    with _bpslaunch_running(*argv) as proc:
        _wait_recorded(pids, 4, proc)
        time.sleep(0.2)  # let the children install their SIGTERM handler
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + signal.SIGINT, out
    assert time.monotonic() - start < 20  # not the 60 s grace
    _assert_all_gone(pids, 2)


def test_unfinished_last_line_is_still_prefixed(child: tuple[Path, Path]) -> None:
    script, pids = child
    out = io.BytesIO()
    assert run_processes([_spec("worker 0.0", script, pids, "partial")], out=out, grace=1) == 0
    assert out.getvalue() == b"[worker 0.0] no newline at the end\n"


def test_missing_command_is_127_and_stops_what_started(child: tuple[Path, Path]) -> None:
    script, pids = child
    out = io.BytesIO()
    specs = [
        _spec("worker 0.0", script, pids, "sleep"),
        ProcessSpec("worker 0.1", ("/nonexistent/tagps-no-such-command",), _clean_env()),
    ]
    assert run_processes(specs, out=out, grace=1) == 127
    assert b"cannot start worker 0.1" in out.getvalue()
    # The first worker may be stopped before it records its pids; whatever it recorded must be dead.
    assert [p for p in _recorded(pids) if _alive(p)] == []


def test_run_processes_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no processes"):
        run_processes([])
    with pytest.raises(ValueError, match="grace"):
        run_processes([ProcessSpec("w", ("true",), {})], grace=-1)
    with pytest.raises(ValueError, match="empty command"):
        ProcessSpec("w", (), {})


def test_role_worker_starts_local_size_ranks(child: tuple[Path, Path]) -> None:
    script, pids = child
    env = _clean_env(
        DMLC_ROLE="worker",
        DMLC_NUM_WORKER="2",
        DMLC_WORKER_ID="1",
        DMLC_NUM_SERVER="0",
        NVIDIA_VISIBLE_DEVICES="0,1,2",
    )
    res = _bpslaunch(sys.executable, str(script), str(pids), "env", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(res.stdout.splitlines())
    assert [line.split("]")[0] for line in lines] == ["[worker 1.0", "[worker 1.1", "[worker 1.2"]
    for r, line in enumerate(lines):
        layout = json.loads(line.partition("] ")[2])
        assert layout["BYTEPS_LOCAL_RANK"] == str(r) and layout["BYTEPS_LOCAL_SIZE"] == "3"
        assert layout["DMLC_WORKER_ID"] == "1" and layout["DMLC_ROLE"] == "worker"
    _assert_all_gone(pids, 3)


def test_a_scheduler_machine_says_it_ignores_the_training_command() -> None:
    # One command line for every machine, as with BytePS: the scheduler runs, and says it dropped the command.
    env = _clean_env(
        DMLC_ROLE="scheduler",
        DMLC_NUM_WORKER="1",
        DMLC_NUM_SERVER="1",
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(free_ports(1)[0]),
        PS_REGISTER_TIMEOUT="1",  # nobody registers: the scheduler gives up after a second
    )
    res = _bpslaunch(sys.executable, "-c", "pass", env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "bpslaunch: DMLC_ROLE=scheduler ignores the command" in res.stderr
    assert "registration timed out" in res.stdout


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({}, "DMLC_ROLE"),
        ({"DMLC_ROLE": "boss"}, "DMLC_ROLE"),
        ({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "two"}, "DMLC_NUM_WORKER"),
        ({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "2"}, "DMLC_WORKER_ID"),
        ({"DMLC_ROLE": "worker", "BYTEPS_LOCAL_SIZE": "0"}, "BYTEPS_LOCAL_SIZE"),
        ({"DMLC_ROLE": "worker", "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1"}, "DMLC_PS_ROOT_URI"),
        ({"DMLC_ROLE": "server", "DMLC_NUM_WORKER": "1"}, "DMLC_NUM_SERVER"),
        (
            {
                "DMLC_ROLE": "scheduler",
                "DMLC_NUM_WORKER": "1",
                "DMLC_NUM_SERVER": "1",
                "DMLC_PS_ROOT_URI": "127.0.0.1",
                "DMLC_PS_ROOT_PORT": "99999",
            },
            "DMLC_PS_ROOT_PORT",
        ),
    ],
)
def test_bad_variables_exit_nonzero_naming_them(env: dict[str, str], variable: str) -> None:
    res = _bpslaunch("true", env=_clean_env(**env))
    assert res.returncode == 2
    assert variable in res.stderr and res.stdout == ""


def test_role_job_worker_honours_byteps_local_size() -> None:
    env = {"DMLC_ROLE": "worker", "BYTEPS_LOCAL_SIZE": "2", "BYTEPS_LOCAL_RANK": "1", "DMLC_WORKER_ID": "0"}
    specs = role_job(["train"], env)
    assert [(s.label, s.env["BYTEPS_LOCAL_RANK"], s.env["BYTEPS_LOCAL_SIZE"]) for s in specs] == [
        ("worker 0.0", "0", "2"),
        ("worker 0.1", "1", "2"),
    ]


def test_role_job_for_servers_runs_the_service_module() -> None:
    env = {
        "DMLC_ROLE": "server",
        "DMLC_NUM_WORKER": "1",
        "DMLC_NUM_SERVER": "1",
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": "9000",
    }
    (spec,) = role_job(["ignored"], env)
    assert spec.argv == (sys.executable, "-m", "tagps.server") and spec.env["DMLC_ROLE"] == "server"


@pytest.mark.parametrize(
    ("env", "size"),
    [
        ({}, 1),
        ({"NVIDIA_VISIBLE_DEVICES": "0,1,2,3"}, 4),
        ({"NVIDIA_VISIBLE_DEVICES": "0,1,2,3", "CUDA_VISIBLE_DEVICES": "1"}, 1),
        ({"CUDA_VISIBLE_DEVICES": ""}, 1),
        ({"NVIDIA_VISIBLE_DEVICES": "none"}, 1),
        ({"NVIDIA_VISIBLE_DEVICES": "0,1", "BYTEPS_LOCAL_SIZE": "3"}, 3),
    ],
)
def test_local_size_defaults_to_visible_devices(env: dict[str, str], size: int) -> None:
    assert launcher_config(env, local=True).local_size == size


def test_visible_devices_all_asks_for_local_size() -> None:
    with pytest.raises(ConfigError, match=r"NVIDIA_VISIBLE_DEVICES.*BYTEPS_LOCAL_SIZE"):
        launcher_config({"NVIDIA_VISIBLE_DEVICES": "all"}, local=True)


def test_free_ports_are_distinct() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(0 < p < 65536 for p in ports)


def test_free_ports_avoid_the_ephemeral_range_where_it_leaves_room() -> None:
    # Outgoing connections take their source ports from the ephemeral range, so a probed port from it
    # may be gone before the child binds it.
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    if low < 11000:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it")
    ports = free_ports(20)
    assert len(set(ports)) == 20 and all(10000 <= p < low for p in ports)


def test_launch_options_need_local() -> None:
    res = _bpslaunch("--servers", "2", "true", env=_clean_env(DMLC_ROLE="worker"))
    assert res.returncode == 2 and "only apply with --local" in res.stderr


# The real job: scheduler and servers from tagps, workers that push_pull through them.
PS_WORKER = textwrap.dedent(
    """
    import os, sys, numpy as np
    from tagps.ps.client import PSClient
    client = PSClient.from_env()
    w = client.worker_id
    if sys.argv[1] == "crash" and w == 1:
        os._exit(3)  # registered, then gone without a word
    client.declare("t", 4 * 1000, np.float32)
    client.barrier()
    buf = np.arange(1000, dtype=np.float32) * (w + 1)
    client.wait(client.push_pull("t", buf, average=False), timeout=30)
    assert np.array_equal(buf, np.arange(1000, dtype=np.float32) * 3), buf[:4]
    print("sum ok", w)
    client.close()
    """
)


@pytest.mark.parametrize(("mode", "status"), [("ok", 0), ("crash", 3)])
def test_local_job_with_real_scheduler_and_servers(tmp_path: Path, mode: str, status: int) -> None:
    script = tmp_path / "ps_worker.py"
    script.write_text(PS_WORKER)
    mark = f"tagps-test-{os.getpid()}-{mode}"
    argv = _local(2, 2, sys.executable, str(script), mode, grace=2)
    res = _bpslaunch(*argv, env=_clean_env(TAGPS_TEST_MARK=mark))
    assert res.returncode == status, res.stdout + res.stderr
    if status == 0:
        assert sorted(line for line in res.stdout.splitlines() if "sum ok" in line) == [
            "[worker 0.0] sum ok 0",
            "[worker 1.0] sum ok 1",
        ]
    else:
        assert "worker 1.0 exited with status 3; stopping the job" in res.stdout
    assert _processes_with(f"TAGPS_TEST_MARK={mark}") == []


HANGING_PS_WORKER = textwrap.dedent(
    """
    import time
    from tagps.ps.client import PSClient
    client = PSClient.from_env()
    client.barrier()
    print("registered", flush=True)
    time.sleep(120)
    """
)


def test_sigint_to_a_real_job_leaves_nothing_behind(tmp_path: Path) -> None:
    script = tmp_path / "hanging_worker.py"
    script.write_text(HANGING_PS_WORKER)
    mark = f"tagps-test-{os.getpid()}-sigint"
    argv = _local(2, 2, sys.executable, str(script), grace=2)
    with _bpslaunch_running(*argv, env=_clean_env(TAGPS_TEST_MARK=mark)) as proc:
        assert proc.stdout is not None
        seen = []
        while len(seen) < 2:  # both workers registered, passed a barrier, and now sleep inside the job
            line = proc.stdout.readline()
            assert line, f"bpslaunch ended early: {seen}"
            if line.endswith("registered\n"):
                seen.append(line)
        assert len(_processes_with(f"TAGPS_TEST_MARK={mark}")) == 6  # bpslaunch, scheduler, 2+2
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + signal.SIGINT, out
    assert _processes_with(f"TAGPS_TEST_MARK={mark}") == []


def _processes_with(variable: str) -> list[int]:
    """Pids of live processes whose environment holds ``variable`` (``NAME=value``)."""
    found = []
    needle = variable.encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _alive(int(proc.name)):
            try:
                if needle in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_workers_share_a_shm_dir_that_is_removed_with_what_a_killed_worker_left(tmp_path: Path) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    # Each worker leaves an "arena" in the directory it was given, then dies with SIGKILL.
    script = (
        "import os, pathlib, signal; d = pathlib.Path(os.environ['TAGPS_SHM_DIR']); "
        "(d / os.environ['BYTEPS_LOCAL_RANK']).write_bytes(b'x'); print(d, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    res = _bpslaunch(
        *_local(1, 0, sys.executable, "-c", script, local_size=2), env=_clean_env(TAGPS_SHM_DIR=str(base))
    )
    assert res.returncode == 128 + signal.SIGKILL, res.stdout + res.stderr
    dirs = {line.partition("] ")[2] for line in res.stdout.splitlines() if line.startswith("[worker")}
    assert len(dirs) == 1 and Path(dirs.pop()).parent == base, res.stdout
    assert list(base.iterdir()) == []


def _owner_of(pid: int) -> str:
    """What a job directory records of bpslaunch ``pid``: the pid and its start time (/proc/PID/stat)."""
    return f"{pid} {Path(f'/proc/{pid}/stat').read_text().rpartition(')')[2].split()[19]}"


def _job_dirs(base: Path) -> list[str]:
    return sorted(p.name for p in base.glob("tagps-job-*"))


def test_a_job_dir_whose_bpslaunch_is_gone_is_swept_by_the_next_one(tmp_path: Path) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    env = _clean_env(TAGPS_SHM_DIR=str(base))
    # A bpslaunch killed with SIGKILL leaves its directory (its worker dies with it: PR_SET_PDEATHSIG).
    sleeper = _local(1, 0, sys.executable, "-c", "import time; time.sleep(120)")
    with _bpslaunch_running(*sleeper, env=env, output=False) as proc:
        deadline = time.monotonic() + TIMEOUT
        while not list(base.glob("tagps-job-*/.bpslaunch")) and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = _job_dirs(base)
        assert len(killed) == 1 and (base / killed[0] / ".bpslaunch").read_text() == _owner_of(proc.pid)
        proc.kill()
        proc.wait(timeout=TIMEOUT)
    assert _job_dirs(base) == killed
    # Others: a pid that is dead, a live pid with another start time (reused), a live owner (this test),
    # and one that names no owner (an older bpslaunch's, or one being made): only the first two are stale.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    owners = {
        "tagps-job-dead": f"{int(dead.stdout)} 1",
        "tagps-job-reused": f"{os.getpid()} 1",
        "tagps-job-live": _owner_of(os.getpid()),
        "tagps-job-unowned": None,
    }
    for name, owner in owners.items():
        (base / name).mkdir()
        (base / name / "arena").write_bytes(b"x")
        if owner is not None:
            (base / name / ".bpslaunch").write_text(owner)
    res = _bpslaunch(*_local(1, 0, sys.executable, "-c", "pass"), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _job_dirs(base) == ["tagps-job-live", "tagps-job-unowned"]


# The signal arrives while bpslaunch prepares the job, before its supervisor handles signals: without a
# handler of its own, SIGTERM and SIGHUP would end it at once and leave its directory behind.
PREPARE_AND_SIGNAL = textwrap.dedent(
    """
    import os, signal, sys, time
    from tagps import launcher
    real = launcher.local_job
    def local_job(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        time.sleep(30)
        return real(*args, **kwargs)
    launcher.local_job = local_job
    sys.exit(launcher.main(["--local", "1", "--servers", "0", "--", sys.executable, "-c", "pass"]))
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_before_the_job_starts_removes_the_job_dir(tmp_path: Path, sig: signal.Signals) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    res = subprocess.run(
        [sys.executable, "-c", PREPARE_AND_SIGNAL, sig.name], capture_output=True, text=True, timeout=TIMEOUT,
        env=_clean_env(TAGPS_SHM_DIR=str(base)),
    )  # fmt: skip
    assert res.returncode == 128 + sig, res.stdout + res.stderr
    assert f"bpslaunch: received {sig.name}; stopped" in res.stderr, res.stderr
    assert _job_dirs(base) == []


def test_a_shm_dir_that_cannot_be_made_is_refused_by_name(tmp_path: Path, child: tuple[Path, Path]) -> None:
    missing = tmp_path / "no-such-dir"
    res = _bpslaunch(*_local(1, 0, *_child_argv(child, "ok")), env=_clean_env(TAGPS_SHM_DIR=str(missing)))
    assert res.returncode == 2 and f"TAGPS_SHM_DIR='{missing}'" in res.stderr, res.stderr
