"""`bpslaunch`: start the processes of a BytePS-style job and supervise them.

Two ways to use it:

* **Role mode** (BytePS-compatible). ``DMLC_ROLE`` says what this machine is. A ``worker`` machine starts
  ``BYTEPS_LOCAL_SIZE`` copies of the command (default: the count in ``CUDA_VISIBLE_DEVICES`` or
  ``NVIDIA_VISIBLE_DEVICES``, else 1), each with its own ``BYTEPS_LOCAL_RANK``; a ``server`` starts
  ``python -m tagps.server`` and a ``scheduler`` ``python -m tagps.scheduler`` (a command given to those two
  roles is ignored, as BytePS does).
* **Local mode**: ``bpslaunch --local W --servers S [--local-size L] -- CMD`` starts a scheduler, ``S``
  servers and ``W`` worker machines of ``L`` local ranks each on this host with free ports. Each machine
  has its own loopback address (machine ``w`` on ``127.0.0.<w+1>``, server ``s`` on machine ``s mod W``),
  so that, as between real machines, a worker shares memory (``TAGPS_PS_IPC``) only with the servers of
  its own machine.

Either way every child runs in its own process group (its own session), its output is streamed line by
line with a ``[worker 0.1]`` / ``[server 1]`` / ``[scheduler]`` prefix, the first non-zero exit status ends
the job (the others are stopped) and becomes bpslaunch's own status, and on exit, failure, ``SIGINT``,
``SIGTERM`` or ``SIGHUP`` every process group is sent ``SIGTERM`` and, after a grace period, ``SIGKILL``.
A child's exit is observed with ``waitid(WNOWAIT)`` so its pid, and so its process group id, cannot be
reused before the final ``SIGKILL`` reaches the group. Children also get ``PR_SET_PDEATHSIG`` so that even
a ``SIGKILL`` of bpslaunch itself leaves no worker behind.

The job's shared-memory arenas live in a private directory ``TAGPS_SHM_DIR/tagps-job-*``, which records
its bpslaunch and is removed when the job ends, a stop signal included; one whose bpslaunch was killed with
``SIGKILL`` is removed by the next bpslaunch that starts on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from tagps.atomic import write_text_atomic
from tagps.config import ConfigError, comm_config, launcher_config, ps_config, usable_cores

__all__ = [
    "LaunchError",
    "ProcessSpec",
    "free_ports",
    "local_job",
    "machine_hosts",
    "main",
    "role_job",
    "run_processes",
    "share_cores",
]

_PR_SET_PDEATHSIG = 1
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Variables that describe one process's place in a job; local mode sets them per child and never passes
# the parent's values through.
_LAYOUT_VARS = (
    "DMLC_ROLE",
    "DMLC_NUM_WORKER",
    "DMLC_NUM_SERVER",
    "DMLC_PS_ROOT_URI",
    "DMLC_PS_ROOT_PORT",
    "DMLC_WORKER_ID",
    "DMLC_NODE_HOST",
    "BYTEPS_LOCAL_RANK",
    "BYTEPS_LOCAL_SIZE",
    "TAGPS_DIST_PORT",
    "TAGPS_MACHINE_SIZES",
)


class LaunchError(RuntimeError):
    """A child process could not be started."""


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a job.

    Args:
        label: prefix of its output lines, e.g. ``"worker 0.1"``.
        argv: the command; ``argv[0]`` is looked up on ``PATH``.
        env: its complete environment.
        service: ``True`` for schedulers and servers: the job is over when every non-service process has
            exited with status 0, and services still running then get the grace period to exit on their own
            before they are stopped.
    """

    label: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    service: bool = False

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError(f"process {self.label!r} has an empty command")


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000  # below: well-known and registered services


