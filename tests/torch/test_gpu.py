"""GPU workers: the backend per device type, device binding, and CUDA tensors through every sync method.

The tests without a mark run everywhere: they check the backend chosen for each ``TAGPS_DIST_BACKEND`` and
the device binding with ``torch.cuda`` monkeypatched. The ``gpu`` tests need CUDA and skip without it; on a
GPU machine (``bench/gpu.sh``) they run real jobs (``bpslaunch --local``) of this file as the worker: each
rank trains a small model on its GPU under tagps and, in the same process, a reference on the global batch,
and reports the largest parameter difference, as ``test_torch_parity.py`` does on CPU.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tagps.torch as bps
from tagps.comm import collectives
from tagps.config import CommConfig, ConfigError, comm_config
from tagps.torch import ops

MIXED = collectives.MIXED_BACKEND
# Splitting the batch changes the order of float sums: on a GPU (TF32 off) that moves parameters by ~1e-6.
TOL = 1e-4
FP16_TOL = 1.3e-3  # as test_torch_parity.py: fp16 rounding of each gradient, five SGD-momentum steps
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no usable GPU here")
NEEDS_2_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL cannot run two ranks on one GPU"
)


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[torch.device]]:
    """Pretend this host has NCCL and 2 GPUs; yield the devices ``set_device`` was called with."""
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(collectives, "_bound", None)  # restored after the test
    yield calls


@pytest.mark.parametrize(
    ("setting", "cuda", "expected"),
    [("auto", False, "gloo"), ("auto", True, MIXED), ("gloo", True, "gloo"), ("gloo", False, "gloo"),
     ("nccl", True, "nccl"), (MIXED, True, MIXED)],
)  # fmt: skip
def test_backend_per_setting(
    monkeypatch: pytest.MonkeyPatch, setting: str, cuda: bool, expected: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    cfg = comm_config({"TAGPS_DIST_BACKEND": setting})
    assert collectives.backend_for(cfg) == expected


@pytest.mark.parametrize("setting", ["nccl", MIXED])
def test_nccl_without_a_gpu_is_refused(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ConfigError, match=f"TAGPS_DIST_BACKEND={setting} needs NCCL and a GPU.*=gloo or auto"
    ):
        collectives.backend_for(CommConfig(dist_backend=setting))


def test_backend_setting_is_checked() -> None:
    assert comm_config({"TAGPS_DIST_BACKEND": " CPU:gloo,CUDA:nccl "}).dist_backend == MIXED
    with pytest.raises(ConfigError, match="TAGPS_DIST_BACKEND='mpi' is malformed"):
        comm_config({"TAGPS_DIST_BACKEND": "mpi"})


@pytest.mark.parametrize("backend", ["auto", "nccl", MIXED])
def test_nccl_binds_the_local_rank_to_its_gpu(fake_gpus: list[torch.device], backend: str) -> None:
    cfg = CommConfig(local_size=2, local_rank=1, dist_backend=backend)
    assert collectives.bind_device(cfg) == torch.device("cuda", 1)
    assert fake_gpus == [torch.device("cuda", 1)]
    assert collectives.bound_device() == torch.device("cuda", 1)


def test_gloo_binds_nothing(fake_gpus: list[torch.device]) -> None:
    """Under gloo ranks may share a GPU, so nothing is bound and three local ranks on two GPUs are fine."""
    assert collectives.bind_device(CommConfig(local_size=3, local_rank=2, dist_backend="gloo")) is None
    assert fake_gpus == []


def test_an_adopted_gloo_group_binds_nothing(fake_gpus: list[torch.device]) -> None:
    """A process group the script created keeps its backend, whatever TAGPS_DIST_BACKEND would pick."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert collectives.bind_device(CommConfig(local_size=3, local_rank=2)) is None
    finally:
        dist.destroy_process_group()
    assert fake_gpus == []


def test_more_local_ranks_than_gpus_under_nccl_is_refused(fake_gpus: list[torch.device]) -> None:
    with pytest.raises(ConfigError, match=r"BYTEPS_LOCAL_SIZE=3 processes share 2 visible GPU.*=gloo"):
        collectives.bind_device(CommConfig(local_size=3, local_rank=0))
    assert fake_gpus == []


def test_init_refuses_too_many_local_ranks_before_the_rendezvous(
    fake_gpus: list[torch.device], monkeypatch: pytest.MonkeyPatch
) -> None:
    """init() must fail at once: joining the process group would wait for the other local ranks."""
    layout = {"DMLC_NUM_WORKER": "1", "BYTEPS_LOCAL_SIZE": "3", "BYTEPS_LOCAL_RANK": "1",
              "TAGPS_DIST_PORT": "1", "TAGPS_DIST_TIMEOUT": "1"}  # fmt: skip
    for name, value in layout.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="share 2 visible GPU"):
        bps.init()
    assert not bps.is_initialized()


