"""Simulator calibration: the fits recover known constants, the file round-trips, plans use the constants."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tagps.strategy.calibration import (
    FITTED,
    Calibration,
    CommSample,
    ComputeSample,
    RunSample,
    fit_comm,
    fit_compute,
    fit_runs,
    load_calibration,
    single_device_time,
)
from tagps.strategy.devices import DeviceType
from tagps.strategy.graph import Graph, extract_graph
from tagps.strategy.grouping import group_ops
from tagps.strategy.simulator import Simulator
from tagps.strategy.topology import DeviceGroup, Link, Topology

CAL = Calibration(100e9, 20e9, 0.6, 0.3, 20e-6, 300e-6, 50e-6, 0.8, 0.5)
# CAL after the host-CPU micro-benchmarks: the PS engine's and a push_pull's CPU are measured, not fitted.
MEASURED = dataclasses.replace(CAL, message_overhead_s=15e-6, ps_call_s=200e-6, ps_local_call_s=800e-6)
# The runtimes' CPU constants that the jobs below were "measured" with.
JOB_TRUTH = dataclasses.replace(MEASURED, collective_step_s=200e-6, collective_call_s=300e-6)


def _graph(width: int) -> Graph:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.Linear(width, 10))
    return extract_graph(model, (torch.empty(1, 64, device="meta"),), f"mlp{width}")


def test_fit_comm_recovers_the_ring_model_constants() -> None:
    inter_lat, intra_lat, inter_eff, intra_eff = 400e-6, 30e-6, 0.7, 0.9
    samples = []
    for inter, lat, eff, bw in ((True, inter_lat, inter_eff, 50e6), (False, intra_lat, intra_eff, 2e9)):
        for n in (2, 3):
            for size in (1 << 16, 1 << 20, 1 << 23):
                t = 2 * (n - 1) / n * size / (eff * bw) + 2 * (n - 1) * lat
                samples.append(CommSample(size, n, bw, inter, t))
    got = fit_comm(samples)
    assert got[:4] == pytest.approx((inter_lat, intra_lat, inter_eff, intra_eff), rel=1e-6)
    assert got[4] == pytest.approx(0.0, abs=1e-9)


def test_fit_comm_without_inter_samples_reuses_the_intra_constants() -> None:
    samples = [CommSample(s, 2, 1e9, False, s / 0.5e9 + 2 * 1e-4) for s in (1 << 16, 1 << 22)]
    inter_lat, intra_lat, inter_eff, intra_eff, _ = fit_comm(samples)
    assert (inter_lat, inter_eff) == pytest.approx((intra_lat, intra_eff))
    assert intra_eff == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([CommSample(1, 2, 1.0, True, 1.0)], "at least 2"),
        ([CommSample(1, 1, 1.0, True, 1.0)] * 2, "n >= 2"),
    ],
)
def test_fit_comm_rejects_bad_samples(samples: list[CommSample], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fit_comm(samples)


def test_fit_compute_recovers_simulated_steps() -> None:
    truth = DeviceType("CPU", 100e9, 1 << 34, 20e9, 0.55, 0.25, 30e-6)
    samples = [
        ComputeSample(f"w{w}@{b}", g, b, "adam", single_device_time(g, b, "adam", truth))
        for w in (32, 256, 1024)
        for g in [_graph(w)]
        for b in (1, 8, 64)
    ]
    eff, mem_eff, overhead, error = fit_compute(samples, truth.peak_flops, truth.memory_bandwidth)
    assert error < 0.01
    assert (eff, mem_eff) == pytest.approx((0.55, 0.25), rel=0.05)
    assert overhead == pytest.approx(30e-6, rel=0.1)
    with pytest.raises(ValueError, match="at least 3"):
        fit_compute(samples[:2], 1e9, 1e9)


def test_calibration_file_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    CAL.save(path)
    assert load_calibration(path) == CAL
    with pytest.raises(ValueError, match="does not exist"):
        load_calibration(tmp_path / "none.json")
    data = CAL.to_dict()
    with pytest.raises(ValueError, match="version"):
        Calibration.from_dict({**data, "version": 99})
    with pytest.raises(ValueError, match="unknown keys \\['speed'\\]"):
        Calibration.from_dict({**data, "speed": 1})
    with pytest.raises(ValueError, match=r"efficiency \(.*\) must be in its physical range \[0\.05, 1\]"):
        dataclasses.replace(CAL, efficiency=1.5)
    with pytest.raises(ValueError, match="core_flops must be a positive"):
        dataclasses.replace(CAL, core_flops=0)
    with pytest.raises(ValueError, match=r"op_overhead_s .* physical range \[5e-07, 0\.001\] s"):
        dataclasses.replace(CAL, op_overhead_s=-1.0)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_calibration(bad_json)


def test_an_old_file_with_an_unphysical_constant_is_refused_by_name(tmp_path: Path) -> None:
    # What version 1 files could hold before the ranges: a latency of 0 and an efficiency of 0.05.
    old = {**CAL.to_dict(), "inter_latency_s": 0.0, "intra_bandwidth_efficiency": 0.05}
    del old["at_bound"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"old\.json.*inter_latency_s .* physical range .*refit with"):
        load_calibration(path)
    old["inter_latency_s"] = CAL.inter_latency_s
    old["intra_bandwidth_efficiency"] = CAL.intra_bandwidth_efficiency
    path.write_text(json.dumps(old))
    assert load_calibration(path) == CAL  # files without ``at_bound`` still load


def test_every_fitted_constant_has_a_meaning_and_a_physical_range() -> None:
    assert set(FITTED) == {
        "efficiency", "memory_efficiency", "op_overhead_s", "inter_latency_s", "intra_latency_s",
        "inter_bandwidth_efficiency", "intra_bandwidth_efficiency",
    }  # fmt: skip
    for name, rng in FITTED.items():
        assert rng.meaning and 0 <= rng.low < rng.high, name
        assert rng.unit == ("s" if name.endswith("_s") else "")
    assert CAL.at_bound == ()


def test_a_fit_forced_onto_a_bound_is_reported(tmp_path: Path) -> None:
    # All-reduces faster than the measured goodput allows and with no latency at all: the ring model
    # needs an efficiency above 1 and a latency below any TCP message.
    samples = [CommSample(s, 2, 1e8, inter, s / 2e8) for s in (1 << 16, 1 << 22) for inter in (True, False)]
    inter_lat, intra_lat, inter_eff, intra_eff, _ = fit_comm(samples)
    assert (inter_eff, intra_eff) == (1.0, 1.0)
    assert (inter_lat, intra_lat) == (FITTED["inter_latency_s"].low, FITTED["intra_latency_s"].low)
    cal = dataclasses.replace(
        CAL, inter_latency_s=inter_lat, intra_latency_s=intra_lat,
        inter_bandwidth_efficiency=inter_eff, intra_bandwidth_efficiency=intra_eff,
    )  # fmt: skip
    bounded = [n for n in FITTED if "latency" in n or "bandwidth" in n]
    assert len(bounded) == 4 and list(cal.at_bound) == bounded
    assert cal.to_dict()["at_bound"] == bounded
    warnings = cal.bound_warnings()
    assert len(warnings) == 4 and all(w.startswith("WARNING: ") for w in warnings)
    assert "inter_latency_s" in warnings[0] and "lower end" in warnings[0]
    assert "upper end" in warnings[2]
    path = tmp_path / "cal.json"
    cal.save(path)
    assert json.loads(path.read_text())["at_bound"] == bounded
    assert load_calibration(path).at_bound == cal.at_bound


def test_a_compute_fit_forced_onto_a_bound_is_reported() -> None:
    # Steps three times faster than a roofline at full efficiency: no efficiency <= 1 explains them.
    truth = DeviceType("CPU", 100e9, 1 << 34, 20e9, 1.0, 1.0, 1e-6)
    samples = [
        ComputeSample(f"w{w}@{b}", g, b, "adam", single_device_time(g, b, "adam", truth) / 3)
        for w in (256, 1024)
        for g in [_graph(w)]
        for b in (8, 64)
    ]
    eff, mem_eff, overhead, _ = fit_compute(samples, truth.peak_flops, truth.memory_bandwidth)
    cal = dataclasses.replace(CAL, efficiency=eff, memory_efficiency=mem_eff, op_overhead_s=overhead)
    assert "efficiency" in cal.at_bound and "memory_efficiency" in cal.at_bound


def _topology() -> Topology:
    groups = (
        DeviceGroup("full", "CPU", 2, 16.0, peak_flops=CAL.core_flops),
        DeviceGroup("half", "CPU", 1, 8.0, peak_flops=CAL.core_flops / 2),
    )
    return Topology("t", groups, 1.0, (Link("full", "half", 0.5),), 1e-6, 1e-6)


def test_a_device_at_half_a_core_takes_twice_as_long() -> None:
    types = CAL.device_types(_topology())
    graph = _graph(128)
    full = single_device_time(graph, 16, "adam", types["full"])
    half = single_device_time(graph, 16, "adam", types["half"])
    assert half == pytest.approx(2 * full, rel=1e-9)


def test_apply_sets_latencies_and_scales_bandwidths() -> None:
    topo = CAL.apply(_topology())
    assert (topo.inter_latency_s, topo.intra_latency_s) == (CAL.inter_latency_s, CAL.intra_latency_s)
    assert topo.bandwidth("full", "half") == pytest.approx(0.5e9 / 8 * CAL.inter_bandwidth_efficiency)
    assert topo.bandwidth("full", "full") == pytest.approx(16e9 / 8 * CAL.intra_bandwidth_efficiency)


def test_calibrated_simulator_predicts_plans_of_the_measured_topology() -> None:
    from tagps.strategy.baselines import dp_nccl

    graph = _graph(256)
    grouping = group_ops(graph, 2)
    measured = _topology()
    plan = dp_nccl(Simulator(graph, grouping, measured), 12)
    sim = CAL.simulator(graph, grouping, measured)
    calibrated = CAL.evaluate(sim, plan)
    slower = dataclasses.replace(CAL, inter_latency_s=5e-3)
    assert slower.evaluate(slower.simulator(graph, grouping, measured), plan) > calibrated > 0


BASELINE_NAMES = ("dp-nccl", "byteps-like")


def _quota_jobs(truth: Calibration, graph: Graph, *, plans_on_measured: bool) -> list[RunSample]:
    """Jobs of ``graph`` on a quota'd two-machine topology, "measured" with ``truth``: the baselines and a's
    two devices alone, each without and with 1 MiB fusion.

    Args:
        truth: the constants the jobs' times are simulated with.
        graph: the model the jobs train.
        plans_on_measured: make the plans on the measured topology, so that they name it as the runtime's
            do; otherwise on ``truth``'s calibrated one.
    """
    from tagps.strategy.baselines import BASELINES, data_parallel_plan
    from tagps.strategy.plan import CommSettings

    grouping = group_ops(graph, 3)
    groups = tuple(
        DeviceGroup(n, "CPU", k, 40.0, peak_flops=100e9 * q) for n, k, q in (("a", 2, 0.5), ("b", 1, 0.25))
    )
    # 10 Gbps links, so that a PS step is bound by the ranks' CPU (the constants fitted) and not the wire.
    topo = Topology("quota", groups, 10.0)
    sim = truth.simulator(graph, grouping, topo)
    planner = Simulator(graph, grouping, topo) if plans_on_measured else sim
    runs = []
    for fusion in (0, 1 << 20):
        comm = CommSettings(True, fusion)
        plans = {
            name: dataclasses.replace(BASELINES[name](planner, 16), comm=comm) for name in BASELINE_NAMES
        }
        # A ring of another size (a's two devices alone), so that steps and calls can be told apart.
        plans["a alone"] = data_parallel_plan(planner, 16, {"a:0": 8, "a:1": 8, "b:0": 0}, comm=comm)
        for name, plan in plans.items():
            runs.append(RunSample(f"{name}/{fusion}", graph, grouping, topo, plan, truth.evaluate(sim, plan)))
    return runs


def test_fit_runs_recovers_the_runtimes_cpu_constants_from_jobs() -> None:
    runs = _quota_jobs(JOB_TRUTH, _graph(256), plans_on_measured=False)
    fitted, error = fit_runs(MEASURED, runs)
    assert error < 1e-3
    assert fitted.collective_step_s == pytest.approx(200e-6, rel=0.05)
    assert fitted.collective_call_s == pytest.approx(300e-6, rel=0.05)
    for name in ("message_overhead_s", "ps_call_s", "ps_local_call_s"):  # measured, not fitted
        assert getattr(fitted, name) == getattr(MEASURED, name)
    assert fitted.at_bound == ()
    with pytest.raises(ValueError, match="at least 4 runs"):
        fit_runs(MEASURED, runs[:3])


def _recorded_jobs(truth: Calibration) -> list[RunSample]:
    """Jobs of registry model mlp-mini, planned on the measured topology as the runtime's are."""
    from tagps.strategy.graph import model_graph

    return _quota_jobs(truth, model_graph("mlp-mini"), plans_on_measured=True)


