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
    ModelTimes,
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


def synthetic(
    graph: Graph, scale: float = 1.0, device_type: str = "CPU", whole: float = 1.0, apply: float | None = None
) -> Profile:
    """A profile whose op i costs (i+1) ms + (i+1)·0.1 ms/sample forward and twice that backward; the whole
    model's passes take ``whole`` times the ops' sum, and an Adam step ``apply`` seconds (None: not timed)."""
    times = {
        b: {op.name: (scale * (i + 1) * (1e-3 + 1e-4 * b), scale * 2 * (i + 1) * (1e-3 + 1e-4 * b))
            for i, op in enumerate(graph.ops)}
        for b in (1, 4, 16)
    }
    passes = ModelTimes(
        tuple(whole * sum(f for f, _ in times[b].values()) for b in (1, 4, 16)),
        tuple(whole * sum(w for _, w in times[b].values()) for b in (1, 4, 16)),
        {} if apply is None else {"adam": apply},
        graph.param_bytes,
    )
    return Profile.from_times(graph, device_type, (1, 4, 16), times, passes, {"device": "test"})


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


def test_op_fits_add_up_to_the_measured_whole_pass(mlp):
    # Ops timed alone add up to less than a pass over the model: each op keeps its share of the whole.
    grouping = grouping_from_names(mlp, [[op.name for op in mlp.ops[:2]], [op.name for op in mlp.ops[2:]]])
    topo = Topology("t", (CPU,), 10.0)
    alone = Simulator(mlp, grouping, topo, profiles={"CPU": synthetic(mlp)})
    slower = Simulator(mlp, grouping, topo, profiles={"CPU": synthetic(mlp, whole=1.5)})
    for batch in (1.0, 4.0, 16.0, 40.0):
        for g in range(2):
            assert slower.group_time(g, 0, batch) == pytest.approx(
                tuple(1.5 * t for t in alone.group_time(g, 0, batch)), rel=1e-6
            )
    whole = synthetic(mlp, whole=1.5).whole
    for b, fwd, bwd in zip((1.0, 4.0, 16.0), whole.fwd_s, whole.bwd_s, strict=True):
        parts = [slower.group_time(g, 0, b) for g in range(2)]
        assert sum(f for f, _ in parts) == pytest.approx(fwd, rel=1e-6)
        assert sum(w for _, w in parts) == pytest.approx(bwd, rel=1e-6)


def test_a_whole_pass_with_a_fixed_cost_the_ops_lack_spreads_it_by_their_slopes():
    from tagps.strategy.profiles import _match_pass

    fits = _match_pass([(0.0, 1e-4), (0.0, 3e-4)], (2e-3, 8e-4))
    assert [x for fit in fits for x in fit] == pytest.approx([5e-4, 2e-4, 1.5e-3, 6e-4])
    assert _match_pass([(0.0, 0.0)], (1e-3, 1e-4)) == [(0.0, 0.0)]  # an op without backward stays free


def test_the_optimizer_step_is_the_profiles_measured_one(mlp):
    grouping, topo = one_group(mlp, CPU)
    roof = Simulator(mlp, grouping, topo, profiles={})
    sim = Simulator(mlp, grouping, topo, profiles={"CPU": synthetic(mlp, apply=0.02)})
    cpu = sim.dtypes[0]
    n = len(mlp.params)
    assert sim.apply_time(mlp.param_bytes, n, cpu, "adam") == pytest.approx(0.02)
    assert sim.apply_time(mlp.param_bytes / 4, 1, cpu, "adam") == pytest.approx(0.005)  # pro rata
    assert sim.apply_time(0, 0, cpu, "adam") == 0.0
    # An optimizer the profile did not time keeps the memory-bound model.
    assert sim.apply_time(mlp.param_bytes, n, cpu, "sgd") == roof.apply_time(mlp.param_bytes, n, cpu, "sgd")
    # On a quota'd quarter of the profiled core, the step takes four times as long, like the ops.
    quota = DeviceGroup("slow", "CPU", 1, 10.0, peak_flops=40e9)
    grouping, topo = one_group(mlp, quota)
    profiles = {"CPU": synthetic(mlp, apply=0.02)}
    shared = Simulator(mlp, grouping, topo, profiles=profiles, cpu_core_flops=160e9)
    assert shared.apply_time(mlp.param_bytes, n, shared.dtypes[0], "adam") == pytest.approx(0.08)


def test_time_model_times_passes_and_every_optimizer():
    from tagps.strategy.plan import OPTIMIZERS
    from tagps.strategy.profiles import time_model

    torch.set_num_threads(1)
    whole = time_model("mlp-mini", (1, 4), repeats=1)
    assert len(whole.fwd_s) == len(whole.bwd_s) == 2 and min(whole.fwd_s + whole.bwd_s) > 0
    assert set(whole.apply_s) == set(OPTIMIZERS) and min(whole.apply_s.values()) > 0
    assert whole.param_bytes == model_graph("mlp-mini").param_bytes