def _fake_cuda_tensor(index: int) -> Any:
    """What the device check reads of a tensor on ``cuda:index`` (no CUDA tensor can exist here)."""
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", index), shape=(3,))


def test_a_tensor_on_another_gpu_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "_bound", torch.device("cuda", 1))
    collectives.check_device(_fake_cuda_tensor(1), "'fc.weight'")
    collectives.check_device(torch.ones(3), "'cpu metric'")  # CPU tensors go through gloo
    with pytest.raises(
        ValueError, match=r"'fc.weight' is on cuda:0, but .* bound to cuda:1.*\.to\('cuda:1'\)"
    ):
        collectives.check_device(_fake_cuda_tensor(0), "'fc.weight'")
    with pytest.raises(ValueError, match=r"the \(3,\) tensor to all-reduce is on cuda:0"):
        collectives.all_reduce_async(_fake_cuda_tensor(0))


def test_ps_refuses_a_tensor_on_another_gpu_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "BYTEPS_LOCAL_SIZE", "BYTEPS_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    st = ops.init()
    try:
        monkeypatch.setattr(collectives, "_bound", torch.device("cuda", 1))
        with pytest.raises(ValueError, match=r"'layer.grad' is on cuda:0, but .* bound to cuda:1"):
            st.ps_service().push_pull_async("layer.grad", _fake_cuda_tensor(0))
    finally:
        monkeypatch.undo()  # first, so that shutdown() leaves no device bound for the next test
        ops.shutdown()


# ------------------------------------------------------------------------------------------ GPU jobs
def _cases(model: str, methods: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    return [
        {"id": f"{model}-{m}-{opt}", "model": model, "optimizer": opt, "strategy": s}
        for m, s in methods.items()
        for opt in ("sgd", "adam")
    ]


ALLREDUCE_SFB = {
    "allreduce": {"prior": "none", "default": "allreduce"},
    "sfb": {"head.weight": "sfb", "head.bias": "sfb", "prior": "none", "default": "allreduce"},
}
WITH_PS = {
    **ALLREDUCE_SFB,
    "ps": {"prior": "none", "default": "ps"},
    "mix": {"head.weight": "sfb", "conv.bias": "allreduce", "prior": "none", "default": "ps"},
}
FP16_PS = {"id": "cnn-ps-fp16", "model": "cnn", "optimizer": "sgd", "compression": "fp16",
           "strategy": {"prior": "none", "default": "ps"}}  # fmt: skip
# (launcher layout, environment, cases) of every GPU job; all fit one GPU but "nccl-2gpu".
JOBS: dict[str, tuple[dict[str, int], dict[str, str], list[dict[str, Any]]]] = {
    # One worker, the default backend (cpu:gloo,cuda:nccl) and a server: the CUDA staging path.
    "nccl-1w": ({"workers": 1, "servers": 1}, {}, [*_cases("cnn", WITH_PS), FP16_PS]),
    # Two workers sharing the GPU under gloo: CUDA tensors through gloo and through the server.
    "gloo-2w": ({"workers": 2, "servers": 1}, {"TAGPS_DIST_BACKEND": "gloo"},
                [*_cases("cnn", WITH_PS), FP16_PS]),
    # One machine, two local ranks sharing the GPU under gloo: staged tensors meet in shared memory.
    "gloo-2local": ({"workers": 1, "servers": 1, "local_size": 2}, {"TAGPS_DIST_BACKEND": "gloo"},
                    _cases("cnn", {"ps": WITH_PS["ps"]})),
    # Horovod on a GPU host: a CPU metric reduces through gloo, CUDA tensors through the servers.
    "mixed-cpu-metric": ({"workers": 2, "servers": 1}, {}, [{"id": "cpu-metric", "kind": "metric"}]),
    # Two GPUs in one switch group: NCCL reduce and broadcast around the leaders' host sum.
    "nccl-2gpu": ({"workers": 1, "servers": 1, "local_size": 2}, {"BYTEPS_PCIE_SWITCH_SIZE": "2"},
                  [*_cases("cnn", WITH_PS), FP16_PS]),
}  # fmt: skip


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run each job once, on first use; map job name to every rank's results."""
    import bpslaunch_job

    done: dict[str, Any] = {}

    def run(job: str) -> list[dict[str, Any]]:
        if job not in done:
            layout, env, cases = JOBS[job]
            # The shared launcher helper, with this file as the worker.
            done[job] = bpslaunch_job.run_job(
                Path(__file__), tmp_path_factory.mktemp(job), cases, env=env, timeout=240, **layout
            )
        return done[job]

    return {"run": run}


def _check(results: list[dict[str, Any]], case_id: str) -> None:
    tol = FP16_TOL if "fp16" in case_id else TOL
    for rank, by_case in enumerate(results):
        got = by_case[case_id]
        assert "error" not in got, f"rank {rank}: {got.get('trace', got['error'])}"
        assert got["max_abs_diff"] <= tol, f"rank {rank}: {case_id} differs by {got['max_abs_diff']}"


def _job_params(*jobs: str) -> list[Any]:
    return [
        pytest.param(
            job, case["id"], id=f"{job}-{case['id']}", marks=[NEEDS_2_GPUS] if job == "nccl-2gpu" else []
        )
        for job in jobs
        for case in JOBS[job][2]
    ]


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize(("job", "case_id"), _job_params(*JOBS))
def test_cuda_training_matches_one_process(gpu_results: dict[str, Any], job: str, case_id: str) -> None:
    _check(gpu_results["run"](job), case_id)


@pytest.mark.gpu
@NEEDS_CUDA
def test_init_binds_local_rank_0_to_gpu_0(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "BYTEPS_LOCAL_SIZE", "BYTEPS_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TAGPS_DIST_BACKEND", "auto")
    ops.init()
    try:
        assert collectives.bound_device() == torch.device("cuda", 0)
        assert torch.cuda.current_device() == 0
        assert "nccl" in str(dist.get_backend())
        count = bps.allreduce(torch.tensor([2]), name="cpu.count", op=bps.Sum)  # gloo, not NCCL
        assert count.item() == 2
    finally:
        ops.shutdown()


@pytest.mark.gpu
@NEEDS_CUDA
@NEEDS_2_GPUS
def test_a_real_tensor_on_another_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "BYTEPS_LOCAL_SIZE", "BYTEPS_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ops.init()
    try:
        with pytest.raises(ValueError, match=r"'stray' is on cuda:1, but .* bound to cuda:0"):
            bps.push_pull(torch.ones(4, device="cuda:1"), name="stray")
    finally:
        ops.shutdown()


# --------------------------------------------------------------------------- the worker of the GPU jobs
def _train(case: dict[str, Any], distributed: bool) -> nn.Module:
    """Five steps of the parity worker's model and data on this rank's GPU (the global batch if not
    ``distributed``)."""
    from parity_worker import batch, make_model, make_optimizer

    device = torch.device("cuda", torch.cuda.current_device())
    model = make_model(case["model"], seed=7).to(device)
    opt = make_optimizer(case["optimizer"], model)
    if distributed:
        opt = bps.DistributedOptimizer(
            opt,
            named_parameters=model.named_parameters(),
            strategy=case["strategy"],
            compression=getattr(bps.Compression, case.get("compression", "none")),
        )
    rows, offset = (4, 4 * bps.rank()) if distributed else (4 * bps.size(), 0)
    for step in range(5):
        opt.zero_grad()
        x, y = batch(case["model"], step, rows, offset)
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device)) + model.penalty()
        loss.backward()
        opt.step()
    return model