def test_a_calibration_records_its_jobs_and_refits_on_them_from_the_file(tmp_path: Path) -> None:
    from tagps.strategy.calibration import refit_runs

    fitted, _ = fit_runs(MEASURED, _recorded_jobs(JOB_TRUTH))
    assert [r["name"] for r in fitted.job_runs] == [r.name for r in _recorded_jobs(JOB_TRUTH)]
    path = tmp_path / "cal.json"
    # A model change moved the constants away; the file still holds the jobs they were fitted on.
    moved = {"collective_step_s": 1e-3, "collective_call_s": 2e-6}
    dataclasses.replace(fitted, **moved).save(path)
    loaded = load_calibration(path)
    assert loaded.job_runs == fitted.job_runs
    rebuilt = RunSample.from_dict(loaded.job_runs[0])
    assert rebuilt.plan.to_dict() == fitted.job_runs[0]["plan"]
    assert rebuilt.measured_s == fitted.job_runs[0]["measured_s"]
    refitted = refit_runs(loaded)
    # The calibration's own fit, reproduced from the file: the same constants, the jobs' times again.
    for name in moved:
        assert getattr(refitted, name) == pytest.approx(getattr(fitted, name), rel=1e-6)
    assert refitted.fit_error["jobs"] < 1e-3
    assert refitted.job_runs == loaded.job_runs


