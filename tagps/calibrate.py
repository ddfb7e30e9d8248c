"""Calibrate the simulator on this host: ``python -m tagps.calibrate [--quick] [--no-cluster] [--out FILE]``.

1. **Profile** the calibration set (``mlp-mini``, ``convnet-mini``, ``encoder-mini``; the benchmarks
   validate on other models) on one thread: a full training step (forward, backward, Adam) at several
   batch sizes, in CPU time, plus this core's float32 matmul rate and copy bandwidth; fit the roofline
   constants.
2. **Measure links**: ``gloo`` all-reduces of several sizes between two devices of one machine and
   between two machines of an emulated calibration cluster (:data:`CALIBRATION_CLUSTER`, unlike the
   benchmark's) whose goodput was measured; fit the ring model's latencies and bandwidth efficiencies.
3. **Measure the host CPU's communication costs**: the summation kernel's rate on one thread, one side
   of a loopback TCP transfer, in memory passes per byte (what a PS message costs each side), and the PS
   engine's CPU per message (a loopback summation server's, while one worker push_pulls small tensors).
4. **Fit on whole jobs**: train ``mlp-mini`` and ``encoder-mini`` on that cluster with DDP, tagps
   all-reduce and tagps PS, and fit what the runtimes add to the links' costs: the CPU of each ring step
   of a collective and of launching each collective call on every rank, which a quota'd machine runs
   slowly. Before it, back-to-back small all-reduces (rings of 3 and 6) on that cluster measure the same
   costs outside a training step: the micro-benchmarks the fit is compared with, and the CPU a
   collective's steps and calls consume (``collective_step_cpu_s``, ``collective_call_cpu_s``), which
   the simulator charges to each rank's machine quota. Back-to-back small push_pulls from machines of one
   rank, of two and of three measure a push_pull call's CPU on a rank (``ps_call_s``), what a machine of
   several ranks adds once (``ps_shared_call_s``: its root's coordination of the shared-memory reduction)
   and what each further local rank adds (``ps_local_call_s``).

At the end it prints each fitted constant beside the micro-benchmark it is a fraction or a counterpart of
(matmul rate, copy bandwidth, one op's dispatch, half a TCP round trip, TCP goodput) with its physical
range, and a warning for every constant that ended on an end of its range (a failure of the cost model,
also flagged as ``at_bound`` in the JSON).

Without root only the loopback ring of step 2 is measured, the inter-machine constants are taken equal to
the intra-machine ones and step 4 is skipped (the output says so). The result is the JSON the simulator
loads (:mod:`tagps.strategy.calibration`; default ``$TAGPS_CACHE_DIR/calibration.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tagps.atomic import write_text_atomic
from tagps.heap import keep_freed_buffers
from tagps.strategy.calibration import (
    FITTED,
    HOST_CPU,
    RUNTIME_CPU,
    Calibration,
    CommSample,
    ComputeSample,
    RunSample,
    fit_comm,
    fit_compute,
    fit_runs,
    load_calibration,
    refit_runs,
)

__all__ = [
    "CALIBRATION_CLUSTER",
    "CALIBRATION_MODELS",
    "Reference",
    "calibrate",
    "calibrate_stages",
    "constants_table",
    "default_path",
    "main",
    "measure_dispatch",
    "measure_runtime_cpu",
    "measure_sum_bandwidth",
    "probe_argv",
    "profile_step",
]

# Two emulated machines, neither like the benchmark's: three devices at 1 core, three at 0.75 cores. Their
# devices run at two shares of a core (1/3 and 1/4), so the job fit sees how a collective's CPU scales with
# the share, and their rings have 3 ranks (ca alone) and 6 (both), so it sees how the CPU grows with a
# ring's steps: with rings of 2 and 3 ranks the fit extrapolated a 6-rank call to 3.8 ms of CPU, where
# 38 back-to-back async all-reduces of 6 ranks measured 3.0 ms per call (process CPU time, each rank).
CALIBRATION_CLUSTER = {
    "name": "calib",
    "machines": [
        {"name": "ca", "workers": 3, "cpu": 1.0, "rate_mbit": 400},
        {"name": "cb", "workers": 3, "cpu": 0.75, "rate_mbit": 400},
    ],
}
CALIBRATION_MODELS = ("mlp-mini", "convnet-mini", "encoder-mini")
_SIZES = (1 << 16, 1 << 20, 1 << 23)  # bytes of the probed all-reduces
_BATCH = 24


def default_path() -> Path:
    """Where the calibration lives by default: ``$TAGPS_CACHE_DIR/calibration.json``."""
    from tagps.config import strategy_config

    return Path(strategy_config().cache_dir) / "calibration.json"


def profile_step(model: Any, inputs: Sequence[Any], steps: int = 5) -> float:
    """Fastest of ``steps`` training steps (forward, cross-entropy, backward, Adam) on one thread, in CPU
    seconds of that thread (``time.thread_time``: other load on the host does not count)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    keep_freed_buffers()  # as a worker runs (tagps.torch.init)
    with torch.no_grad():
        out = model(*inputs)
    targets = torch.randint(0, out.shape[-1], out.shape[:-1])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 2):
        t = time.thread_time()
        opt.zero_grad()
        F.cross_entropy(model(*inputs).flatten(0, -2), targets.flatten()).backward()
        opt.step()
        if step >= 2:
            times.append(time.thread_time() - t)
    return min(times)


