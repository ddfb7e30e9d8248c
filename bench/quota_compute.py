"""What a machine's CPU quota does to a training step's CPU time, per model, and to the matmul probe.

Usage: python bench/quota_compute.py [--seconds S] [--out FILE]   (needs root: cgroups, netns)

The simulator turns a model's op profile (one thread on a free core) into a quota'd device's times with
one ratio per device group: the group's ``peak_flops`` over the profiled core's. On an emulated machine
of ``cpu`` cores and ``workers`` devices the ratio could be the share itself, ``min(1, cpu / workers)``,
or what the cluster's matmul probe reads there (``Cluster.device_flops``, what ``tagps cluster up``
records). Neither is right for every model if the step's CPU time itself changes under the quota. This
benchmark measures it. For each model and per-device batch (vgg-mini at 24, transformer-mini at 12 and
24: what the e2e benchmark's plans give a device) it runs the training step (forward, backward, Adam;
one thread) in fresh processes over one common window:

- **alone**: one process on the host, no quota (what a profile measures);
- **pair**: two processes on the host at once, no quota (they share the last-level cache and memory);
- **quota**: both devices of one machine of :data:`SPEC` (2 workers, 0.7 cores) at once, the other
  machines idle, as a one-machine plan runs.

and reports each condition's process CPU seconds per step and wall seconds per step. The same three
conditions run the matmul probe (``MATMUL_N`` float32 matmuls, as ``measure_core`` and the cluster's
probe time them). The shared host's speed drifts by tens of percent from minute to minute, so the three
conditions of a case run back to back, a factor divides within that round, and ``--rounds`` rounds go
over every case in turn; figures are medians over the rounds (each round's factors in ``results``).

JSON figures: ``<case>_quota_cpu_factor`` and ``<case>_pair_cpu_factor`` (the condition's CPU per step
over alone's, for ``vgg_b24``, ``transformer_b12``, ``transformer_b24`` and ``matmul``: 1 means the
profile holds there) and ``<case>_quota_share_delivered`` (CPU per step over wall per step, against the
share, 0.35). Scaling a profile by the share alone is right for a model whose quota factor is 1; the
probe's reading is right for a model whose factor equals the matmul's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from subprocess import PIPE
from typing import Any

from benchlib import command_line, machine_info, write_json

REPO = Path(__file__).resolve().parent.parent
SPEC = {"name": "quota", "machines": [{"name": "q", "workers": 2, "cpu": 0.7}]}
CASES = (("vgg-mini", 24), ("transformer-mini", 12), ("transformer-mini", 24))
_READY_S = 120.0

# One device's loop: warm up, say "ready", wait for the common window on stdin, then count whole steps
# (or matmuls) inside it and print the CPU and wall seconds of what it counted.
_LOOP = """
import sys, time, torch
torch.set_num_threads(1)
model, batch, n = sys.argv[1], int(sys.argv[2]), 0
if model == "matmul":
    a, b = torch.randn(batch, batch), torch.randn(batch, batch)
    def step(): a @ b
else:
    from tagps.models import build_model, example_inputs
    torch.manual_seed(0)
    net = build_model(model).train()
    x = example_inputs(model, batch)
    opt = torch.optim.Adam(net.parameters())
    def step():
        opt.zero_grad()
        net(*x).float().sum().backward()
        opt.step()
