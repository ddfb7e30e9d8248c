"""Run Horovod's and BytePS's public PyTorch examples under ``bpslaunch`` with only their imports changed.

The four scripts are Horovod's ``examples/pytorch/pytorch_mnist.py`` and ``pytorch_synthetic_benchmark.py``
and BytePS's ``example/pytorch/benchmark_byteps.py`` and ``train_mnist_byteps.py``. They are not part of
this repository: copy them from their projects into one folder and pass it with ``--scripts``. Each is run
from a copy in which only its ``horovod``/``byteps`` import lines name tagps instead; the JSON records the
hash of each original and every line that differs, so a reader can check that nothing else changed.

They import torchvision, whose wheels link torch's CUDA libraries, which this project's torch 2.13.0 CPU
build lacks, so they run in a second virtual environment (``make compat-deps``: the same torch release in
its CUDA build, which runs on the CPU, and torchvision 0.28.0, from ``requirements/compat.txt``) with this
checkout's ``tagps`` (its C++ core built by ``make build``) on ``PYTHONPATH``. No data set can be
downloaded here, so MNIST is synthetic: ten noisy class templates written in MNIST's own idx format where
torchvision looks before it downloads, learnable enough that a test accuracy well above chance shows the
job trained.

    make compat-deps && .venv-compat/bin/python bench/public_scripts.py --scripts DIR
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import benchlib
import numpy as np

ROOT = Path(__file__).resolve().parent.parent

# The only lines rewritten: the frameworks' imports, each pointed at tagps under the name the script uses.
IMPORT_REWRITES = {
    "import horovod.torch as hvd": "import tagps.torch as hvd",
    "import byteps.torch as bps": "import tagps.torch as bps",
    "import horovod": "import tagps as horovod",
}


@dataclass(frozen=True)
class Case:
    """One run: a script, its arguments, the job's shape, and what its output must show."""

    name: str
    script: str
    args: tuple[str, ...]
    servers: int
    expect: str  # a regex that the output must match; its first group is the reported figure
    minimum: float  # the figure must be at least this
    workers: int = 2


# Small batches and few steps: the point is that the scripts run and train, on two CPU cores.
BENCH_ARGS = ("--model", "resnet50", "--batch-size", "4", "--num-warmup-batches", "1",
              "--num-batches-per-iter", "3", "--num-iters", "3")  # fmt: skip
IMG_SEC = r"Img/sec per CPU: ([0-9.]+)"
ACCURACY = r"Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+)%"
TRAIN_ARGS = ("--epochs", "2", "--log-interval", "20")
CASES = [
    Case("horovod_mnist", "pytorch_mnist.py", TRAIN_ARGS, 0, ACCURACY, 50.0),
    Case("horovod_mnist_fp16", "pytorch_mnist.py", ("--epochs", "1", "--fp16-allreduce"), 0, ACCURACY, 30.0),
    Case("horovod_synthetic_benchmark", "pytorch_synthetic_benchmark.py", BENCH_ARGS, 0, IMG_SEC, 0.0),
    # The same script on one worker, which has both cores: the yardstick for the two workers' total.
    Case("horovod_synthetic_benchmark_1w", "pytorch_synthetic_benchmark.py", BENCH_ARGS, 0, IMG_SEC, 0.0, 1),
    Case("byteps_benchmark", "benchmark_byteps.py", BENCH_ARGS, 1, IMG_SEC, 0.0),
    Case("byteps_benchmark_fp16", "benchmark_byteps.py", (*BENCH_ARGS, "--fp16-pushpull"), 1, IMG_SEC, 0.0),
    Case("byteps_mnist", "train_mnist_byteps.py", TRAIN_ARGS, 1, ACCURACY, 50.0),
]


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array in MNIST's idx format (0, 0, 0x08, the rank, then the dims big-endian)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_synthetic_mnist(root: Path, train: int = 6000, test: int = 1000, seed: int = 0) -> None:
    """Put a synthetic MNIST under ``root/MNIST/raw``: each image is its class's fixed random template
    plus noise, so a small CNN learns it in an epoch while a constant guess scores 10 %."""
    rng = np.random.default_rng(seed)
    templates = rng.random((10, 28, 28)) > 0.7
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, count).astype(np.uint8)
        noise = rng.normal(0.0, 60.0, (count, 28, 28))
        images = np.clip(templates[labels] * 160.0 + 40.0 + noise, 0, 255).astype(np.uint8)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)