def test_time_model_counts_the_median_pass_not_the_fastest(monkeypatch):
    """Training pays the typical pass: of timed passes taking 3, 1, 2 (forward) and 6, 4, 5 (backward), the
    profile keeps 2 and 5."""
    import itertools

    from tagps.strategy import profiles

    stamps = [0.0, 1.0]  # the warm-up pass reads the clock twice
    t = 10.0
    for f, b in ((3.0, 6.0), (1.0, 4.0), (2.0, 5.0)):
        stamps += [t, t + f, t + f + b]
        t += 100.0
    clock = itertools.chain(stamps, itertools.count(t))  # the optimizer steps come after
    monkeypatch.setattr(profiles, "timing_clock", lambda device: (lambda: None, lambda: float(next(clock))))
    whole = profiles.time_model("mlp-mini", (4,), repeats=3)
    assert whole.fwd_s == (2.0,) and whole.bwd_s == (5.0,)


def test_time_model_times_every_optimizer_step_from_the_initial_weights(monkeypatch):
    """A step that blows the weights up (the summed output is no loss to descend: a few SGD steps on it
    left vgg-mini's weights NaN, where Adam ran 2x faster) must not carry over into the next timed step."""
    import tagps.models
    from tagps.strategy import profiles

    seen = []

    class Diverging:
        def __init__(self, params):
            self.params = list(params)

        def zero_grad(self, set_to_none=True):
            for p in self.params:
                p.grad = None

        def step(self):
            seen.append(all(bool(torch.isfinite(p).all()) for p in self.params))
            with torch.no_grad():
                for p in self.params:
                    p.mul_(1e30)  # inf by the next step, NaN in a pass, unless the weights are restored

    monkeypatch.setattr(tagps.models, "plan_optimizer", lambda name, params: Diverging(params))
    profiles.time_model("mlp-mini", (2,), repeats=3)
    assert len(seen) == 4 * len(profiles.OPTIMIZERS) and all(seen)


def test_a_median_profile_keeps_the_median_of_every_time(mlp):
    from tagps.strategy.profiles import median_profile

    draws = [synthetic(mlp, scale, apply=0.01 * scale) for scale in (1.0, 5.0, 2.0)]
    merged = median_profile(draws)
    middle = draws[2]
    for got, want in zip(merged.ops, middle.ops, strict=True):
        assert got.fwd_s == pytest.approx(want.fwd_s) and got.bwd_s == pytest.approx(want.bwd_s)
        assert got.fwd_fit == pytest.approx(want.fwd_fit)
    assert merged.whole.fwd_s == pytest.approx(middle.whole.fwd_s)
    assert merged.whole.apply_s == pytest.approx({"adam": 0.02})
    assert merged.host["processes"] == "3"
    two_batches = {b: {op.name: (1e-3, 2e-3) for op in mlp.ops} for b in (1, 4)}
    whole = ModelTimes((1e-2, 2e-2), (2e-2, 4e-2), {}, mlp.param_bytes)
    other = Profile.from_times(mlp, "CPU", (1, 4), two_batches, whole)
    with pytest.raises(ValueError, match="does not match"):
        median_profile([draws[0], other])
    with pytest.raises(ValueError, match="at least one"):
        median_profile([])


