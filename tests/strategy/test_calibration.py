"""Simulator calibration: the fits recover known constants, the file round-trips, plans use the constants."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from tagps.strategy.calibration import (
    Calibration,
    CommSample,
    ComputeSample,
    fit_comm,
    fit_compute,
    load_calibration,
    single_device_time,
)
from tagps.strategy.devices import DeviceType
from tagps.strategy.graph import extract_graph
from tagps.strategy.grouping import group_ops
from tagps.strategy.topology import DeviceGroup, Link, Topology

CAL = Calibration(100e9, 20e9, 0.6, 0.3, 20e-6, 300e-6, 50e-6, 0.8, 0.5)


def _graph(width: int) -> object:
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
    with pytest.raises(ValueError, match="efficiency must be in \\(0, 1\\]"):
        dataclasses.replace(CAL, efficiency=1.5)
    with pytest.raises(ValueError, match="core_flops must be a positive"):
        dataclasses.replace(CAL, core_flops=0)
    with pytest.raises(ValueError, match="op_overhead_s must be in"):
        dataclasses.replace(CAL, op_overhead_s=-1.0)


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
    from tagps.strategy.simulator import Simulator

    graph = _graph(256)
    grouping = group_ops(graph, 2)
    measured = _topology()
    plan = dp_nccl(Simulator(graph, grouping, measured), 12)
    sim = CAL.simulator(graph, grouping, measured)
    calibrated = CAL.evaluate(sim, plan)
    slower = dataclasses.replace(CAL, inter_latency_s=0.1)
    assert slower.evaluate(slower.simulator(graph, grouping, measured), plan) > calibrated > 0
