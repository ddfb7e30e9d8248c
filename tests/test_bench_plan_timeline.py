"""bench/plan_timeline.py: module and optimizer stamps cut into steps, and a plan's job run with them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import plan_timeline  # noqa: E402  (a script of bench/, importable once that folder is on the path)


def test_stamps_cut_into_steps_of_forward_backward_and_apply() -> None:
    def step(t: float) -> list[tuple[str, str, float, float]]:
        # forward 10 ms (4 of CPU), a wait, backward from 20 to 50 ms, the optimizer step 50-55 ms
        return [
            ("0", "f0", t, t / 2),
            ("1", "f1", t + 0.010, t / 2 + 0.004),
            ("1", "b0", t + 0.020, t / 2 + 0.005),
            ("0", "b0", t + 0.030, t / 2 + 0.010),
            ("optimizer", "a0", t + 0.050, t / 2 + 0.020),
            ("optimizer", "a1", t + 0.055, t / 2 + 0.025),
        ]

    events = step(0.0) + step(0.1) + step(0.2)
    cut = plan_timeline.steps(events)
    assert len(cut) == 2  # the first step ends the warm-up: it has no start
    for s in cut:
        assert s["forward"] == pytest.approx((0.010, 0.004))
        assert s["backward"] == pytest.approx((0.030, 0.015))
        assert s["apply"] == pytest.approx((0.005, 0.005))
        assert s["step"] == pytest.approx((0.1, 0.05))
    medians = plan_timeline.medians(cut)
    assert medians["forward"] == pytest.approx({"wall_s": 0.010, "cpu_s": 0.004})
    # A rank that computes no module of its own has only its optimizer step.
    bare = [e for e in events if e[0] == "optimizer"]
    assert set(plan_timeline.medians(plan_timeline.steps(bare))) == {"apply", "step"}


def test_a_model_is_stamped_forward_in_order_and_backward_in_reverse() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    events: list[tuple[str, str, float, float]] = []
    handles = plan_timeline.record(model, events)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
    finally:
        for handle in handles:  # the optimizer hooks are global to the process
            handle.remove()
    one = [(name, kind) for name, kind, _, _ in events[: len(events) // 3]]
    assert one == [
        ("0", "f0"), ("0", "f1"), ("2", "f0"), ("2", "f1"),
        ("2", "b0"), ("0", "b0"), ("optimizer", "a0"), ("optimizer", "a1"),
    ]  # fmt: skip
    walls = [wall for _, _, wall, _ in events]
    assert walls == sorted(walls)
    assert len(plan_timeline.steps(events)) == 2


@pytest.mark.timeout(240)
def test_a_plans_job_runs_stamped_as_local_processes(tmp_path: Path) -> None:
    from tagps.strategy.baselines import dp_nccl
    from tagps.strategy.simulator import Simulator
    from tagps.strategy.topology import DeviceGroup, Topology

    local = Topology("local", (DeviceGroup("local", "CPU", 2, 10.0),), 10.0)
    plan_path, out = tmp_path / "plan.json", tmp_path / "timeline.json"
    dp_nccl(Simulator.for_model("mlp-mini", local, groups=2), 8, "sgd").save(plan_path)
    args = [str(plan_path), "--steps", "2", "--warmup", "1", "--out", str(out)]
    script = str(BENCH / "plan_timeline.py")
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sorted(result["steps"]) == ["rank0", "rank1"]
    for device, per_step in result["steps"].items():
        assert len(per_step) == 2, device
        for phases in per_step:
            assert set(phases) == {"forward", "backward", "apply", "step"}
            assert 0 < phases["forward"][0] < phases["step"][0]
    assert result["cluster"] == {} and result["plan"]["model"] == "mlp-mini"