def test_profiling_in_several_processes_merges_their_profiles(tmp_path, monkeypatch):
    from tagps.strategy.profiles import build_profile

    monkeypatch.setenv("TAGPS_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="processes"):
        build_profile("mlp-mini", processes=0)
    profile = build_profile("mlp-mini", batch_sizes=(1, 2), repeats=1, processes=2)
    assert profile.host["processes"] == "2" and profile.model == "mlp-mini"
    assert min(profile.whole.fwd_s) > 0 and profile.core_flops and profile.core_flops > 0
    assert not list(tmp_path.glob("profile-*.json"))  # each process kept its op times in its own cache


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
    # A profile that measured its core (at 200 GFLOP/s, on a quieter host) is costed against that speed.
    measured = {"CPU": dataclasses.replace(synthetic(mlp), core_flops=200e9)}
    sim = Simulator(mlp, grouping, topo, profiles=measured, cpu_core_flops=160e9)
    assert sim.group_time(0, 1, 4.0) == pytest.approx((5 * fwd, 5 * bwd))
    assert Simulator(mlp, grouping, topo, profiles=measured).compute_sources == {"CPU": "profile + roofline"}
    faster = DeviceGroup("fast", "CPU", 1, 10.0, peak_flops=320e9)
    grouping, topo = one_group(mlp, CPU, faster)
    assert Simulator(mlp, grouping, topo, profiles=profile, cpu_core_flops=160e9).compute_sources == {
        "CPU": "profile + roofline"
    }


def test_a_calibrations_simulator_costs_compute_with_the_profiles_it_is_given(mlp):
    # bench/e2e_cluster.py predicts its runs from the median of the profiles it measured: a calibrated
    # simulator must use the profile passed in (twice as slow here: twice the times), not one it finds.
    from tagps.strategy.calibration import Calibration

    cal = Calibration(160e9, 20e9, 0.6, 0.3, 20e-6, 300e-6, 50e-6, 0.8, 0.5)
    quota = DeviceGroup("slow", "CPU", 1, 10.0, peak_flops=40e9)
    grouping, topo = one_group(mlp, quota)
    fast, slow = synthetic(mlp), synthetic(mlp, scale=2.0)
    sims = [cal.simulator(mlp, grouping, topo, profiles={"CPU": p}) for p in (fast, slow)]
    assert [sim.compute_sources for sim in sims] == [{"CPU": "profile"}] * 2
    (fwd, bwd), (slow_fwd, slow_bwd) = (sim.group_time(0, 0, 4.0) for sim in sims)
    assert (slow_fwd, slow_bwd) == pytest.approx((2 * fwd, 2 * bwd), rel=1e-9)
    assert cal.simulator(mlp, grouping, topo, profiles={}).compute_sources == {"CPU": "roofline"}


def test_a_mismatched_profile_is_an_error_naming_the_op(mlp):
    grouping, topo = one_group(mlp, CPU)
    good = synthetic(mlp)
    missing = dataclasses.replace(good, ops=good.ops[:-1])
    with pytest.raises(ValueError, match=f"op '{mlp.ops[-1].name}' .* is not in the profile"):
        Simulator(mlp, grouping, topo, profiles={"CPU": missing})
    renamed = dataclasses.replace(good.ops[0], name="conv99")
    extra = dataclasses.replace(good, ops=(*good.ops, renamed))
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
    bad_core = {**synthetic(mlp).to_dict(), "core_flops": -1.0}
    path.write_text(json.dumps(bad_core))
    with pytest.raises(ValueError, match=r"core_flops must be a positive number or null, got -1\.0"):
        load_profile(path)
    del data["peak_flops"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing or malformed field 'peak_flops'"):
        load_profile(path)
    data = synthetic(mlp).to_dict()
    data["whole"]["apply_s"] = {"lamb": 1e-3}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"apply_s names unknown optimizers \['lamb'\]"):
        load_profile(path)
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a tagps-op-profile/2 file") as info:
        load_profile(path)
    assert "tagps profile" not in str(info.value)
    path.write_text(json.dumps({"format": "tagps-op-profile/1"}))
    with pytest.raises(ValueError, match=r"an older format: make it again with `tagps profile`"):
        load_profile(path)


def test_a_cached_profile_of_an_older_format_is_passed_over_with_a_warning():
    # An upgrade must not leave every plan failing on what an older tagps cached: the shipped profile serves.
    stale = profile_path("vgg-mini", "CPU")
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"format": "tagps-op-profile/1", "model": "vgg-mini"}))
    with pytest.warns(UserWarning, match=r"older format: ignored; make it again with `tagps profile --model"):
        assert find_profile("vgg-mini", "CPU") == SHIPPED_DIR / "vgg-mini.CPU.json"


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
    assert "whole pass ms" in out and "optimizer step over" in out and "adam" in out
    profile = load_profile(path)
    assert profile.batch_sizes == (1, 2) and profile.device_type == "CPU"
    assert profile.core_flops is not None and 1e9 < profile.core_flops < 1e13
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


def test_cli_profile_reports_a_failed_profiling_process_as_a_failure_not_bad_input(monkeypatch, capsys):
    import tagps.strategy.profiles as profiles

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("profiling mlp-mini in process 2 of 3 failed: Killed")

    monkeypatch.setattr(profiles, "build_profile", fail)
    assert main(["profile", "--model", "mlp-mini", "--processes", "3", "--quiet"]) == 1
    assert "process 2 of 3 failed: Killed" in capsys.readouterr().err


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


def test_a_profile_is_measured_with_the_heap_a_worker_keeps(tmp_path, monkeypatch):
    # tagps.torch.init() keeps freed buffers (tagps.heap); a profile timed with glibc's defaults would
    # count the page faults a worker no longer pays.
    import tagps.calibrate as calibrate
    from tagps.models import build_model, example_inputs
    from tagps.strategy import profiles

    kept: list[str] = []
    monkeypatch.setenv("TAGPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profiles, "keep_freed_buffers", lambda: kept.append("profile"))
    monkeypatch.setattr(calibrate, "keep_freed_buffers", lambda: kept.append("calibration step"))
    profiles.build_profile("mlp-mini", batch_sizes=(1, 2), repeats=1)
    calibrate.profile_step(build_model("mlp-mini"), example_inputs("mlp-mini", 2), steps=1)
    assert kept == ["profile", "calibration step"]
