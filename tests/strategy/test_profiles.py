"""Measured op profiles: the fit, the JSON file, the simulator's use of them and `tagps profile`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tagps.cli import main
from tagps.strategy.baselines import dp_nccl
from tagps.strategy.graph import Graph, model_graph
from tagps.strategy.grouping import grouping_from_names
from tagps.strategy.profiles import (
    SHIPPED_DIR,
    Profile,
    find_profile,
    fit_linear,
    load_profile,
    profile_path,
)
from tagps.strategy.simulator import Simulator, summarize
from tagps.strategy.topology import DeviceGroup, Topology


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    """No profile from the user's cache: each test sees only what it writes (and the shipped ones)."""
    monkeypatch.setenv("TAGPS_CACHE_DIR", str(tmp_path / "cache"))


def synthetic(graph: Graph, scale: float = 1.0, device_type: str = "CPU") -> Profile:
    """A profile whose op i costs (i+1) ms + (i+1)·0.1 ms/sample forward and twice that backward."""
    times = {
        b: {op.name: (scale * (i + 1) * (1e-3 + 1e-4 * b), scale * 2 * (i + 1) * (1e-3 + 1e-4 * b))
            for i, op in enumerate(graph.ops)}
        for b in (1, 4, 16)
    }
    return Profile.from_times(graph, device_type, (1, 4, 16), times, {"device": "test"})


def one_group(graph: Graph, *groups: DeviceGroup) -> tuple:
    grouping = grouping_from_names(graph, [[op.name for op in graph.ops]])
    return grouping, Topology("t", groups, 10.0)


CPU = DeviceGroup("cpu", "CPU", 1, 10.0)
SHIPPED = ["vgg-mini", "transformer-mini", "mlp-mini", "convnet-mini", "encoder-mini"]


@pytest.mark.parametrize(
    ("batches", "fwd", "expected"),
    [
        ((1, 8, 32), (3e-3 + 2e-4 * 1, 3e-3 + 2e-4 * 8, 3e-3 + 2e-4 * 32), (3e-3, 2e-4)),  # exactly linear
        ((1, 8, 32), (5e-3, 4e-3, 3e-3), None),  # falling with the batch: c clamps to 0
        ((1, 8), (1e-4, 1.5e-3), None),  # the line through both points has a < 0: a clamps to 0
        ((1, 8, 32), (0.0, 0.0, 0.0), (0.0, 0.0)),  # an op without backward
    ],
)
def test_fit_linear(batches, fwd, expected):
    a, c = fit_linear(batches, fwd)
    assert a >= 0 and c >= 0
    if expected is not None:
        assert (a, c) == pytest.approx(expected, rel=1e-9, abs=1e-15)
    if fwd[0] > fwd[-1]:
        assert c == 0 and 3e-3 < a < 5e-3
    if batches == (1, 8):
        assert a == 0 and 1e-4 <= c <= 1.5e-3 / 8  # between the two points' slopes


def test_fit_linear_needs_two_batch_sizes():
    with pytest.raises(ValueError, match="two distinct batch sizes"):
        fit_linear((8, 8), (1.0, 1.0))


def test_a_profile_replaces_the_roofline(mlp):
    profile = synthetic(mlp)
    grouping, topo = one_group(mlp, CPU)
    sim = Simulator(mlp, grouping, topo, profiles={"CPU": profile})
    roof = Simulator(mlp, grouping, topo, profiles={})
    n = len(mlp.ops)
    expected_fwd = sum((i + 1) * (1e-3 + 1e-4 * 8) for i in range(n))
    fwd, bwd = sim.group_time(0, 0, 8.0)
    assert fwd == pytest.approx(expected_fwd, rel=1e-9)
    assert bwd == pytest.approx(2 * expected_fwd, rel=1e-9)
    assert sim.ops_time(range(n), sim.dtypes[0], 8.0) == pytest.approx((fwd, bwd), rel=1e-12)
    roof_fwd, roof_bwd = roof.group_time(0, 0, 8.0)
    assert abs(roof_fwd - fwd) > 0.1 * fwd and abs(roof_bwd - bwd) > 0.1 * bwd

    plan = dp_nccl(sim, 8)
    result, roof_result = sim.evaluate(plan), roof.evaluate(plan)
    apply = sim.apply_time(mlp.param_bytes, len(mlp.params), sim.dtypes[0], plan.optimizer)
    assert result.iteration_time == pytest.approx(fwd + bwd + apply, rel=1e-9)  # one device: no sync
    assert result.compute == {"CPU": "profile"}
    assert roof_result.compute == {"CPU": "roofline"}
    assert result.iteration_time != pytest.approx(roof_result.iteration_time, rel=0.05)
    assert "CPU: profile" in summarize(result, 8)