for _ in range(3): step()
print("ready", flush=True)
start, end = map(float, sys.stdin.readline().split())
while time.time() < start: time.sleep(0.001)
w0, c0 = time.perf_counter(), time.process_time()
while time.time() < end: step(); n += 1
print(n, time.process_time() - c0, time.perf_counter() - w0)
"""


def _window(argvs: Sequence[Sequence[str]], seconds: float) -> list[tuple[int, float, float]]:
    """Run one loop per argv, all inside one window of ``seconds``: (count, CPU s, wall s) per loop."""
    procs = [subprocess.Popen(list(a), stdin=PIPE, stdout=PIPE, stderr=PIPE, text=True) for a in argvs]
    try:
        deadline = time.monotonic() + _READY_S
        for p in procs:
            line = p.stdout.readline().strip()  # type: ignore[union-attr]
            if line != "ready" or time.monotonic() > deadline:
                raise RuntimeError(f"a loop was not ready: {line!r} {p.communicate()[1][-2000:]}")
        start = time.time() + 0.1
        for p in procs:
            p.stdin.write(f"{start!r} {start + seconds!r}\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        out = []
        for p in procs:
            text, err = p.communicate(timeout=seconds + 120)
            if p.returncode != 0:
                raise RuntimeError(f"a loop failed: {err[-2000:]}")
            n, cpu, wall = text.split()
            out.append((int(n), float(cpu), float(wall)))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def measure(
    exec_argv: Callable[[list[str]], list[str]], model: str, batch: int, seconds: float
) -> dict[str, tuple[float, float]]:
    """One round of the three conditions for one case, back to back: (CPU s, wall s) per step, the mean
    over the condition's processes; ``exec_argv`` runs an argv on the quota'd machine."""
    loop = [sys.executable, "-c", _LOOP, model, str(batch)]
    conditions = {"alone": [loop], "pair": [loop, loop], "quota": [exec_argv(loop), exec_argv(loop)]}
    out = {}
    for name, argvs in conditions.items():
        runs = _window(argvs, seconds)
        out[name] = (statistics.mean(c / n for n, c, _ in runs), statistics.mean(w / n for n, _, w in runs))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="each window (default 4)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over every case (default 5)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "quota_compute.json")
    args = parser.parse_args(argv)

    from tagps.cluster import ClusterError, check_support
    from tagps.cluster.measure import MATMUL_N
    from tagps.cluster.run import up

    try:
        check_support()
    except ClusterError as exc:
        print(f"skipped: {exc}")
        return 0
    machine = SPEC["machines"][0]
    share = min(1.0, machine["cpu"] / machine["workers"])
    cases = [*CASES, ("matmul", MATMUL_N)]
    keys = ["matmul" if m == "matmul" else f"{m.split('-')[0]}_b{b}" for m, b in cases]
    rounds: dict[str, list[dict[str, tuple[float, float]]]] = {k: [] for k in keys}
    with up(SPEC) as cluster:
        # Rounds go over every case in turn, so that a slow stretch of the shared host falls on every
        # case; a round's three conditions run back to back, and its factors divide within the round.
        for rnd in range(args.rounds):
            for key, (model, batch) in zip(keys, cases, strict=True):
                print(
                    f"round {rnd}: {key}: alone, pair, quota ({args.seconds:.0f} s windows) ...", flush=True
                )
                rounds[key].append(measure(lambda a: cluster.exec_argv("q", a), model, batch, args.seconds))
    results: dict[str, dict[str, Any]] = {}
    figures: dict[str, float] = {}
    for key, rs in rounds.items():
        factors = {c: [r[c][0] / r["alone"][0] for r in rs] for c in ("pair", "quota")}
        results[key] = {
            "cpu_s": {c: [r[c][0] for r in rs] for c in ("alone", "pair", "quota")},
            "wall_s": {c: [r[c][1] for r in rs] for c in ("alone", "pair", "quota")},
            "pair_cpu_factors": factors["pair"],
            "quota_cpu_factors": factors["quota"],
        }
        figures[f"{key}_pair_cpu_factor"] = statistics.median(factors["pair"])
        figures[f"{key}_quota_cpu_factor"] = statistics.median(factors["quota"])
        figures[f"{key}_quota_share_delivered"] = statistics.median(r["quota"][0] / r["quota"][1] for r in rs)
    print(f"\n{'case':<18}{'alone ms':>10}{'pair ms':>10}{'quota ms':>10}{'pair x':>8}{'quota x':>9}"
          f"{'quota x range':>16}{'share':>7}  (CPU per step, medians; matmul: per matmul)")  # fmt: skip
    for key, r in results.items():
        ms = {c: statistics.median(v) * 1e3 for c, v in r["cpu_s"].items()}
        span = f"{min(r['quota_cpu_factors']):.2f}-{max(r['quota_cpu_factors']):.2f}"
        print(f"{key:<18}{ms['alone']:>10.2f}{ms['pair']:>10.2f}{ms['quota']:>10.2f}"
              f"{figures[f'{key}_pair_cpu_factor']:>8.3f}{figures[f'{key}_quota_cpu_factor']:>9.3f}"
              f"{span:>16}{figures[f'{key}_quota_share_delivered']:>7.3f}")  # fmt: skip
    write_json(
        args.out,
        {
            "machine": machine_info(),
            "command": command_line(),
            "spec": SPEC,
            "share": share,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "results": results,
            "figures": figures,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
