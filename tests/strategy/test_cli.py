import json

from tagps.cli import main
from tagps.strategy.baselines import dp_nccl, dp_nccl_p
from tagps.strategy.calibration import Calibration
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import paper_testbed


def test_simulate_baseline_with_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    code = main(
        [
            "simulate",
            "--model",
            "vgg19",
            "--topology",
            "paper-testbed",
            "--strategy",
            "dp-nccl",
            "--batch",
            "32",
            "--trace",
            str(trace),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "iteration time" in out and "samples/s" in out
    assert "v100:0" in out and "p100-1:1" in out
    assert json.loads(trace.read_text())["traceEvents"]


def test_simulate_plan_file_matches_the_library(tmp_path, capsys):
    sim = Simulator.for_model("resnet101", paper_testbed())
    plan = dp_nccl_p(sim, 64)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert main(["simulate", "--strategy", str(path)]) == 0
    out = capsys.readouterr().out
    expected = sim.evaluate(plan).iteration_time * 1e3
    assert f"{expected:10.2f} ms" in out


def test_simulate_reports_oom_with_exit_status_1(tmp_path, capsys):
    topo = tmp_path / "tiny.yaml"
    topo.write_text(
        "name: tiny\ninter_bandwidth_gbps: 10\ngroups:\n"
        "  - {name: g, device: T4, count: 2, intra_bandwidth_gbps: 96, memory_bytes: 100000000}\n"
    )
    assert main(["simulate", "--model", "vgg19", "--topology", str(topo), "--strategy", "dp-nccl"]) == 1
    assert "OOM" in capsys.readouterr().out


def test_simulate_errors_are_clear(capsys):
    assert main(["simulate", "--strategy", "dp-nccl"]) == 2
    assert "--model is required" in capsys.readouterr().err
    assert main(["simulate", "--strategy", "no-such-plan.json"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["simulate", "--model", "alexnet"]) == 2
    assert "unknown model 'alexnet'" in capsys.readouterr().err


def test_topology_show(capsys):
    assert main(["topology", "show", "paper-testbed"]) == 0
    out = capsys.readouterr().out
    assert "V100-32GB" in out and "1080Ti" in out and "P100" in out and "100 Gbit/s" in out
    assert main(["topology", "show", "nowhere"]) == 2
    assert "neither a preset" in capsys.readouterr().err


CAL = Calibration(100e9, 20e9, 0.6, 0.3, 20e-6, 300e-6, 50e-6, 0.8, 0.5)


def test_simulate_with_a_calibration(tmp_path, capsys):
    path = tmp_path / "cal.json"
    CAL.save(path)
    base = ["simulate", "--model", "vgg19", "--batch", "32", "--groups", "8", "--strategy"]
    assert main([*base, "dp-nccl", "--calibration", str(path)]) == 0
    out = capsys.readouterr().out
    sim = Simulator.for_model("vgg19", paper_testbed(), 8)
    calibrated = CAL.simulator(sim.graph, sim.grouping, sim.topology)
    expected = calibrated.evaluate(dp_nccl(calibrated, 32)).iteration_time
    assert expected != sim.evaluate(dp_nccl(sim, 32)).iteration_time
    assert f"{expected * 1e3:10.2f} ms" in out and f"calibration {path}" in out
    plan_path = tmp_path / "plan.json"
    dp_nccl(sim, 32).save(plan_path)  # a plan file names the measured topology
    assert main(["simulate", "--strategy", str(plan_path), "--calibration", str(path)]) == 0
    assert f"{expected * 1e3:10.2f} ms" in capsys.readouterr().out


def test_simulate_warns_about_a_calibration_on_a_bound(tmp_path, capsys):
    path = tmp_path / "cal.json"
    Calibration(100e9, 20e9, 1.0, 0.3, 20e-6, 300e-6, 50e-6, 0.8, 0.5).save(path)
    assert main(["simulate", "--model", "vgg19", "--groups", "8", "--calibration", str(path)]) == 0
    err = capsys.readouterr().err
    assert "WARNING: efficiency" in err and "upper end" in err


def test_simulate_calibration_errors_are_clear(tmp_path, capsys):
    base = ["simulate", "--model", "vgg19", "--calibration"]
    assert main([*base, str(tmp_path / "none.json")]) == 2
    assert "none.json' does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "core_flops": 1e9}')
    assert main([*base, str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tagps simulate: calibration file") and "missing keys" in err
