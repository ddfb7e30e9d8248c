"""Fused optimizer steps (tagps.kernels.*_step) and tagps.optim against torch.optim.

Parity is measured over 20 steps on a small model (parameters of 1003, 7, 1 and 33x5 elements) as the
relative error of the whole parameter vector, ||p - p_torch|| / ||p_torch|| <= 1e-6 (per tensor it is
noise-dominated: a lone element in an ill-conditioned case, e.g. centered RMSprop, drifts ~1e-5 from
float64 in torch itself), and against a float64 run of torch.optim: our error must stay within torch's
own float32 error.
Bitwise equality with torch is not reachable for Adam/RMSprop: torch's CPU sqrt on float32 is not
correctly rounded (1 ulp off the exact result in ~17% of elements), ours is. SGD has no square root
and matches torch bit for bit. float64 steps match torch to 1e-14 (SGD bit for bit).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from tagps import _core, optim
from tagps import kernels as K
from tagps.config import kernel_config

MODES = ["scalar", pytest.param("avx2", marks=pytest.mark.skipif(not _core.cpu_has_avx2(), reason="no AVX2"))]
SHAPES = [(1003,), (7,), (1,), (33, 5)]


@pytest.fixture(autouse=True)
def _restore_kernel_settings():
    """Leave the SIMD mode as TAGPS_SIMD set it."""
    yield
    K.set_simd_mode(kernel_config().simd)


@pytest.fixture(params=MODES)
def simd(request: pytest.FixtureRequest) -> str:
    K.set_simd_mode(request.param)
    return request.param


def _combos(**options: list[Any]) -> list[dict[str, Any]]:
    keys = list(options)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*options.values())]


SGD_CASES = [
    c for c in _combos(lr=[0.05], momentum=[0.0, 0.9], dampening=[0.0, 0.3], nesterov=[False, True],
                       weight_decay=[0.0, 0.1], maximize=[False, True])
    if not (c["nesterov"] and (c["momentum"] == 0 or c["dampening"] != 0))
]
ADAM_CASES = _combos(lr=[0.01], betas=[(0.9, 0.999), (0.3, 0.6)], weight_decay=[0.0, 0.1],
                     amsgrad=[False, True], maximize=[False, True])
ADAMW_CASES = _combos(lr=[0.01], weight_decay=[0.0, 0.1], amsgrad=[False, True], maximize=[False, True])
RMSPROP_CASES = _combos(lr=[0.01], alpha=[0.99, 0.3], weight_decay=[0.0, 0.1], momentum=[0.0, 0.9],
                        centered=[False, True], maximize=[False, True])
CASES = (
    [(torch.optim.SGD, optim.SGD, c) for c in SGD_CASES]
    + [(torch.optim.Adam, optim.Adam, c) for c in ADAM_CASES]
    + [(torch.optim.AdamW, optim.AdamW, c) for c in ADAMW_CASES]
    + [(torch.optim.RMSprop, optim.RMSprop, c) for c in RMSPROP_CASES]
)


def _case_id(case: tuple[type, type, dict[str, Any]]) -> str:
    return case[1].__name__ + "-" + "-".join(f"{k}={v}" for k, v in case[2].items() if k != "lr")


def _run(
    optimizer_cls: type,
    options: dict[str, Any],
    init: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], Any]:
    params = [p.to(dtype, copy=True).requires_grad_() for p in init]
    opt = optimizer_cls(params, **options)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.to(dtype, copy=True)
        opt.step()
    return params, opt


def _inputs(shapes: list[tuple[int, ...]], steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in shapes]
    return init, [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def _run_pair(torch_cls: type, tagps_cls: type, options: dict[str, Any], shapes: list[tuple[int, ...]],
              steps: int = 20) -> tuple[list[torch.Tensor], list[torch.Tensor], Any, Any]:
    init, grads = _inputs(shapes, steps)
    ref, opt_ref = _run(torch_cls, options, init, grads)
    ours, opt_ours = _run(tagps_cls, options, init, grads)
    return ref, ours, opt_ref, opt_ours


def _norm(tensors: list[torch.Tensor]) -> float:
    return torch.cat([t.detach().double().flatten() for t in tensors]).norm().item()


def _assert_parity(ref: list[torch.Tensor], ours: list[torch.Tensor], exact: bool = False) -> None:
    if exact:
        for a, b in zip(ref, ours, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        return
    rel = _norm([b - a for a, b in zip(ref, ours, strict=True)]) / _norm(ref)
    assert rel <= 1e-6, f"relative error {rel:.3e} > 1e-6"


def _assert_within_torch_rounding(ref: list[torch.Tensor], ours: list[torch.Tensor],
                                  exact: list[torch.Tensor]) -> None:
    err_torch = _norm([a.double() - x for a, x in zip(ref, exact, strict=True)])
    err_ours = _norm([b.double() - x for b, x in zip(ours, exact, strict=True)])
    assert err_ours <= 2 * err_torch + 1e-7 * _norm(exact), (err_ours, err_torch)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_20_steps_match_torch(simd: str, case: tuple[type, type, dict[str, Any]]) -> None:
    torch_cls, tagps_cls, options = case
    init, grads = _inputs(SHAPES, 20)
    ref, opt_ref = _run(torch_cls, options, init, grads)
    ours, opt_ours = _run(tagps_cls, options, init, grads)
    _assert_parity(ref, ours, exact=tagps_cls is optim.SGD)
    _assert_within_torch_rounding(ref, ours, _run(torch_cls, options, init, grads, torch.float64)[0])
    # Same state names and the same state values.
    for p_ref, p_ours in zip(ref, ours, strict=True):
        s_ref, s_ours = opt_ref.state[p_ref], opt_ours.state[p_ours]
        assert sorted(s_ref) == sorted(s_ours)
        for key, value in s_ref.items():
            assert s_ours[key].dtype == value.dtype, key
            torch.testing.assert_close(s_ours[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("torch_cls,tagps_cls,options", [
    (torch.optim.Adam, optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01}),
    (torch.optim.AdamW, optim.AdamW, {"lr": 0.01}),
    (torch.optim.RMSprop, optim.RMSprop, {"lr": 0.001, "momentum": 0.9, "centered": True}),
    (torch.optim.SGD, optim.SGD, {"lr": 0.01, "momentum": 0.9, "nesterov": True}),
])
def test_large_tensor_on_threads_matches_torch(
    torch_cls: type, tagps_cls: type, options: dict[str, Any]
) -> None:
    ref, ours, _, _ = _run_pair(torch_cls, tagps_cls, options, [(1_000_003,)], steps=3)
    _assert_parity(ref, ours, exact=tagps_cls is optim.SGD)


FLOAT64_CASES = [
    (torch.optim.SGD, optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    (torch.optim.Adam, optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.AdamW, optim.AdamW, {"lr": 0.01, "betas": (0.3, 0.6)}),
    (
        torch.optim.RMSprop,
        optim.RMSprop,
        {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1},
    ),
]


@pytest.mark.parametrize("torch_cls,tagps_cls,options", FLOAT64_CASES)
def test_float64_20_steps_match_torch(
    simd: str, torch_cls: type, tagps_cls: type, options: dict[str, Any]
) -> None:
    init, grads = _inputs(SHAPES, 20)
    ref, _ = _run(torch_cls, options, init, grads, torch.float64)
    ours, _ = _run(tagps_cls, options, init, grads, torch.float64)
    assert all(p.dtype == torch.float64 for p in ours)
    if tagps_cls is optim.SGD:
        _assert_parity(ref, ours, exact=True)
    else:
        rel = _norm([b - a for a, b in zip(ref, ours, strict=True)]) / _norm(ref)
        assert rel <= 1e-14, f"relative error {rel:.3e} > 1e-14"


def test_state_dict_interchangeable_with_torch() -> None:
    """Five steps in tagps, load into torch, five more there == ten steps in torch alone (and back)."""
    for torch_cls, tagps_cls, options in [
        (torch.optim.Adam, optim.Adam, {"lr": 0.01, "amsgrad": True}),
        (torch.optim.RMSprop, optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
        (torch.optim.SGD, optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    ]:
        gen = torch.Generator().manual_seed(1)
        init = torch.randn(101, generator=gen)
        grads = [torch.randn(101, generator=gen) for _ in range(10)]
        alone = init.clone().requires_grad_()
        opt_alone = torch_cls([alone], **options)
        mixed = init.clone().requires_grad_()
        first = tagps_cls([mixed], **options)
        for i, g in enumerate(grads):
            alone.grad = g.clone()
            opt_alone.step()
            mixed.grad = g.clone()
            if i < 5:
                first.step()
            else:
                if i == 5:
                    second = torch_cls([mixed], **options)
                    second.load_state_dict(first.state_dict())
                second.step()
        _assert_parity([alone], [mixed])
        back = tagps_cls([alone], **options)
        back.load_state_dict(opt_alone.state_dict())
        assert sorted(back.state[alone]) == sorted(opt_alone.state[alone])


def test_scalar_and_avx2_bitwise_equal() -> None:
    """The update template issues the same operations on both paths (tails included)."""
    if not _core.cpu_has_avx2():
        pytest.skip("no AVX2")
    for tagps_cls, options in [
        (optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1, "maximize": True}),
        (optim.AdamW, {"lr": 0.01, "betas": (0.3, 0.6)}),
        (optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1}),
        (optim.SGD, {"lr": 0.01, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.1}),
    ]:
        init, grads = _inputs([(1037,), (5,)], 5)
        for dtype in (torch.float32, torch.float64):
            results = []
            for mode in ("scalar", "avx2"):
                K.set_simd_mode(mode)
                results.append(_run(tagps_cls, options, init, grads, dtype)[0])
            for a, b in zip(*results, strict=True):
                assert torch.equal(a, b), (tagps_cls.__name__, dtype)


def test_closure_and_params_without_grad() -> None:
    p = torch.ones(3, requires_grad=True)
    q = torch.ones(3, requires_grad=True)  # never gets a gradient: left alone, no state
    opt = optim.Adam([p, q], lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert torch.all(p < 1) and torch.equal(q, torch.ones(3))
    assert len(opt.state[q]) == 0


# ------------------------------------------------------------------------------------------------ errors


def _with_grad(p: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    p.grad = torch.ones_like(p) if grad is None else grad
    return p


def test_optimizer_rejects_unsupported_params_and_options() -> None:
    with pytest.raises(TypeError, match="runs on CPU tensors; got a parameter on meta"):
        optim.Adam([_with_grad(torch.empty(3, device="meta"))]).step()
    with pytest.raises(TypeError, match="complex"):
        optim.SGD([_with_grad(torch.zeros(3, dtype=torch.complex64))], lr=0.1).step()
    with pytest.raises(TypeError, match=r"float32 or float64 parameters; got torch\.float16"):
        optim.RMSprop([_with_grad(torch.zeros(3, dtype=torch.float16))]).step()
    with pytest.raises(TypeError, match="sparse"):
        optim.SGD([_with_grad(torch.zeros(3), torch.zeros(3).to_sparse())], lr=0.1).step()
    with pytest.raises(ValueError, match="param is not contiguous"):
        optim.SGD([_with_grad(torch.zeros(4, 4).t())], lr=0.1).step()
    for key in ("fused", "capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"does not support {key}=True"):
            optim.Adam([torch.zeros(3)], **{key: True})
    opt = optim.AdamW([torch.zeros(3)])
    with pytest.raises(ValueError, match="does not support fused=True"):
        opt.add_param_group({"params": [torch.zeros(2)], "fused": True})
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own validation is kept
        optim.SGD([torch.zeros(3)], lr=-1.0)


def _f32(n: int = 8) -> np.ndarray:
    return np.zeros(n, np.float32)


def test_step_kernel_errors() -> None:
    p, g = _f32(), np.ones(8, np.float32)
    with pytest.raises(TypeError, match="exp_avg has dtype float64 but param has float32"):
        K.adam_step(p, g, np.zeros(8), _f32(), step=1)
    with pytest.raises(TypeError, match="grad has dtype float16 but param has float32"):
        K.sgd_step(p, np.zeros(8, np.float16), lr=0.1)
    with pytest.raises(TypeError, match="param has dtype int32; the optimizer steps take float32 or float64"):
        K.sgd_step(np.zeros(8, np.int32), np.zeros(8, np.int32), lr=0.1)
    with pytest.raises(ValueError, match="exp_avg_sq has 7 elements but param has 8"):
        K.adam_step(p, g, _f32(), _f32(7), step=1)
    m = _f32()
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        K.adam_step(p, g, m, m, step=1)
    with pytest.raises(ValueError, match="param and grad share memory"):
        K.sgd_step(p, p, lr=0.1)
    with pytest.raises(ValueError, match="amsgrad=True needs a max_exp_avg_sq"):
        K.adam_step(p, g, _f32(), _f32(), step=1, amsgrad=True)
    with pytest.raises(ValueError, match="step is the 1-based step count, got 0"):
        K.adamw_step(p, g, _f32(), _f32(), step=0)
    with pytest.raises(TypeError, match="step must be an int"):
        K.adam_step(p, g, _f32(), _f32(), step=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0, 1\)"):
        K.adam_step(p, g, _f32(), _f32(), step=1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr must be >= 0"):
        K.rmsprop_step(p, g, _f32(), lr=float("nan"))
    with pytest.raises(ValueError, match="momentum > 0 needs a momentum_buffer"):
        K.rmsprop_step(p, g, _f32(), momentum=0.9)
    with pytest.raises(ValueError, match="centered=True needs a grad_avg"):
        K.rmsprop_step(p, g, _f32(), centered=True)
    with pytest.raises(ValueError, match="momentum != 0 needs a momentum_buffer"):
        K.sgd_step(p, g, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        K.sgd_step(p, g, _f32(), lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(TypeError, match="maximize must be a bool"):
        K.sgd_step(p, g, lr=0.1, maximize=1)  # type: ignore[arg-type]
    ro = _f32()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="square_avg is read-only"):
        K.rmsprop_step(p, g, ro)
    g.flags.writeable = False
    K.sgd_step(p, g, lr=0.5)  # a read-only gradient is fine
    np.testing.assert_array_equal(p, np.full(8, -0.5, np.float32))


def test_step_kernels_on_empty_and_offset_buffers(simd: str) -> None:
    K.adam_step(_f32(0), _f32(0), _f32(0), _f32(0), step=1)
    # Four unaligned views into one array, separated by sentinels that must stay untouched.
    base = np.full(41, 7.0, np.float32)
    p, g, m, v = base[1:10], base[11:20], base[21:30], base[31:40]
    p[:] = np.linspace(-1, 1, 9)
    g[:] = np.linspace(2, -3, 9)
    m[:] = 0
    v[:] = 0
    expected = torch.from_numpy(p.copy()).requires_grad_()
    expected.grad = torch.from_numpy(g.copy())
    torch.optim.Adam([expected], lr=0.1).step()
    K.adam_step(p, g, m, v, step=1, lr=0.1)
    np.testing.assert_allclose(p, expected.detach().numpy(), rtol=1e-6, atol=0)
    np.testing.assert_array_equal(base[[0, 10, 20, 30, 40]], np.full(5, 7.0, np.float32))
