"""The CPU one push_pull call costs each rank of a quota'd machine, by role, back to back and inside a step.

Usage: python bench/ps_call_cpu.py [--model M] [--steps N] [--out FILE]   (needs root: cgroups, netns)

The simulator charges a machine of ``m > 1`` ranks ``m * ps_call_s + ps_shared_call_s + (m - 1) *
ps_local_call_s`` of CPU per push_pull call (a lone rank ``ps_call_s``), the constants measured by
``python -m tagps.calibrate`` from back-to-back 1 KiB push_pulls on machines of one rank, two and three.
Training differs in two ways: a model's gradients have their own sizes (most of transformer-mini's 38
are 1-256 KiB, the futex path; two are 512 KiB, the shard-and-message path), and a backward pass
issues them one after another between slices of compute, waiting for them together. This benchmark
runs a tagps job on :data:`SPEC` (the bench cluster's two 1 Gbit/s machines: 2 ranks each at 0.7 cores,
a summation server on each) whose ranks push_pull the model's gradient shapes, the small ones (up to
``ROOT_SUMS_BYTES``) and the big ones apart, in two regimes:

- **serial**: one call at a time, each waited for (the calibration probe's regime);
- **step**: each call issued after a slice of compute on the main thread (float32 matmuls, thread CPU
  timed), the whole set waited for at the end, as a backward pass does; the compute's own CPU is taken out.

It reports each rank's process CPU per call (every thread: the engine's, ZeroMQ's, the local reduction's),
by role: the machine's **root** (local rank 0: it sums the machine's tensors and talks to the servers) and
its **other** rank; and the same for a machine of one rank (**lone**: one rank per machine). Beside them,
the per-machine CPU per call that the calibration at ``--calibration`` (default: the committed
``bench/results/e2e_cluster.json``'s) charges, messages and bytes aside.

JSON figures, per tensor set (``small``, ``big``) and regime: ``<set>_<regime>_root_us``,
``<set>_<regime>_other_us``, ``<set>_<regime>_lone_us``, ``<set>_<regime>_machine_us`` (root + other) and
``<set>_step_over_serial`` (a two-rank machine's CPU per call inside a step over back to back), and
``model_machine_us`` (what the calibration charges a machine of two ranks per call).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchlib import command_line, machine_info, repo_relative, write_json

REPO = Path(__file__).resolve().parent.parent
SPEC = {
    "name": "pscall",
    "machines": [
        {"name": "m0", "workers": 2, "servers": 1, "cpu": 0.7, "rate_mbit": 1000},
        {"name": "m1", "workers": 2, "servers": 1, "cpu": 0.7, "rate_mbit": 1000},
    ],
}
COMPUTE_PER_STEP_S = 30e-3  # transformer-mini's backward on one of these devices is about this much CPU
SETS = ("small", "big")
REGIMES = ("serial", "step")


def _worker(out: str, model: str, which: str, steps: int) -> None:
    """One rank: push_pull ``model``'s gradient shapes of set ``which`` in both regimes; rank 0 writes every
    rank's CPU per call of each, with its local rank."""
    import torch
    import torch.distributed as dist

    import tagps.torch as bps
    from tagps.comm.local_reduce import ROOT_SUMS_BYTES
    from tagps.models import build_model
    from tagps.torch import ops

    torch.set_num_threads(1)
    bps.init()
    grads = [torch.ones_like(p) for p in build_model(model).parameters()]
    grads = [g for g in grads if (g.numel() * g.element_size() <= ROOT_SUMS_BYTES) == (which == "small")]
    names = [f"{which}-{i}" for i in range(len(grads))]
    a = torch.randn(128, 128)
    slice_s = COMPUTE_PER_STEP_S / len(grads)

    def compute() -> float:  # the main thread's CPU spent on it
        start = time.thread_time()
        while time.thread_time() - start < slice_s:
            a @ a
        return time.thread_time() - start

    for _ in range(3):  # warm-up: declarations, connections, first allocations
        for g, name in zip(grads, names, strict=True):
            ops.start_sum(g, method="ps", name=name).wait()
    per_call: dict[str, float] = {}
    dist.barrier()
    start = time.process_time()
    for _ in range(steps):
        for g, name in zip(grads, names, strict=True):
            ops.start_sum(g, method="ps", name=name).wait()
    per_call["serial"] = (time.process_time() - start) / (steps * len(grads))
    dist.barrier()
    computed, start = 0.0, time.process_time()
    for _ in range(steps):
        handles = []
        for g, name in zip(grads, names, strict=True):
            computed += compute()
            handles.append(ops.start_sum(g, method="ps", name=name))
        for h in handles:
            h.wait()
    per_call["step"] = (time.process_time() - start - computed) / (steps * len(grads))
    everyone: list[Any] = [None] * bps.size()
    dist.all_gather_object(everyone, {"local_rank": bps.local_rank(), **per_call})
    if bps.rank() == 0:
        Path(out).write_text(json.dumps(everyone))
    bps.shutdown()


