"""Fault injection: a node of a PS job killed with SIGKILL at a random moment ends the whole job cleanly.

Each seed starts a job of a scheduler, 2 servers and 2 worker machines of 2 local ranks (so the training
uses the ps method: shared-memory reduction on each machine, then push and pull), every machine under its
own ``bpslaunch`` in role mode as on a cluster: the dead node's launcher stops its own machine only, and
the others must learn of the death from the runtime. ``random.Random(seed)`` picks the victim and the
moment: mostly a little after every worker started training, sometimes during start-up (before the job
assembled, which ``PS_REGISTER_TIMEOUT`` bounds). Every run must end within its bound, with every launcher
failing, every surviving machine's output naming the dead node, no process of the job left, and nothing
left in the job's shared-memory directory.

The 20 runs go two at a time (a run waits on timeouts more than it computes) in one module fixture; each
seed is its own test case.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tagps.launcher import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test runs every seed

REPO = Path(__file__).resolve().parents[1]
SEEDS = range(20)
WORKERS, LOCAL_SIZE, SERVERS = 2, 2, 2
HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = 0.5, 2.5
# A kill during start-up leaves a job that can never assemble: the others wait PS_REGISTER_TIMEOUT, kept
# short there. Later kills find the job assembled, and a long timeout keeps a slow start from failing it.
EARLY_REGISTER_TIMEOUT, REGISTER_TIMEOUT = 10.0, 60.0
# After the runtime names the dead node: raising, leaving, the interpreter's teardown, and a launcher
# stopping its siblings (--grace 2). The teardown dominates: a process that imported torch spends 0.6 s of
# CPU exiting (its final garbage collection), and the 4 worker processes exit at once on 2 cores. Measured
# from the kill to the last machine's end, seeds killing a server: 4.8-7.4 s idle, 6.2-8.3 s beside one
# busy core; in CI (seeds two at a time, as here) one run took over 10.5 s, failing at 8 s of slack.
EXIT_SLACK = 15.0
EARLY_KILL_CHANCE = 0.2
# Each machine's bpslaunch runs through this line, which writes main's return value to a file: Popen
# reports 0 for a child that another waiter reaped first (ECHILD), which the suite's 32768 pids, recycled
# within a run, make possible. Without the file a 0 is no success: the launcher died of a signal.
LAUNCH = (
    "import sys; from tagps.launcher import main; status = main(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(status)); sys.exit(status)"
)
STATUS_LOST = -999  # exited without returning from main, its status reaped by another waiter

WORKER = textwrap.dedent(
    """
    import time
    import torch
    import tagps.torch as bps

    print("imported", flush=True)
    bps.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    print("training", flush=True)
    while True:  # until the job fails: no run may end on its own
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(0.005)
    """
)


@dataclass(frozen=True)
class Machine:
    """One ``bpslaunch`` of the job: its label, role variables and the victim names it holds."""

    label: str
    env: dict[str, str]
    nodes: tuple[str, ...]


MACHINES = (
    Machine("scheduler", {"DMLC_ROLE": "scheduler"}, ("scheduler",)),
    *(Machine(f"server{s}", {"DMLC_ROLE": "server"}, (f"server{s}",)) for s in range(SERVERS)),
    *(
        Machine(
            f"worker{w}",
            {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(w), "BYTEPS_LOCAL_SIZE": str(LOCAL_SIZE)},
            tuple(f"worker{w}.{r}" for r in range(LOCAL_SIZE)),
        )
        for w in range(WORKERS)
    ),
)
NODES = tuple(node for m in MACHINES for node in m.nodes)


@dataclass
class Run:
    """What one seeded run did and saw."""

    seed: int
    victim: str
    early: bool
    killed_pid: int = 0
    kill_at: float = 0.0  # seconds after the launch
    assembled: bool = False  # every worker was training when the victim was killed
    ended: dict[str, float] = field(default_factory=dict)  # machine -> seconds after the launch
    status: dict[str, int | None] = field(default_factory=dict)  # None: still running at the deadline
    output: dict[str, str] = field(default_factory=dict)
    procs: dict[int, psutil.Process] = field(default_factory=dict)  # every process seen in the job
    shm_dir: Path = Path()

    def describe(self) -> str:
        out = "\n".join(f"--- {m} ({self.status.get(m)}):\n{text[-2500:]}" for m, text in self.output.items())
        return (
            f"seed {self.seed}: killed {self.victim} (pid {self.killed_pid}) at {self.kill_at:.1f} s "
            f"({'assembled' if self.assembled else 'during start-up'}); ended {self.ended}\n{out}"
        )


def _descendants(procs: list[subprocess.Popen[bytes]]) -> dict[int, psutil.Process]:
    found = {}
    for proc in procs:
        try:
            found.update((child.pid, child) for child in psutil.Process(proc.pid).children(recursive=True))
        except psutil.Error:  # exited meanwhile
            continue
    return found


def _victim_pid(launcher: subprocess.Popen[bytes], node: str) -> int | None:
    """The pid of ``node``'s process among ``launcher``'s children (a worker's by its local rank)."""
    rank = node.partition(".")[2]
    try:
        for child in psutil.Process(launcher.pid).children():
            if not rank or child.environ().get("BYTEPS_LOCAL_RANK") == rank:
                return child.pid
    except psutil.Error:
        pass
    return None


def _printed(logs: dict[str, Path], machines: list[str], line: str) -> bool:
    """Whether every worker process of ``machines`` printed ``line``."""
    text = "".join(logs[m].read_text(errors="replace") for m in machines)
    return text.count(f"] {line}\n") == len(machines) * LOCAL_SIZE


def _start(tmp: Path, early: bool) -> tuple[dict[str, subprocess.Popen[bytes]], dict[str, Path]]:
    """Start every machine's bpslaunch (role mode) on fresh ports; return them and their log files."""
    script = tmp / "worker.py"
    script.write_text(WORKER)
    root_port, dist_port = free_ports(2)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_", "TAGPS_DIST"))}
    base.update(
        DMLC_NUM_WORKER=str(WORKERS), DMLC_NUM_SERVER=str(SERVERS), DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(root_port), DMLC_NODE_HOST="127.0.0.1", TAGPS_DIST_PORT=str(dist_port),
        PS_HEARTBEAT_INTERVAL=str(HEARTBEAT_INTERVAL), PS_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT),
        PS_REGISTER_TIMEOUT=str(EARLY_REGISTER_TIMEOUT if early else REGISTER_TIMEOUT),
        TAGPS_DIST_TIMEOUT="120", TAGPS_SHM_DIR=str(tmp / "shm"),
    )  # fmt: skip
    command = ["--grace", "2", "--", sys.executable, str(script)]
    logs = {m.label: tmp / f"{m.label}.log" for m in MACHINES}
    launchers = {}
    for m in MACHINES:
        with logs[m.label].open("wb") as log:
            launchers[m.label] = subprocess.Popen(
                [sys.executable, "-c", LAUNCH, str(_status_file(tmp, m.label)), *command],
                cwd=REPO,
                env={**base, **m.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    return launchers, logs


def _status_file(tmp: Path, label: str) -> Path:
    return tmp / f"{label}.status"


def _exit_status(proc: subprocess.Popen[bytes], status_file: Path) -> int | None:
    """A launcher's exit status (None while it runs): what its main returned, else what the OS reported."""
    code = proc.poll()
    if code is None:
        return None
    if status_file.exists():
        return int(status_file.read_text())
    return STATUS_LOST if code == 0 else code


def _run(seed: int, tmp: Path) -> Run:
    rng = random.Random(seed)
    run = Run(seed, rng.choice(NODES), rng.random() < EARLY_KILL_CHANCE)
    delay = rng.uniform(0.0, 4.0) if run.early else rng.uniform(0.0, 2.0)
    tmp.mkdir(parents=True)
    run.shm_dir = tmp / "shm"
    run.shm_dir.mkdir()
    start = time.monotonic()
    launchers, logs = _start(tmp, run.early)
    victim_machine = next(m.label for m in MACHINES if run.victim in m.nodes)
    workers = [m.label for m in MACHINES if m.label.startswith("worker")]
    surviving = [m for m in workers if m != victim_machine]
    limit = start + REGISTER_TIMEOUT + 10

    def watch_until(done: Callable[[], bool], until: float) -> None:
        """Record the job's processes and when each machine ended, until ``done()`` or ``until``."""
        while True:
            run.procs.update(_descendants(list(launchers.values())))
            for label, proc in launchers.items():
                if proc.poll() is not None and label not in run.ended:
                    run.ended[label] = time.monotonic() - start
            if done() or time.monotonic() > until:
                return
            time.sleep(0.05)

    try:
        # The moment: `delay` after the launch (early), or after every worker printed that it trains.
        if not run.early:
            watch_until(lambda: _printed(logs, workers, "training") or bool(run.ended), limit)
        watch_until(lambda: False, time.monotonic() + delay)
        victim = launchers[victim_machine]
        watch_until(lambda: _victim_pid(victim, run.victim) is not None or victim.poll() is not None, limit)
        pid = _victim_pid(victim, run.victim)
        run.assembled = _printed(logs, workers, "training")
        run.kill_at = time.monotonic() - start
        if pid is not None:
            run.killed_pid = pid
            os.kill(pid, signal.SIGKILL)
        bound = HEARTBEAT_TIMEOUT
        if not run.assembled:
            # The workers still importing torch (slowly on a loaded machine) join the rendezvous and register
            # later: their timeouts (one each) run from then.
            alive = [launchers[m] for m in surviving]
            watch_until(
                lambda: _printed(logs, surviving, "imported") or any(p.poll() is not None for p in alive),
                limit,
            )
            bound = 2 * EARLY_REGISTER_TIMEOUT + HEARTBEAT_TIMEOUT
        watch_until(lambda: len(run.ended) == len(launchers), time.monotonic() + bound + EXIT_SLACK)
    finally:
        for label, proc in launchers.items():
            run.status[label] = _exit_status(proc, _status_file(tmp, label))
            if proc.poll() is None:
                proc.kill()  # its children die with it (PR_SET_PDEATHSIG)
                proc.wait()
    run.output = {label: path.read_text(errors="replace") for label, path in logs.items()}
    (tmp / "run.txt").write_text(run.describe().partition("\n")[0] + "\n")  # for a post-mortem
    return run


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Run]:
    """Run the selected seeds, two at a time."""
    seeds = sorted(
        {item.callspec.params["seed"] for item in request.session.items if item.module is request.module}
    )
    base = tmp_path_factory.mktemp("faults")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(seeds, pool.map(lambda s: _run(s, base / f"seed{s}"), seeds), strict=True))


