"""tagps.kernels: sum_into, scale and cast against numpy/torch references, on both SIMD paths."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tagps import _core
from tagps import kernels as K
from tagps.config import kernel_config

SIZES = [0, 1, 7, 8, 33, 1023, 1_000_003]
MODES = ["scalar", pytest.param("avx2", marks=pytest.mark.skipif(not _core.cpu_has_avx2(), reason="no AVX2"))]
AUTO_MODE = "avx2" if _core.cpu_has_avx2() else "scalar"
NUMPY_DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64]


@pytest.fixture(autouse=True)
def _restore_kernel_settings():
    """Leave the SIMD mode and thread count as TAGPS_SIMD / TAGPS_NUM_THREADS set them."""
    yield
    config = kernel_config()
    K.set_simd_mode(config.simd)
    K.set_num_threads(config.num_threads)


@pytest.fixture(params=MODES)
def simd(request: pytest.FixtureRequest) -> str:
    """Run the test on one SIMD path."""
    K.set_simd_mode(request.param)
    assert K.simd_mode() == request.param
    return request.param


def _random(rng: np.random.Generator, n: int, dtype: type) -> np.ndarray:
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)  # overflow wraps
    return (rng.standard_normal(n) * 50).astype(dtype)


def _sum_reference(dst: np.ndarray, srcs: list[np.ndarray]) -> np.ndarray:
    """numpy's ((dst + s0) + s1) + ...; float16 accumulated in float32 and rounded once."""
    acc = dst.astype(np.float32) if dst.dtype == np.float16 else dst.copy()
    with np.errstate(all="ignore"):  # inf/NaN inputs and overflow are part of the contract
        for s in srcs:
            np.add(acc, s.astype(acc.dtype, copy=False), out=acc)
        return acc.astype(dst.dtype)


