"""Start real PS jobs on 127.0.0.1 for tests: a scheduler, servers and worker processes, each bounded.

Usage (the ``ps_job`` fixture returns a :class:`PSJob` factory; other test folders can import this file by
path)::

    with ps_job(num_workers=2, num_servers=2) as job:
        results = job.run_workers("from tagps.ps import PSClient; ...", timeout=60)
        config = job.client_config(worker_id=0)  # for a PSClient inside the test process

Every test that takes ``ps_job`` runs once per data-plane engine (``TAGPS_PS_ENGINE``): ``python`` (pyzmq)
and ``cpp`` (``tagps._core``'s libzmq engine, skipped when the core was built without libzmq). The engine
applies to every process of the job, servers and workers, and to ``client_config``;
``TAGPS_TEST_SERVER_ENGINE`` (``python`` or ``cpp``) overrides it for the servers only, to test a client of
one engine against a server of the other.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import zmq
from bpslaunch_job import PS_ENGINES, ps_engine_env

from tagps.config import PSConfig, ps_config
from tagps.launcher import free_ports
from tagps.ps.node import SchedulerLink
from tagps.ps.protocol import Op, routing_id, unpack_header, worker_node_id
from tagps.ps.transport import Security

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["PSJob", "WorkerResult", "ps_engine", "ps_job", "ps_job_class"]


@dataclass
class WorkerResult:
    """Exit status and output of one worker process."""

    worker_id: int
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> WorkerResult:
        """Raise AssertionError with the worker's output unless it exited with 0."""
        if self.returncode != 0:
            raise AssertionError(
                f"worker {self.worker_id} exited with {self.returncode}\n--- stdout\n{self.stdout}\n"
                f"--- stderr\n{self.stderr}"
            )
        return self


