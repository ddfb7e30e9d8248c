"""Worker of the general-plan tests: train with ``tagps.torch.distribute`` and compare with one process.

Run under ``bpslaunch --local W`` with ``--cases FILE`` (a JSON list of ``{name, model, plan, steps}``) and
``--out DIR``; every rank writes ``DIR/rank<R>.json`` with, per case, the largest absolute difference
between the parameters it holds and those of the same model trained in this process on the global batch with
the same optimizer (or the error it raised, with its type).
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tagps.torch as bps
from tagps.strategy.plan import PlanError


class WideCNN(nn.Module):
    """Convolutions, then a classifier wider than them (VGG's shape, small)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(8 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


class MLP(nn.Module):
    """Linear layers and a learned shift added after fc1 (a batch-independent value crossing op groups)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.shift = nn.Parameter(torch.linspace(-0.5, 0.5, 32))
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x) + self.shift * 2.0)
        return self.fc3(torch.relu(self.fc2(h)))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP()
    if kind == "cnn":
        return WideCNN()
    from tagps.models import build_model

    # eval(): dropout would draw different masks here and in the reference (no other layer cares).
    return build_model(kind).eval()


def global_batch(kind: str, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)
    if kind == "cnn":
        return torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)
    from tagps.models.small import MINI_SEQ, MINI_VOCAB

    ids = torch.randint(0, MINI_VOCAB, (batch, MINI_SEQ), generator=g)
    return ids, torch.randint(0, MINI_VOCAB, (batch, MINI_SEQ), generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    kind, plan, steps = case["model"], case["plan"], case.get("steps", 3)
    batch = plan["batch_size"]
    model = make_model(kind)
    try:
        dmodel = bps.distribute(model, plan, loss_fn)
    except PlanError as exc:
        return {"error": str(exc), "type": "PlanError"}
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = global_batch(kind, batch, step)
        xs, ys = dmodel.shard((x,), y)
        opt.zero_grad()
        losses.append(float(dmodel.train_step(xs, ys)))
        opt.step()
    reference = make_model(kind)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for step in range(steps):
        x, y = global_batch(kind, batch, step)
        ref_opt.zero_grad()
        loss = loss_fn(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(float(loss))
    ref_params = dict(reference.named_parameters())
    held = {id(p) for p in dmodel.parameters()}
    diff = 0.0
    names = []
    for name, p in model.named_parameters():
        if id(p) in held:
            diff = max(diff, float((p.detach() - ref_params[name].detach()).abs().max()))
            names.append(name)
    return {"max_diff": diff, "params": names, "losses": losses, "ref_losses": ref_losses}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bps.init()
    results = {}
    for case in json.loads(Path(args.cases).read_text()):
        try:
            results[case["name"]] = run_case(case)
        except Exception as exc:  # reported per case; the test prints it
            results[case["name"]] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    Path(args.out, f"rank{bps.rank()}.json").write_text(json.dumps(results))
    bps.shutdown()


if __name__ == "__main__":
    main()
