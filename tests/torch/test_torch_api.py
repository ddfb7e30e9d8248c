"""The torch adapter's API in a job of one process: arguments, errors, the optimizer protocol."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import tagps
import tagps.torch as bps
from tagps.comm.local_reduce import shard_bounds
from tagps.comm.sufficient_factors import SFBNotApplicable
from tagps.config import ConfigError, comm_config
from tagps.torch.strategy import resolve_strategy


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _backward(model: nn.Module) -> None:
    model(torch.randn(5, 4)).pow(2).sum().backward()


def test_world_of_one_layout(world_of_one: None) -> None:
    assert (bps.size(), bps.rank(), bps.local_size(), bps.local_rank()) == (1, 0, 1, 0)
    assert bps.is_initialized()


def test_functions_need_init() -> None:
    assert not bps.is_initialized()
    with pytest.raises(RuntimeError, match=re.escape("call tagps.torch.init")):
        bps.size()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 1023, 1 << 20])
def test_push_pull_variants(world_of_one: None, n: int) -> None:
    x = torch.arange(n, dtype=torch.float32)
    out = bps.push_pull(x, average=False)
    assert out is not x and torch.equal(out, x)
    assert torch.equal(bps.allreduce(x, op=bps.Sum), x)
    h = bps.push_pull_async_inplace(x)
    assert bps.synchronize(h) is x
    assert torch.equal(bps.push_pull(x, compression=bps.Compression.fp16), x.half().float())


def test_unknown_or_reused_handle_raises(world_of_one: None) -> None:
    h = bps.push_pull_async(torch.ones(3))
    assert bps.poll(h)
    bps.synchronize(h)
    with pytest.raises(ValueError, match="unknown handle"):
        bps.synchronize(h)
    with pytest.raises(ValueError, match="unknown handle"):
        bps.poll(h)


def test_push_pull_argument_errors(world_of_one: None) -> None:
    # Integers average as in Horovod (truncated toward zero); a world of one divides by 1.
    assert torch.equal(bps.push_pull(torch.ones(3, dtype=torch.int64)), torch.ones(3).long())
    assert torch.equal(bps.push_pull(torch.ones(3, dtype=torch.int64), average=False), torch.ones(3).long())
    with pytest.raises(TypeError, match=re.escape("expected a torch.Tensor")):
        bps.push_pull([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="op parameter supersedes average"):
        bps.allreduce(torch.ones(1), average=True, op=bps.Sum)
    with pytest.raises(ValueError, match="tagps has no Adasum"):
        bps.allreduce(torch.ones(1), op=bps.Adasum)


def test_broadcast_and_gather_helpers(world_of_one: None) -> None:
    t = torch.randn(3, 2)
    assert torch.equal(bps.broadcast(t, root_rank=0), t)
    assert torch.equal(bps.allgather(t), t)
    assert bps.broadcast_object({"a": 1}) == {"a": 1}
    assert bps.allgather_object({"a": 1}) == [{"a": 1}]
    assert bps.gloo_built() and not bps.mpi_built() and not bps.mpi_threads_supported()
    with pytest.raises(ValueError, match=re.escape("root_rank must be a (global) rank of")):
        bps.broadcast_(t, root_rank=1)
    bps.barrier()


@pytest.mark.parametrize("compressor", [bps.Compression.fp16, bps.Compression.bf16])
def test_compression_round_trip(compressor: type[bps.Compression.none]) -> None:
    x = torch.randn(1000, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    wire, ctx = compressor.compress(x)
    assert wire.dtype == compressor.wire
    back = compressor.decompress(wire, ctx)
    assert back.dtype == torch.float32
    # Half an ulp: 2**-8 (bf16) or 2**-11 (fp16) relative; fp16 subnormals below 2**-14 are 2**-24 apart.
    rtol, atol = (2.0**-8, 0.0) if compressor is bps.Compression.bf16 else (2.0**-11, 2.0**-25)
    assert torch.allclose(back, x, rtol=rtol, atol=atol)
    ints = torch.arange(5)
    assert compressor.compress(ints)[0] is ints


def test_optimizer_protocol(world_of_one: None) -> None:
    model = _mlp()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _backward(model)
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) was called after backward"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=1"):
        _backward(model)
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05
    opt.zero_grad()
    state = opt.state_dict()
    opt.load_state_dict(state)
    bps.broadcast_optimizer_state(opt, root_rank=0)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    with pytest.raises(RuntimeError, match="add_param_group after wrapping"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})


def test_backward_passes_per_step_accumulates(world_of_one: None) -> None:
    model = _mlp()
    ref = _mlp()
    opt = bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), backward_passes_per_step=2
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(1)
    xs = [torch.randn(5, 4) for _ in range(2)]
    for x in xs:
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)


def test_optimizer_argument_errors(world_of_one: None) -> None:
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=re.escape("must be a torch.optim.Optimizer")):
        bps.DistributedOptimizer(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1"):
        bps.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="op must be Average or Sum"):
        bps.DistributedOptimizer(sgd, op=bps.Adasum)
    with pytest.raises(ValueError, match="missing from named_parameters"):
        bps.DistributedOptimizer(sgd, named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(ValueError, match=re.escape("has the name '0.weight' twice")):
        named = list(model.named_parameters())
        bps.DistributedOptimizer(sgd, named_parameters=[*named, named[0]])
    with pytest.raises(ValueError, match="batch_share must be positive"):
        bps.DistributedOptimizer(sgd, batch_share=0.0)
    with pytest.raises(ValueError, match=re.escape("needs named_parameters=model.named_parameters()")):
        bps.DistributedOptimizer(sgd, strategy={"0.weight": "sfb"})


def test_sfb_refuses_where_it_does_not_apply(world_of_one: None) -> None:
    conv = nn.Conv2d(1, 2, 3)
    with pytest.raises(SFBNotApplicable, match=re.escape("nn.Linear weights only")):
        bps.DistributedOptimizer(
            torch.optim.SGD(conv.parameters(), lr=0.1), conv.named_parameters(), strategy={"weight": "sfb"}
        )
    # MultiheadAttention calls out_proj through F.linear: no module call records its factors.
    mha = nn.MultiheadAttention(8, 2)
    opt = bps.DistributedOptimizer(
        torch.optim.SGD(mha.parameters(), lr=0.1), mha.named_parameters(), strategy={"out_proj.weight": "sfb"}
    )
    x = torch.randn(3, 2, 8)
    with pytest.raises(SFBNotApplicable, match=re.escape("no nn.Linear module call using it")):
        mha(x, x, x)[0].sum().backward()  # the hook starts the sync during backward, and refuses
    del opt


def test_sfb_refuses_tied_weights(world_of_one: None) -> None:
    lin = nn.Linear(4, 4)
    opt = bps.DistributedOptimizer(
        torch.optim.SGD(lin.parameters(), lr=0.1), lin.named_parameters(), strategy={"weight": "sfb"}
    )
    x = torch.randn(5, 4)
    with pytest.raises(SFBNotApplicable, match="tied or shared weights"):
        (lin(x).sum() + (lin.weight @ x.t()).pow(2).sum()).backward()
    del opt


def test_sfb_gradient_is_exact_in_a_world_of_one(world_of_one: None) -> None:
    """Two calls of one layer per forward and two backward passes per step: the factors concatenate."""
    torch.manual_seed(0)
    square, head = nn.Linear(4, 4), nn.Linear(4, 2)
    model = nn.ModuleDict({"square": square, "head": head})
    ref = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    opt = bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        strategy={"default": "sfb"},
        backward_passes_per_step=2,
    )
    for _ in range(2):
        x = torch.randn(6, 4)
        head(torch.tanh(square(torch.tanh(square(x))))).pow(2).sum().backward()
        h = torch.tanh(x @ ref["square.weight"].t() + ref["square.bias"])
        h = torch.tanh(h @ ref["square.weight"].t() + ref["square.bias"])
        (h @ ref["head.weight"].t() + ref["head.bias"]).pow(2).sum().backward()
    opt.synchronize()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n].grad, rtol=1e-5, atol=1e-6), n


def test_resolve_strategy_errors() -> None:
    names = ["fc1.weight", "fc1.bias"]
    with pytest.raises(ValueError, match=re.escape("did you mean 'fc1.weight'")):
        resolve_strategy({"fc1.wieght": "ps"}, names, "allreduce")
    with pytest.raises(
        ValueError, match=r"unknown sync method 'gossip'.*valid methods: allreduce, ps, sfb, none"
    ):
        resolve_strategy({"fc1.weight": "gossip"}, names, "allreduce")
    with pytest.raises(ValueError, match="unknown sync method 'rings'"):
        resolve_strategy({"default": "rings"}, names, "allreduce")
    with pytest.raises(TypeError, match="strategy must be None, a dict"):
        resolve_strategy(42, names, "allreduce")
    plan = resolve_strategy({"fc1.bias": "none", "default": "ps"}, names, "allreduce")
    assert dict(plan.methods) == {"fc1.weight": "ps", "fc1.bias": "none"}
    assert dict(resolve_strategy(None, names, "ps").methods) == {"fc1.weight": "ps", "fc1.bias": "ps"}


def test_resolve_strategy_refuses_general_plans(tmp_path: pytest.TempPathFactory) -> None:
    from tagps.strategy.plan import PLAN_VERSION
    from tagps.strategy.topology import paper_testbed

    topology = paper_testbed()
    shares = dict.fromkeys(topology.devices(), 0)
    shares["v100:0"] = 4
    doc = {
        "version": PLAN_VERSION, "kind": "general", "model": "m", "batch_size": 4,
        "topology": topology.to_dict(),
        "groups": [{"ops": ["fc1"], "placement": ["v100"], "option": "allreduce"}],
        "gradients": {"fc1.weight": {"group": 0, "sync": "allreduce"}}, "batch_shares": shares,
    }  # fmt: skip
    path = tmp_path / "plan.json"  # type: ignore[operator]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="executes data-parallel plans"):
        resolve_strategy(str(path), ["fc1.weight"], "allreduce")


@pytest.mark.parametrize("count", [0, 1, 7, 8, 1023, 1 << 20])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_shards_cover_the_tensor_once(count: int, parts: int) -> None:
    covered = []
    for i in range(parts):
        start, stop = shard_bounds(count, parts, i)
        assert start % 16 == 0 or start == count
        covered += range(start, stop)
    assert covered == list(range(count))


def test_local_topology_config() -> None:
    base = {"BYTEPS_LOCAL_SIZE": "4"}
    assert comm_config(base).local_groups() == ((0, 1, 2, 3),)
    assert comm_config({**base, "BYTEPS_PCIE_SWITCH_SIZE": "2"}).local_groups() == ((0, 1), (2, 3))
    assert comm_config({**base, "TAGPS_LOCAL_TOPOLOGY": "0,3|1,2"}).local_groups() == ((0, 3), (1, 2))
    with pytest.raises(ConfigError, match=r"TAGPS_LOCAL_TOPOLOGY.*exactly once"):
        comm_config({**base, "TAGPS_LOCAL_TOPOLOGY": "0,1|1,2"})
    with pytest.raises(ConfigError, match=re.escape("TAGPS_LOCAL_TOPOLOGY='0,,|' is malformed")):
        comm_config({**base, "TAGPS_LOCAL_TOPOLOGY": "0,,|"})
    with pytest.raises(ConfigError, match="TAGPS_DIST_PORT"):
        from tagps.comm.collectives import init_process_group

        init_process_group(comm_config({"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1"}))


def test_machines_of_different_sizes_number_ranks_machine_major() -> None:
    base = {"DMLC_NUM_WORKER": "3", "TAGPS_MACHINE_SIZES": "1,2,2"}
    layout = ("DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE")
    cfgs = [
        comm_config(base | dict(zip(layout, map(str, (m, r, n)), strict=True)))
        for m, n in enumerate((1, 2, 2))
        for r in range(n)
    ]
    assert [c.rank for c in cfgs] == [0, 1, 2, 3, 4] and {c.size for c in cfgs} == {5}
    assert [cfgs[0].machine_of(r) for r in range(5)] == [0, 1, 1, 2, 2]
    assert [cfgs[0].first_rank(m) for m in range(3)] == [0, 1, 3]
    assert [cfgs[0].local_groups(m) for m in range(3)] == [((0,),), ((0, 1),), ((0, 1),)]
    assert comm_config(base | {"DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_SIZE": "2"}).local_groups() == ((0, 1),)
    for bad, message in (
        ({"TAGPS_MACHINE_SIZES": "1,2"}, "must name 3 machines"),
        ({"BYTEPS_LOCAL_SIZE": "2"}, "gives machine 0 1 processes, but BYTEPS_LOCAL_SIZE=2"),
        ({"TAGPS_MACHINE_SIZES": "1,0,2"}, "at least one worker process"),
        ({"TAGPS_MACHINE_SIZES": "1,x,2"}, "like 1,2,2"),
        ({"TAGPS_LOCAL_TOPOLOGY": "0"}, "cannot hold for machines of different sizes"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            comm_config({**base, **bad})


def test_top_level_distributed_optimizer(world_of_one: None) -> None:
    model = _mlp()
    opt = tagps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    _backward(model)
    opt.step()
    with pytest.raises(TypeError, match="no tagps adapter"):
        tagps.DistributedOptimizer(object())


def test_fusion_units_are_deterministic_runs() -> None:
    from tagps.strategy.plan import CommSettings
    from tagps.torch.buckets import fusion_units

    f32, f64 = torch.float32, torch.float64
    shapes = [(4, f32), (4, f32), (300, f32), (2, f32), (2, f64), (2, f64), (8, f32)]
    ps = [nn.Parameter(torch.zeros(n, dtype=d)) for n, d in shapes]
    method = dict.fromkeys(ps, "allreduce")
    method[ps[3]] = "sfb"
    index = {id(p): i for i, p in enumerate(ps)}
    cut = [[index[id(p)] for p in u] for u in fusion_units(ps, method, CommSettings(fusion_bytes=64))]
    assert cut == [[0, 1], [2], [3], [4, 5], [6]]
    method[ps[1]] = "ps"  # a change of method cuts too
    assert [[index[id(p)] for p in u] for u in fusion_units(ps, method, CommSettings(fusion_bytes=64))] == [
        [0],
        [1],
        [2],
        [3],
        [4, 5],
        [6],
    ]
    unfused = fusion_units(ps, method, CommSettings(fusion_bytes=0))
    assert [[index[id(p)] for p in u] for u in unfused] == [[i] for i in range(7)]
    # DDP's early first bucket: the first unit closes at first_bucket_bytes, the rest at fusion_bytes.
    same = dict.fromkeys(ps[:4], "allreduce")
    cut = fusion_units(ps[:4], same, CommSettings(fusion_bytes=2048, first_bucket_bytes=16))
    assert [[index[id(p)] for p in u] for u in cut] == [[0], [1, 2, 3]]


def _world_plan(comm: dict[str, object], gradients: dict[str, dict[str, object]] | None = None) -> dict:
    """A data-parallel plan for :func:`_mlp` in a world of one (all 4 samples on ``v100:0``)."""
    from tagps.strategy.plan import PLAN_VERSION
    from tagps.strategy.topology import paper_testbed

    topology = paper_testbed()
    shares = dict.fromkeys(topology.devices(), 0)
    shares["v100:0"] = 4
    return {
        "version": PLAN_VERSION, "kind": "data-parallel", "model": "mlp", "batch_size": 4,
        "topology": topology.to_dict(),
        "groups": [{"ops": ["_0", "_1", "_2"], "placement": ["v100"], "option": "allreduce"}],
        "gradients": gradients or {}, "batch_shares": shares, "comm": comm,
    }  # fmt: skip


@pytest.fixture
def started_sums(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the summations the optimizer starts, in order."""
    from tagps.torch import ops

    started: list[str] = []
    real = ops.start_sum

    def record(tensor: torch.Tensor, **kwargs: object) -> object:
        started.append(str(kwargs["name"]))
        return real(tensor, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "start_sum", record)
    return started


