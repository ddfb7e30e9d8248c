"""`tagps plan` and `tagps show` end to end (in process): plans load, validate and simulate as printed."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tagps.cli import main
from tagps.strategy.calibration import Calibration
from tagps.strategy.plan import load
from tagps.strategy.planner import parse_budget, simulator_for_plan
from tagps.strategy.topology import load_topology

FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn

    def tiny():
        model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 10))
        return model, (torch.randn(1, 512),)

    def broken():
        return nn.Linear(2, 2)
    """
)


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "tagps_test_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "tagps_test_models:tiny"
    sys.modules.pop("tagps_test_models", None)


def test_plan_then_show_a_factory_model(factory: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", factory, "--batch", "16", "--topology", "random:5", "--budget", "40",
                 "--prior", "uniform", "--quiet", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    plan = load(out)
    assert plan.model == factory and plan.batch_size == 16 and plan.predicted is not None
    for needle in ("option", "device type", "AllReduce", "PS", "SFB", "dp-nccl", "dp-nccl-p", "horovod-like",
                   "byteps-like", "predicted iteration time"):
        assert needle in printed
    assert f"{plan.predicted.iteration_time_s * 1e3:.2f} ms" in printed
    sim = simulator_for_plan(plan)
    assert sim.evaluate(plan).iteration_time == pytest.approx(plan.predicted.iteration_time_s)

    png = tmp_path / "pic.png"
    assert main(["show", str(out), "--png", str(png)]) == 0
    shown = capsys.readouterr().out
    assert f"{plan.predicted.iteration_time_s * 1e3:.2f} ms" in shown
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_data_parallel_restriction(factory: str, tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    assert main(["plan", "--model", factory, "--batch", "16", "--topology", "paper-cloud", "--budget", "30",
                 "--prior", "gnn", "--data-parallel", "--quiet", "-o", str(out)]) == 0
    plan = load(out)
    assert plan.kind == "data-parallel"
    assert len({g.placement for g in plan.groups}) == 1


def test_plan_with_a_calibration(factory: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    topology = tmp_path / "cpus.yaml"
    topology.write_text(
        "name: cpus\ninter_bandwidth_gbps: 1\ngroups:\n"
        "  - {name: a, device: CPU, count: 2, intra_bandwidth_gbps: 10, peak_flops: 1.0e+11}\n"
        "  - {name: b, device: CPU, count: 1, intra_bandwidth_gbps: 10, peak_flops: 5.0e+10}\n"
    )
    cal = Calibration(100e9, 20e9, 0.6, 0.3, 20e-6, 300e-6, 50e-6, 0.8, 0.5)
    cal_path = tmp_path / "cal.json"
    cal.save(cal_path)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", factory, "--batch", "16", "--topology", str(topology), "--budget", "20",
                 "--prior", "uniform", "--quiet", "--calibration", str(cal_path), "-o", str(out)]) == 0
    assert f"calibration {cal_path}" in capsys.readouterr().out
    plan = load(out)
    assert plan.topology == load_topology(str(topology))  # the runtime's topology, not the calibrated copy
    sim = simulator_for_plan(plan)
    calibrated = cal.evaluate(cal.simulator(sim.graph, sim.grouping, plan.topology), plan)
    assert calibrated == pytest.approx(plan.predicted.iteration_time_s)
    assert sim.evaluate(plan).iteration_time != pytest.approx(calibrated)
    assert main(["plan", "--model", factory, "--batch", "16", "--quiet", "-o", str(out),
                 "--calibration", str(tmp_path / "none.json")]) == 2
    assert "none.json' does not exist" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["paper-testbed", "paper-cloud", "random:7"])
def test_plan_every_reference_model(preset: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for model in ("vgg19", "resnet101", "inceptionv3", "transformer", "bert-large", "gpt2"):
        out = tmp_path / f"{model}.json"
        assert main(["plan", "--model", model, "--topology", preset, "--budget", "8", "--groups", "16",
                     "--quiet", "-o", str(out)]) == 0, model
        plan = load(out)
        assert plan.predicted is not None and plan.predicted.iteration_time_s > 0
        assert json.loads(out.read_text())["model"] == model
    capsys.readouterr()


def test_plan_errors_are_reported(factory: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = ["plan", "--quiet", "-o", str(tmp_path / "x.json")]
    assert main([*base, "--model", "vgg19", "--budget", "soon"]) == 2
    assert "budget" in capsys.readouterr().err
    assert main([*base, "--model", "no-such-model", "--budget", "5"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main([*base, "--model", factory, "--budget", "5"]) == 2
    assert "--batch is required" in capsys.readouterr().err
    assert main([*base, "--model", "tagps_test_models:broken", "--batch", "4", "--budget", "5"]) == 2
    assert "must return" in capsys.readouterr().err
    assert main([*base, "--model", "vgg19", "--weights", str(tmp_path / "none.pt"), "--budget", "5"]) == 2
    assert "do not exist" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_parse_budget() -> None:
    assert parse_budget("60s").seconds == 60 and parse_budget("60s").iterations is None
    assert parse_budget("2m").seconds == 120
    assert parse_budget("500").iterations == 500 and parse_budget("500it").iterations == 500
    for bad in ("0", "1.5", "-3s", "0s", "fast"):
        with pytest.raises(ValueError):
            parse_budget(bad)
