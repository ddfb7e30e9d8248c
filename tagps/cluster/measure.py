"""Host measurements: the links between emulated machines (round-trip time, TCP goodput) and one core.

``python -m tagps.cluster.measure serve HOST PORT`` accepts two connections: on the first it echoes
64-byte messages (the round trip), on the second it counts the bytes the client streams and answers with
the goodput from the first to the last byte and the CPU it took to receive them.
``python -m tagps.cluster.measure probe HOST PORT SECONDS`` is that client; it prints one JSON line
``{"rtt_s": ..., "bandwidth_Bps": ..., "rx_cpu_cores": ...}``. The cluster runs the server in one machine's
namespace and cgroup and the client in another's (:func:`measure_pair`), so the figures include the ``tc``
limits, the kernel's TCP stack and the machines' CPU quotas.

:func:`measure_core` measures the core this process runs on: the references the roofline's fitted
efficiencies are fractions of (``python -m tagps.calibrate``) and a local executor's device speed.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["MATMUL_N", "LinkMeasurement", "measure_core", "measure_pair", "probe", "serve"]

# Square float32 matmuls of this size measure a core: three 1 MiB operands, beyond a core's L2, as a
# training step's working set is, so that cores sharing a cache and memory read as slow as they run.
MATMUL_N = 512
_MSG = 64
_CHUNK = 1 << 20
_PINGS = 50


@dataclass(frozen=True)
class LinkMeasurement:
    """What one probe measured.

    Args:
        rtt_s: median round trip of a 64-byte message in seconds.
        bandwidth_Bps: TCP goodput in bytes/s, from the first to the last byte received.
        rx_cpu_cores: the CPU the receiving process took meanwhile, in cores (its CPU seconds over those
            seconds): what receiving at the link's rate costs the receiver.
    """

    rtt_s: float
    bandwidth_Bps: float
    rx_cpu_cores: float


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection during the measurement")
        buf += part
    return buf


def serve(host: str, port: int, timeout_s: float = 60.0) -> None:
    """Serve one probe (echo, then count) on ``host:port``; print ``ready`` once listening."""
    with socket.create_server((host, port)) as srv:
        srv.settimeout(timeout_s)
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while msg := conn.recv(_MSG):
                if len(msg) < _MSG:
                    msg += _recv_exact(conn, _MSG - len(msg))
                conn.sendall(msg)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(timeout_s)
            # Into one buffer, as the runtime receives into its tensors: no allocation per read.
            buf = memoryview(bytearray(_CHUNK))
            total, first, last, cpu_first = 0, 0.0, 0.0, 0.0
            while n := conn.recv_into(buf):
                last = time.perf_counter()
                if not total:
                    first, cpu_first = last, time.process_time()
                total += n
            # Read once after the last byte (and the close), not per read: each reading is a system call.
            cpu_s = time.process_time() - cpu_first
            reply = {"bytes": total, "seconds": last - first, "cpu_s": cpu_s}
            conn.sendall(json.dumps(reply).encode())


def probe(host: str, port: int, seconds: float) -> LinkMeasurement:
    """Measure the round trip and the goodput to a :func:`serve` at ``host:port`` (streaming ``seconds``)."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = bytes(range(_MSG))
        rtts = []
        for _ in range(_PINGS):
            start = time.perf_counter()
            conn.sendall(msg)
            _recv_exact(conn, _MSG)
            rtts.append(time.perf_counter() - start)
    with socket.create_connection((host, port), timeout=30) as conn:
        chunk = bytes(range(256)) * (_CHUNK // 256)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(seconds + 30)
        reply = b""
        while part := conn.recv(4096):
            reply += part
    result = json.loads(reply)
    if result["seconds"] <= 0:
        raise RuntimeError(f"goodput probe to {host}:{port} received too little data: {result}")
    return LinkMeasurement(
        statistics.median(rtts), result["bytes"] / result["seconds"], result["cpu_s"] / result["seconds"]
    )


def measure_pair(
    server_argv: Callable[[Sequence[str]], list[str]],
    client_argv: Callable[[Sequence[str]], list[str]],
    host: str,
    port: int,
    seconds: float = 0.5,
) -> LinkMeasurement:
    """Run a :func:`serve` and a :func:`probe` as processes and return the measurement.

    Args:
        server_argv: wraps a command so that it runs on the serving machine (namespace and cgroup).
        client_argv: the same for the probing machine.
        host: the address the server listens on (reachable from the client).
        port: its port.
        seconds: how long the client streams.

    Raises:
        RuntimeError: a side failed (its output is in the message).
    """
    me = [sys.executable, "-m", "tagps.cluster.measure"]
    with subprocess.Popen(
        server_argv([*me, "serve", host, str(port)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            ready = server.stdout.readline().strip() if server.stdout else ""
            if ready != "ready":
                raise RuntimeError(f"link probe server on {host}:{port} failed: {server.communicate()[1]}")
            client = subprocess.run(
                client_argv([*me, "probe", host, str(port), str(seconds)]),
                capture_output=True,
                text=True,
                timeout=seconds + 60,
            )
            if client.returncode != 0:
                raise RuntimeError(f"link probe to {host}:{port} failed: {client.stderr.strip()}")
            data = json.loads(client.stdout)
            server.wait(timeout=30)
            return LinkMeasurement(**data)  # what _main printed with dataclasses.asdict
        finally:
            if server.poll() is None:
                server.kill()


def measure_core(seconds: float = 0.5) -> tuple[float, float]:
    """Return one thread's float32 matmul rate (FLOP/s) and copy bandwidth (bytes read + written per s).

    Both count this thread's CPU time (``time.thread_time``), not wall time, and keep the best of several
    windows, so that other load on the host shows as little as it can.
    """
    import numpy as np
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    for _ in range(3):
        a @ b
    rates = []
    for _ in range(10):
        n, start = 0, time.thread_time()
        while time.thread_time() - start < seconds / 10:
            a @ b
            n += 1
        rates.append(2 * MATMUL_N**3 * n / (time.thread_time() - start))
    src = np.ones(1 << 23, dtype=np.float32)  # 32 MiB, touched once before timing
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    copies = []
    for _ in range(5):
        t = time.thread_time()
        np.copyto(dst, src)
        copies.append(time.thread_time() - t)
    return max(rates), 2 * src.nbytes / min(copies)


def _main(argv: Sequence[str]) -> None:
    if len(argv) == 3 and argv[0] == "serve":
        serve(argv[1], int(argv[2]))
    elif len(argv) == 4 and argv[0] == "probe":
        m = probe(argv[1], int(argv[2]), float(argv[3]))
        print(json.dumps(dataclasses.asdict(m)))
    else:
        raise SystemExit("usage: python -m tagps.cluster.measure serve HOST PORT | probe HOST PORT SECONDS")


if __name__ == "__main__":
    _main(sys.argv[1:])