@pytest.fixture
def no_env_fusion(monkeypatch: pytest.MonkeyPatch, world_of_one: None) -> Iterator[None]:
    """A world of one started with ``TAGPS_FUSION_BYTES=0`` (every gradient alone without a plan)."""
    bps.shutdown()
    monkeypatch.setenv("TAGPS_FUSION_BYTES", "0")
    bps.init()
    yield


def test_plan_fusion_bytes_takes_precedence_over_the_environment(
    no_env_fusion: None, started_sums: list[str]
) -> None:
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = bps.DistributedOptimizer(sgd, model.named_parameters(), strategy={"default": "allreduce"})
    _backward(model)
    opt.step()
    assert len(started_sums) == 4  # the environment's 0: no fusion
    started_sums.clear()
    del opt
    opt = bps.DistributedOptimizer(
        sgd, model.named_parameters(), strategy=_world_plan({"fusion_bytes": 1 << 20})
    )
    opt.zero_grad()
    _backward(model)
    opt.step()
    assert len(started_sums) == 1  # the plan's 1 MiB bucket holds all four gradients


def test_plan_without_overlap_syncs_after_backward(world_of_one: None, started_sums: list[str]) -> None:
    model, ref = _mlp(), _mlp()
    plan = _world_plan({"overlap": False, "fusion_bytes": 0})
    opt = bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), strategy=plan
    )
    x = torch.randn(5, 4)
    model(x).pow(2).sum().backward()
    assert started_sums == []  # nothing starts during backward
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) was called after backward"):
        opt.zero_grad()
    opt.step()
    assert len(started_sums) == 4
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).pow(2).sum().backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_plan_sfb_ops_beyond_the_owning_linear_are_refused(world_of_one: None) -> None:
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)

    def plan(sfb_ops: list[str]) -> dict:
        return _world_plan({}, {"0.weight": {"group": 0, "sync": "sfb", "sfb_ops": sfb_ops}})

    with pytest.raises(ValueError, match=re.escape("gradient '0.weight' sfb_ops ['_0', '_1']")) as err:
        bps.DistributedOptimizer(sgd, model.named_parameters(), strategy=plan(["_0", "_1"]))
    assert "cannot duplicate ['_1']" in str(err.value)
    for ok in ([], ["_0"]):  # the owning op, or nothing, is what the runtime's SFB does
        opt = bps.DistributedOptimizer(sgd, model.named_parameters(), strategy=plan(ok))
        _backward(model)
        opt.step()
        opt.zero_grad()
        del opt