def measure_dispatch(seconds: float = 0.2) -> float:
    """Return the CPU seconds of one op on a one-element tensor on one thread: the framework's dispatch
    alone, the micro-benchmark beside the fitted ``op_overhead_s``."""
    import torch

    torch.set_num_threads(1)
    x = torch.ones(1)
    best = math.inf
    for _ in range(5):
        n, start = 0, time.thread_time()
        while time.thread_time() - start < seconds / 5:
            for _ in range(100):  # amortises the clock reads
                torch.neg(x)
            n += 100
        best = min(best, (time.thread_time() - start) / n)
    return best


class Reference(NamedTuple):
    """The micro-benchmark beside a fitted constant: a value the constant is a fraction of (fractions) or
    the measured counterpart of (seconds).

    Args:
        what: what was measured.
        value: the measurement.
        unit: its unit.
    """

    what: str
    value: float
    unit: str


def _si(value: float, unit: str) -> str:
    """``value`` with an SI prefix (``12.3 us``, ``45.1 GFLOP/s``); plain for a fraction."""
    if not unit:
        return f"{value:.3g}"
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "u")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value / 1e-9:.3g} n{unit}"


def constants_table(cal: Calibration, references: dict[str, Reference]) -> str:
    """Each fitted constant of ``cal`` beside its micro-benchmark, in the micro-benchmark's unit.

    Args:
        cal: the calibration.
        references: the micro-benchmark of each fitted constant (a constant without one shows ``-``).

    Returns:
        A table; constants on an end of their physical range are marked ``ON BOUND``.
    """
    rows = [("constant", "value", "physical range", "micro-benchmark", "value, same unit", "")]
    for name, rng in {**FITTED, **HOST_CPU}.items():
        value, ref = getattr(cal, name), references.get(name)
        bench = same = "-"
        if ref is not None:
            bench = f"{ref.what}: {_si(ref.value, ref.unit)}"
            if name == "message_copies":  # passes per byte: the copy rate they leave for one side
                same = _si(cal.memory_bandwidth / value, ref.unit)
            else:
                same = _si(value * ref.value if not rng.unit else value, ref.unit)
        elif name in HOST_CPU and not value:
            bench = "not costed"
        bounds = f"[{_si(rng.low, rng.unit)}, {_si(rng.high, rng.unit)}]"
        rows.append(
            (name, _si(value, rng.unit), bounds, bench, same, "ON BOUND" if name in cal.at_bound else "")
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def measure_sum_bandwidth(nbytes: int = 16 << 20, reps: int = 5) -> float:
    """Return the bytes per CPU second that :func:`tagps.kernels.sum_into` adds into a buffer on one
    thread (float32, ``nbytes`` per operand, the best of ``reps``)."""
    import numpy as np

    from tagps import kernels

    kernels.set_num_threads(1)
    dst, src = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
    kernels.sum_into(dst, src)  # first touch
    best = math.inf
    for _ in range(reps):
        start = time.thread_time()
        kernels.sum_into(dst, src)
        best = min(best, time.thread_time() - start)
    return nbytes / best


def _process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_ps_message_s(keys: int = 16, key_bytes: int = 16_000, seconds: float = 1.5) -> float:
    """Return the CPU seconds a summation server spends per message on one core: a loopback job of one
    server, whose one worker (this process) push_pulls ``keys`` tensors of ``key_bytes`` (one partition
    each) round after round for about ``seconds``; the server process's CPU over its messages (a push and
    a pull per key and round). Small tensors, so that the bytes' copies and sums are a small part."""
    import subprocess

    import numpy as np

    from tagps.config import ps_config
    from tagps.launcher import local_job
    from tagps.ps import PSClient

    specs = local_job(["true"], 1, 1, 1)
    services = {
        s.env["DMLC_ROLE"]: subprocess.Popen(
            s.argv, env=dict(s.env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for s in specs
        if s.service
    }
    client = None
    try:
        client = PSClient(ps_config(specs[-1].env))
        buffers = [np.ones(key_bytes // 4, np.float32) for _ in range(keys)]
        for k in range(keys):
            client.declare(f"probe{k}", key_bytes, np.float32)
        client.barrier()

        def round_trip() -> None:
            for handle in [client.push_pull(f"probe{k}", b) for k, b in enumerate(buffers)]:
                client.wait(handle, timeout=30)

        for _ in range(10):  # warm-up: connections, first allocations
            round_trip()
        server = services["server"].pid
        cpu, start, rounds = _process_cpu_s(server), time.monotonic(), 0
        while time.monotonic() - start < seconds:
            round_trip()
            rounds += 1
        return (_process_cpu_s(server) - cpu) / (2 * keys * rounds)
    finally:
        if client is not None:
            client.close()
        for proc in services.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _host_cpu(memory_bandwidth: float) -> tuple[dict[str, float], dict[str, Reference]]:
    """The measured host-CPU constants and their micro-benchmarks: ``sum_bandwidth`` from the kernel,
    ``message_copies`` as the memory passes that one side of a loopback TCP transfer costs per byte (its
    goodput, with each side on its own core, against the copy bandwidth), and ``message_overhead_s`` from a
    loopback server (:func:`measure_ps_message_s`)."""
    from tagps.cluster.measure import measure_pair
    from tagps.launcher import free_ports

    summed = measure_sum_bandwidth()
    goodput = measure_pair(list, list, "127.0.0.1", free_ports(1)[0], 0.5).bandwidth_Bps
    per_message = measure_ps_message_s()
    values = {
        "sum_bandwidth": HOST_CPU["sum_bandwidth"].clip(summed),
        "message_copies": HOST_CPU["message_copies"].clip(memory_bandwidth / goodput),
        "message_overhead_s": HOST_CPU["message_overhead_s"].clip(per_message),
    }
    refs = {
        "sum_bandwidth": Reference("sum_into, one thread", summed, "B/s"),
        "message_copies": Reference("TCP goodput, loopback", goodput, "B/s"),
        "message_overhead_s": Reference("loopback server's CPU per message", per_message, "s"),
    }
    return values, refs


def _compute_samples(batches: Sequence[int], steps: int) -> list[ComputeSample]:
    import torch

    from tagps.models import build_model, example_inputs
    from tagps.strategy.graph import model_graph

    samples = []
    for name in CALIBRATION_MODELS:
        graph = model_graph(name)
        torch.manual_seed(0)
        model = build_model(name)
        for b in batches:
            seconds = profile_step(model, example_inputs(name, b), steps)
            samples.append(ComputeSample(f"{name}@{b}", graph, b, "adam", seconds))
    return samples


@contextlib.contextmanager
def _probe_rank() -> Iterator[Any]:
    """Join the probe's job as a one-thread rank (the probes time the runtime, not torch's thread pool);
    yield :mod:`tagps.torch` and leave the job at the end."""
    import torch

    import tagps.torch as bps

    torch.set_num_threads(1)
    bps.init()
    try:
        yield bps
    finally:
        bps.shutdown()


def _allreduce_probe(out: str, reps: int) -> None:
    """Worker of the link calibration: time gloo all-reduces of ``_SIZES``; rank 0 writes the fastest."""
    import torch
    import torch.distributed as dist

    with _probe_rank() as bps:
        result = {}
        for size in _SIZES:
            t = torch.ones(size // 4)
            for _ in range(2):
                dist.all_reduce(t)
            times = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - start)
            result[str(size)] = min(times)
        if bps.rank() == 0:
            write_text_atomic(out, json.dumps(result))


def _runtime_cpu_probe(out: str, calls: int) -> None:
    """Worker of the runtime-CPU micro-benchmarks: ``calls`` back-to-back sums of a 1 KiB tensor through the
    path the executor's buckets take (``ops.start_sum``), all-reduce and, where the job has servers,
    push_pull; rank 0 writes every rank's process CPU seconds per call of each."""
    import torch
    import torch.distributed as dist

    from tagps.config import comm_config
    from tagps.torch import ops

    with _probe_rank() as bps:
        tensor = torch.ones(256)
        per_call: dict[str, float] = {}
        for method in ("allreduce", "ps") if comm_config().num_server else ("allreduce",):
            for _ in range(20):  # warm-up: connections, declarations, first allocations
                ops.start_sum(tensor, method=method, name="cpu-probe").wait()
            dist.barrier()
            start = time.process_time()  # every thread of the process: the transport's and the engine's too
            for _ in range(calls):
                ops.start_sum(tensor, method=method, name="cpu-probe").wait()
            per_call[method] = (time.process_time() - start) / calls
        everyone: list[Any] = [None] * bps.size()
        dist.all_gather_object(everyone, per_call)
        if bps.rank() == 0:
            write_text_atomic(out, json.dumps({m: [r[m] for r in everyone] for m in per_call}))


def _run_logged(run: Callable[[Any], int], what: str) -> None:
    with tempfile.TemporaryFile() as log:
        status = run(log)
        if status != 0:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{what} failed with status {status}:\n{tail}")


def probe_argv(out: str, reps: int, probe: str = "--allreduce-probe") -> list[str]:
    """The command line of one of this module's worker probes (``probe``: its hidden flag)."""
    return [sys.executable, "-m", "tagps.calibrate", probe, out, "--reps", str(reps)]


def _loopback_allreduces(reps: int) -> tuple[list[CommSample], dict[str, Reference]]:
    """Loopback all-reduces, and the loopback link's micro-benchmarks for both kinds of link constants."""
    from tagps.cluster.measure import measure_pair
    from tagps.launcher import free_ports, local_job, run_processes

    link = measure_pair(list, list, "127.0.0.1", free_ports(1)[0], 0.5)
    refs = {}
    for kind in ("inter", "intra"):
        refs[f"{kind}_latency_s"] = Reference("half TCP round trip, loopback", link.rtt_s / 2, "s")
        refs[f"{kind}_bandwidth_efficiency"] = Reference("TCP goodput, loopback", link.bandwidth_Bps, "B/s")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        _run_logged(
            lambda log: run_processes(local_job(probe_argv(out, reps), 2, 0, 1), out=log),
            "loopback all-reduce probe",
        )
        data = json.loads(Path(out).read_text())
    return [CommSample(int(s), 2, link.bandwidth_Bps, False, t) for s, t in data.items()], refs


def _cluster_allreduces(
    cluster: Any, topology: Any, reps: int
) -> tuple[list[CommSample], dict[str, Reference]]:
    """All-reduces inside ``ca`` and between ``ca`` and ``cb``, and the links' micro-benchmarks (the
    measured topology's)."""
    refs = {
        "inter_latency_s": Reference("half TCP round trip, machines", topology.inter_latency_s, "s"),
        "intra_latency_s": Reference("half TCP round trip, in a machine", topology.intra_latency_s, "s"),
        "inter_bandwidth_efficiency": Reference("TCP goodput ca-cb", topology.bandwidth("ca", "cb"), "B/s"),
        "intra_bandwidth_efficiency": Reference("TCP goodput in ca", topology.bandwidth("ca", "ca"), "B/s"),
    }
    samples = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        for devices, inter in ((["ca:0", "ca:1"], False), (["ca:0", "cb:0"], True)):
            _run_logged(
                lambda log, d=devices: cluster.run(probe_argv(out, reps), devices=d, out=log),
                f"all-reduce probe on {devices}",
            )
            bandwidth = topology.bandwidth("ca", "cb" if inter else "ca")
            data = json.loads(Path(out).read_text())
            samples += [CommSample(int(s), 2, bandwidth, inter, t) for s, t in data.items()]
    return samples, refs


def measure_runtime_cpu(
    cluster: Any, calls: int, message_s: float = 0.0
) -> tuple[dict[str, float], dict[str, Reference]]:
    """Measure the CPU a collective and a push_pull consume on each rank: back-to-back small all-reduces on
    rings of 3 (``ca``) and 6 ranks, whose CPU per call is ``call + 2 (n - 1) step`` (solved for both), and
    back-to-back push_pulls to a server on each machine, from machines of one rank (``ca:0`` and ``cb:0``),
    of two and of three: a machine of ``m > 1`` ranks consumes ``m c_call + c_shared + (m - 1) c_local``
    per call beyond its messages (``message_s`` each, a push and a pull: measured apart,
    :func:`measure_ps_message_s`), so the machines of two and three give ``c_shared + c_local`` and
    ``c_shared + 2 c_local``. A root's coordination costs more than a further rank's (on the bench
    cluster, 2026-12-06: a root of two ranks 462 us a call, its other rank 127, a lone rank 207), which a
    cost per further rank alone, fitted on machines of three, put at 354 us for a machine of two where
    it took 589.

    Returns:
        The calibration's measured ``collective_step_cpu_s``, ``collective_call_cpu_s``, ``ps_call_s``,
        ``ps_shared_call_s`` and ``ps_local_call_s`` (each put in its physical range; a reading under 0,
        noise around a cost of nothing, is 0; a machine of three that costs less than one of two leaves
        the whole cost to ``c_shared``), and the all-reduce readings as the micro-benchmarks beside the
        runtime CPU constants that :func:`fit_runs` fits: a fit far from them is a cost of whole jobs
        (hooks, buckets, waiting on a quota'd core) that back-to-back calls do not show.
    """
    machines = CALIBRATION_CLUSTER["machines"]
    devices = [f"{m['name']}:{i}" for m in machines for i in range(m["workers"])]
    servers = {m["name"]: 1 for m in machines}
    lone = [f"{m['name']}:0" for m in machines]  # one rank per machine
    pairs = [f"{m['name']}:{i}" for m in machines for i in range(2)]  # two ranks per machine
    per_rank = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runtime-cpu.json")
        argv = probe_argv(out, calls, "--runtime-cpu-probe")
        jobs = (
            ("3", devices[:3], {}),
            ("6", devices, servers),
            ("lone", lone, servers),
            ("pair", pairs, servers),
        )
        for label, ranks, s in jobs:
            _run_logged(
                lambda log, d=ranks, s=s: cluster.run(argv, devices=d, servers=s, out=log),
                f"runtime CPU probe on {', '.join(ranks)}",
            )
            per_rank.update({(m, label): v for m, v in json.loads(Path(out).read_text()).items()})

    def steps(ring: int) -> int:  # of a ring all-reduce
        return 2 * (ring - 1)

    three, six = (statistics.mean(per_rank[("allreduce", n)]) for n in ("3", "6"))
    step = (six - three) / (steps(6) - steps(3))
    call = three - steps(3) * step
    # A machine pushes and pulls each call's one partition once: 2 messages, whatever its ranks.
    messages = 2 * message_s
    ps_call = statistics.mean(per_rank[("ps", "lone")]) - messages

    def beyond_calls(label: str, size: int) -> float:  # a machine's CPU per call beyond its ranks' calls
        ranks = per_rank[("ps", label)]
        machine = statistics.mean(sum(ranks[i : i + size]) for i in range(0, len(ranks), size))
        return machine - messages - size * ps_call

    size = machines[0]["workers"]
    two, more = beyond_calls("pair", 2), beyond_calls("6", size)
    ps_local = max(0.0, (more - two) / (size - 2))
    readings = {
        "collective_step_cpu_s": step,
        "collective_call_cpu_s": call,
        "ps_call_s": ps_call,
        "ps_shared_call_s": two - ps_local,
        "ps_local_call_s": ps_local,
    }
    measured = {name: HOST_CPU[name].clip(value) if value > 0 else 0.0 for name, value in readings.items()}
    return measured, {
        "collective_step_s": Reference("back-to-back 1 KiB all-reduces, 3 and 6 ranks: per step", step, "s"),
        "collective_call_s": Reference("the same, per call beyond its steps", call, "s"),
    }


def _job_samples(executor: Any, models: Sequence[str], steps: int) -> list[RunSample]:
    """Whole training jobs on the calibration cluster: DDP, tagps all-reduce and tagps PS per model, and tagps
    all-reduce on the first machine alone: rings of two sizes, so that the CPU of a collective's steps and of
    its calls can be told apart (:func:`~tagps.strategy.calibration.fit_runs`)."""
    from tagps.cluster.experiment import MEASURED_STEP, ddp_plan, run_plan
    from tagps.strategy.baselines import byteps_like, data_parallel_plan, even_shares
    from tagps.strategy.graph import model_graph
    from tagps.strategy.grouping import group_ops
    from tagps.strategy.plan import CommSettings
    from tagps.strategy.simulator import Simulator

    runs = []
    for model in models:
        graph = model_graph(model)
        grouping = group_ops(graph, 4)
        sim = Simulator(graph, grouping, executor.topology)
        overlapped = CommSettings(overlap=True)
        first = sim.dgroups[0]
        on_first = f"{first.name}:"
        alone = {d: _BATCH // first.count if d.startswith(on_first) else 0 for d in sim.topology.devices()}
        plans = {
            "ddp": (ddp_plan(sim, _BATCH), "ddp"),
            "allreduce": (
                data_parallel_plan(sim, _BATCH, even_shares(sim, _BATCH), comm=overlapped),
                "tagps",
            ),
            "ps": (dataclasses.replace(byteps_like(sim, _BATCH), comm=overlapped), "tagps"),
            f"allreduce on {first.name}": (data_parallel_plan(sim, _BATCH, alone, comm=overlapped), "tagps"),
        }
        for name, (plan, runtime) in plans.items():
            result = run_plan(executor, model, plan, runtime, steps=steps, warmup=2)
            measured = result[MEASURED_STEP]
            runs.append(RunSample(f"{model}/{name}", graph, grouping, executor.topology, plan, measured))
    return runs


def calibrate(
    quick: bool = False,
    use_cluster: bool = True,
    jobs: bool = True,
    log: Callable[[str], None] = print,
) -> Calibration:
    """Measure this host and fit the simulator's constants (see the module docstring).

    Args:
        quick: fewer batch sizes, repetitions and jobs.
        use_cluster: measure inter-machine links on an emulated cluster when root allows.
        jobs: also fit the communication constants to whole training jobs (step 3; needs the cluster).
        log: where progress lines go.

    Returns:
        The calibration after the last stage that ran (see :func:`calibrate_stages`).
    """
    return list(calibrate_stages(quick, use_cluster, jobs, log).values())[-1]


def calibrate_stages(
    quick: bool = False,
    use_cluster: bool = True,
    jobs: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Calibration]:
    """Like :func:`calibrate`, but return the calibration after each stage that ran.

    Returns:
        ``{"links": ...}`` (compute fit plus the all-reduce fit) and, when the job fit ran, ``"jobs"``
        (the same with the communication constants refitted to whole jobs).
    """
    from tagps.cluster import ClusterError, check_support
    from tagps.cluster.measure import measure_core

    batches, steps, reps = ((4, 32), 3, 3) if quick else ((4, 16, 32), 5, 5)
    started = time.monotonic()
    core_flops, memory_bandwidth = measure_core()
    log(f"core: {core_flops / 1e9:.1f} GFLOP/s float32 matmul, {memory_bandwidth / 1e9:.1f} GB/s copy")
    compute = _compute_samples(batches, steps)
    eff, mem_eff, overhead, compute_err = fit_compute(compute, core_flops, memory_bandwidth)
    log(
        f"compute fit on {len(compute)} steps: efficiency {eff:.3f}, memory efficiency {mem_eff:.3f}, "
        f"op overhead {overhead * 1e6:.1f} us, mean error {compute_err:.1%}"
    )
    references = {
        "efficiency": Reference("matmul, one core", core_flops, "FLOP/s"),
        "memory_efficiency": Reference("copy, one core", memory_bandwidth, "B/s"),
        "op_overhead_s": Reference("one op on one element", measure_dispatch(), "s"),
    }
    fitted = {"efficiency": eff, "memory_efficiency": mem_eff, "op_overhead_s": overhead}
    note = "loopback only (--no-cluster)"
    if use_cluster:
        try:
            check_support()
        except ClusterError as exc:
            use_cluster, note = False, f"loopback only ({exc})"
    names = [s.name for s in compute]
    host_cpu, host_refs = _host_cpu(memory_bandwidth)
    log(
        f"host CPU: sum_into {host_cpu['sum_bandwidth'] / 1e9:.1f} GB/s, one side of a message "
        f"{host_cpu['message_copies']:.2f} memory passes per byte, PS engine "
        f"{host_cpu['message_overhead_s'] * 1e6:.0f} us per message"
    )
    references.update(host_refs)
    fitted.update(host_cpu)  # measured, beside the compute fit
    if not use_cluster:
        comm, link_refs = _loopback_allreduces(reps)
        cal = _comm_fit(core_flops, memory_bandwidth, fitted, compute_err, comm, note, log)
        stages = {"links": dataclasses.replace(cal, calibration_set=(*names, f"allreduce: {note}"))}
    else:
        from tagps.cluster.experiment import Executor
        from tagps.cluster.run import up

        machines = ", ".join(
            f"{m['name']}({m['workers']} devices, {m['cpu']} cpu, {m['rate_mbit']} Mbit/s)"
            for m in CALIBRATION_CLUSTER["machines"]
        )
        note = f"emulated cluster {machines}"
        with up(CALIBRATION_CLUSTER) as cluster:
            topology = cluster.topology()
            comm, link_refs = _cluster_allreduces(cluster, topology, reps)
            cal = _comm_fit(core_flops, memory_bandwidth, fitted, compute_err, comm, note, log)
            fit_error = dict(cal.fit_error)
            names.append(f"allreduce: {note}")
            stages = {"links": dataclasses.replace(cal, calibration_set=tuple(names))}
            if jobs:
                # Measured first: the job fit costs plans with the quota that this CPU takes.
                measured, runtime_refs = measure_runtime_cpu(
                    cluster, 100 if quick else 1000, fitted["message_overhead_s"]
                )
                link_refs.update(runtime_refs)
                us = {name: f"{value * 1e6:.0f} us" for name, value in measured.items()}
                log(
                    f"runtime CPU: per collective step {us['collective_step_cpu_s']}, per collective call "
                    f"{us['collective_call_cpu_s']}, per push_pull call {us['ps_call_s']}, "
                    f"{us['ps_shared_call_s']} for a machine of several ranks and "
                    f"{us['ps_local_call_s']} for each further local rank"
                )
                executor = Executor(topology, cluster)
                runs = _job_samples(executor, ("mlp-mini", "encoder-mini"), 5 if quick else 10)
                cal, job_err = fit_runs(dataclasses.replace(cal, **measured), runs)
                fit_error["jobs"] = job_err
                names += [f"job: {r.name}" for r in runs]
                log(
                    f"job fit on {len(runs)} runs: CPU per collective step {cal.collective_step_s * 1e6:.0f} "
                    f"us, per collective call {cal.collective_call_s * 1e6:.0f} us, "
                    f"mean error {job_err:.1%}{_on_bound(cal)}"
                )
                stages["jobs"] = dataclasses.replace(cal, fit_error=fit_error, calibration_set=tuple(names))
    final = list(stages.values())[-1]
    log(constants_table(final, {**references, **link_refs}))
    for line in final.bound_warnings():
        log(line)
    log(f"calibrated in {time.monotonic() - started:.0f} s")
    return stages


def _on_bound(cal: Calibration) -> str:
    """A note for a fit's log line naming the constants that ended on a bound (empty when none did)."""
    return f"; ON BOUND: {', '.join(cal.at_bound)}" if cal.at_bound else ""


def _comm_fit(
    core_flops: float,
    memory_bandwidth: float,
    constants: dict[str, float],
    compute_err: float,
    comm: list[CommSample],
    note: str,
    log: Callable[[str], None],
) -> Calibration:
    """The calibration of the measured core, ``constants`` (the compute fit and the measured host-CPU
    constants) and the all-reduce fit of ``comm``."""
    inter_lat, intra_lat, inter_eff, intra_eff, comm_err = fit_comm(comm)
    cal = Calibration(
        core_flops,
        memory_bandwidth,
        **constants,
        inter_latency_s=inter_lat,
        intra_latency_s=intra_lat,
        inter_bandwidth_efficiency=inter_eff,
        intra_bandwidth_efficiency=intra_eff,
        fit_error={"compute": compute_err, "comm": comm_err},
    )
    log(
        f"all-reduce fit on {len(comm)} runs, {note}: latency inter {inter_lat * 1e6:.0f} us, "
        f"intra {intra_lat * 1e6:.0f} us, bandwidth efficiency inter {inter_eff:.2f}, intra {intra_eff:.2f}, "
        f"mean error {comm_err:.1%}{_on_bound(cal)}"
    )
    return cal


def main(argv: Sequence[str] | None = None) -> int:
    """Run the calibration command line; return its exit status."""
    p = argparse.ArgumentParser(prog="python -m tagps.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer batch sizes, repetitions and jobs")
    p.add_argument("--no-cluster", action="store_true", help="measure loopback links only")
    p.add_argument("--no-jobs", action="store_true", help="skip the fit on whole training jobs")
    p.add_argument(
        "--refit", metavar="FILE", help="measure nothing: refit FILE's runtime CPU constants on the jobs it "
        "recorded, with the simulator as it is now (written to --out, default FILE)"
    )  # fmt: skip
    p.add_argument("--out", help="calibration file (default: $TAGPS_CACHE_DIR/calibration.json)")
    p.add_argument("--allreduce-probe", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--runtime-cpu-probe", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.allreduce_probe:
        _allreduce_probe(args.allreduce_probe, args.reps)
        return 0
    if args.runtime_cpu_probe:
        _runtime_cpu_probe(args.runtime_cpu_probe, args.reps)
        return 0
    if args.refit:
        try:
            before = load_calibration(args.refit)
            cal = refit_runs(before)
        except ValueError as exc:
            p.exit(2, f"python -m tagps.calibrate --refit: {exc}\n")
        for name in RUNTIME_CPU:
            print(f"{name:<20} {getattr(before, name) * 1e6:9.1f} us -> {getattr(cal, name) * 1e6:9.1f} us")
        print(f"job fit on {len(cal.job_runs)} recorded runs: mean error "
              f"{before.fit_error.get('jobs', float('nan')):.1%} -> {cal.fit_error['jobs']:.1%}")  # fmt: skip
        for line in cal.bound_warnings():
            print(line)
        path = Path(args.out or args.refit)
        cal.save(path)
        print(f"calibration written to {path}")
        return 0
    cal = calibrate(args.quick, not args.no_cluster, not args.no_jobs)
    path = Path(args.out) if args.out else default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    cal.save(path)
    print(f"calibration written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
