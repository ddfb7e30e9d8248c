"""Benchmark push_pull through the summation servers against raw pyzmq and gloo all_reduce.

Usage: ``python bench/pushpull.py [--quick] [--no-emulated | --emulated-only] [--out FILE]`` (default
``bench/results/pushpull.json``; ``--emulated-only``, for experiments on that part alone, needs ``--out``).
``TAGPS_PS_ENGINE`` (``cpp`` or ``python``) picks the data plane of the PS jobs' servers and workers; the
JSON records it.

Two set-ups, each compared within the same run:

* **Loopback** (engine efficiency): 2 worker machines and 1 server on this host (``bpslaunch --local 2
  --servers 1``: machine ``w`` on 127.0.0.<w+1>, the server on machine 0), float32 tensors of 4 and
  64 MiB, the default partition size. The raw pyzmq loopback throughput ``T`` is that of one PUSH to one
  PULL socket, 4 MiB messages, between two processes (median of 3 runs before and 3 after the PS job).
  Over TCP (``TAGPS_PS_IPC=0``) the server must receive every worker's tensor and send the sum back to
  each, ``2 W M`` bytes through its sockets, so ``t_min = 2 W M / T`` bounds the push_pull time from
  below, and ``pushpull_loopback_efficiency = min over sizes of t_min / t``.
  ``pushpull_vs_gloo_64MiB_2w`` is the gloo all_reduce time of the same 64 MiB between the same 2 workers
  divided by the push_pull time, in the default set-up: the worker on the server's machine shares memory
  with it (``TAGPS_PS_IPC=1``; docs/protocol.md), the other goes over TCP. ``pushpull_vs_gloo_64MiB_2w2s``
  is the same with 2 servers (``--servers 2``), one on each machine: each worker sends half its tensor
  over TCP and shares the other half with its own machine's server, the bytes of a ring, where theory
  says PS equals the ring (target 0.9). ``pushpull_tcp_vs_gloo_64MiB_2w`` and ``_2w2s`` are the same
  jobs with every byte over TCP (``TAGPS_PS_IPC=0``), and ``pushpull_ipc_vs_tcp_64MiB_2w2s`` the 2-server
  TCP time over the default one. A job whose servers count shared pushes when they should not, or none
  when they should, fails the run.
* **Emulated links** (where the BytePS argument holds; needs root): every one of 4 workers, 4 servers and
  the scheduler in its own network namespace, each link limited to 1 Gbit/s with ``tc`` (tagps.cluster).
  64 MiB: ``pushpull_vs_allreduce_4w_4s_1gbit`` = gloo all_reduce time among the 4 workers ÷ push_pull time
  (theory 1.5), ``pushpull_vs_optimal_4w_4s_1gbit`` = the BytePS optimum ``M / B`` ÷ push_pull time.
  ``B`` is the tc rate, which counts packet headers too, so goodput tops out near 0.95 ``B`` at 1500 MTU.
  The strongest simple alternative on those links is plain TCP: ``plain_tcp_s`` moves each worker's bytes
  to the servers and back (no sums) through sockets, in the ideal schedule of phases where every link
  carries one flow each way (``pushpull_worker.py tcp-*``); ``pushpull_vs_plain_tcp_4w_4s_1gbit`` is its
  time over push_pull's, ``plain_tcp_vs_optimal_4w_4s_1gbit`` what the links and this host's kernel allow.

``server_sum_GBps``: the summation rate inside the server engine, measured by the server of the loopback
job over TCP (1 server) itself (``python -m tagps.server --stats``): gradient bytes folded into sums (both
workers' pushes of every round) per second of the engine threads' CPU time inside the summation kernels
(the wall-clock rate, which also counts the moments the OS ran another of the job's threads, is in the
measurements).
``sum_into_GBps``: the same work with ``tagps.kernels.sum_into`` alone, right after the job in this
process, one thread like a server's engine: 2 sources of 64 MiB, summed partition by partition
(``BYTEPS_PARTITION_BYTES``) into the first, bytes counted the same way. ``server_sum_vs_sum_into`` is their
ratio (target 0.8: the engine sums within 20 % of the kernel's own rate).

Each timed iteration starts after a barrier on every worker; an iteration's time is the slowest worker's,
and a figure uses the median over iterations. Every result is checked against the exact sum.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import machine_info, write_json

from tagps import kernels
from tagps.cluster import ClusterError, LinkLimit, Network, check_support, up
from tagps.config import PSConfig, ps_config
from tagps.launcher import ProcessSpec, free_ports, local_job, role_job, run_processes

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "pushpull_worker.py"
MiB = 1 << 20
SIZES = (4 * MiB, 64 * MiB)
EMULATED_SIZE = 64 * MiB
LINK_MBIT = 1000.0
TARGETS = {
    "pushpull_loopback_efficiency": 0.85,
    "pushpull_vs_gloo_64MiB_2w": None,
    "pushpull_vs_gloo_64MiB_2w2s": 0.9,
    "pushpull_tcp_vs_gloo_64MiB_2w": None,
    "pushpull_tcp_vs_gloo_64MiB_2w2s": None,
    "pushpull_ipc_vs_tcp_64MiB_2w2s": None,
    "pushpull_vs_allreduce_4w_4s_1gbit": 1.3,
    "pushpull_vs_optimal_4w_4s_1gbit": 0.92,
    "pushpull_vs_plain_tcp_4w_4s_1gbit": None,
    "plain_tcp_vs_optimal_4w_4s_1gbit": None,
    "server_sum_GBps": None,
    "sum_into_GBps": None,
    "server_sum_vs_sum_into": 0.8,
}
# Emulated job: 128 chunks of 512 KiB spread evenly over the 4 servers by the `balanced` key hash. Small
# chunks let a chunk's pull overlap the pushes of later ones (with 4 MB chunks the pulls start late).
EMULATED_PS_ENV = {"BYTEPS_PARTITION_BYTES": str(512 * 1024), "BYTEPS_KEY_HASH_FN": "balanced"}


class Bench:
    """Runs the measurements and records the command of each job."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.commands: list[str] = []
        self.measurements: dict[str, Any] = {}
        self.env = dict(os.environ)

    def record(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        prefix = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        self.commands.append((prefix + " " if prefix else "") + shlex.join(argv))

    # -- raw pyzmq ---------------------------------------------------------------------------------

    def zmq_loopback(self, runs: int = 3) -> list[float]:
        """Bytes/s of ``runs`` PUSH→PULL streams of 4 MiB messages between two processes on 127.0.0.1."""
        total, message = (256 if self.quick else 1024) * MiB, 4 * MiB
        rates = []
        for _ in range(runs):
            (port,) = free_ports(1)
            sink_argv = [sys.executable, str(WORKER), "zmq-sink", str(port), str(total), str(message)]
            source_argv = [sys.executable, str(WORKER), "zmq-source", str(port), str(total), str(message)]
            sink = subprocess.Popen(sink_argv, stdout=subprocess.PIPE, text=True, env=self.env)
            source = subprocess.run(source_argv, env=self.env, timeout=120, check=False)
            out, _ = sink.communicate(timeout=120)
            if source.returncode or sink.returncode:
                raise RuntimeError(
                    f"pyzmq loopback run failed (source {source.returncode}, sink {sink.returncode})"
                )
            rates.append(json.loads(out)["bytes_per_s"])
        self.record(sink_argv)
        self.record(source_argv)
        return rates

    # -- jobs --------------------------------------------------------------------------------------

    def job(self, specs: list[ProcessSpec], out: str, workers: int) -> dict[int, float]:
        """Run one job; return {size: median over iterations of the slowest worker's seconds}.

        Its servers write their counters (``--stats``) to ``OUT.server<i>.json``, kept in the measurements.
        """
        servers = [i for i, spec in enumerate(specs) if spec.label.startswith("server")]
        for n, i in enumerate(servers):
            stats_argv = (*specs[i].argv, "--stats", f"{out}.server{n}.json")
            specs[i] = dataclasses.replace(specs[i], argv=stats_argv)
        log = io.BytesIO()
        status = run_processes(specs, out=log, grace=5)
        if status != 0:
            sys.stderr.write(log.getvalue().decode(errors="replace"))
            raise RuntimeError(f"benchmark job failed with status {status} (its output is above)")
        per_worker = [json.loads(Path(f"{out}.{w}.json").read_text()) for w in range(workers)]
        slowest = {
            int(size): [max(step) for step in zip(*(r[size] for r in per_worker), strict=True)]
            for size in per_worker[0]
        }
        self.measurements.setdefault("iterations_s", {})[Path(out).name] = slowest
        self.measurements.setdefault("server_stats", {})[Path(out).name] = [
            json.loads(Path(f"{out}.server{n}.json").read_text()) for n in range(len(servers))
        ]
        return {size: statistics.median(steps) for size, steps in slowest.items()}

    def worker_argv(self, mode: str, out: str, sizes: Sequence[int], iters: Sequence[int]) -> list[str]:
        return [sys.executable, str(WORKER), mode, out, ",".join(map(str, sizes)), ",".join(map(str, iters))]

    def loopback(self, tmp: str) -> dict[str, float]:
        iters = (10, 3) if self.quick else (40, 10)  # per size: small tensors are cheap and noisier
        # pyzmq is measured right before and after the PS job, so both see the same machine load.
        rates = self.zmq_loopback()
        times = {}
        # "ps2s": two servers, one per machine. The network path (TAGPS_PS_IPC=0) first; "-ipc": the same
        # jobs as they run by default, where each worker shares memory with its own machine's server.
        jobs = [("ps", "ps", 1, "0"), ("ps2s", "ps", 2, "0"), ("gloo", "gloo", 0, "0")]
        jobs += [("ps-ipc", "ps", 1, "1"), ("ps2s-ipc", "ps", 2, "1")]
        for label, mode, servers, ipc in jobs:
            argv = self.worker_argv(mode, f"{tmp}/loop-{label}", SIZES, iters)
            env = {**self.env, "GLOO_SOCKET_IFNAME": "lo", "TAGPS_PS_IPC": ipc}
            self.record(
                ["bpslaunch", "--local", "2", "--servers", str(servers), "--", *argv],
                {"GLOO_SOCKET_IFNAME": "lo", "TAGPS_PS_IPC": ipc},
            )
            times[label] = self.job(local_job(argv, 2, servers, 1, env), f"{tmp}/loop-{label}", 2)
            if label == "ps":
                rates += self.zmq_loopback()
            if mode == "ps":
                shared = sum(s["ipc_pushes"] for s in self.measurements["server_stats"][f"loop-{label}"])
                if (ipc == "1") != (shared > 0):
                    raise RuntimeError(f"job {label} with TAGPS_PS_IPC={ipc} pushed {shared} chunks shared")
        rate = statistics.median(rates)
        bounds = {size: 2 * 2 * size / rate for size in SIZES}
        self.measurements["loopback"] = {
            "zmq_loopback_GBps": rate / 1e9,
            "zmq_loopback_runs_GBps": [r / 1e9 for r in rates],
            "pushpull_s": {str(s): times["ps"][s] for s in SIZES},
            "pushpull_2_servers_s": {str(s): times["ps2s"][s] for s in SIZES},
            "pushpull_ipc_s": {str(s): times["ps-ipc"][s] for s in SIZES},
            "pushpull_ipc_2_servers_s": {str(s): times["ps2s-ipc"][s] for s in SIZES},
            "gloo_allreduce_s": {str(s): times["gloo"][s] for s in SIZES},
            "pushpull_bound_s": {str(s): bounds[s] for s in SIZES},
            "efficiency": {str(s): bounds[s] / times["ps"][s] for s in SIZES},
            # The same with the fastest pyzmq run and the fastest push_pull iteration (less load noise).
            "efficiency_best_vs_best": {
                str(s): 2 * 2 * s / max(rates) / min(self.measurements["iterations_s"]["loop-ps"][s])
                for s in SIZES
            },
        }
        big = 64 * MiB
        return {
            "pushpull_loopback_efficiency": min(bounds[s] / times["ps"][s] for s in SIZES),
            "pushpull_vs_gloo_64MiB_2w": times["gloo"][big] / times["ps-ipc"][big],
            "pushpull_vs_gloo_64MiB_2w2s": times["gloo"][big] / times["ps2s-ipc"][big],
            "pushpull_tcp_vs_gloo_64MiB_2w": times["gloo"][big] / times["ps"][big],
            "pushpull_tcp_vs_gloo_64MiB_2w2s": times["gloo"][big] / times["ps2s"][big],
            "pushpull_ipc_vs_tcp_64MiB_2w2s": times["ps2s"][big] / times["ps2s-ipc"][big],
        }

    def emulated(self, tmp: str) -> dict[str, float]:
        iters = [2 if self.quick else 5]
        names = ["sched"] + [f"s{i}" for i in range(4)] + [f"w{i}" for i in range(4)]
        with up(names, LinkLimit(rate_mbit=LINK_MBIT)) as net:
            self.commands.append(
                f"tagps.cluster.up({names}, LinkLimit(rate_mbit={LINK_MBIT}))  # tbf, 1500 MTU"
            )
            ps_argv = self.worker_argv("ps", f"{tmp}/emu-ps", [EMULATED_SIZE], iters)
            t_ps = self.job(self._ps_specs(net, ps_argv), f"{tmp}/emu-ps", 4)[EMULATED_SIZE]
            gloo_argv = self.worker_argv("gloo", f"{tmp}/emu-gloo", [EMULATED_SIZE], iters)
            t_gloo = self.job(self._gloo_specs(net, gloo_argv), f"{tmp}/emu-gloo", 4)[EMULATED_SIZE]
            tcp_specs = self._tcp_specs(net, f"{tmp}/emu-tcp", iters[0])
            t_tcp = self.job(tcp_specs, f"{tmp}/emu-tcp", 4)[EMULATED_SIZE]
        optimum = EMULATED_SIZE / (LINK_MBIT * 1e6 / 8)
        self.measurements["emulated"] = {
            "pushpull_s": t_ps,
            "gloo_allreduce_s": t_gloo,
            "plain_tcp_s": t_tcp,
            "bytesps_optimum_s": optimum,
            "ring_optimum_s": 1.5 * optimum,
        }
        return {
            "pushpull_vs_allreduce_4w_4s_1gbit": t_gloo / t_ps,
            "pushpull_vs_optimal_4w_4s_1gbit": optimum / t_ps,
            "pushpull_vs_plain_tcp_4w_4s_1gbit": t_tcp / t_ps,
            "plain_tcp_vs_optimal_4w_4s_1gbit": optimum / t_tcp,
        }

    def _in_netns(self, net: Network, node: str, spec: ProcessSpec, label: str, service: bool) -> ProcessSpec:
        self.record(
            net.exec_argv(node, spec.argv),
            {
                k: spec.env[k]
                for k in sorted(spec.env)
                if k.startswith(("DMLC_", "BYTEPS_", "TAGPS_DIST", "GLOO_"))
            },
        )
        return dataclasses.replace(
            spec, label=label, argv=tuple(net.exec_argv(node, spec.argv)), service=service
        )

    def _ps_specs(self, net: Network, argv: list[str]) -> list[ProcessSpec]:
        common = {
            **self.env,
            **EMULATED_PS_ENV,
            "DMLC_NUM_WORKER": "4",
            "DMLC_NUM_SERVER": "4",
            "DMLC_PS_ROOT_URI": net.address("sched"),
            "DMLC_PS_ROOT_PORT": "9000",
            "BYTEPS_LOCAL_SIZE": "1",
        }
        specs = []
        for node, role, extra in (
            [("sched", "scheduler", {})]
            + [(f"s{i}", "server", {}) for i in range(4)]
            + [(f"w{i}", "worker", {"DMLC_WORKER_ID": str(i)}) for i in range(4)]
        ):
            env = {**common, **extra, "DMLC_ROLE": role, "DMLC_NODE_HOST": net.address(node)}
            (spec,) = role_job(argv, env)
            label = "scheduler" if role == "scheduler" else f"{role} {node[1:]}"
            specs.append(self._in_netns(net, node, spec, label, service=role != "worker"))
        return specs

    def _gloo_specs(self, net: Network, argv: list[str]) -> list[ProcessSpec]:
        common = {
            **self.env,
            "DMLC_NUM_WORKER": "4",
            "DMLC_NUM_SERVER": "0",
            "DMLC_PS_ROOT_URI": net.address("w0"),
            "TAGPS_DIST_PORT": "29500",
            "GLOO_SOCKET_IFNAME": "eth0",
            "BYTEPS_LOCAL_SIZE": "1",
        }
        specs = []
        for i in range(4):
            env = {
                **common,
                "DMLC_ROLE": "worker",
                "DMLC_WORKER_ID": str(i),
                "DMLC_NODE_HOST": net.address(f"w{i}"),
            }
            (spec,) = role_job(argv, env)
            specs.append(self._in_netns(net, f"w{i}", spec, f"worker {i}", service=False))
        return specs

    def _tcp_specs(self, net: Network, out: str, iters: int) -> list[ProcessSpec]:
        """The push_pull's bytes through plain sockets on the same links (pushpull_worker's ``tcp-*``)."""
        share, port = EMULATED_SIZE // 4, 9100
        hosts = ",".join(net.address(f"s{i}") for i in range(4))
        specs = []
        for i in range(4):
            argv = ("tcp-server", net.address(f"s{i}"), str(port), "4", str(share), str(iters))
            spec = ProcessSpec(f"tcp server {i}", (sys.executable, str(WORKER), *argv), self.env)
            specs.append(self._in_netns(net, f"s{i}", spec, spec.label, service=True))
        for i in range(4):
            argv = ("tcp-worker", out, str(i), hosts, str(port), str(EMULATED_SIZE), str(iters))
            spec = ProcessSpec(f"tcp worker {i}", (sys.executable, str(WORKER), *argv), self.env)
            specs.append(self._in_netns(net, f"w{i}", spec, spec.label, service=False))
        return specs

    # -- summation ----------------------------------------------------------------------------------

    def server_sum(self, workers: int = 2) -> dict[str, float]:
        """The loopback job's server summation rate (its ``--stats``) beside ``sum_into`` alone doing the same
        work: ``workers`` sources of 64 MiB, summed partition by partition into the first on one thread."""
        stats = self.measurements["server_stats"]["loop-ps"]
        summed = sum(s["sum_bytes"] for s in stats)
        cpu, wall = sum(s["sum_cpu_seconds"] for s in stats), sum(s["sum_seconds"] for s in stats)
        if not summed or not cpu:
            raise RuntimeError(f"the loopback job's server summed nothing: {stats}")
        part = _ps_partition_bytes() // 4
        n = 64 * MiB // 4
        pushes = [np.empty(n, dtype=np.float32) for _ in range(workers)]
        threads = kernels.num_threads()
        kernels.set_num_threads(1)  # as in a server: its engine threads are the parallelism
        cpu_times, wall_times = [], []
        try:
            for _ in range(3 if self.quick else 10):
                for w, push in enumerate(pushes):
                    push.fill(w + 1)
                wall0, cpu0 = time.perf_counter(), time.thread_time()
                for start in range(0, n, part):
                    chunks = [p[start : start + part] for p in pushes]
                    kernels.sum_into(chunks[0], *chunks[1:])
                cpu_times.append(time.thread_time() - cpu0)
                wall_times.append(time.perf_counter() - wall0)
                if not np.all(pushes[0] == workers * (workers + 1) / 2):
                    raise RuntimeError("sum_into gave a wrong sum")
        finally:
            kernels.set_num_threads(threads)
        kernel_bytes = workers * 4 * n
        self.measurements["server_sum"] = {
            "engine_sum_bytes": summed,
            "engine_sum_cpu_s": cpu,
            "engine_sum_wall_s": wall,
            "engine_GBps_wall": summed / wall / 1e9,
            "sum_into_workers": workers,
            "sum_into_bytes_per_source": 4 * n,
            "sum_into_partition_bytes": 4 * part,
            "sum_into_GBps_wall": kernel_bytes / statistics.median(wall_times) / 1e9,
            "simd": kernels.simd_mode(),
        }
        engine, alone = summed / cpu / 1e9, kernel_bytes / statistics.median(cpu_times) / 1e9
        return {"server_sum_GBps": engine, "sum_into_GBps": alone, "server_sum_vs_sum_into": engine / alone}


def _machine() -> dict[str, Any]:
    import zmq

    return machine_info(
        cpu_key="cpu", kernel=platform.release(), pyzmq=zmq.__version__, libzmq=zmq.zmq_version()
    )


def _ps_job_config() -> PSConfig:
    """The PS settings of the loopback jobs' nodes, as they read them."""
    job = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1"}
    return ps_config({**os.environ, **job, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1"})


def _ps_engine() -> str:
    """The data plane of the PS jobs' nodes: ``TAGPS_PS_ENGINE`` as they read it."""
    return _ps_job_config().engine


def _ps_partition_bytes() -> int:
    """``BYTEPS_PARTITION_BYTES`` of the loopback jobs."""
    return _ps_job_config().partition_bytes


def _table(figures: dict[str, float | None], skipped: dict[str, str]) -> str:
    rows = [f"{'figure':40s} {'value':>10s} {'target':>8s}  status"]
    for name, value in figures.items():
        target = TARGETS[name]
        shown = "n/a" if value is None else f"{value:.3f}"
        status = (
            "skipped" if value is None else "-" if target is None else "ok" if value >= target else "MISS"
        )
        rows.append(f"{name:40s} {shown:>10s} {'' if target is None else f'>= {target}':>8s}  {status}")
    rows += [f"skipped {part}: {reason}" for part, reason in skipped.items()]
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, write the JSON, print the table; return 0 (misses are reported, not errors)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (same sizes)")
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--no-emulated", action="store_true", help="skip the emulated-links part")
    part.add_argument(
        "--emulated-only", action="store_true", help="run the emulated-links part alone (needs --out)"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/pushpull.json")
    args = parser.parse_args(argv)
    if args.emulated_only and args.out is None:  # its JSON lacks the other figures: keep the full run's file
        parser.error("--emulated-only writes only that part's figures: give --out")
    out = args.out or ROOT / "bench" / "results" / "pushpull.json"
    bench = Bench(args.quick)
    load_before = os.getloadavg()
    figures: dict[str, float | None] = dict.fromkeys(TARGETS)
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="tagps-pushpull-") as tmp:
        if args.emulated_only:
            skipped["loopback and server sum"] = "--emulated-only"
        else:
            figures.update(bench.loopback(tmp))
        try:
            if args.no_emulated:
                raise ClusterError("--no-emulated")
            check_support()
        except ClusterError as exc:
            skipped["emulated"] = f"the emulated-links part needs root and network namespaces: {exc}"
        else:
            figures.update(bench.emulated(tmp))
    if not args.emulated_only:
        figures.update(bench.server_sum())
    result = {
        # Other jobs on the machine skew every figure; the 1-minute load average says how busy it was.
        "machine": {**_machine(), "load_average_1min": {"start": load_before[0], "end": os.getloadavg()[0]}},
        "quick": args.quick,
        "ps_engine": _ps_engine(),
        "commands": bench.commands,
        "figures": figures,
        "targets": {k: v for k, v in TARGETS.items() if v is not None},
        "measurements": bench.measurements,
        "skipped": skipped,
    }
    write_json(out, result)
    print(_table(figures, skipped))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