def test_byteps_declare_suspend_resume(world_of_one: None) -> None:
    bps.declare("fc.weight")
    with pytest.raises(TypeError, match="non-empty tensor name"):
        bps.declare("")
    bps.suspend()
    assert not bps.is_initialized()
    bps.resume(1, 0)
    assert bps.is_initialized() and torch.equal(bps.push_pull(torch.ones(2)), torch.ones(2))
    with pytest.raises(NotImplementedError, match="elastic scaling is not implemented"):
        bps.resume(2, 0)


def test_unnamed_sums_reuse_a_bounded_set_of_keys(world_of_one: None, started_sums: list[str]) -> None:
    x = torch.ones(3)
    for _ in range(500):
        bps.push_pull(x)
        bps.allreduce(x, op=bps.Sum)
        bps.synchronize(bps.allreduce_async_(x, op=bps.Sum))
    assert set(started_sums) == {"noname.float32.3.NoneCompressor.0"}  # not one key per call
    started_sums.clear()
    handles = [bps.push_pull_async(x) for _ in range(3)]  # in flight together: distinct keys
    bps.push_pull(x.double())
    bps.push_pull(x, compression=bps.Compression.fp16)  # what travels differs: another key
    for handle in handles:
        bps.synchronize(handle)
    bps.grouped_allreduce([x, x])
    assert started_sums == [
        "noname.float32.3.NoneCompressor.0",
        "noname.float32.3.NoneCompressor.1",
        "noname.float32.3.NoneCompressor.2",
        "noname.float64.3.NoneCompressor.0",
        "noname.float32.3.FP16Compressor.0",
        "noname.float32.3.NoneCompressor.0",
        "noname.float32.3.NoneCompressor.1",
    ]


@pytest.mark.usefixtures("no_job_layout")
def test_a_workers_kernels_keep_to_torchs_thread_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from tagps import kernels

    before, torch_threads = kernels.num_threads(), torch.get_num_threads()
    monkeypatch.delenv("TAGPS_NUM_THREADS", raising=False)
    try:
        kernels.set_num_threads(0)  # all cores: an idle OpenMP thread would spin on a CPU quota
        torch.set_num_threads(1)
        bps.init()
        bps.shutdown()
        assert kernels.num_threads() == 1
        monkeypatch.setenv("TAGPS_NUM_THREADS", "3")  # said explicitly: init leaves it
        kernels.set_num_threads(3)
        bps.init()
        bps.shutdown()
        assert kernels.num_threads() == 3
    finally:
        kernels.set_num_threads(before)
        torch.set_num_threads(torch_threads)
