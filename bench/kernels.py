"""Benchmark the tagps CPU kernels against the alternatives, measured in the same run.

Usage: python bench/kernels.py [--quick] [--out FILE]

Prints a table and writes JSON (default bench/results/kernels.json) with a ``machine`` object, the
``commands`` that produced it, the raw ``measurements`` and the ``figures`` (ratios, higher is better for
tagps) with their ``targets``:

- sum2_fp32_vs_stream: GB/s of sum_into(dst, src) on 64 MiB / GB/s of the fastest streaming add
  (dst += src) timed here on the same buffers: numpy ``np.add(dst, src, out=dst)`` and torch ``add_``;
  3 x 64 MiB moved per call for both.
- sum8_fp32_vs_numpy: 8-way sum_into on 8 x 16 MiB / the fastest numpy way (a chain of
  ``np.add(..., out=dst)``, or ``np.add.reduce`` over a pre-stacked array then one add).
- sum2_fp16_vs_fp32: bytes/s of the 2-way float16 sum / bytes/s of the float32 one (64 MiB buffers).
- adam_vs_torch_foreach, adam_vs_torch_fused: adam_step on 16M float32 params / torch.optim.Adam with
  foreach=True and with fused=True (same hyperparameters).
- rmsprop_vs_torch_foreach: rmsprop_step / torch.optim.RMSprop(foreach=True).

Buffers are allocated and touched once, then reused (first-touch page faults would distort the
figures). Candidates are timed in interleaved rounds and compared by their best round (the machine is
shared, and the fastest round is the one least disturbed by other processes); the medians are kept in
the JSON too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from benchlib import best_times, command_line, cpu_flags, machine_info, write_json

from tagps import kernels, optim

MIB = 1 << 20
TARGETS = {
    "sum2_fp32_vs_stream": 0.9,
    "sum8_fp32_vs_numpy": 2.0,
    "sum2_fp16_vs_fp32": 0.8,
    "adam_vs_torch_foreach": 1.5,
    "adam_vs_torch_fused": 1.0,
    "rmsprop_vs_torch_foreach": 1.5,
}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kernels.json"


def _filled(n: int, dtype: type, rng: np.random.Generator) -> np.ndarray:
    """Distinct values (so a verify step catches mixed-up buffers), already touched."""
    return rng.uniform(-1.0, 1.0, n).astype(dtype)


def bench_sums(
    rounds: int, rng: np.random.Generator, medians: dict[str, float]
) -> dict[str, dict[str, float]]:
    n2 = 64 * MIB // 4
    dst, src = _filled(n2, np.float32, rng), _filled(n2, np.float32, rng)
    tdst, tsrc = torch.from_numpy(dst), torch.from_numpy(src)
    # Verify on a copy: one sum must equal numpy's add.
    check = dst.copy()
    kernels.sum_into(check, src)
    if not np.array_equal(check, dst + src):
        raise RuntimeError("sum_into(dst, src) disagrees with numpy")
    bytes2 = 3 * dst.nbytes
    h_dst = _filled(64 * MIB // 2, np.float16, rng)
    h_src = _filled(64 * MIB // 2, np.float16, rng)
    # The float16 sum runs in the same rounds as the float32 ones, so its ratio compares like with like.
    t2 = best_times(
        {
            "tagps sum_into": lambda: kernels.sum_into(dst, src),
            "numpy np.add(out=)": lambda: np.add(dst, src, out=dst),
            "torch add_": lambda: tdst.add_(tsrc),
            "tagps sum_into fp16": lambda: kernels.sum_into(h_dst, h_src),
        },
        rounds,
        medians,
    )

    n8 = 16 * MIB // 4
    d8 = _filled(n8, np.float32, rng)
    stacked = np.stack([_filled(n8, np.float32, rng) for _ in range(8)])
    srcs8 = list(stacked)
    tmp = np.empty_like(d8)
    check = d8.copy()
    kernels.sum_into(check, *srcs8)
    expected = d8.copy()
    for s in srcs8:
        np.add(expected, s, out=expected)
    if not np.array_equal(check, expected):
        raise RuntimeError("8-way sum_into disagrees with numpy")

    def numpy_chain() -> None:
        for s in srcs8:
            np.add(d8, s, out=d8)

    def numpy_reduce() -> None:
        np.add.reduce(stacked, axis=0, out=tmp)
        np.add(d8, tmp, out=d8)

    t8 = best_times(
        {
            "tagps sum_into x8": lambda: kernels.sum_into(d8, *srcs8),
            "numpy add chain x8": numpy_chain,
            "numpy add.reduce x8": numpy_reduce,
        },
        rounds,
        medians,
    )
    gbps = {name: (3 * h_dst.nbytes if "fp16" in name else bytes2) / t / 1e9 for name, t in t2.items()}
    return {"sum2_GBps": gbps, "sum8_seconds": t8}


ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
RMSPROP = {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8}


def verify_optimizers(rng: np.random.Generator) -> None:
    """Three steps of tagps.optim against torch.optim (foreach) on 64 Ki parameters: rel. error <= 1e-6."""
    init = torch.from_numpy(_filled(1 << 16, np.float32, rng))
    grad = torch.from_numpy(_filled(1 << 16, np.float32, rng))
    for torch_cls, tagps_cls, hyper in [
        (torch.optim.Adam, optim.Adam, ADAM),
        (torch.optim.RMSprop, optim.RMSprop, RMSPROP),
    ]:
        ref, ours = init.clone().requires_grad_(), init.clone().requires_grad_()
        opt_ref, opt_ours = torch_cls([ref], foreach=True, **hyper), tagps_cls([ours], **hyper)
        for _ in range(3):
            ref.grad, ours.grad = grad, grad
            opt_ref.step()
            opt_ours.step()
        rel = ((ours - ref).norm() / ref.norm()).item()
        if rel > 1e-6:
            raise RuntimeError(f"{tagps_cls.__name__} disagrees with torch: relative error {rel:.2e}")


def bench_optimizers(
    rounds: int, rng: np.random.Generator, medians: dict[str, float]
) -> dict[str, dict[str, float]]:
    verify_optimizers(rng)
    n = 16 * MIB
    grad = torch.from_numpy(_filled(n, np.float32, rng))
    ours = {name: torch.zeros(n) for name in ("param", "exp_avg", "exp_avg_sq", "square_avg")}
    ours["param"].copy_(torch.from_numpy(_filled(n, np.float32, rng)))
    step = [0]

    def tagps_adam() -> None:
        step[0] += 1
        kernels.adam_step(ours["param"], grad, ours["exp_avg"], ours["exp_avg_sq"], step=step[0], **ADAM)

    def tagps_rmsprop() -> None:
        kernels.rmsprop_step(ours["param"], grad, ours["square_avg"], **RMSPROP)

    def torch_optimizer(factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> Callable[[], None]:
        p = ours["param"].clone().requires_grad_()
        p.grad = grad
        opt = factory([p])
        return opt.step

    adam = best_times(
        {
            "tagps adam_step": tagps_adam,
            "torch Adam foreach": torch_optimizer(lambda ps: torch.optim.Adam(ps, foreach=True, **ADAM)),
            "torch Adam fused": torch_optimizer(lambda ps: torch.optim.Adam(ps, fused=True, **ADAM)),
        },
        rounds,
        medians,
    )
    rms = best_times(
        {
            "tagps rmsprop_step": tagps_rmsprop,
            "torch RMSprop foreach": torch_optimizer(
                lambda ps: torch.optim.RMSprop(ps, foreach=True, **RMSPROP)
            ),
        },
        rounds,
        medians,
    )
    return {"adam_seconds": adam, "rmsprop_seconds": rms}


def machine() -> dict[str, object]:
    flags = cpu_flags()
    wanted = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16")
    return machine_info(
        flags=[f for f in wanted if f in flags],
        numpy=np.__version__,
        simd_mode=kernels.simd_mode(),
        tagps_threads=kernels.num_threads(),
        torch_threads=torch.get_num_threads(),
        # Other processes share the cores; a high load makes the multi-threaded figures noisy.
        load_average_1min=round(os.getloadavg()[0], 2),
    )


def figures(m: dict[str, dict[str, float]]) -> dict[str, float]:
    g2, t8 = m["sum2_GBps"], m["sum8_seconds"]
    adam, rms = m["adam_seconds"], m["rmsprop_seconds"]
    return {
        "sum2_fp32_vs_stream": g2["tagps sum_into"] / max(g2["numpy np.add(out=)"], g2["torch add_"]),
        "sum8_fp32_vs_numpy": min(t8["numpy add chain x8"], t8["numpy add.reduce x8"])
        / t8["tagps sum_into x8"],
        "sum2_fp16_vs_fp32": g2["tagps sum_into fp16"] / g2["tagps sum_into"],
        "adam_vs_torch_foreach": adam["torch Adam foreach"] / adam["tagps adam_step"],
        "adam_vs_torch_fused": adam["torch Adam fused"] / adam["tagps adam_step"],
        "rmsprop_vs_torch_foreach": rms["torch RMSprop foreach"] / rms["tagps rmsprop_step"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (under 60 s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    # Sums take milliseconds, so many rounds are cheap and give every candidate quiet moments to show
    # its speed in; a torch foreach step takes ~0.1 s.
    rounds = {"sums": 31 if args.quick else 101, "optimizers": 5 if args.quick else 15}
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    medians: dict[str, float] = {}
    measurements = bench_sums(rounds["sums"], rng, medians)
    measurements |= bench_optimizers(rounds["optimizers"], rng, medians)
    figs = figures(measurements)
    result = {
        "machine": machine(),
        "commands": {"run": command_line()},
        "quick": args.quick,
        "rounds": rounds,
        "seconds": round(time.perf_counter() - start, 1),
        "measurements": measurements,
        "median_seconds": medians,
        "figures": figs,
        "targets": TARGETS,
        "met": {k: figs[k] >= v for k, v in TARGETS.items()},
    }
    write_json(args.out, result)

    print(f"{'measurement':38s} {'value':>12s}")
    for group, values in measurements.items():
        unit = "GB/s" if group.endswith("GBps") else "ms"
        for name, value in values.items():
            shown = value if unit == "GB/s" else value * 1e3
            print(f"{group + ': ' + name:38s} {shown:10.2f} {unit}")
    print(f"\n{'figure':28s} {'ratio':>8s} {'target':>8s}  met")
    for key, value in figs.items():
        print(f"{key:28s} {value:8.2f} {TARGETS[key]:8.2f}  {'yes' if value >= TARGETS[key] else 'NO'}")
    print(f"\nwrote {args.out} ({result['seconds']} s, simd={kernels.simd_mode()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
