"""Calibrate the simulator on this host: ``python -m tagps.calibrate [--quick] [--no-cluster] [--out FILE]``.

1. **Profile** a calibration set of small models (an MLP, a conv net, a one-layer Transformer; none of
   them is a model the benchmarks validate on) on one thread: a full training step (forward, backward,
   Adam) at several batch sizes, plus this core's float32 matmul rate and copy bandwidth.
2. **Measure links**: ``gloo`` all-reduces of several sizes between two worker processes inside one
   machine and, where root allows, between two emulated machines (:mod:`tagps.cluster`) whose TCP goodput
   was measured; without root only the loopback ring is measured and the inter-machine latency is taken
   equal to the intra-machine one (said in the output).
3. **Fit** the roofline constants and the ring model's latencies and bandwidth efficiency
   (:mod:`tagps.strategy.calibration`) and write the JSON that the simulator loads (default:
   ``$TAGPS_CACHE_DIR/calibration.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tagps.strategy.calibration import Calibration, CommSample, ComputeSample, fit_comm, fit_compute

__all__ = ["CALIBRATION_CLUSTER", "calibrate", "default_path", "main", "measure_core", "profile_step"]

# Two emulated machines, neither like the benchmark's: two devices at 400 Mbit/s, one at 400 Mbit/s.
CALIBRATION_CLUSTER = {
    "name": "calib",
    "machines": [
        {"name": "ca", "workers": 2, "cpu": 1.0, "rate_mbit": 400},
        {"name": "cb", "workers": 1, "cpu": 0.5, "rate_mbit": 400},
    ],
}
_SIZES = (1 << 16, 1 << 20, 1 << 23)  # bytes of the probed all-reduces


def default_path() -> Path:
    """Where the calibration lives by default: ``$TAGPS_CACHE_DIR/calibration.json``."""
    from tagps.config import strategy_config

    return Path(strategy_config().cache_dir) / "calibration.json"


def _calibration_models() -> dict[str, tuple[Callable[[], Any], Callable[[int, str], tuple[Any, ...]]]]:
    import torch
    from torch import nn

    from tagps.models.transformer import Encoder

    def mlp() -> nn.Module:
        return nn.Sequential(
            nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )

    def convnet() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 8 * 8, 10),
        )

    def encoder() -> nn.Module:
        return Encoder(512, 16, 64, 2, 256, 1, causal=True)

    return {
        "mlp": (mlp, lambda b, dev: (torch.randn(b, 512, device=dev),)),
        "convnet": (convnet, lambda b, dev: (torch.randn(b, 3, 32, 32, device=dev),)),
        "encoder": (encoder, lambda b, dev: (torch.randint(0, 512, (b, 16), device=dev),)),
    }


def measure_core(seconds: float = 0.5) -> tuple[float, float]:
    """Return one thread's float32 matmul rate (FLOP/s) and copy bandwidth (bytes read + written per s).

    Both count this thread's CPU time (``time.thread_time``), not wall time, and keep the best of several
    windows, so that other load on the host shows as little as it can.
    """
    import numpy as np
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for _ in range(3):
        a @ b
    rates = []
    for _ in range(10):
        n, start = 0, time.thread_time()
        while time.thread_time() - start < seconds / 10:
            a @ b
            n += 1
        rates.append(2 * 256**3 * n / (time.thread_time() - start))
    src = np.ones(1 << 23, dtype=np.float32)  # 32 MiB, touched once before timing
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    copies = []
    for _ in range(5):
        t = time.thread_time()
        np.copyto(dst, src)
        copies.append(time.thread_time() - t)
    return max(rates), 2 * src.nbytes / min(copies)


def profile_step(model: Any, inputs: Sequence[Any], steps: int = 5) -> float:
    """Fastest of ``steps`` training steps (forward, cross-entropy, backward, Adam) on one thread, in CPU
    seconds of that thread (``time.thread_time``: other load on the host does not count)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
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


def _compute_samples(batches: Sequence[int], steps: int) -> list[ComputeSample]:
    import torch

    from tagps.strategy.graph import extract_graph

    samples = []
    for name, (factory, inputs) in _calibration_models().items():
        with torch.device("meta"):
            meta = factory()
        graph = extract_graph(meta, inputs(1, "meta"), name)
        torch.manual_seed(0)
        model = factory()
        for b in batches:
            seconds = profile_step(model, inputs(b, "cpu"), steps)
            samples.append(ComputeSample(f"{name}@{b}", graph, b, "adam", seconds))
    return samples


def _allreduce_probe(out: str, reps: int) -> None:
    """Worker of the link calibration: time gloo all-reduces of ``_SIZES``; rank 0 writes the fastest."""
    import torch
    import torch.distributed as dist

    import tagps.torch as bps

    torch.set_num_threads(1)
    bps.init()
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
        Path(out).write_text(json.dumps(result))
    bps.shutdown()


