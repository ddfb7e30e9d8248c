"""Benchmark the shared-memory arena of the local reduction: one C++ call per shard against the Python loop it
replaced, and against the memory-bound floor (``sum_into`` alone), measured in the same run.

Usage: python bench/local_reduce.py [--ranks 4] [--mib 64] [--rounds 5] [--threads 1] [--out FILE]

One process plays every local rank: an arena of ``--ranks`` slots of ``--mib`` MiB float32 in /dev/shm,
and the reduction of the whole tensor as the ranks' shards one after another (on a machine they run at
once, each on its own cores; ``--threads`` is the kernels' and torch's threads, 1 by default because one
rank's share of a shared machine's cores is small, and an OpenMP team on oversubscribed cores waits for
its descheduled members). Candidates, timed in interleaved rounds, best round kept (medians in the JSON):

- cpp: ``ShmArena.reduce_shard`` per shard (csrc/comm/arena.cc).
- python_loop: the replaced path: torch views of an mmap of the same file, per shard a ``kernels.sum_into``
  call per group, ``copy_`` of slot 0 into the result row, ``sum_into`` of the other group leaders.
- sum_into: ``kernels.sum_into(x0, x1, ..., xn)`` on private tensors of the same size: reads every row
  once and writes one, as the arena's one-group reduction does (it sums the slots straight into the
  result row); with two groups the arena writes each leader once more and reads it back.
- copy_in_out, cpp vs torch: every rank's copy into its slot and one copy of the result out.

Then the coordination of small tensors (unless ``--small-calls 0``): a job of ``--small-ranks`` local ranks
on one machine (``bpslaunch --local 1 --local-size 3 --servers 1``; with one machine the local sum is the
global one) makes ``--small-calls`` back-to-back sums of a 1 KiB tensor through ``tagps.torch.ops.start_sum``
with ``ps`` (the shared-memory reduction: at this size the root sums alone, the others wait on a futex)
and with ``allreduce`` (gloo over loopback TCP, the strongest simple alternative), and reports the process
CPU every rank spends per call (``python -m tagps.calibrate --runtime-cpu-probe``, the probe calibration
measures ``ps_local_call_s`` with).

Writes JSON (default bench/results/local_reduce.json) with the ``machine``, ``measurements`` (ms),
``small_sum_cpu_us`` (per method, every rank's CPU per small sum) and ``figures``:
``cpp_vs_python_loop_<topology>`` (python_loop time / cpp time), ``cpp_vs_sum_into`` (sum_into time / cpp
time, one group; both move ranks + 1 rows, so 1 is the floor's ratio) and ``copy_cpp_vs_torch``, and for
the small tensors ``small_sum_machine_cpu_us_ps`` and ``_allreduce`` (all ranks' CPU per call, microseconds)
and ``small_sum_ps_vs_allreduce`` (allreduce's CPU / ps's).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchlib import best_times, command_line, machine_info, write_json

from tagps import kernels
from tagps.calibrate import probe_argv
from tagps.comm.arena import ShmArena
from tagps.comm.local_reduce import shard_bounds

MIB = 1 << 20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "local_reduce.json"


def _python_loop(slots: torch.Tensor, result: torch.Tensor, groups: list[list[int]], ranks: int) -> None:
    """The reduction as tagps.comm.local_reduce did it before csrc/comm/arena.cc, every shard in turn."""
    count = result.numel()
    for me in range(ranks):
        start, stop = shard_bounds(count, ranks, me)
        if start >= stop:
            continue
        part = slots[:, start:stop]
        for group in groups:
            kernels.sum_into(part[group[0]], *(part[m] for m in group[1:]))
        out = result[start:stop]
        out.copy_(part[0])
        kernels.sum_into(out, *(part[g[0]] for g in groups[1:]))


def _cpp(arena: ShmArena, groups: list[list[int]], ranks: int) -> None:
    for me in range(ranks):
        arena.reduce_shard(groups, *shard_bounds(arena.count, ranks, me))


def bench(
    ranks: int, mib: float, rounds: int, shm_dir: str
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    count = int(mib * MIB) // 4
    gen = torch.Generator().manual_seed(0)
    xs = [torch.rand(count, generator=gen) + i for i in range(ranks)]  # distinct values per rank
    expected = torch.stack(xs).sum(0)
    topologies = {
        "one_group": [list(range(ranks))],
        "two_groups": [list(range(0, ranks, 2)), list(range(1, ranks, 2))],
    }
    medians: dict[str, float] = {}
    measurements: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(dir=shm_dir) as where:
        path = os.path.join(where, "arena")
        arena = ShmArena(path, torch.float32, ranks, count)
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), arena.header_bytes + (ranks + 1) * count * 4)
        rows = torch.frombuffer(mm, dtype=torch.float32, offset=arena.header_bytes).view(ranks + 1, count)
        slots, result = rows[:-1], rows[-1]
        out = torch.empty(count)

        def fill() -> None:
            for i, x in enumerate(xs):
                arena.write(i, x)

        for topo, groups in topologies.items():
            for name, run in {
                "cpp": lambda g=groups: _cpp(arena, g, ranks),
                "python_loop": lambda g=groups: _python_loop(slots, result, g, ranks),
            }.items():
                fill()
                run()
                torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-5, msg=f"{topo} {name}")
            measurements[f"reduce_{topo}_ms"] = best_times(
                {
                    "cpp": lambda g=groups: _cpp(arena, g, ranks),
                    "python_loop": lambda g=groups: _python_loop(slots, result, g, ranks),
                },
                rounds,
                medians,
            )
        dst, srcs = xs[0].clone(), xs[1:]
        measurements["floor_ms"] = best_times(
            {"sum_into": lambda: kernels.sum_into(dst, *srcs)}, rounds, medians
        )

        def copy_cpp() -> None:
            fill()
            arena.read_result(out)

        def copy_torch() -> None:
            for i, x in enumerate(xs):
                slots[i].copy_(x)
            out.copy_(result)

        measurements["copy_in_out_ms"] = best_times({"cpp": copy_cpp, "torch": copy_torch}, rounds, medians)
    ms = {g: {k: v * 1e3 for k, v in d.items()} for g, d in measurements.items()}
    return ms, {k: v * 1e3 for k, v in medians.items()}


def small_sums(ranks: int, calls: int) -> dict[str, list[float]]:
    """Every rank's process CPU seconds per back-to-back 1 KiB sum, per method (``ps``, ``allreduce``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cpu.json")
        launch = [sys.executable, "-m", "tagps.launcher", "--local", "1", "--local-size", str(ranks)]
        launch += ["--servers", "1"]
        probe = probe_argv(out, calls, "--runtime-cpu-probe")  # what calibration launches
        env = {**os.environ, "TAGPS_NUM_THREADS": "1"}
        subprocess.run([*launch, "--", *probe], check=True, env=env, timeout=600, stdout=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())