def _metric() -> float:
    """Horovod's CPU metric on a GPU host, and a CUDA push_pull through the servers; the worst error."""
    # An integer count is not a PS dtype, so it reduces through torch.distributed: gloo for CPU tensors.
    correct = bps.allreduce(torch.tensor([bps.rank() + 1]), name="correct", op=bps.Sum)
    floats = bps.allreduce(torch.tensor([float(bps.rank())]), name="loss", op=bps.Max)
    grad = torch.full((1 << 20,), float(bps.rank() + 1), device="cuda")
    summed = bps.push_pull(grad, average=False, name="cuda.grad")
    total = bps.size() * (bps.size() + 1) / 2
    return max(
        abs(correct.item() - total),
        abs(floats.item() - (bps.size() - 1)),
        float((summed - total).abs().max()),
    )


def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    try:
        if case.get("kind") == "metric":
            return {"max_abs_diff": _metric()}
        mine = dict(_train(case, distributed=True).named_parameters())
    except Exception as exc:  # reported to the test
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    ref = _train(case, distributed=False)
    return {"max_abs_diff": max(float((mine[n] - p).abs().max()) for n, p in ref.named_parameters())}


def _worker() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # cuDNN convolutions default to TF32, whose rounding (1e-3) would hide a wrong sum.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    bps.init()
    if collectives.bound_device() is None:  # gloo: ranks share the GPU of their local rank, if any
        torch.cuda.set_device(bps.local_rank() % torch.cuda.device_count())
    results = {c["id"]: _run_case(c) for c in json.loads(Path(args.cases).read_text())}
    bps.barrier()
    Path(args.out, f"rank{bps.rank()}.json").write_text(json.dumps(results))
    bps.shutdown()


if __name__ == "__main__":
    _worker()