def _ports_outside_ephemeral() -> range | None:
    """The ports from 10000 up to the kernel's ephemeral range (None: unknown, or too few)."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(_LOWEST_PORT, low) if low - _LOWEST_PORT >= 1000 else None


def _bind_free(s: socket.socket, host: str, candidates: range | None) -> None:
    """Bind ``s`` to a free port among ``candidates`` (random tries), else to one the kernel picks."""
    for port in random.sample(candidates, min(100, len(candidates))) if candidates else ():
        with contextlib.suppress(OSError):  # taken: try another
            s.bind((host, port))
            return
    s.bind((host, 0))


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``count`` distinct TCP ports that are free on ``host`` right now.

    The ports come from below the kernel's ephemeral range when it leaves room: a port the kernel hands
    out (``bind`` to 0) may be given again, before the child binds it, as the source port of any outgoing
    connection, as a job's rendezvous store once found (its ping then fails). All sockets are held open
    until every port is chosen, so the ports differ; another program may still take one meanwhile.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    candidates = _ports_outside_ephemeral()
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            _bind_free(s, host, candidates)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _exit_status(code: int, status: int) -> int:
    """Map a ``waitid`` result to a shell-style exit status (128 + signal for a killed process)."""
    return status if code == os.CLD_EXITED else 128 + status


_LIBC = ctypes.CDLL(None, use_errno=True)


def _set_pdeathsig() -> None:  # runs in the child between fork and exec: keep it to one system call
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class _Child:
    """A started process: its pipe, the unfinished last line, and its exit status once observed."""

    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        self.prefix = f"[{spec.label}] ".encode()
        try:
            self.proc = subprocess.Popen(
                spec.argv,
                env=dict(spec.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_set_pdeathsig,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {spec.label} ({' '.join(spec.argv)}): {exc}") from exc
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.partial = b""
        self.status: int | None = None

    def exited(self) -> bool:
        """Observe (without reaping) whether the process has exited; record its status."""
        if self.status is None:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_pid == self.proc.pid:
                self.status = _exit_status(info.si_code, info.si_status)
        return self.status is not None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (the leader may be a zombie: that is fine)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class _Supervisor:
    """The event loop of :func:`run_processes`: stream output, watch exits, stop everything."""

    def __init__(self, specs: Sequence[ProcessSpec], out: BinaryIO, grace: float) -> None:
        self.out: BinaryIO | None = out
        self.grace = grace
        self.children: list[_Child] = []
        self.selector = selectors.DefaultSelector()
        self.signalled: int | None = None  # the first stop signal
        self.signal_count = 0
        self.failure: int | None = None
        self.specs = specs

    def emit(self, data: bytes) -> None:
        """Write to the output; once it is gone (a closed pipe) drop output but keep supervising."""
        if self.out is None:
            return
        try:
            self.out.write(data)
            self.out.flush()
        except OSError:
            self.out = None

    def log(self, message: str) -> None:
        self.emit(f"[bpslaunch] {message}\n".encode())

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signal_count += 1
        if self.signalled is None:
            self.signalled = signum

    def pump(self, timeout: float) -> None:
        """Forward whatever output is ready within ``timeout`` seconds, prefixed, whole lines only."""
        if not self.selector.get_map():
            time.sleep(timeout)
            return
        lines = []
        for key, _ in self.selector.select(timeout):
            child: _Child = key.data
            try:
                data = os.read(child.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not data:
                self.selector.unregister(child.fd)
                if child.partial:
                    lines.append(child.prefix + child.partial + b"\n")
                    child.partial = b""
                continue
            *complete, child.partial = (child.partial + data).split(b"\n")
            lines.extend(child.prefix + line + b"\n" for line in complete)
        if lines:
            self.emit(b"".join(lines))

    def wait_until(self, done: Callable[[], bool], timeout: float, interruptible: bool = False) -> bool:
        """Pump output until ``done()``, ``timeout`` seconds, or (if ``interruptible``) a signal; return
        ``done()``."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or (interruptible and self.signalled is not None):
                return done()
            self.pump(min(0.05, left))
        return True

    def run(self) -> int:
        handlers = {s: signal.signal(s, self._on_signal) for s in _STOP_SIGNALS}
        try:
            try:
                for spec in self.specs:
                    child = _Child(spec)
                    self.children.append(child)
                    self.selector.register(child.fd, selectors.EVENT_READ, child)
                self._supervise()
            except LaunchError as exc:
                self.log(str(exc))
                self.failure = 127
            finally:
                status = self._teardown()
            return status
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            self.selector.close()

    def _supervise(self) -> None:
        """Return when the job has succeeded, failed, or been interrupted."""
        reported: set[int] = set()
        mains = [c for c in self.children if not c.spec.service]
        services = [c for c in self.children if c.spec.service]
        while self.signalled is None:
            # Looked at before the statuses below, so that a main that exits between the two looks is
            # still checked: otherwise a failed last main would end the job with status 0.
            mains_done = all(c.exited() for c in mains)
            for i, child in enumerate(self.children):
                if i in reported or not child.exited():
                    continue
                reported.add(i)
                if child.status != 0:
                    self.log(f"{child.spec.label} exited with status {child.status}; stopping the job")
                    self.failure = child.status
                    return
            if mains_done:
                self.wait_until(lambda: all(c.exited() for c in services), self.grace, interruptible=True)
                bad = next((c for c in services if c.exited() and c.status != 0), None)
                if bad is not None:
                    self.log(f"{bad.spec.label} exited with status {bad.status}")
                    self.failure = bad.status
                break
            self.pump(0.05)
        if self.signalled is not None and self.failure is None:
            self.log(
                f"received {signal.Signals(self.signalled).name}; stopping the job (again: kill at once)"
            )

    def _teardown(self) -> int:
        """Stop every process group (TERM, grace, KILL), reap, drain output; return the job's status."""
        running = [c for c in self.children if not c.exited()]
        for child in running:
            child.signal_group(signal.SIGTERM)
        if running:
            signals = self.signal_count  # one more stop signal cuts the grace period short
            self.wait_until(
                lambda: all(c.exited() for c in running) or self.signal_count > signals, self.grace
            )
        for child in self.children:
            child.signal_group(signal.SIGKILL)  # stragglers in the group, and leaders past the grace
        for child in self.children:
            child.proc.wait()
        # Every writer of the pipes is dead now, so this ends promptly.
        self.wait_until(lambda: not self.selector.get_map(), 5.0)
        for child in self.children:
            child.proc.stdout.close()  # type: ignore[union-attr]
        if self.failure is not None:
            return self.failure
        if self.signalled is not None:
            return 128 + self.signalled
        return 0


