"""Worker of the multi-process tests: train replicas under tagps and compare with one-process training.

Run under ``bpslaunch --local W`` with ``--cases FILE`` (a JSON list of cases) and ``--out DIR``; every
rank writes ``DIR/rank<R>.json`` with, per case, the largest absolute difference between its parameters
and those of a model trained in this process on the concatenated global batch (or the error it raised).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tagps.torch as bps
from tagps.config import comm_config


class MLP(nn.Module):
    """Two Linear layers and a data-independent ``prior`` (its gradient is equal on every replica)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 5)
        self.prior = nn.Parameter(torch.linspace(-1.0, 1.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def penalty(self) -> torch.Tensor:
        return 0.1 * (self.prior - 0.5).pow(2).sum()


class CNN(nn.Module):
    """A small convolutional net with a Linear head, and the same ``prior``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.head = nn.Linear(6 * 4 * 4, 5)
        self.prior = nn.Parameter(torch.linspace(-1.0, 1.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.max_pool2d(torch.tanh(self.conv(x)), 2)
        return self.head(h.flatten(1))

    def penalty(self) -> torch.Tensor:
        return 0.1 * (self.prior - 0.5).pow(2).sum()


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MLP() if kind == "mlp" else CNN()


def batch(kind: str, step: int, rows: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``offset .. offset+rows`` of the global batch of ``step`` (the same on every worker)."""
    g = torch.Generator().manual_seed(1000 + step)
    shape = (64, 12) if kind == "mlp" else (64, 3, 8, 8)
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, 5, (64,), generator=g)
    return x[offset : offset + rows], y[offset : offset + rows]


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def train(case: dict[str, Any], distributed: bool, progress: dict[str, int]) -> nn.Module:
    shares: list[int] = case.get("shares") or [4] * bps.size()
    bpps: int = case.get("bpps", 1)
    skewed = distributed and case.get("skew_init", False)
    model = make_model(case["model"], seed=7 + (bps.rank() if skewed else 0))
    opt = make_optimizer(case["optimizer"], model)
    if distributed:
        if case.get("skew_init"):
            bps.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = bps.DistributedOptimizer(
            opt,
            named_parameters=model.named_parameters(),
            strategy=case.get("plan", case.get("strategy")),
            compression=getattr(bps.Compression, case.get("compression", "none")),
            backward_passes_per_step=bpps,
            # A plan carries its own batch shares; otherwise every worker states its share.
            batch_share=float(shares[bps.rank()]) if case.get("shares") and not case.get("plan") else None,
        )
    loss_fn = nn.CrossEntropyLoss()
    for step in range(case.get("steps", 5)):
        opt.zero_grad()
        for micro in range(bpps):
            s = step * bpps + micro
            if distributed:
                x, y = batch(case["model"], s, shares[bps.rank()], sum(shares[: bps.rank()]))
            else:
                x, y = batch(case["model"], s, sum(shares), 0)
            loss = (loss_fn(model(x), y) + model.penalty()) / bpps
            loss.backward()
        opt.step()
        progress["steps_done"] = step + 1
    return model


def push_pull_sizes() -> float:
    """push_pull (copy, in place, async with poll) of distinct values per rank; return the worst error."""
    worst = 0.0
    weight = float(bps.rank() + 1)
    total = sum(r + 1 for r in range(bps.size()))
    for dtype in (torch.float32, torch.float64):
        for n in (0, 1, 7, 8, 1023, 1 << 20):
            base = torch.arange(n, dtype=dtype) % 1000 - 500
            mine = base * weight
            expect = base * total
            got_copy = bps.push_pull(mine, average=False, name=f"sizes.{dtype}.{n}")
            assert torch.equal(mine, base * weight), "push_pull must not change its argument"
            handle = bps.push_pull_async_inplace(mine, average=True, name=f"sizes.inplace.{dtype}.{n}")
            while not bps.poll(handle):
                pass
            bps.synchronize(handle)
            worst = max(
                worst,
                float((got_copy - expect).abs().max()) if n else 0.0,
                float((mine - expect / bps.size()).abs().max()) if n else 0.0,
            )
    return worst


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    if case.get("kind") == "push_pull":
        return {"max_abs_diff": push_pull_sizes()}
    if case.get("kind") == "skip":  # only local rank 0 joins: its wait must time out with a clear error
        if bps.local_rank() != 0:
            # Enter the next collective late enough that its own timeout outlasts local rank 0's wait.
            time.sleep(comm_config().dist_timeout_s / 2)
            return {"skipped": True}
        try:
            bps.push_pull(torch.ones(4), name="joined-by-local-rank-0-only")
        except RuntimeError as exc:
            return {"error": str(exc)}
        return {"error": ""}
    progress = {"steps_done": 0}
    try:
        dist_model = train(case, distributed=True, progress=progress)
    except Exception as exc:  # reported to the test, which decides whether it was expected
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(), **progress}
    ref_model = train(case, distributed=False, progress={})
    ref = dict(ref_model.named_parameters())
    diff = max(float((p.detach() - ref[n].detach()).abs().max()) for n, p in dist_model.named_parameters())
    return {"max_abs_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    bps.init()
    cases = json.loads(Path(args.cases).read_text())
    results = {c["id"]: run_case(c) for c in cases}
    bps.barrier()
    Path(args.out, f"rank{bps.rank()}.json").write_text(json.dumps(results))
    bps.shutdown()


if __name__ == "__main__":
    main()
