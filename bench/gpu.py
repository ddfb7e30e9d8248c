"""GPU check: what tagps costs on one GPU and how its CUDA push_pull compares with gloo, as ratios.

Run on a GPU machine through ``bench/gpu.sh`` (which installs missing wheels, builds tagps and runs the
``gpu`` tests first), or directly: ``python bench/gpu.py [--tests-log FILE]``. It starts two jobs with
``bpslaunch --local`` whose workers are this file (``--worker KIND``) and writes ``bench/results/gpu.json``:

- ``gpu_1w_overhead``: one GPU worker with one CPU server (the default ``ps`` method, so every gradient is
  staged through pinned host memory), step time over plain torch on the same GPU, for a ResNet-50-sized
  and a VGG19 model; the figure is the worse of the two. Goal <= 1.05.
- ``gpu_pushpull_vs_gloo``: 2 workers sharing the GPU (gloo: NCCL cannot run two ranks on one GPU) and 2
  servers; gloo all-reduce time of a 64 MiB CUDA tensor over the push_pull time of the same tensor (so
  above 1 means push_pull is faster). Goal >= 0.9.
- ``gpu_copy_hidden``: the share of the PS staging copies (device to host and back, of every gradient,
  timed alone) hidden behind backward: ``1 - (tagps step - plain step) / copy time``, clipped to [0, 1].
  The exposed time also holds the host-side work, so this is a lower bound.

Exit status: 0 when it measured and wrote the JSON; 3 when this host has no usable CUDA (a "no CUDA"
message on stderr, nothing measured or written); 1 when a job failed (its output on stderr).
The whole run takes about a minute on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "bench" / "results" / "gpu.json"
NO_CUDA = 3
MIB64 = 16 << 20  # float32 elements in 64 MiB
WARMUP, STEPS = 3, 10
JOB_TIMEOUT_S = 150.0


# ---------------------------------------------------------------------------------------------- workers
def _step_time(step: Callable[[], None]) -> float:
    """Seconds per call of ``step`` on the GPU, after a warm-up."""
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / STEPS


def _copy_time(params: list[torch.nn.Parameter]) -> float:
    """Seconds to stage every gradient as the ps method does: to pinned host memory and back."""
    grads = [p.grad for p in params if p.grad is not None]
    hosts = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in grads]

    def copy() -> None:
        for host, grad in zip(hosts, grads, strict=True):
            host.copy_(grad, non_blocking=True)
        for host, grad in zip(hosts, grads, strict=True):
            grad.copy_(host, non_blocking=True)

    return _step_time(copy)


def _trainer(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], None]:
    """One training step of ``model`` on the batch ``(x, y)``."""

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _overhead_worker(out: Path) -> None:
    """One worker, one server: plain torch, then tagps, on each model; writes the per-model figures."""
    import tagps.torch as bps
    from tagps.models import cnn

    bps.init()
    device = torch.device("cuda", torch.cuda.current_device())
    figures: dict[str, Any] = {}
    models = {"resnet50": (lambda: cnn.ResNet((3, 4, 6, 3)), 64), "vgg19": (cnn.vgg19, 32)}
    for name, (build, batch) in models.items():
        torch.manual_seed(0)
        model = build().to(device)
        x = torch.randn(batch, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (batch,), device=device)
        plain = _step_time(_trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3), x, y))
        copy = _copy_time(list(model.parameters()))
        opt = bps.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters()
        )
        tagps = _step_time(_trainer(model, opt, x, y))
        figures[name] = {
            "batch": batch,
            "params_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
            "plain_step_s": plain,
            "tagps_step_s": tagps,
            "overhead": tagps / plain,
            "copy_s": copy,
            "copy_hidden": min(1.0, max(0.0, 1.0 - (tagps - plain) / copy)),
        }
        del model, opt
        torch.cuda.empty_cache()
    out.write_text(json.dumps(figures))
    bps.shutdown()


def _pushpull_worker(out: Path) -> None:
    """2 workers, 2 servers, gloo: push_pull and gloo all-reduce of one 64 MiB CUDA tensor; rank 0 writes
    the figures."""
    import torch.distributed as dist

    import tagps.torch as bps

    bps.init()
    tensor = torch.ones(MIB64, device="cuda")

    def push_pull() -> None:
        bps.push_pull_inplace(tensor, average=True, name="bench.64MiB")

    def all_reduce() -> None:
        dist.all_reduce(tensor)
        tensor.div_(bps.size())

    figures: dict[str, Any] = {"bytes": MIB64 * 4, "workers": bps.size()}
    for name, step in (("push_pull", push_pull), ("gloo_all_reduce", all_reduce)):
        bps.barrier()
        seconds = _step_time(step)
        figures[f"{name}_s"] = seconds
        figures[f"{name}_gbps"] = MIB64 * 4 / seconds / 1e9
    figures["max_abs_error"] = float((tensor - 1.0).abs().max())
    if bps.rank() == 0:
        out.write_text(json.dumps(figures))
    bps.shutdown()


# ----------------------------------------------------------------------------------------------- driver
def _job(kind: str, workers: int, servers: int, env: dict[str, str], tmp: Path) -> dict[str, Any]:
    """Run this file as the worker of a local job; return rank 0's figures."""
    out = tmp / f"{kind}.json"
    cmd = [
        sys.executable, "-m", "tagps.launcher", "--local", str(workers), "--servers", str(servers),
        "--grace", "2", "--", sys.executable, __file__, "--worker", kind, "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    if proc.returncode != 0 or not out.exists():
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        raise RuntimeError(f"the {kind} job failed ({proc.returncode}):\n{output}")
    return json.loads(out.read_text())


def _tests_summary(log: Path | None) -> str | None:
    """The last pytest summary line of ``log`` (e.g. ``40 passed, 1 skipped in 80s``)."""
    if log is None or not log.exists():
        return None
    lines = [
        ln.strip("= ")
        for ln in log.read_text().splitlines()
        if " in " in ln and ("passed" in ln or "failed" in ln or "skipped" in ln)
    ]
    return lines[-1] if lines else None


def main() -> int:
    """Measure and write the JSON (see the module docstring for the exit status)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests-log", type=Path, help="the gpu tests' pytest output, summarised in the JSON")
    parser.add_argument("--worker", choices=("overhead", "pushpull"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        (_overhead_worker if args.worker == "overhead" else _pushpull_worker)(args.out)
        return 0
    if not torch.cuda.is_available():
        print(
            f"bench/gpu.py: no CUDA here (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
            f"nothing measured, exit status {NO_CUDA}",
            file=sys.stderr,
        )
        return NO_CUDA
    sys.path.insert(0, str(Path(__file__).parent))
    import benchlib

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tagps-gpu-") as tmp:
        try:
            overhead = _job("overhead", 1, 1, {}, Path(tmp))
            pushpull = _job("pushpull", 2, 2, {"TAGPS_DIST_BACKEND": "gloo"}, Path(tmp))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"bench/gpu.py: {exc}", file=sys.stderr)
            return 1
    payload = {
        "machine": benchlib.machine_info(
            gpu=torch.cuda.get_device_name(),
            gpus=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        ),
        "command": benchlib.command_line(),
        "gpu_tests": _tests_summary(args.tests_log),
        "gpu_1w_overhead": max(m["overhead"] for m in overhead.values()),
        "gpu_pushpull_vs_gloo": pushpull["gloo_all_reduce_s"] / pushpull["push_pull_s"],
        "gpu_copy_hidden": min(m["copy_hidden"] for m in overhead.values()),  # the worse model's
        "goals": {"gpu_1w_overhead": "<= 1.05", "gpu_pushpull_vs_gloo": ">= 0.9"},
        "overhead_per_model": overhead,
        "pushpull": pushpull,
        "wall_s": time.perf_counter() - started,
    }
    benchlib.write_json(RESULT, payload)
    print(f"{'figure':<24}{'value':>10}  goal")
    for key in ("gpu_1w_overhead", "gpu_pushpull_vs_gloo", "gpu_copy_hidden"):
        print(f"{key:<24}{payload[key]:>10.3f}  {payload['goals'].get(key, '')}")
    print(f"wrote {RESULT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