def run_processes(specs: Sequence[ProcessSpec], *, out: BinaryIO | None = None, grace: float = 5.0) -> int:
    """Start ``specs``, stream their output and supervise them until the job ends; return its status.

    The status is 0 when every non-service process and every service exited with 0; otherwise the status
    of the first process seen to fail (128 + N for a process killed by signal N; 127 when a command cannot
    be started; 128 + N when bpslaunch itself received signal N). Must be called from the main thread
    (it installs handlers for ``SIGINT``, ``SIGTERM`` and ``SIGHUP`` while it runs).

    Args:
        specs: the processes, started in this order.
        out: binary stream for the prefixed output (default: standard output).
        grace: seconds a process gets between ``SIGTERM`` and ``SIGKILL``, and services get to exit on
            their own once the workers are done (default 5).

    Returns:
        The job's exit status.
    """
    if not specs:
        raise ValueError("no processes to run")
    if grace < 0:
        raise ValueError(f"grace must be >= 0, got {grace}")
    return _Supervisor(specs, out if out is not None else sys.stdout.buffer, grace).run()


def _service_argv(role: str) -> tuple[str, ...]:
    return (sys.executable, "-m", f"tagps.{role}")


def _child_env(base: Mapping[str, str], **layout: object) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _LAYOUT_VARS}
    env.setdefault("PYTHONUNBUFFERED", "1")  # stream a Python child's lines as they are printed
    env.update({k: str(v) for k, v in layout.items()})
    return env