def _names(run: Run) -> re.Pattern[str]:
    """What a message naming the victim looks like: by pid or rank once the job assembled; before, the
    scheduler can only say which roles are missing."""
    pid = run.killed_pid
    if run.victim == "scheduler":
        return re.compile(r"the scheduler at \S+ (sent nothing|did not answer)")
    if run.victim.startswith("server"):
        # A server killed after registering, before the address book, has no rank yet: named by its pid.
        return re.compile(rf"server (\d+ )?\(pid {pid} |missing: [^;]*\b1 server\b")
    w = int(run.victim[len("worker") :].split(".")[0])
    # A worker's launcher stops its other local ranks at once, so the survivors may see any rank of the
    # victim's machine (its worker node) die first: the store's owner, local rank 0, often goes before the
    # victim's heartbeat lapses. The scheduler knows a worker machine by its PS client, local rank 0.
    machine = "|".join(str(w * LOCAL_SIZE + i) for i in range(LOCAL_SIZE))
    rank = rf"\b(?:{machine})\b"
    return re.compile(
        rf"worker ranks? [0-9, ]*{rank}[0-9, ]* (failed|did not join)|worker {w} \(pid \d+ |"
        rf"missing: [^;]*\bworker {w}\b"
    )


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s:02d}")
def test_a_killed_node_ends_the_job_cleanly(runs: dict[int, Run], seed: int) -> None:
    run = runs[seed]
    assert run.killed_pid, f"the victim never started\n{run.describe()}"
    stopped = all(s is not None for s in run.status.values())
    assert stopped, f"a machine did not stop in time\n{run.describe()}"
    assert all(s != 0 for s in run.status.values()), f"a machine succeeded\n{run.describe()}"
    names = _names(run)
    survivors = [m.label for m in MACHINES if run.victim not in m.nodes]
    # Once the job assembled every other machine learns who died; before, nobody but the scheduler knew
    # the victim, and only its role.
    naming = [m for m in survivors if names.search(run.output[m])]
    if run.assembled:
        assert naming == survivors, f"only {naming} name {run.victim}\n{run.describe()}"
    else:
        assert naming, f"no machine names {run.victim}\n{run.describe()}"
    alive = [p for p in run.procs.values() if _running(p)]
    assert not alive, f"orphans {alive}\n{run.describe()}"
    left = sorted(p.name for p in run.shm_dir.glob("*")) if run.shm_dir.exists() else []
    assert not left, f"shared memory left: {left}\n{run.describe()}"


def _running(proc: psutil.Process) -> bool:
    """Whether ``proc`` (the same process: psutil compares its start time) is alive and not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
