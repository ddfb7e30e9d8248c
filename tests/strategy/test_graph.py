import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tagps.models import MODELS, build_model, default_batch_size, example_inputs
from tagps.strategy.graph import Graph, calibrate_device, extract_graph, model_graph, profile_graph
from tagps.strategy.grouping import group_ops, grouping_from_names, split_ops


def _model_flops(model: nn.Module, inputs: tuple) -> tuple[int, int]:
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(*inputs)
    fwd = counter.get_total_flops()
    with counter:
        out.sum().backward()
    return fwd, counter.get_total_flops()


@pytest.mark.parametrize("name", ["resnet101", "transformer"])
def test_per_op_flops_add_up_to_the_whole_model(name):
    with torch.device("meta"):
        model = build_model(name)
    fwd, bwd = _model_flops(model, example_inputs(name, 1, "meta"))
    graph = model_graph(name)
    assert graph.fwd_flops == fwd
    assert sum(op.bwd_flops for op in graph.ops) == bwd


def test_mlp_figures(mlp: Graph):
    fc1, relu, fc2 = mlp.ops
    assert [op.kind for op in mlp.ops] == ["Linear", "ReLU", "Linear"]
    assert fc1.fwd_flops == 2 * 64 * 256
    assert fc1.bwd_flops == 2 * 64 * 256  # weight gradient only: the input needs none
    assert fc2.bwd_flops == 2 * 2 * 256 * 10  # weight and input gradients
    assert fc1.out_bytes == 256 * 4 and fc1.in_bytes == 64 * 4
    assert fc1.params == ("0.weight", "0.bias") and fc1.param_bytes == (64 * 256 + 256) * 4
    assert relu.params == () and relu.fwd_flops == 0
    assert mlp.edges == [(0, 1, 256 * 4), (1, 2, 256 * 4)]
    assert Graph.from_dict(mlp.to_dict()) == mlp


@pytest.mark.parametrize("name", list(MODELS))
def test_reference_models_trace_and_own_every_parameter(name):
    graph = model_graph(name)
    owned = [p for op in graph.ops for p in op.params]
    assert sorted(owned) == sorted(graph.params)
    assert len(owned) == len(set(owned))
    assert graph.fwd_flops > 0
    assert default_batch_size(name) >= 1
    assert all(src < dst for src, dst, _ in graph.edges)  # topological order


def test_parameter_used_through_get_attr_belongs_to_its_consumer():
    class WithPos(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(4, 8))
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x + self.pos)

    graph = extract_graph(WithPos(), (torch.randn(1, 4, 8),), "pos")
    assert [op.params for op in graph.ops] == [("pos",), ("fc.weight", "fc.bias")]


def test_untraceable_model_names_the_module():
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    with pytest.raises(RuntimeError, match="cannot trace branchy: module Branchy failed"):
        extract_graph(Branchy(), (torch.randn(1, 3),), "branchy")
    net = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU(), Branchy()))
    with pytest.raises(RuntimeError, match=r"submodule '1\.1' \(Branchy\) failed"):
        extract_graph(net, (torch.randn(1, 3),), "net")
    with pytest.raises(TypeError, match=r"nn\.Module"):
        extract_graph(lambda x: x, (torch.randn(1),))


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'alexnet'"):
        build_model("alexnet")


@pytest.mark.parametrize("name", ["resnet101", "bert-large", "vgg19"])
@pytest.mark.parametrize("k", [1, 7, 60])
def test_grouping_is_a_deterministic_acyclic_partition(name, k):
    graph = model_graph(name)
    grouping = group_ops(graph, k, seed=3)
    assert grouping == group_ops(graph, k, seed=3)
    assert 1 <= len(grouping) <= k
    flat = sorted(op for g in grouping.groups for op in g)
    assert flat == list(range(len(graph.ops)))  # every op in exactly one group
    assert all(grouping.op_group[s] <= grouping.op_group[d] for s, d, _ in graph.edges)
    assert grouping_from_names(graph, [[graph.ops[i].name for i in g] for g in grouping.groups]) == grouping


def test_grouping_caps_small_graphs_and_rejects_bad_k(mlp):
    assert len(group_ops(mlp, 60)) == 1
    with pytest.raises(ValueError, match="integer >= 1"):
        group_ops(mlp, 0)


def test_grouping_from_names_errors(mlp):
    fc1, relu, fc2 = (op.name for op in mlp.ops)
    with pytest.raises(ValueError, match="not in graph"):
        grouping_from_names(mlp, [[fc1, relu, fc2, "nope"]])
    with pytest.raises(ValueError, match="in no op group"):
        grouping_from_names(mlp, [[fc1]])
    with pytest.raises(ValueError, match="in op groups 0 and 1"):
        grouping_from_names(mlp, [[fc1, relu], [relu, fc2]])
    with pytest.raises(ValueError, match="feeds the earlier op group"):
        grouping_from_names(mlp, [[fc2], [fc1, relu]])


def test_split_ops_for_model_parallelism():
    graph = model_graph("bert-large")
    grouping = group_ops(graph)
    ops = grouping.groups[10]
    parts = split_ops(graph, ops, 4)
    assert 1 <= len(parts) <= 4
    assert sorted(op for p in parts for op in p) == sorted(ops)


def test_profile_graph_is_cached_on_disk_and_calibrates(tmp_path, monkeypatch):
    monkeypatch.setenv("TAGPS_CACHE_DIR", str(tmp_path))
    import tagps.strategy.graph as graph_module

    first = profile_graph("vgg-mini", batch_sizes=(1, 2), repeats=1)
    assert set(first) == {1, 2}
    graph = model_graph("vgg-mini")
    assert list(first[1]) == [op.name for op in graph.ops]
    assert all(fwd > 0 for fwd, _ in first[1].values())
    # every op but the first (whose input needs no gradient) and the flatten view has a backward to time
    assert sum(bwd > 0 for _, bwd in first[1].values()) >= len(graph.ops) - 2

    def no_tracing(*args, **kwargs):
        raise AssertionError("profiled again instead of reading the cache")

    monkeypatch.setattr(graph_module, "_trace", no_tracing)
    assert profile_graph("vgg-mini", batch_sizes=(1, 2), repeats=1) == first
    assert list(tmp_path.glob("profile-vgg-mini-*.json"))
    assert not list(tmp_path.glob("*.partial"))
    fitted = calibrate_device("vgg-mini", batch_sizes=(1, 2), repeats=1)  # from the cached profile
    assert fitted.name == "CPU" and 0 < fitted.efficiency <= 1 and 0 < fitted.memory_efficiency <= 1
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile_graph("vgg-mini", repeats=0)


def test_fit_device_recovers_known_constants():
    import numpy as np

    from tagps.strategy.devices import DEVICE_TYPES, calibrated, fit_device

    truth = calibrated(DEVICE_TYPES["CPU"], efficiency=0.3, memory_efficiency=0.2, op_overhead_s=3e-5)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(300):
        flops, moved = 10 ** rng.uniform(3, 10), 10 ** rng.uniform(3, 9)
        samples.append((flops, moved, truth.op_time(flops, moved)))
    fitted = fit_device(DEVICE_TYPES["CPU"], samples)
    assert fitted.efficiency == pytest.approx(0.3, rel=0.08)
    assert fitted.memory_efficiency == pytest.approx(0.2, rel=0.08)
    assert fitted.op_overhead_s == pytest.approx(3e-5, rel=0.3)
    with pytest.raises(ValueError, match="positive measured time"):
        fit_device(DEVICE_TYPES["CPU"], [(1.0, 1.0, 0.0)])