def machine_hosts(num_workers: int, host: str = "127.0.0.1") -> list[str]:
    """The address of each worker machine of a local job on ``host``.

    On ``127.0.0.1`` machine ``w`` gets ``127.0.0.<w+1>`` (Linux routes all of 127.0.0.0/8 to the loopback
    device), so that machines are told apart by address as real ones are: a worker then counts only its
    own machine's servers as co-located (shared memory, ``TAGPS_PS_IPC``). Any other ``host`` is shared
    by every machine.

    Raises:
        ValueError: more machines than loopback addresses (254).
    """
    if host != "127.0.0.1":
        return [host] * num_workers
    if num_workers > 254:
        raise ValueError(f"--local takes at most 254 machines on 127.0.0.0/8, got {num_workers}")
    return [f"127.0.0.{w + 1}" for w in range(num_workers)]


def local_job(
    command: Sequence[str],
    num_workers: int,
    num_servers: int,
    local_size: int | Sequence[int],
    env: Mapping[str, str] = os.environ,
    host: str = "127.0.0.1",
) -> list[ProcessSpec]:
    """Describe a whole job on one machine: scheduler, servers, and workers × local ranks.

    With ``num_servers == 0`` (an all-reduce-only job) neither a scheduler nor servers are started; the
    workers still get ``DMLC_PS_ROOT_URI``/``DMLC_PS_ROOT_PORT`` and a free ``TAGPS_DIST_PORT`` for
    ``torch.distributed`` rendezvous.

    Args:
        command: the worker command.
        num_workers: worker machines ``W`` (``DMLC_NUM_WORKER``), >= 1.
        num_servers: servers ``S`` (``DMLC_NUM_SERVER``), >= 0.
        local_size: processes per worker machine ``L`` (``BYTEPS_LOCAL_SIZE``), >= 1, or one count per
            machine (``TAGPS_MACHINE_SIZES``) for machines of different sizes.
        env: the environment the children inherit (layout variables are replaced).
        host: the scheduler's address; the machines bind to :func:`machine_hosts` of it, server ``s`` to
            machine ``s mod W``'s.

    Returns:
        The scheduler and servers (``service=True``) followed by the workers, machine-major.
    """
    if not command:
        raise ValueError("--local needs a worker command after --")
    sizes = [local_size] * num_workers if isinstance(local_size, int) else list(local_size)
    for name, value, least in (
        ("--local", num_workers, 1),
        ("--servers", num_servers, 0),
        *(("--local-size", n, 1) for n in sizes),
    ):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if len(sizes) != num_workers:
        raise ValueError(f"--local-size names {len(sizes)} machines' sizes, but --local is {num_workers}")
    root_port, dist_port = free_ports(2, host)
    machines = machine_hosts(num_workers, host)
    common: dict[str, object] = dict(
        DMLC_NUM_WORKER=num_workers,
        DMLC_NUM_SERVER=num_servers,
        DMLC_PS_ROOT_URI=host,
        DMLC_PS_ROOT_PORT=root_port,
    )
    if not isinstance(local_size, int):
        common["TAGPS_MACHINE_SIZES"] = ",".join(map(str, sizes))
    specs = []
    if num_servers:
        specs.append(
            ProcessSpec(
                "scheduler",
                _service_argv("scheduler"),
                _child_env(env, DMLC_ROLE="scheduler", DMLC_NODE_HOST=host, **common),
                service=True,
            )
        )
        specs += [
            ProcessSpec(
                f"server {s}",
                _service_argv("server"),
                _child_env(env, DMLC_ROLE="server", DMLC_NODE_HOST=machines[s % num_workers], **common),
                service=True,
            )
            for s in range(num_servers)
        ]
    for w in range(num_workers):
        for r in range(sizes[w]):
            worker_env = _child_env(
                env,
                DMLC_ROLE="worker",
                DMLC_WORKER_ID=w,
                DMLC_NODE_HOST=machines[w],
                BYTEPS_LOCAL_RANK=r,
                BYTEPS_LOCAL_SIZE=sizes[w],
                TAGPS_DIST_PORT=dist_port,
                **common,
            )
            specs.append(ProcessSpec(f"worker {w}.{r}", tuple(command), worker_env))
    return specs