def test_refit_refuses_a_calibration_without_recorded_jobs_and_bad_records() -> None:
    from tagps.strategy.calibration import refit_runs

    with pytest.raises(ValueError, match="recorded no job runs"):
        refit_runs(CAL)
    with pytest.raises(ValueError, match="job_runs must be a list"):
        Calibration.from_dict({**CAL.to_dict(), "job_runs": "x"})
    with pytest.raises(ValueError, match="needs name, plan and measured_s"):
        RunSample.from_dict({"name": "x", "measured_s": 1.0})
    record = _recorded_jobs(CAL)[0].to_dict()
    with pytest.raises(ValueError, match="measured_s must be positive"):
        RunSample.from_dict({**record, "measured_s": 0})


def test_refit_cli_refits_the_recorded_jobs_and_refuses_a_file_without_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tagps.calibrate import main

    fitted, _ = fit_runs(MEASURED, _recorded_jobs(JOB_TRUTH))
    src, out = tmp_path / "cal.json", tmp_path / "refit.json"
    dataclasses.replace(fitted, collective_step_s=1e-3).save(src)
    assert main(["--refit", str(src), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "collective_step_s" in printed and f"calibration written to {out}" in printed
    assert load_calibration(out).collective_step_s == pytest.approx(fitted.collective_step_s, rel=1e-6)
    assert load_calibration(src).collective_step_s == 1e-3  # --out: the input is left as it was
    CAL.save(src)
    with pytest.raises(SystemExit) as exc:
        main(["--refit", str(src)])
    assert exc.value.code == 2
    assert "recorded no job runs" in capsys.readouterr().err
