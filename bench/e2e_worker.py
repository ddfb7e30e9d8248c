"""Worker of ``bench/e2e_local.py``: time training steps of one model under several sync methods.

Every method gets its own replica of the model (same initial weights) and optimizer; the methods take
turns step by step (the starting method rotates each round), so that all of them see the same machine
load. Rank 0 writes the step times per method as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tagps.torch as bps

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_synthetic import make_model, make_strategy


def make_step(model_name: str, method: str, data: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
    """Build a replica trained with ``method`` (``ddp`` or a ``--strategy`` of the example)."""
    torch.manual_seed(1234)
    model = make_model(model_name, data.shape[-1])
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if method == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        optimizer = bps.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), strategy=make_strategy(method, model)
        )

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--methods", required=True, help="comma-separated: ddp, allreduce, ps, allreduce:sfb, ...")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    bps.init()
    torch.manual_seed(100 + bps.rank())
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))
    methods = args.methods.split(",")
    steps = {m: make_step(args.model, m, data, target) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(args.warmup + args.steps):
        for i in range(len(methods)):
            method = methods[(r + i) % len(methods)]
            bps.barrier()
            start = time.perf_counter()
            steps[method]()
            elapsed = time.perf_counter() - start
            if r >= args.warmup:
                times[method].append(elapsed)
    if bps.rank() == 0:
        args.out.write_text(
            json.dumps({"workers": bps.size(), "batch_size": args.batch_size, "step_s": times})
        )
    bps.shutdown()


if __name__ == "__main__":
    main()