def _both_paths(fn, *arrays: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run fn on copies of arrays on the scalar and on the AVX2 path; return both sets of outputs."""
    outs = []
    for mode in ("scalar", "avx2"):
        K.set_simd_mode(mode)
        copies = [a.copy() for a in arrays]
        fn(*copies)
        outs.append(copies)
    return outs[0], outs[1]


# ---------------------------------------------------------------------------------------------- sum_into


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("nsrc", [0, 1, 3, 8])
def test_sum_into_matches_numpy(simd: str, n: int, dtype: type, nsrc: int) -> None:
    rng = np.random.default_rng(n * 31 + nsrc)
    dst = _random(rng, n, dtype)
    srcs = [_random(rng, n, dtype) for _ in range(nsrc)]
    expected = _sum_reference(dst, srcs)
    K.sum_into(dst, *srcs)
    # Same order of additions per element: exact for every dtype.
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize("n", [1, 7, 33, 1_000_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_sum_into_torch_tensors(simd: str, n: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n)
    make = (
        (lambda: torch.randint(-1000, 1000, (n,), generator=gen, dtype=dtype))
        if not dtype.is_floating_point
        else (lambda: (torch.randn(n, generator=gen) * 10).to(dtype))
    )
    dst, srcs = make(), [make() for _ in range(4)]
    acc = dst.float() if dtype in (torch.bfloat16, torch.float16) else dst.clone()
    for s in srcs:
        acc += s.to(acc.dtype)
    K.sum_into(dst, *srcs)
    torch.testing.assert_close(dst, acc.to(dtype), rtol=0, atol=0)


def test_sum_into_bfloat16_numpy_uint16_storage(simd: str) -> None:
    t = torch.randn(1001) * 3
    s = torch.randn(1001) * 3
    dst = t.bfloat16().view(torch.int16).numpy().view(np.uint16).copy()
    src = s.bfloat16().view(torch.int16).numpy().view(np.uint16).copy()
    K.sum_into(dst, src)
    expected = (t.bfloat16().float() + s.bfloat16().float()).bfloat16()
    got = torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_sum_into_offset_views(simd: str, dtype: type) -> None:
    """a[1:]-style views start off any alignment; the vector loop uses unaligned access."""
    rng = np.random.default_rng(7)
    base_dst = _random(rng, 1003, dtype)
    base_srcs = [_random(rng, 1007, dtype) for _ in range(3)]
    first = base_dst[0].copy()
    dst = base_dst[1:]
    srcs = [base_srcs[0][3:1005], base_srcs[1][2:1004], base_srcs[2][5:]]
    expected = _sum_reference(dst, srcs)
    K.sum_into(dst, *srcs)
    np.testing.assert_array_equal(dst, expected)
    assert base_dst[0] == first  # the element before the view is untouched


def test_sum_into_dst_as_source_doubles(simd: str) -> None:
    x = np.arange(100, dtype=np.float32)
    y = np.ones(100, dtype=np.float32)
    K.sum_into(x, x, y)
    np.testing.assert_array_equal(x, 2 * np.arange(100, dtype=np.float32) + 1)


def test_sum_into_threads_give_same_result() -> None:
    rng = np.random.default_rng(3)
    srcs = [rng.standard_normal(1_000_003).astype(np.float32) for _ in range(4)]
    outs = []
    for n in (1, 2, 3):
        K.set_num_threads(n)
        dst = np.zeros(1_000_003, dtype=np.float32)
        K.sum_into(dst, *srcs)
        outs.append(dst)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


floats32 = st.floats(width=32)  # with inf, NaN and subnormals


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data(), st.integers(0, 8))
def test_sum_into_property_matches_numpy_chain(simd: str, data: st.DataObject, nsrc: int) -> None:
    dst = data.draw(hnp.arrays(np.float32, st.integers(0, 300), elements=floats32))
    srcs = [data.draw(hnp.arrays(np.float32, dst.shape, elements=floats32)) for _ in range(nsrc)]
    expected = _sum_reference(dst, srcs)
    K.sum_into(dst, *srcs)
    np.testing.assert_array_equal(dst, expected)


def _assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    """Identical bits, except that a NaN may carry either operand's payload (IEEE 754 leaves it open and
    the compiler may swap the operands of a scalar add), so NaN positions only have to match."""
    floats = a.view(np.float16) if a.dtype == np.uint16 else a
    nan_a, nan_b = np.isnan(floats), np.isnan(b.view(floats.dtype))
    np.testing.assert_array_equal(nan_a, nan_b)
    bits = np.uint32 if a.itemsize == 4 else np.uint16
    np.testing.assert_array_equal(a.view(bits)[~nan_a], b.view(bits)[~nan_b])


@pytest.mark.skipif(not _core.cpu_has_avx2(), reason="no AVX2")
@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["float32", "float16", "bfloat16"]), st.integers(0, 100), st.integers(1, 4),
       st.integers(0, 2**32 - 1))
def test_sum_into_scalar_and_avx2_bitwise_equal(kind: str, n: int, nsrc: int, seed: int) -> None:
    """Arbitrary bit patterns (NaN payloads, inf, subnormals): both paths give identical bits."""
    rng = np.random.default_rng(seed)
    if kind == "float32":
        arrays = [rng.integers(0, 2**32, size=n, dtype=np.uint32).view(np.float32) for _ in range(nsrc + 1)]
    else:
        bits = [rng.integers(0, 2**16, size=n, dtype=np.uint16) for _ in range(nsrc + 1)]
        arrays = [b.view(np.float16) for b in bits] if kind == "float16" else bits
    scalar, avx2 = _both_paths(K.sum_into, *arrays)
    if kind == "bfloat16":  # every NaN rounds to 0x7FC0: fully bitwise
        np.testing.assert_array_equal(scalar[0], avx2[0])
    else:
        _assert_same_bits(scalar[0], avx2[0])


# ------------------------------------------------------------------------------------------------- scale


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_scale_floats(simd: str, n: int, dtype: type) -> None:
    x = _random(np.random.default_rng(n), n, dtype)
    acc = np.float32 if dtype != np.float64 else np.float64
    expected = (x.astype(acc) * acc(0.37)).astype(dtype)
    K.scale(x, 0.37)
    np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_scale_integers_wrap(simd: str, dtype: type) -> None:
    x = _random(np.random.default_rng(1), 1001, dtype)
    expected = x * dtype(-3)
    K.scale(x, -3)
    np.testing.assert_array_equal(x, expected)


def test_scale_bfloat16_tensor(simd: str) -> None:
    t = torch.randn(1001).bfloat16()
    expected = (t.float() * 0.25).bfloat16()
    K.scale(t, 0.25)
    torch.testing.assert_close(t, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ errors


def test_sum_into_errors() -> None:
    a = np.zeros(10, np.float32)
    with pytest.raises(TypeError, match="srcs\\[0\\] has dtype float64 but dst has float32"):
        K.sum_into(a, np.zeros(10, np.float64))
    with pytest.raises(ValueError, match="srcs\\[1\\] has 9 elements but dst has 10"):
        K.sum_into(a, np.zeros(10, np.float32), np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="srcs\\[0\\] is not C-contiguous"):
        K.sum_into(a, np.zeros(20, np.float32)[::2])
    with pytest.raises(ValueError, match="dst is not contiguous"):
        K.sum_into(torch.zeros(4, 4).t(), torch.zeros(16))
    ro = np.zeros(10, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="dst is read-only"):
        K.sum_into(ro, a)
    K.sum_into(a, ro)  # a read-only source is fine
    with pytest.raises(TypeError, match="unsupported dtype complex64"):
        K.sum_into(np.zeros(3, np.complex64), np.zeros(3, np.complex64))
    with pytest.raises(TypeError, match="unsupported dtype uint8"):
        K.sum_into(np.zeros(3, np.uint8))
    with pytest.raises(TypeError, match="must be a numpy array or a CPU torch tensor, got list"):
        K.sum_into(a, [0.0] * 10)
    with pytest.raises(TypeError, match=r"unsupported dtype torch\.complex64"):
        K.sum_into(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="sparse_coo"):
        K.sum_into(torch.zeros(3).to_sparse())
    with pytest.raises(TypeError, match="torch tensor on meta; the kernels work on CPU tensors only"):
        K.sum_into(torch.zeros(3, device="meta"))
    ro_buf = np.zeros(3, np.float32)
    ro_buf.flags.writeable = False
    with pytest.raises(ValueError, match="buf is read-only"):
        K.scale(ro_buf, 2.0)
    with pytest.raises(TypeError, match=r"torch\.uint16"):
        K.sum_into(torch.zeros(3, dtype=torch.uint16))


def test_sum_into_partial_overlap_rejected() -> None:
    base = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match="srcs\\[0\\] partly overlaps dst"):
        K.sum_into(base[0:10], base[5:15])
    K.sum_into(base[0:10], base[10:20])  # adjacent is fine


def test_sum_into_no_sources_still_validates() -> None:
    K.sum_into(np.zeros(3, np.float32))  # no-op
    with pytest.raises(TypeError):
        K.sum_into(np.zeros(3, np.bool_))


def test_scale_errors() -> None:
    with pytest.raises(ValueError, match="not integral"):
        K.scale(np.zeros(3, np.int32), 0.5)
    with pytest.raises(ValueError, match="not integral"):
        K.scale(np.zeros(3, np.int64), float("inf"))
    with pytest.raises(TypeError, match="factor must be a real number"):
        K.scale(np.zeros(3, np.float32), "2")
    with pytest.raises(TypeError, match="factor must be a real number"):
        K.scale(np.zeros(3, np.float32), True)


def test_core_rejects_bad_input_directly() -> None:
    """The bindings guard a direct caller too: typed exceptions, never a crash."""
    a = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="src size"):
        _core.sum_into(a, [np.zeros(4, np.float32)], int(_core.DType.float32))
    with pytest.raises(ValueError, match="element size"):
        _core.sum_into(a, [a], int(_core.DType.float64))
    with pytest.raises(TypeError, match="unknown dtype code 99"):
        _core.sum_into(a, [a], 99)
    assert issubclass(_core.InvalidArgument, ValueError)
    assert issubclass(_core.InvalidType, TypeError)


def test_simd_and_threads_settings() -> None:
    with pytest.raises(ValueError, match="'auto', 'avx2' or 'scalar'"):
        K.set_simd_mode("avx512")
    with pytest.raises(TypeError):
        K.set_simd_mode(2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        K.set_num_threads(-1)
    with pytest.raises(TypeError):
        K.set_num_threads(1.5)  # type: ignore[arg-type]
    K.set_num_threads(3)
    assert K.num_threads() == 3
    K.set_num_threads(0)
    assert K.num_threads() >= 1
    K.set_simd_mode("auto")
    assert K.simd_mode() == AUTO_MODE


# -------------------------------------------------------------------------------------------------- cast


@pytest.mark.parametrize("n", SIZES)
def test_cast_float32_float16_matches_numpy(simd: str, n: int) -> None:
    rng = np.random.default_rng(n)
    # Normal, subnormal (|x| < 6.1e-5), overflowing (> 65504) and exact-tie values.
    src = (rng.standard_normal(n) * rng.choice([1e-6, 1.0, 1e3, 1e5], size=n)).astype(np.float32)
    half = np.empty(n, np.float16)
    K.cast(half, src)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(half.view(np.uint16), src.astype(np.float16).view(np.uint16))
    back = np.empty(n, np.float32)
    K.cast(back, half)
    np.testing.assert_array_equal(back, half.astype(np.float32))


@pytest.mark.parametrize("n", SIZES)
def test_cast_float32_bfloat16_matches_torch(simd: str, n: int) -> None:
    src = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e3
    dst = torch.empty(n, dtype=torch.bfloat16)
    K.cast(dst, src)
    torch.testing.assert_close(dst, src.bfloat16(), rtol=0, atol=0)
    back = torch.empty(n)
    K.cast(back, dst)
    torch.testing.assert_close(back, dst.float(), rtol=0, atol=0)


def test_cast_rounds_ties_to_even(simd: str) -> None:
    # 1 + 2^-11 lies halfway between two float16 values; 1 + 3*2^-11 too: ties go to the even mantissa.
    src = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65519.0, 65520.0, 2**-25, 3 * 2**-25], np.float32)
    half = np.empty(6, np.float16)
    K.cast(half, src)
    np.testing.assert_array_equal(half, np.array([1.0, 1 + 2**-9, 65504.0, np.inf, 0.0, 2**-23], np.float16))
    # bfloat16 ties: 1 + 2^-8 -> 1.0, 1 + 3*2^-8 -> 1 + 2^-6; NaN -> 0x7FC0.
    bsrc = np.array([1 + 2**-8, 1 + 3 * 2**-8, np.nan], np.float32)
    b = np.empty(3, np.uint16)
    K.cast(b, bsrc)
    np.testing.assert_array_equal(b, np.array([0x3F80, 0x3F82, 0x7FC0], np.uint16))


@pytest.mark.skipif(not _core.cpu_has_avx2(), reason="no AVX2")
@pytest.mark.parametrize("pair", ["f32->f16", "f32->bf16", "f16->f32", "bf16->f32"])
def test_cast_scalar_and_avx2_bitwise_equal_on_all_bit_patterns(pair: str) -> None:
    """Every 16-bit pattern and 2^20 random 32-bit ones (NaN payloads, subnormals, inf): identical bits."""
    rng = np.random.default_rng(11)
    if pair.startswith("f32"):
        src = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint32).view(np.float32)
        dst = np.empty(src.size, np.float16 if pair == "f32->f16" else np.uint16)
    else:
        bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
        src = bits.view(np.float16) if pair == "f16->f32" else bits
        dst = np.empty(src.size, np.float32)
    scalar, avx2 = _both_paths(K.cast, dst, src)
    np.testing.assert_array_equal(scalar[0].view(np.uint8), avx2[0].view(np.uint8))


def test_cast_errors() -> None:
    f32 = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="cast from float64 to float32 is not supported"):
        K.cast(f32, np.zeros(4, np.float64))
    with pytest.raises(TypeError, match="cast from float32 to float32 is not supported"):
        K.cast(f32, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="src has 3 elements but dst has 4"):
        K.cast(f32, np.zeros(3, np.float16))
    buf = np.zeros(16, np.float32)
    with pytest.raises(ValueError, match="dst and src share memory"):
        K.cast(buf[:8], buf.view(np.uint16)[:8])
    ro = np.zeros(4, np.float16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="dst is read-only"):
        K.cast(ro, f32)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TAGPS_SIMD": "scalar", "TAGPS_NUM_THREADS": "1"}, "scalar 1"),
        ({"TAGPS_SIMD": "auto", "TAGPS_NUM_THREADS": "3"}, f"{AUTO_MODE} 3"),
    ],
)
def test_environment_sets_initial_mode(env: dict[str, str], expected: str) -> None:
    code = "from tagps import kernels as K; print(K.simd_mode(), K.num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == expected.split()


def test_environment_malformed_value_names_the_variable() -> None:
    code = "import tagps.kernels"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TAGPS_SIMD": "sse9"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "TAGPS_SIMD='sse9' is malformed" in out.stderr


def test_concurrent_calls_from_threads(simd: str) -> None:
    """The server's engine threads reduce at once (the GIL is released): results stay exact."""
    rng = np.random.default_rng(5)
    jobs = []
    for _ in range(4):
        dst = rng.standard_normal(300_001).astype(np.float32)
        srcs = [rng.standard_normal(300_001).astype(np.float32) for _ in range(3)]
        jobs.append((dst, srcs, _sum_reference(dst, srcs)))

    def work(job: tuple[np.ndarray, list[np.ndarray], np.ndarray]) -> None:
        dst, srcs, _ = job
        K.sum_into(dst, *srcs)

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(work, jobs))
    for dst, _, expected in jobs:
        np.testing.assert_array_equal(dst, expected)
