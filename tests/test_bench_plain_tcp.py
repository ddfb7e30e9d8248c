"""bench/pushpull_worker.py's plain-TCP modes, the bound push_pull is compared with on emulated links: every
worker exchanges its share with every server, after a barrier, and records one time per timed iteration."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tagps.launcher import free_ports

WORKER = Path(__file__).resolve().parent.parent / "bench" / "pushpull_worker.py"


@pytest.mark.timeout(120)
def test_two_workers_exchange_with_two_servers(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    hosts, nbytes, iters = ["127.0.0.1", "127.0.0.2"], 1 << 20, 3
    share = nbytes // len(hosts)
    servers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "tcp-server", h, str(port), "2", str(share), str(iters)]
        )
        for h in hosts
    ]
    out = str(tmp_path / "tcp")
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "tcp-worker",
                out,
                str(w),
                ",".join(hosts),
                str(port),
                str(nbytes),
                str(iters),
            ]
        )
        for w in range(2)
    ]
    try:
        for proc in (*workers, *servers):
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in (*workers, *servers):
            proc.kill()
    for w in range(2):
        times = json.loads((tmp_path / f"tcp.{w}.json").read_text())[str(nbytes)]
        assert len(times) == iters and all(t > 0 for t in times)  # the warm-up iteration is not recorded


@pytest.mark.timeout(60)
def test_a_worker_that_sends_garbage_fails_the_server(tmp_path: Path) -> None:
    import socket

    (port,) = free_ports(1)
    server = subprocess.Popen(
        [sys.executable, str(WORKER), "tcp-server", "127.0.0.1", str(port), "1", "16", "1"],
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(200):
            try:
                sock = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.05)
        else:
            pytest.fail(f"the tcp-server never listened on port {port}")
        sock.sendall(b"x")
        _, err = server.communicate(timeout=30)
        sock.close()
    finally:
        server.kill()
    assert server.returncode != 0 and b"expected b'g' from a worker, got b'x'" in err