def _calibration(path: Path) -> Any:
    """The calibration in ``path``: a calibration file, or a ``bench/e2e_cluster.py`` result holding one."""
    from tagps.strategy.calibration import Calibration

    data = json.loads(path.read_text())
    return Calibration.from_dict(data.get("calibration", data))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="transformer-mini", help="whose gradient shapes (default transformer-mini)"
    )
    parser.add_argument("--steps", type=int, default=30, help="passes over the set per regime (default 30)")
    parser.add_argument(
        "--calibration", type=Path, default=REPO / "bench" / "results" / "e2e_cluster.json",
        help="a calibration file, or an e2e_cluster result holding one (default: the committed result's)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ps_call_cpu.json")
    parser.add_argument("--worker", nargs=4, metavar=("OUT", "MODEL", "SET", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        out, model, which, steps = args.worker
        _worker(out, model, which, int(steps))
        return 0

    from tagps.cluster import ClusterError, check_support
    from tagps.cluster.run import up

    try:
        check_support()
    except ClusterError as exc:
        print(f"skipped: {exc}")
        return 0
    layouts = {"pair": ["m0:0", "m0:1", "m1:0", "m1:1"], "lone": ["m0:0", "m1:0"]}
    readings: dict[str, dict[str, list[dict[str, float]]]] = {}
    commands = []
    with up(SPEC) as cluster, tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "per-call.json")
        for which in SETS:
            for layout, devices in layouts.items():
                print(f"{which} tensors, {layout} ranks: {args.steps} passes per regime ...", flush=True)
                worker = [sys.executable, str(Path(__file__).resolve()), "--worker", out, args.model, which,
                          str(args.steps)]  # fmt: skip
                commands.append(f"tagps cluster run ({' '.join(devices)}) -- {' '.join(worker[1:])}")
                with tempfile.TemporaryFile() as log:
                    status = cluster.run(worker, devices=devices, servers={"m0": 1, "m1": 1}, out=log)
                    if status != 0:
                        log.seek(0)
                        raise RuntimeError(
                            f"job failed ({status}): {log.read().decode(errors='replace')[-3000:]}"
                        )
                readings.setdefault(which, {})[layout] = json.loads(Path(out).read_text())
    figures: dict[str, float] = {}
    for which, layouts_read in readings.items():
        for regime in REGIMES:
            pair = layouts_read["pair"]
            root = statistics.mean(r[regime] for r in pair if r["local_rank"] == 0)
            other = statistics.mean(r[regime] for r in pair if r["local_rank"] != 0)
            lone = statistics.mean(r[regime] for r in layouts_read["lone"])
            figures[f"{which}_{regime}_root_us"] = root * 1e6
            figures[f"{which}_{regime}_other_us"] = other * 1e6
            figures[f"{which}_{regime}_lone_us"] = lone * 1e6
            figures[f"{which}_{regime}_machine_us"] = (root + other) * 1e6
        figures[f"{which}_step_over_serial"] = (
            figures[f"{which}_step_machine_us"] / figures[f"{which}_serial_machine_us"]
        )
    cal = _calibration(args.calibration)  # a machine of two ranks: 2 calls, its root and 1 further rank
    figures["model_machine_us"] = (2 * cal.ps_call_s + cal.ps_shared_call_s + cal.ps_local_call_s) * 1e6
    print(f"\nCPU per call; the calibration charges a machine of two {figures['model_machine_us']:.0f} us")
    print(f"{'set':<7}{'regime':<8}{'root us':>9}{'other us':>10}{'machine us':>12}{'lone us':>9}")
    for which in SETS:
        for regime in REGIMES:
            f = {k: figures[f"{which}_{regime}_{k}_us"] for k in ("root", "other", "machine", "lone")}
            print(
                f"{which:<7}{regime:<8}{f['root']:>9.0f}{f['other']:>10.0f}{f['machine']:>12.0f}{f['lone']:>9.0f}"
            )
    write_json(
        args.out,
        {
            "machine": machine_info(),
            "command": command_line(),
            "jobs": commands,
            "spec": SPEC,
            "model": args.model,
            "steps": args.steps,
            "compute_per_step_s": COMPUTE_PER_STEP_S,
            "calibration": repo_relative(args.calibration),
            "readings": readings,
            "figures": figures,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
