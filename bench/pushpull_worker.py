"""The processes that ``bench/pushpull.py`` starts (through bpslaunch's supervisor); not run by hand.

Modes:
    ps OUT SIZES ITERS      a worker machine: push_pull through the summation servers with PSClient
    gloo OUT SIZES ITERS    a worker: torch.distributed (gloo) all_reduce among the same workers
    zmq-sink PORT BYTES MSG raw pyzmq loopback throughput: receive BYTES in MSG-byte messages
    zmq-source PORT BYTES MSG  the sending side of ``zmq-sink``
    tcp-server HOST PORT WORKERS BYTES ITERS      plain TCP: exchange BYTES with each worker
    tcp-worker OUT ID HOSTS PORT BYTES ITERS      the worker side: the PS job's bytes, scheduled ideally

``SIZES`` is a comma list of tensor sizes in bytes, ``ITERS`` a comma list of the timed iterations of
each. Each worker fills its tensor with distinct values (``(i mod 1024) * (worker + 1)``), and after every
iteration checks the result is the exact sum, so a mixed-up chunk fails the run. Every iteration starts
after a barrier on every worker; each worker writes its per-iteration seconds to ``OUT.<worker>.json``
(the first iteration of each size is warm-up and not recorded).

The ``tcp-*`` modes move a push_pull's bytes through plain sockets with no summation and an ideal schedule:
in phase ``k`` worker ``w`` sends its ``BYTES / S`` share to server ``(w + k) mod S`` while receiving as much
back, so that every link carries one flow each way at a time (all 16 flows at once reach less on tc-shaped
links). Each iteration starts after a barrier through server 0.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time

import numpy as np

from tagps.config import comm_config

__all__: list[str] = []


def _inputs(nbytes: int, worker: int, workers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    base = (np.arange(nbytes // 4, dtype=np.int64) % 1024).astype(np.float32)
    mine = base * (worker + 1)
    expected = base * (workers * (workers + 1) // 2)
    return mine, expected, np.empty_like(mine)


def _timed(step, mine: np.ndarray, expected: np.ndarray, buf: np.ndarray, barrier, iters: int) -> list[float]:
    times = []
    for i in range(iters + 1):
        np.copyto(buf, mine)
        barrier()
        t0 = time.perf_counter()
        step(buf)
        elapsed = time.perf_counter() - t0
        if not np.array_equal(buf, expected):
            bad = int(np.flatnonzero(buf != expected)[0])
            raise RuntimeError(f"wrong sum at element {bad}: {buf[bad]} != {expected[bad]}")
        if i:
            times.append(elapsed)
    return times


def _ps(out: str, sizes: list[int], iters: list[int]) -> None:
    from tagps.ps.client import PSClient

    client = PSClient.from_env()
    try:
        for nbytes in sizes:
            client.declare(f"t{nbytes}", nbytes, np.float32)
        client.barrier()
        result = {}
        for nbytes, count in zip(sizes, iters, strict=True):
            mine, expected, buf = _inputs(nbytes, client.worker_id, client.num_workers)
            name = f"t{nbytes}"
            result[nbytes] = _timed(
                lambda b, name=name: client.wait(client.push_pull(name, b, average=False)),
                mine,
                expected,
                buf,
                client.barrier,
                count,
            )
        _write(out, client.worker_id, result)
    finally:
        client.close()


def _gloo(out: str, sizes: list[int], iters: list[int]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    cfg = comm_config()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{cfg.root_uri}:{cfg.dist_port}",
        rank=cfg.worker_id,
        world_size=cfg.num_worker,
        timeout=datetime.timedelta(seconds=cfg.dist_timeout_s),
    )
    try:
        result = {}
        for nbytes, count in zip(sizes, iters, strict=True):
            mine, expected, buf = _inputs(nbytes, cfg.worker_id, cfg.num_worker)
            tensor = torch.from_numpy(buf)
            result[nbytes] = _timed(
                lambda b, t=tensor: dist.all_reduce(t), mine, expected, buf, dist.barrier, count
            )
        _write(out, cfg.worker_id, result)
    finally:
        dist.destroy_process_group()


def _write(out: str, worker: int, result: dict[int, list[float]]) -> None:
    with open(f"{out}.{worker}.json", "w") as f:
        json.dump({str(k): v for k, v in result.items()}, f)


def _zmq(mode: str, port: int, total: int, message: int) -> None:
    import zmq

    ctx = zmq.Context()
    if mode == "zmq-sink":
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"tcp://127.0.0.1:{port}")
        received, first = 0, None
        while received < total:
            frame = sock.recv(copy=False)
            first = first or time.perf_counter()
            received += len(frame.buffer)
        # The first message's time is not counted: subtract its bytes.
        rate = (received - message) / (time.perf_counter() - first)
        print(json.dumps({"bytes_per_s": rate}), flush=True)
    else:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(f"tcp://127.0.0.1:{port}")
        payload = np.ones(message, dtype=np.uint8)
        for _ in range(total // message):
            sock.send(payload, copy=False)
    sock.close(linger=-1)
    ctx.term()


# A peer that stops sending or never connects fails the tcp-* processes instead of hanging the benchmark.
TCP_TIMEOUT_S = 60.0


def _exchange(sock: socket.socket, payload: bytes, buf: bytearray) -> None:
    """Send ``payload`` while receiving ``len(buf)`` bytes into ``buf`` (full duplex)."""
    sender = threading.Thread(target=sock.sendall, args=(payload,))
    sender.start()
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-exchange")
        got += n
    sender.join()


def _recv_byte(sock: socket.socket, expected: bytes) -> None:
    got = sock.recv(1)
    if got != expected:
        raise ConnectionError(f"expected {expected!r} from the peer, got {got!r}")


def _tcp_server(host: str, port: int, workers: int, nbytes: int, iters: int) -> None:
    """Serve ``iters + 1`` exchanges of ``nbytes`` with each of ``workers`` connections; server 0 (the one
    that also gets barrier bytes) releases every worker once all of them arrived."""
    listener = socket.create_server((host, port), backlog=workers)
    listener.settimeout(TCP_TIMEOUT_S)
    conns = [listener.accept()[0] for _ in range(workers)]
    for conn in conns:
        conn.settimeout(TCP_TIMEOUT_S)
    barrier = threading.Barrier(workers, timeout=TCP_TIMEOUT_S)

    def serve(sock: socket.socket) -> None:
        payload, buf = bytes(nbytes), bytearray(nbytes)
        for _ in range(iters + 1):
            first = sock.recv(1)
            if first == b"b":  # a barrier round before the exchange
                barrier.wait()
                sock.sendall(b"B")
                first = sock.recv(1)
            if first != b"g":
                raise ConnectionError(f"expected b'g' from a worker, got {first!r}")
            _exchange(sock, payload, buf)

    errors: list[BaseException] = []

    def serve_or_stop(sock: socket.socket) -> None:
        try:
            serve(sock)
        except BaseException as exc:  # re-raised below; the other threads must wake first
            errors.append(exc)
            barrier.abort()
            for c in conns:
                with contextlib.suppress(OSError):  # already shut
                    c.shutdown(socket.SHUT_RDWR)

    threads = [threading.Thread(target=serve_or_stop, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in (*conns, listener):
        c.close()
    if errors:
        raise errors[0]


def _tcp_worker(out: str, worker: int, hosts: list[str], port: int, nbytes: int, iters: int) -> None:
    share = nbytes // len(hosts)
    conns = []
    for host in hosts:
        deadline = time.monotonic() + TCP_TIMEOUT_S
        while True:
            try:
                conns.append(socket.create_connection((host, port), timeout=TCP_TIMEOUT_S))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    payload, buf = bytes(share), bytearray(share)
    times = []
    for i in range(iters + 1):
        conns[0].sendall(b"b")
        _recv_byte(conns[0], b"B")
        t0 = time.perf_counter()
        for k in range(len(conns)):
            sock = conns[(worker + k) % len(conns)]
            sock.sendall(b"g")
            _exchange(sock, payload, buf)
        if i:
            times.append(time.perf_counter() - t0)
    for c in conns:
        c.close()
    _write(out, worker, {nbytes: times})


def main(argv: list[str]) -> None:
    mode, *args = argv
    if mode in ("ps", "gloo"):
        out, sizes, iters = (
            args[0],
            [int(s) for s in args[1].split(",")],
            [int(i) for i in args[2].split(",")],
        )
        if len(iters) != len(sizes):
            raise SystemExit(f"{len(sizes)} sizes but {len(iters)} iteration counts")
        (_ps if mode == "ps" else _gloo)(out, sizes, iters)
    elif mode in ("zmq-sink", "zmq-source"):
        _zmq(mode, int(args[0]), int(args[1]), int(args[2]))
    elif mode == "tcp-server":
        _tcp_server(args[0], int(args[1]), int(args[2]), int(args[3]), int(args[4]))
    elif mode == "tcp-worker":
        _tcp_worker(args[0], int(args[1]), args[2].split(","), int(args[3]), int(args[4]), int(args[5]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
