"""CPU kernels of tagps: n-way summation, scaling, casts and fused optimizer steps.

Typed front for the C++ core ``tagps._core``. Every function works in place on contiguous numpy arrays or
CPU torch tensors, checks its arguments first (``TypeError`` for a wrong type or dtype, ``ValueError`` for
a size mismatch, a non-contiguous or read-only buffer, unsafe aliasing or a bad hyperparameter) and
releases the GIL while the C++ code runs, so several threads can reduce at once.

Supported element types of :func:`sum_into` and :func:`scale`: float32, float64, float16, bfloat16
(``torch.bfloat16``, or a numpy ``uint16`` array holding bfloat16 bit patterns), int32 and int64. The
optimizer steps take float32. The SIMD path (AVX2/FMA/F16C or portable scalar) and the OpenMP thread
count start from :func:`tagps.config.kernel_config` (``TAGPS_SIMD``, ``TAGPS_NUM_THREADS``).
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

import numpy as np

from tagps import _core
from tagps.config import kernel_config

__all__ = [
    "num_threads",
    "scale",
    "set_num_threads",
    "set_simd_mode",
    "simd_mode",
    "sum_into",
]

# numpy dtype -> kernel dtype code; uint16 is the storage of bfloat16 on the numpy side.
_NUMPY_CODES: dict[np.dtype, int] = {
    np.dtype(np.float32): int(_core.DType.float32),
    np.dtype(np.float64): int(_core.DType.float64),
    np.dtype(np.float16): int(_core.DType.float16),
    np.dtype(np.uint16): int(_core.DType.bfloat16),
    np.dtype(np.int32): int(_core.DType.int32),
    np.dtype(np.int64): int(_core.DType.int64),
}
_CODE_NAMES: dict[int, str] = {int(v): name for name, v in _core.DType.__members__.items()}
_FLOAT32 = int(_core.DType.float32)
_INT_CODES = frozenset({int(_core.DType.int32), int(_core.DType.int64)})
_SUPPORTED = "float32, float64, float16, bfloat16 (torch.bfloat16 or numpy uint16), int32, int64"


class _Buffer:
    """A validated contiguous buffer: the numpy view the core works on, its dtype code and byte range."""

    __slots__ = ("array", "code", "end", "name", "start")

    def __init__(self, array: np.ndarray, code: int, name: str) -> None:
        self.array = array
        self.code = code
        self.name = name
        self.start = array.__array_interface__["data"][0] if array.size else 0
        self.end = self.start + array.nbytes

    def same_region(self, other: _Buffer) -> bool:
        return self.start == other.start and self.end == other.end

    def overlaps(self, other: _Buffer) -> bool:
        return self.start < other.end and other.start < self.end


def _torch_view(x: Any, name: str) -> tuple[np.ndarray, int] | None:
    """The numpy view and dtype code of a CPU torch tensor, or None when ``x`` is no tensor."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    if x.device.type != "cpu":
        raise TypeError(f"{name} is a torch tensor on {x.device}; the kernels work on CPU tensors only")
    if x.layout != torch.strided:
        raise TypeError(f"{name} is a {x.layout} torch tensor; the kernels need dense (strided) tensors")
    if not x.is_contiguous():
        raise ValueError(f"{name} is not contiguous (torch strides {tuple(x.stride())}); call .contiguous()")
    x = x.detach()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16), int(_core.DType.bfloat16)
    if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64):
        hint = "; use torch.bfloat16 for bfloat16 data" if x.dtype == torch.uint16 else ""
        raise TypeError(f"{name} has unsupported dtype {x.dtype}; supported: {_SUPPORTED}{hint}")
    array = x.numpy()
    return array, _NUMPY_CODES[array.dtype]


def _code_of(dtype: np.dtype, name: str) -> int:
    code = _NUMPY_CODES.get(dtype)
    if code is None:
        raise TypeError(f"{name} has unsupported dtype {dtype}; supported: {_SUPPORTED}")
    return code


def _buffer(x: Any, name: str, *, writable: bool) -> _Buffer:
    """Validate ``x`` (numpy array or CPU torch tensor) as a contiguous kernel buffer."""
    view = _torch_view(x, name)
    if view is not None:
        array, code = view
    elif isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError(f"{name} is not C-contiguous (strides {x.strides}); use np.ascontiguousarray")
        if writable and not x.flags.writeable:
            raise ValueError(f"{name} is read-only; the kernels write it in place")
        array, code = x, _code_of(x.dtype, name)
    else:
        raise TypeError(f"{name} must be a numpy array or a CPU torch tensor, got {type(x).__name__}")
    return _Buffer(array, code, name)