class PSJob:
    """A scheduler plus ``num_servers`` servers on 127.0.0.1; workers are started by :meth:`run_workers`.

    Args:
        num_workers: worker machines (DMLC_NUM_WORKER).
        num_servers: summation servers (DMLC_NUM_SERVER).
        env: extra variables for every process (e.g. BYTEPS_ENABLE_ASYNC).
        server_args: extra command-line flags per server rank order of start (e.g. ``--checkpoint``).
        start_scheduler: start the scheduler (False: a test starts its own).
        engine: ``TAGPS_PS_ENGINE`` of every process (``None``: the environment's, else the default).
        server_engine: ``TAGPS_PS_ENGINE`` of the servers (``None``: as ``engine``).
    """

    def __init__(
        self,
        num_workers: int = 2,
        num_servers: int = 2,
        env: dict[str, str] | None = None,
        server_args: list[list[str]] | None = None,
        start_scheduler: bool = True,
        engine: str | None = None,
        server_engine: str | None = None,
    ) -> None:
        self.num_workers = num_workers
        self.num_servers = num_servers
        # Not a port the kernel hands out: a server's bind to port 0 could take it before the scheduler
        # binds it, and the whole job would then wait PS_REGISTER_TIMEOUT for a scheduler that exited.
        (self.port,) = free_ports(1)
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DMLC_NUM_WORKER": str(num_workers),
            "DMLC_NUM_SERVER": str(num_servers),
            "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": str(self.port),
            "DMLC_NODE_HOST": "127.0.0.1",
            "BYTEPS_SERVER_ENGINE_THREAD": "2",
            "PS_HEARTBEAT_INTERVAL": "0.2",
            "PS_HEARTBEAT_TIMEOUT": "6",  # generous: the test machines are shared; failure tests set 2
            "BYTEPS_LOG_LEVEL": "WARNING",
            "PYTHONFAULTHANDLER": "1",  # a worker killed for its timeout first prints where it hung
            **({"TAGPS_PS_ENGINE": engine} if engine is not None else {}),
            **(env or {}),
        }
        self.server_env = {"TAGPS_PS_ENGINE": server_engine} if server_engine is not None else {}
        self.server_args = server_args if server_args is not None else [[] for _ in range(num_servers)]
        self.start_scheduler = start_scheduler
        self.scheduler: subprocess.Popen[str] | None = None
        self.servers: list[subprocess.Popen[str]] = []
        self._all: list[subprocess.Popen[str]] = []
        self._stderr: dict[int, str] = {}

    def __enter__(self) -> PSJob:
        if self.start_scheduler:
            self.scheduler = self.spawn([sys.executable, "-m", "tagps.scheduler"], {"DMLC_ROLE": "scheduler"})
        for args in self.server_args:
            self.servers.append(
                self.spawn(
                    [sys.executable, "-m", "tagps.server", *args], {"DMLC_ROLE": "server", **self.server_env}
                )
            )
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        for proc in self._all:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._all:
            self.output(proc)
        if exc_type is not None:  # pytest shows this beside the failure: often the cause is in there
            for name, proc in self._infrastructure():
                print(f"--- {name} (exit {proc.returncode}) stderr\n{self._stderr.get(proc.pid, '')}")

    def output(self, proc: subprocess.Popen[str]) -> str:
        """Reap ``proc`` (after it exited or was killed) and return its stderr."""
        if proc.stdout is not None and not proc.stdout.closed:
            _, err = proc.communicate(timeout=10)
            self._stderr[proc.pid] = err
        return self._stderr.get(proc.pid, "")

    def spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        """Start a process of this job (in its own process group, output captured)."""
        proc = subprocess.Popen(
            argv,
            env={**self.env, **env},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._all.append(proc)
        return proc

    def start_worker(
        self, worker_id: int, code: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """Start worker machine ``worker_id`` running the Python source ``code``."""
        worker_env = {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(worker_id), **(env or {})}
        return self.spawn([sys.executable, "-c", textwrap.dedent(code)], worker_env)

    def run_workers(
        self, code: str, timeout: float = 60, env: dict[str, str] | None = None
    ) -> list[WorkerResult]:
        """Run ``code`` on every worker machine and return their results (killing them after ``timeout``)."""
        procs = [self.start_worker(i, code, env) for i in range(self.num_workers)]
        return [self.finish(i, proc, timeout) for i, proc in enumerate(procs)]

    def finish(self, worker_id: int, proc: subprocess.Popen[str], timeout: float) -> WorkerResult:
        """Wait for ``proc`` (killing it after ``timeout`` s) and collect its output."""
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack to stderr
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=5)
            with contextlib.suppress(ProcessLookupError):  # it, if the abort did not end it, and its children
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()  # everything it wrote, both calls' reads together
            err += f"\n[killed after {timeout} s]"
        self._stderr[proc.pid] = err
        return WorkerResult(worker_id, proc.returncode, out, err)

    def client_config(self, worker_id: int = 0, **env: str) -> PSConfig:
        """Settings for a worker machine running inside the test process."""
        return ps_config({**self.env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(worker_id), **env})

    def wait_infrastructure(self, timeout: float = 20) -> dict[str, int | None]:
        """Wait for the scheduler and servers to exit; return their exit codes by name."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for name, proc in self._infrastructure():
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def _infrastructure(self) -> list[tuple[str, subprocess.Popen[str]]]:
        named = [("scheduler", self.scheduler)] if self.scheduler else []
        return named + [(f"server{i}", p) for i, p in enumerate(self.servers)]


class HandWorker:
    """Worker 1 of a two-worker job, registered by hand; its data socket sends whatever the test builds."""

    def __init__(self, job: PSJob) -> None:
        self.context = zmq.Context()
        self.link = SchedulerLink(
            self.context, Security(self.context, None), job.client_config(1), "worker", "127.0.0.1", 0
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._control, daemon=True)
        self._thread.start()

    def _control(self) -> None:
        self.link.register()
        while not self._stop.is_set():
            self.link.beat()
            if self.link.socket.poll(50):
                self.link.receive()

    def connect(self, host: str, port: int) -> None:
        self.data = self.context.socket(zmq.DEALER)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.setsockopt(zmq.ROUTING_ID, routing_id(worker_node_id(1)))
        self.data.connect(f"tcp://{host}:{port}")

    def answer(self, frames: list[bytes]) -> list[bytes]:
        """Send ``frames`` and return the server's next reply."""
        self.data.send_multipart(frames)
        assert self.data.poll(10_000), "the server did not answer"
        return self.data.recv_multipart()

    def refused(self, frames: list[bytes]) -> str:
        """Send ``frames`` and return the reason of the ERROR that must answer them (a PUSH_ACK before it
        is skipped: a server returns a push's credit before its engine looks at the round)."""
        reply = self.answer(frames)
        if unpack_header(reply[0]).op == Op.PUSH_ACK:
            assert self.data.poll(10_000), "the server did not answer after PUSH_ACK"
            reply = self.data.recv_multipart()
        assert unpack_header(reply[0]).op == Op.ERROR
        return reply[1].decode()

    def finish(self) -> None:
        self._stop.set()
        self._thread.join()
        self.link.finalize()
        self.data.close()
        self.link.close()
        self.context.term()


@pytest.fixture(params=PS_ENGINES)  # every ps_job test runs with each
def ps_engine(request: pytest.FixtureRequest) -> str:
    """A data-plane engine (``TAGPS_PS_ENGINE``); ``cpp`` is skipped when ``tagps._core`` lacks it."""
    engine: str = request.param
    ps_engine_env(engine)
    return engine


@pytest.fixture
def ps_job_class() -> type[PSJob]:
    """The :class:`PSJob` class itself, for a test that picks each job's engine (``engine=``)."""
    return PSJob


@pytest.fixture
def ps_job(ps_engine: str) -> Callable[..., PSJob]:
    """:class:`PSJob` with ``ps_engine`` (use it as a context manager so every process is reaped)."""
    server_engine = os.environ.get("TAGPS_TEST_SERVER_ENGINE") or None
    return partial(PSJob, engine=ps_engine, server_engine=server_engine)


@pytest.fixture
def hand_worker() -> type[HandWorker]:
    """The :class:`HandWorker` class: worker 1 of a two-worker job whose data frames a test writes itself."""
    return HandWorker