def figures(ms: dict[str, dict[str, float]], small_us: dict[str, list[float]] | None) -> dict[str, float]:
    figs = {
        f"cpp_vs_python_loop_{topo}": ms[f"reduce_{topo}_ms"]["python_loop"] / ms[f"reduce_{topo}_ms"]["cpp"]
        for topo in ("one_group", "two_groups")
    }
    figs["cpp_vs_sum_into"] = ms["floor_ms"]["sum_into"] / ms["reduce_one_group_ms"]["cpp"]
    figs["copy_cpp_vs_torch"] = ms["copy_in_out_ms"]["torch"] / ms["copy_in_out_ms"]["cpp"]
    if small_us is not None:
        per_call = {m: sum(v) for m, v in small_us.items()}
        figs["small_sum_machine_cpu_us_ps"] = per_call["ps"]
        figs["small_sum_machine_cpu_us_allreduce"] = per_call["allreduce"]
        figs["small_sum_ps_vs_allreduce"] = per_call["allreduce"] / per_call["ps"]
    return {k: round(v, 3) for k, v in figs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="local ranks (slots), default 4")
    parser.add_argument("--mib", type=float, default=64, help="MiB of float32 per rank, default 64")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per candidate, default 5")
    parser.add_argument(
        "--threads", type=int, default=1, help="kernel threads (TAGPS_NUM_THREADS), default 1"
    )
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the arena lives (default /dev/shm)")
    parser.add_argument("--small-ranks", type=int, default=3, help="local ranks of the small sums, default 3")
    parser.add_argument(
        "--small-calls", type=int, default=2000, help="back-to-back small sums per method (0: none; 2000)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    kernels.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)  # the old path's copy_ runs on torch's threads
    start = time.perf_counter()
    ms, medians = bench(args.ranks, args.mib, args.rounds, args.shm_dir)
    small_us = None
    if args.small_calls:
        cpu = small_sums(args.small_ranks, args.small_calls)
        small_us = {m: [round(v * 1e6, 1) for v in per_rank] for m, per_rank in cpu.items()}
    figs = figures(ms, small_us)
    result = {
        "machine": machine_info(
            simd_mode=kernels.simd_mode(),
            tagps_threads=kernels.num_threads(),
            torch_threads=torch.get_num_threads(),
            load_average_1min=round(os.getloadavg()[0], 2),
        ),
        "commands": {"run": command_line()},
        "ranks": args.ranks,
        "mib_per_rank": args.mib,
        "rounds": args.rounds,
        "seconds": round(time.perf_counter() - start, 1),
        "measurements": ms,
        "small_sum_cpu_us": small_us,
        "median_ms": medians,
        "figures": figs,
    }
    write_json(args.out, result)
    print(f"{args.ranks} ranks x {args.mib} MiB float32, best of {args.rounds}")
    print(f"{'measurement':34s} {'ms':>9s}")
    for group, values in ms.items():
        for name, value in values.items():
            print(f"{group.removesuffix('_ms') + ': ' + name:34s} {value:9.3f}")
    for method, per_rank in (small_us or {}).items():
        print(f"{'small_sum_cpu_us: ' + method:34s} {' '.join(f'{v:.0f}' for v in per_rank)} (per rank)")
    print(f"\n{'figure':34s} {'ratio':>9s}")
    for key, value in figs.items():
        print(f"{key:34s} {value:9.3f}")
    print(f"\nwrote {args.out} ({result['seconds']} s, simd={kernels.simd_mode()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