def test_the_roofline_is_the_fallback_and_is_reported(mlp):
    profile = synthetic(mlp)
    grouping, topo = one_group(mlp, CPU, DeviceGroup("gpu", "V100-32GB", 2, 100.0))
    sim = Simulator(mlp, grouping, topo, profiles={"CPU": profile})
    assert sim.compute_sources == {"CPU": "profile", "V100-32GB": "roofline"}
    roof = Simulator(mlp, grouping, topo, profiles={})
    assert sim.group_time(0, 1, 4.0) == roof.group_time(0, 1, 4.0)
    assert sim.group_time(0, 0, 4.0) != roof.group_time(0, 0, 4.0)

    # Found by name: no profile of the graph "mlp" exists, so every device type keeps the roofline.
    auto = Simulator(mlp, grouping, topo)
    assert auto.compute_sources == {"CPU": "roofline", "V100-32GB": "roofline"}
    result = auto.evaluate(dp_nccl(auto, 8))
    assert result.compute == auto.compute_sources
    assert "CPU: roofline, V100-32GB: roofline" in summarize(result, 8)


def test_a_device_with_another_peak_keeps_the_roofline(mlp):
    # A CPU under a cgroup quota (a measured cluster) is not the device that was profiled.
    quota = DeviceGroup("slow", "CPU", 1, 10.0, peak_flops=40e9)
    grouping, topo = one_group(mlp, CPU, quota)
    sim = Simulator(mlp, grouping, topo, profiles={"CPU": synthetic(mlp)})
    roof = Simulator(mlp, grouping, topo, profiles={})
    assert sim.compute_sources == {"CPU": "profile + roofline"}
    assert sim.group_time(0, 1, 4.0) == roof.group_time(0, 1, 4.0)


def test_a_quotad_share_of_the_profiled_core_runs_the_profile_slower(mlp):
    # Under a cgroup quota of a quarter of the 160 GFLOP/s core the profile was recorded on, every op (its
    # dispatch included) takes four times as long; a profile does not apply to a CPU faster than the core.
    quota = DeviceGroup("slow", "CPU", 1, 10.0, peak_flops=40e9)
    grouping, topo = one_group(mlp, CPU, quota)
    profile = {"CPU": synthetic(mlp)}
    sim = Simulator(mlp, grouping, topo, profiles=profile, cpu_core_flops=160e9)
    assert sim.compute_sources == {"CPU": "profile"}
    fwd, bwd = sim.group_time(0, 0, 4.0)
    assert sim.group_time(0, 1, 4.0) == pytest.approx((4 * fwd, 4 * bwd))
    faster = DeviceGroup("fast", "CPU", 1, 10.0, peak_flops=320e9)
    grouping, topo = one_group(mlp, CPU, faster)
    assert Simulator(mlp, grouping, topo, profiles=profile, cpu_core_flops=160e9).compute_sources == {
        "CPU": "profile + roofline"
    }


def test_a_mismatched_profile_is_an_error_naming_the_op(mlp):
    grouping, topo = one_group(mlp, CPU)
    good = synthetic(mlp)
    missing = Profile(good.model, "CPU", good.peak_flops, good.batch_sizes, good.ops[:-1], good.host)
    with pytest.raises(ValueError, match=f"op '{mlp.ops[-1].name}' .* is not in the profile"):
        Simulator(mlp, grouping, topo, profiles={"CPU": missing})
    renamed = dataclasses.replace(good.ops[0], name="conv99")
    extra = Profile(good.model, "CPU", good.peak_flops, good.batch_sizes, (*good.ops, renamed), good.host)
    with pytest.raises(ValueError, match="op 'conv99' is not an op of mlp"):
        Simulator(mlp, grouping, topo, profiles={"CPU": extra})
    other = synthetic(model_graph("mlp-mini"))
    with pytest.raises(ValueError, match="is for model 'mlp-mini', not 'mlp'"):
        Simulator(mlp, grouping, topo, profiles={"CPU": other})