def _run_logged(run: Callable[[Any], int], what: str) -> None:
    with tempfile.TemporaryFile() as log:
        status = run(log)
        if status != 0:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{what} failed with status {status}:\n{tail}")


def _probe_argv(out: str, reps: int) -> list[str]:
    return [sys.executable, "-m", "tagps.calibrate", "--allreduce-probe", out, "--reps", str(reps)]


def _comm_samples(use_cluster: bool, reps: int) -> tuple[list[CommSample], str]:
    """Measured all-reduces and a note on what was measured."""
    from tagps.cluster import ClusterError, check_support

    note = "loopback only (--no-cluster)"
    if use_cluster:
        try:
            check_support()
        except ClusterError as exc:
            use_cluster, note = False, f"loopback only ({exc})"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        if not use_cluster:
            from tagps.cluster.measure import measure_pair
            from tagps.launcher import free_ports, local_job, run_processes

            link = measure_pair(list, list, "127.0.0.1", free_ports(1)[0], 0.5)
            _run_logged(
                lambda log: run_processes(local_job(_probe_argv(out, reps), 2, 0, 1), out=log),
                "loopback all-reduce probe",
            )
            data = json.loads(Path(out).read_text())
            return [CommSample(int(s), 2, link.bandwidth_Bps, False, t) for s, t in data.items()], note
        from tagps.cluster.run import up

        samples = []
        with up(CALIBRATION_CLUSTER) as cluster:
            topo = cluster.topology()
            for devices, inter in ((["ca:0", "ca:1"], False), (["ca:0", "cb:0"], True)):
                _run_logged(
                    lambda log, d=devices: cluster.run(_probe_argv(out, reps), devices=d, out=log),
                    f"all-reduce probe on {devices}",
                )
                bandwidth = topo.bandwidth("ca", "cb" if inter else "ca")
                data = json.loads(Path(out).read_text())
                samples += [CommSample(int(s), 2, bandwidth, inter, t) for s, t in data.items()]
    machines = ", ".join(
        f"{m['name']}({m['workers']} workers, {m['cpu']} cpu, {m['rate_mbit']} Mbit/s)"
        for m in CALIBRATION_CLUSTER["machines"]
    )
    return samples, f"emulated cluster {machines}"


def calibrate(
    quick: bool = False, use_cluster: bool = True, log: Callable[[str], None] = print
) -> Calibration:
    """Measure this host and fit the simulator's constants (see the module docstring).

    Args:
        quick: fewer batch sizes and repetitions (about 30 s instead of about 90 s).
        use_cluster: measure inter-machine links on an emulated cluster when root allows.
        log: where progress lines go.
    """
    batches, steps, reps = ((4, 32), 3, 3) if quick else ((4, 16, 32), 5, 5)
    core_flops, memory_bandwidth = measure_core()
    log(f"core: {core_flops / 1e9:.1f} GFLOP/s float32 matmul, {memory_bandwidth / 1e9:.1f} GB/s copy")
    compute = _compute_samples(batches, steps)
    eff, mem_eff, overhead, compute_err = fit_compute(compute, core_flops, memory_bandwidth)
    log(
        f"compute fit on {len(compute)} steps: efficiency {eff:.3f}, memory efficiency {mem_eff:.3f}, "
        f"op overhead {overhead * 1e6:.1f} us, mean error {compute_err:.1%}"
    )
    comm, note = _comm_samples(use_cluster, reps)
    inter_lat, intra_lat, inter_eff, intra_eff, comm_err = fit_comm(comm)
    log(
        f"all-reduce fit on {len(comm)} runs, {note}: latency inter {inter_lat * 1e6:.0f} us, "
        f"intra {intra_lat * 1e6:.0f} us, bandwidth efficiency inter {inter_eff:.2f}, intra {intra_eff:.2f}, "
        f"mean error {comm_err:.1%}"
    )
    return Calibration(
        core_flops,
        memory_bandwidth,
        eff,
        mem_eff,
        overhead,
        inter_lat,
        intra_lat,
        inter_eff,
        intra_eff,
        {"compute": compute_err, "comm": comm_err},
        (*(s.name for s in compute), f"allreduce: {note}"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the calibration command line; return its exit status."""
    p = argparse.ArgumentParser(prog="python -m tagps.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer batch sizes and repetitions")
    p.add_argument("--no-cluster", action="store_true", help="measure loopback links only")
    p.add_argument("--out", help="calibration file (default: $TAGPS_CACHE_DIR/calibration.json)")
    p.add_argument("--allreduce-probe", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.allreduce_probe:
        _allreduce_probe(args.allreduce_probe, args.reps)
        return 0
    cal = calibrate(args.quick, not args.no_cluster)
    path = Path(args.out) if args.out else default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    cal.save(path)
    print(f"calibration written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