def role_job(command: Sequence[str], env: Mapping[str, str] = os.environ) -> list[ProcessSpec]:
    """Describe what this machine runs in role mode (``DMLC_ROLE``), validating its variables first.

    Raises:
        ConfigError: a variable is missing or malformed (the message names it).
        ValueError: a worker machine was given no command.
    """
    cfg = launcher_config(env)
    if cfg.role != "worker":
        ps_config(env)
        return [ProcessSpec(cfg.role, _service_argv(cfg.role), _child_env(env, **_layout(env)))]
    if not command:
        raise ValueError("DMLC_ROLE=worker needs the training command, e.g. bpslaunch python train.py")
    rank0 = {**env, "BYTEPS_LOCAL_RANK": "0", "BYTEPS_LOCAL_SIZE": str(cfg.local_size)}
    layout = comm_config(rank0)
    if layout.num_server > 0:
        ps_config(rank0)
    return [
        ProcessSpec(
            f"worker {layout.worker_id}.{r}",
            tuple(command),
            _child_env(env, **{**_layout(env), "BYTEPS_LOCAL_RANK": r, "BYTEPS_LOCAL_SIZE": cfg.local_size}),
        )
        for r in range(cfg.local_size)
    ]


def share_cores(specs: Sequence[ProcessSpec], cores: int) -> tuple[list[ProcessSpec], int | None]:
    """Give each worker of ``specs`` an equal share of ``cores`` (``OMP_NUM_THREADS``), as torchrun does.

    torch starts one thread per core in every process, so two workers on one machine oversubscribe it, and
    their OpenMP threads spinning at barriers make each step several times slower: resnet50 at batch 4 on
    two cores took 0.87 s a step for one worker, 4-6 s in each of two, 1.4-1.5 s with one thread each.
    A single worker, and the services (which set their own threads), are left as they are.

    Returns:
        ``specs`` with ``OMP_NUM_THREADS`` set in each worker's environment when there are several, and the
        threads each got (``None`` when nothing was set).
    """
    workers = sum(not spec.service for spec in specs)
    if workers < 2:
        return list(specs), None
    threads = max(1, cores // workers)
    shared = [
        spec if spec.service else replace(spec, env={**spec.env, "OMP_NUM_THREADS": str(threads)})
        for spec in specs
    ]
    return shared, threads


def _layout(env: Mapping[str, str]) -> dict[str, str]:
    """The layout variables of ``env`` that are set (role mode passes them through unchanged)."""
    return {k: env[k] for k in _LAYOUT_VARS if k in env}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bpslaunch",
        description="Start the processes of a tagps (BytePS-style) job and supervise them.",
        epilog="Role mode reads DMLC_ROLE and the other DMLC_*/BYTEPS_* variables (docs/environment.md); "
        "local mode: bpslaunch --local 2 --servers 1 -- python train.py",
    )
    p.add_argument(
        "--local",
        type=int,
        metavar="W",
        help="run a whole job on this host: W worker machines (127.0.0.1, .2, ...)",
    )
    p.add_argument("--servers", type=int, metavar="S", help="servers in local mode (default 1)")
    p.add_argument(
        "--local-size",
        type=_local_sizes,
        metavar="L",
        help="processes per worker machine in local mode (default: as BYTEPS_LOCAL_SIZE), or one count "
        "per machine, e.g. 1,2 (TAGPS_MACHINE_SIZES)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="time between SIGTERM and SIGKILL when stopping (default 5)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the worker command")
    return p


def _local_sizes(raw: str) -> int | list[int]:
    """``--local-size``: ``L``, or ``L0,L1,...`` for machines of different sizes."""
    try:
        sizes = [int(part) for part in raw.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a process count, or one per machine such as 1,2; got {raw!r}"
        ) from None
    return sizes[0] if len(sizes) == 1 else sizes


_JOB_DIR_PREFIX = "tagps-job-"
_OWNER = ".bpslaunch"  # in a job directory: "PID STARTTIME" of the bpslaunch that made it


class _Stopped(BaseException):
    """A stop signal reached bpslaunch while no supervisor ran (preparing the job or cleaning up)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_signals_unwind() -> Iterator[None]:
    """Turn the first ``SIGINT``, ``SIGTERM`` or ``SIGHUP`` into :class:`_Stopped` (and ignore later ones),
    so that a signal while no supervisor handles it still runs the clean-ups on its way out, where the
    default action would end bpslaunch at once. :func:`run_processes` installs its own handlers meanwhile."""

    def on_signal(signum: int, frame: object) -> None:
        for s in _STOP_SIGNALS:  # one is enough: a second must not cut the clean-ups short
            signal.signal(s, signal.SIG_IGN)
        raise _Stopped(signum)

    previous = {s: signal.signal(s, on_signal) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _start_time(pid: int) -> str | None:
    """Return when process ``pid`` started (``/proc/PID/stat`` field 22, clock ticks since boot), ``None``
    when there is no such process; with the pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # the fields after the command name start at field 3


def _sweep_stale_job_dirs(base: str) -> None:
    """Remove the job directories in ``base`` whose bpslaunch is gone: one killed with ``SIGKILL`` cannot
    remove its own. A directory that names no owner (being made, or made by an older bpslaunch) or that
    cannot be read (another user's) is left alone."""
    for path in Path(base).glob(f"{_JOB_DIR_PREFIX}*"):
        try:
            pid, started = (path / _OWNER).read_text().split()
            alive = _start_time(int(pid)) == started
        except (OSError, ValueError):
            continue
        if not alive:
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _job_shm_dir(base: str) -> Iterator[str]:
    """Make a private directory in ``base`` for the job's shared-memory arenas, recording this process as its
    owner; remove it, whatever is left in it, once every child is reaped (a process killed between creating
    an arena and unlinking it, or stopped with SIGTERM, cannot remove its own). First remove the directories
    of earlier bpslaunch processes that are gone (see :func:`_sweep_stale_job_dirs`)."""
    started = _start_time(os.getpid())
    if started is not None:  # without /proc no owner can be told alive: record and sweep nothing
        _sweep_stale_job_dirs(base)
    try:
        path = tempfile.mkdtemp(prefix=_JOB_DIR_PREFIX, dir=base)
    except OSError as exc:
        raise ValueError(f"TAGPS_SHM_DIR={base!r}: cannot make the job's arena directory: {exc}") from None
    try:
        if started is not None:
            write_text_atomic(Path(path) / _OWNER, f"{os.getpid()} {started}")
        yield path
    finally:
        # A stop signal now must not cut the removal short (the supervisor, if any, has stopped already).
        ignored = {s: signal.signal(s, signal.SIG_IGN) for s in _STOP_SIGNALS}
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            for s, handler in ignored.items():
                signal.signal(s, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``bpslaunch`` and return its exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.local is None and (args.local_size is not None or args.servers is not None):
        parser.error("--servers and --local-size only apply with --local")
    try:
        cfg = launcher_config(os.environ, local=args.local is not None)
        with _stop_signals_unwind(), _job_shm_dir(cfg.shm_dir) as shm_dir:
            env = {**os.environ, "TAGPS_SHM_DIR": shm_dir}
            if args.local is not None:
                servers = 1 if args.servers is None else args.servers
                specs = local_job(command, args.local, servers, args.local_size or cfg.local_size, env)
            else:
                specs = role_job(command, env)
                if cfg.role != "worker" and command:
                    print(f"bpslaunch: DMLC_ROLE={specs[0].label} ignores the command", file=sys.stderr)
            if not cfg.threads_chosen:
                cores = usable_cores()
                specs, threads = share_cores(specs, cores)
                if threads is not None:
                    print(
                        f"bpslaunch: OMP_NUM_THREADS is unset: each worker here gets {threads} of the "
                        f"{cores} cores; set OMP_NUM_THREADS to choose",
                        file=sys.stderr,
                    )
            return run_processes(specs, grace=args.grace)
    except (ConfigError, ValueError) as exc:
        print(f"bpslaunch: error: {exc}", file=sys.stderr)
        return 2
    except _Stopped as stop:
        print(f"bpslaunch: received {signal.Signals(stop.signum).name}; stopped", file=sys.stderr)
        return 128 + stop.signum


if __name__ == "__main__":
    sys.exit(main())