def test_a_corrupt_profile_file_is_a_clear_error(tmp_path, mlp):
    grouping, topo = one_group(mlp, CPU)
    path = profile_path("mlp", "CPU")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"profile {path}: not valid JSON"):
        Simulator(mlp, grouping, topo)
    data = synthetic(mlp).to_dict()
    data["ops"][1]["bwd_s"] = [1e-3]  # one time for three batch sizes
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"op '{mlp.ops[1].name}' needs one time per batch size"):
        Simulator(mlp, grouping, topo)
    data = synthetic(mlp).to_dict()
    data["ops"][0]["fwd_fit"] = [-1.0, 0.0]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"op '{mlp.ops[0].name}' has a time that is not a finite number"):
        load_profile(path)
    del data["peak_flops"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing or malformed field 'peak_flops'"):
        load_profile(path)
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a tagps-op-profile/1 file"):
        load_profile(path)


def test_the_json_round_trip_and_the_cache_first(mlp):
    profile = synthetic(mlp)
    path = profile_path("mlp", "CPU")
    profile.save(path)
    assert not list(path.parent.glob("*.partial"))
    loaded = load_profile(path)
    assert loaded == Profile(**{**profile.__dict__, "source": str(path)})
    assert loaded.to_dict() == profile.to_dict()
    assert find_profile("mlp", "CPU") == path
    assert find_profile("mlp", "V100-32GB") is None
    # The cache (what `tagps profile` wrote on this host) wins over a shipped profile.
    profile_path("vgg-mini", "CPU").write_text(path.read_text())
    assert find_profile("vgg-mini", "CPU") == profile_path("vgg-mini", "CPU")
    grouping, topo = one_group(mlp, CPU)
    assert Simulator(mlp, grouping, topo).compute_sources == {"CPU": "profile"}


@pytest.mark.parametrize("model", SHIPPED)
def test_shipped_profiles_match_their_graphs(model):
    path = SHIPPED_DIR / f"{model}.CPU.json"
    profile = load_profile(path)
    graph = model_graph(model)
    fits = profile.coefficients(graph)
    assert len(fits) == len(graph.ops)
    assert profile.device_type == "CPU" and len(profile.batch_sizes) >= 2
    sim = Simulator.for_model(model, Topology("host", (DeviceGroup("host", "CPU", 2, 50.0),), 10.0), groups=4)
    assert sim.compute_sources == {"CPU": "profile"}
    fwd, bwd = sim.ops_time(range(len(graph.ops)), sim.dtypes[0], 8.0)
    assert fwd == pytest.approx(sum(f[0] + 8 * f[1] for f in fits), rel=1e-9)
    assert bwd == pytest.approx(sum(f[2] + 8 * f[3] for f in fits), rel=1e-9)


def test_cli_profile_writes_a_profile_the_simulator_uses(tmp_path, capsys):
    assert main(["profile", "--model", "mlp-mini", "--batches", "1,2", "--repeats", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    path = profile_path("mlp-mini", "CPU")
    assert f"profile written to {path}" in out and "measured ms" in out and "roofline ms" in out
    profile = load_profile(path)
    assert profile.batch_sizes == (1, 2) and profile.device_type == "CPU"
    assert [op.name for op in profile.ops] == [op.name for op in model_graph("mlp-mini").ops]
    assert all(op.fwd_s[0] > 0 for op in profile.ops)

    topo = tmp_path / "host.json"
    topo.write_text(json.dumps(Topology("host", (DeviceGroup("host", "CPU", 2, 50.0),), 10.0).to_dict()))
    assert main(["simulate", "--model", "mlp-mini", "--topology", str(topo), "--groups", "3"]) == 0
    assert "compute          CPU: profile" in capsys.readouterr().out

    other = tmp_path / "elsewhere" / "p.json"
    assert main(["profile", "--model", "mlp-mini", "--batches", "1,2", "--repeats", "1", "--quiet",
                 "--device-type", "T4", "-o", str(other)]) == 0
    assert load_profile(other).device_type == "T4"


def test_cli_profile_errors_are_clear(capsys):
    assert main(["profile", "--model", "nope", "--quiet"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["profile", "--model", "mlp-mini", "--batches", "8", "--quiet"]) == 2
    assert "at least two distinct batch sizes" in capsys.readouterr().err
    assert main(["profile", "--model", "mlp-mini", "--device-type", "TPU", "--quiet"]) == 2
    assert "unknown device type 'TPU'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["profile", "--model", "mlp-mini", "--device", "cuda", "--quiet"]) == 2
        assert "CUDA is not available on this machine" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("gpu", "gib", "expected"),
    [
        ("NVIDIA H200", 139, "H200"),
        ("NVIDIA A100-SXM4-40GB", 40, "A100"),
        ("Tesla V100-SXM2-32GB", 32, "V100-32GB"),
        ("Tesla V100-PCIE-16GB", 16, "V100-16GB"),
        ("NVIDIA L4", 24, None),
    ],
)
def test_local_device_type_names_the_gpu_row(monkeypatch, gpu, gib, expected):
    from types import SimpleNamespace

    from tagps.strategy.profiles import local_device_type

    assert local_device_type("cpu") == "CPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    props = SimpleNamespace(total_memory=gib << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    if expected is None:
        with pytest.raises(ValueError, match=r"'NVIDIA L4' is not in the device table .*--device-type"):
            local_device_type("cuda")
    else:
        assert local_device_type("cuda") == expected
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        local_device_type("tpu")