def port_script(source: Path, target: Path) -> list[str]:
    """Copy ``source`` to ``target`` with the framework imports pointed at tagps.

    Returns:
        The unified diff between the two, which holds import lines only.
    """
    original = source.read_text()
    lines = [IMPORT_REWRITES.get(line.rstrip(), line.rstrip()) for line in original.splitlines()]
    ported = "\n".join(lines) + ("\n" if original.endswith("\n") else "")
    target.write_text(ported)
    return [
        line
        for line in difflib.unified_diff(original.splitlines(), ported.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def run_case(case: Case, scripts: Path, workdir: Path, timeout: float) -> dict[str, object]:
    """Run one case under ``bpslaunch --local`` in ``workdir`` and check its output."""
    source = scripts / case.script
    ported = workdir / case.script
    diff = port_script(source, ported)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    launch = ["--local", str(case.workers), "--servers", str(case.servers), "--"]
    shown = shlex.join(["bpslaunch", *launch, "python", case.script, *case.args])
    print(f"[{case.name}] {shown}", flush=True)
    command = [sys.executable, "-m", "tagps.launcher", *launch, sys.executable, case.script, *case.args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    wall = time.perf_counter() - start
    found = re.findall(case.expect, output)
    figure = float(found[-1]) if found else None
    passed = rc == 0 and figure is not None and figure >= case.minimum
    losses = [float(x) for x in re.findall(r"Loss: ([0-9.]+)", output)]
    return {
        "script": case.script,
        "script_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "changed_lines": diff,
        "command": shown,
        "rc": rc,
        "wall_s": round(wall, 1),
        "figure": figure,
        "figure_pattern": case.expect,
        "minimum": case.minimum,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "passed": passed,
        "output_tail": output[-3000:] if not passed else output[-600:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", type=Path, required=True, help="folder holding the four public scripts")
    parser.add_argument("--only", nargs="*", default=None, help="case names to run (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case (default 600)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "public_scripts.json")
    args = parser.parse_args()
    missing = sorted({c.script for c in CASES} - {p.name for p in args.scripts.glob("*.py")})
    if missing:
        parser.error(f"{args.scripts} lacks {', '.join(missing)}: copy them from Horovod and BytePS")
    import torch
    import torchvision

    cases = [c for c in CASES if args.only is None or c.name in args.only]
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="tagps-public-scripts-") as tmp:
        workdir = Path(tmp)
        for root in ("data", "data-0", "data-1"):  # Horovod's --data-dir default, BytePS's data-RANK
            write_synthetic_mnist(workdir / root)
        for case in cases:
            results[case.name] = run_case(case, args.scripts, workdir, args.timeout)
            r = results[case.name]
            verdict = "ok" if r["passed"] else "FAILED"
            print(f"[{case.name}] rc={r['rc']} {r['wall_s']} s figure={r['figure']} "
                  f"loss {r['first_loss']} -> {r['last_loss']}: {verdict}", flush=True)  # fmt: skip
    print(f"\n{'case':32} {'rc':>4} {'wall s':>7} {'figure':>8}  passed")
    for name, r in results.items():
        print(f"{name:32} {r['rc']!s:>4} {r['wall_s']:>7} {r['figure']!s:>8}  {r['passed']}")
    figures = {}
    two, one = results.get("horovod_synthetic_benchmark"), results.get("horovod_synthetic_benchmark_1w")
    if two and one and two["figure"] and one["figure"]:
        # Per-worker img/sec times the workers, over one worker's: 1.0 is perfect scaling on these cores.
        figures["synthetic_2w_total_vs_1w"] = round(2 * two["figure"] / one["figure"], 3)
    payload = {
        "machine": benchlib.machine_info(torchvision=torchvision.__version__),
        "command": benchlib.command_line(),
        "torch_in_compat_venv": torch.__version__,
        "figures": figures,
        "cases": results,
        "all_passed": all(r["passed"] for r in results.values()),
    }
    benchlib.write_json(args.out, payload)
    for name, value in figures.items():
        print(f"{name}: {value}")
    print(f"wrote {args.out}")
    return 0 if payload["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