def _check_like(ref: _Buffer, other: _Buffer) -> None:
    """``other`` has ``ref``'s dtype and number of elements."""
    if other.code != ref.code:
        raise TypeError(
            f"{other.name} has dtype {_CODE_NAMES[other.code]} but {ref.name} has {_CODE_NAMES[ref.code]}"
        )
    if other.array.size != ref.array.size:
        raise ValueError(
            f"{other.name} has {other.array.size} elements but {ref.name} has {ref.array.size}"
        )


def _check_disjoint(buffers: list[_Buffer]) -> None:
    """No two of ``buffers`` share memory."""
    for i, a in enumerate(buffers):
        for b in buffers[i + 1 :]:
            if a.overlaps(b):
                raise ValueError(f"{a.name} and {b.name} share memory; they must be distinct buffers")


def _real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def sum_into(dst: Any, *srcs: Any) -> None:
    """Add every source to ``dst`` in one pass: ``dst += srcs[0] + srcs[1] + ...``.

    Each element is accumulated in the order ``((dst + srcs[0]) + srcs[1]) + ...``, so float32 results
    equal those of a chain of ``np.add(dst, src, out=dst)`` calls, on the scalar and the AVX2 path alike.
    float16/bfloat16 accumulate in float32 and round once (round-to-nearest-even); integers wrap.

    Args:
        dst: destination array or tensor, written in place.
        *srcs: sources of ``dst``'s dtype and number of elements. A source may be ``dst`` itself; a
            source that partly overlaps ``dst`` is rejected. No sources: nothing happens.

    Raises:
        TypeError: unsupported or mismatched dtype, or not an array/tensor.
        ValueError: size mismatch, non-contiguous or read-only ``dst``, partial overlap with ``dst``.
    """
    out = _buffer(dst, "dst", writable=True)
    ins = [_buffer(s, f"srcs[{i}]", writable=False) for i, s in enumerate(srcs)]
    for src in ins:
        _check_like(out, src)
        if src.overlaps(out) and not src.same_region(out):
            raise ValueError(
                f"{src.name} partly overlaps dst; an in-place sum needs it disjoint or identical to dst"
            )
    if ins:
        _core.sum_into(out.array, [s.array for s in ins], out.code)


def scale(buf: Any, factor: float) -> None:
    """Multiply ``buf`` by ``factor`` in place.

    The factor is rounded to float32 for float32/float16/bfloat16 buffers (which compute in float32 and
    round once); integer buffers need an integral factor and wrap on overflow.

    Args:
        buf: array or tensor of a :func:`sum_into` dtype.
        factor: the multiplier.

    Raises:
        TypeError: unsupported dtype or a non-real factor.
        ValueError: non-contiguous or read-only buffer, non-integral factor for an integer buffer.
    """
    b = _buffer(buf, "buf", writable=True)
    f = _real(factor, "factor")
    if b.code in _INT_CODES and not (math.isfinite(f) and f.is_integer()):
        raise ValueError(
            f"factor {factor!r} is not integral; an integer buffer can only be scaled by an integer"
        )
    _core.scale(b.array, f, b.code)


def simd_mode() -> str:
    """Return the SIMD path the kernels use now: ``"avx2"`` or ``"scalar"``."""
    return _core.simd_mode()


def set_simd_mode(mode: str) -> None:
    """Select the SIMD path.

    Args:
        mode: ``"auto"`` (AVX2/FMA/F16C when the CPU has them), ``"avx2"`` (``RuntimeError`` if the CPU
            lacks them) or ``"scalar"`` (portable path; same results).
    """
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, got {type(mode).__name__}")
    _core.set_simd_mode(mode)


def set_num_threads(n: int) -> None:
    """Set the OpenMP threads that large arrays are split across; 0 means all cores."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"number of threads must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"number of threads must be >= 0 (0 = all cores), got {n}")
    _core.set_num_threads(int(n))


def num_threads() -> int:
    """Return the number of threads large arrays are split across."""
    return _core.num_threads()


def _configure() -> None:
    config = kernel_config()
    set_simd_mode(config.simd)
    set_num_threads(config.num_threads)


_configure()
