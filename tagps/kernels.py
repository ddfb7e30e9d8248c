"""CPU kernels of tagps: n-way summation, scaling, casts and fused optimizer steps.

Typed front for the C++ core ``tagps._core``. Every function works in place on contiguous numpy arrays or
CPU torch tensors, checks its arguments first (``TypeError`` for a wrong type or dtype, ``ValueError`` for
a size mismatch, a non-contiguous or read-only buffer, unsafe aliasing or a bad hyperparameter) and
releases the GIL while the C++ code runs, so several threads can reduce at once.

Supported element types of :func:`sum_into` and :func:`scale`: float32, float64, float16, bfloat16
(``torch.bfloat16``, or a numpy ``uint16`` array holding bfloat16 bit patterns), int32 and int64. The
optimizer steps take float32 or float64 (every buffer of a step in the parameter's dtype). The SIMD path
(AVX2/FMA/F16C or portable scalar) and the OpenMP thread count start from
:func:`tagps.config.kernel_config` (``TAGPS_SIMD``, ``TAGPS_NUM_THREADS``).
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
    "adam_step",
    "adamw_step",
    "cast",
    "num_threads",
    "rmsprop_step",
    "scale",
    "set_num_threads",
    "set_simd_mode",
    "sgd_step",
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
_CAST_PAIRS = frozenset(
    pair
    for half in (int(_core.DType.float16), int(_core.DType.bfloat16))
    for pair in ((half, _FLOAT32), (_FLOAT32, half))
)
_INT_CODES = frozenset({int(_core.DType.int32), int(_core.DType.int64)})
_OPTIMIZER_CODES = frozenset({_FLOAT32, int(_core.DType.float64)})
_SUPPORTED = "float32, float64, float16, bfloat16 (torch.bfloat16 or numpy uint16), int32, int64"


_TORCH_CODES: dict[Any, int] = {}  # torch dtype -> kernel dtype code, filled when torch is first seen


def _torch_codes(torch: Any) -> dict[Any, int]:
    if not _TORCH_CODES:
        _TORCH_CODES.update({
            torch.float32: int(_core.DType.float32),
            torch.float64: int(_core.DType.float64),
            torch.float16: int(_core.DType.float16),
            torch.bfloat16: int(_core.DType.bfloat16),
            torch.int32: int(_core.DType.int32),
            torch.int64: int(_core.DType.int64),
        })
    return _TORCH_CODES


def _torch_array(x: Any, torch: Any, name: str) -> tuple[np.ndarray, int]:
    """The numpy view (sharing memory) and dtype code of a dense contiguous CPU tensor."""
    if not x.is_cpu:
        raise TypeError(f"{name} is a torch tensor on {x.device}; the kernels work on CPU tensors only")
    if x.layout != torch.strided:
        raise TypeError(f"{name} is a {x.layout} torch tensor; the kernels need dense (strided) tensors")
    code = _torch_codes(torch).get(x.dtype)
    if code is None:
        hint = "; use torch.bfloat16 for bfloat16 data" if x.dtype == torch.uint16 else ""
        raise TypeError(f"{name} has unsupported dtype {x.dtype}; supported: {_SUPPORTED}{hint}")
    if not x.is_contiguous():
        raise ValueError(f"{name} is not contiguous (torch strides {tuple(x.stride())}); call .contiguous()")
    if x.requires_grad:
        x = x.detach()
    if code == int(_core.DType.bfloat16):
        return x.view(torch.int16).numpy().view(np.uint16), code
    return x.numpy(), code


def _buffer(x: Any, name: str, *, writable: bool) -> tuple[np.ndarray, int]:
    """Validate ``x`` (numpy array or CPU torch tensor) as a contiguous kernel buffer.

    Returns:
        The numpy array the core works on (``x`` itself or a view of the tensor's memory) and its dtype
        code. Overlaps between buffers are checked by the core, which sees the addresses anyway.
    """
    if isinstance(x, np.ndarray):
        code = _NUMPY_CODES.get(x.dtype)
        if code is None:
            raise TypeError(f"{name} has unsupported dtype {x.dtype}; supported: {_SUPPORTED}")
        flags = x.flags
        if not flags.c_contiguous:
            raise ValueError(f"{name} is not C-contiguous (strides {x.strides}); use np.ascontiguousarray")
        if writable and not flags.writeable:
            raise ValueError(f"{name} is read-only; the kernels write it in place")
        return x, code
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _torch_array(x, torch, name)
    raise TypeError(f"{name} must be a numpy array or a CPU torch tensor, got {type(x).__name__}")


def _real(value: Any, name: str) -> float:
    if type(value) is float:  # the common case, without the slower ABC check below
        return value
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
    out, code = _buffer(dst, "dst", writable=True)
    arrays = []
    for i, s in enumerate(srcs):
        name = f"srcs[{i}]"
        array, src_code = _buffer(s, name, writable=False)
        if src_code != code:
            raise TypeError(f"{name} has dtype {_CODE_NAMES[src_code]} but dst has {_CODE_NAMES[code]}")
        if array.size != out.size:
            raise ValueError(f"{name} has {array.size} elements but dst has {out.size}")
        arrays.append(array)
    if arrays:
        _core.sum_into(out, arrays, code)


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
    array, code = _buffer(buf, "buf", writable=True)
    f = _real(factor, "factor")
    if code in _INT_CODES and not (math.isfinite(f) and f.is_integer()):
        raise ValueError(
            f"factor {factor!r} is not integral; an integer buffer can only be scaled by an integer"
        )
    _core.scale(array, f, code)


def cast(dst: Any, src: Any) -> None:
    """Convert ``src`` into ``dst`` between float32 and float16/bfloat16.

    Narrowing rounds to nearest even (float16 overflows to inf; a bfloat16 NaN becomes 0x7FC0 as in
    torch); widening is exact.

    Args:
        dst: float32, float16 or bfloat16 array/tensor, written in place.
        src: array/tensor with as many elements; one of the two must be float32 and the other 16-bit.

    Raises:
        TypeError: a pair other than float32 <-> float16/bfloat16.
        ValueError: size mismatch, non-contiguous or read-only ``dst``, ``src`` sharing memory with ``dst``.
    """
    out, out_code = _buffer(dst, "dst", writable=True)
    inp, in_code = _buffer(src, "src", writable=False)
    if (out_code, in_code) not in _CAST_PAIRS:
        raise TypeError(
            f"cast from {_CODE_NAMES[in_code]} to {_CODE_NAMES[out_code]} is not supported; "
            "supported: float32 <-> float16, float32 <-> bfloat16"
        )
    if inp.size != out.size:
        raise ValueError(f"src has {inp.size} elements but dst has {out.size}")
    _core.cast(out, inp, out_code, in_code)


def _optimizer_buffers(param: Any, grad: Any, **states: Any) -> tuple[dict[str, np.ndarray | None], int]:
    """Validate the buffers of an optimizer step: float32 or float64, all of ``param``'s dtype and number
    of elements; None stays None. The core rejects buffers that share memory.

    Returns:
        The arrays by name and their dtype code.
    """
    p, code = _buffer(param, "param", writable=True)
    if code not in _OPTIMIZER_CODES:
        raise TypeError(f"param has dtype {_CODE_NAMES[code]}; the optimizer steps take float32 or float64")
    arrays: dict[str, np.ndarray | None] = {"param": p}
    for name, x, writable in [("grad", grad, False), *((n, x, True) for n, x in states.items())]:
        if x is None:
            arrays[name] = None
            continue
        array, other = _buffer(x, name, writable=writable)
        if other != code:
            raise TypeError(f"{name} has dtype {_CODE_NAMES[other]} but param has {_CODE_NAMES[code]}")
        if array.size != p.size:
            raise ValueError(f"{name} has {array.size} elements but param has {p.size}")
        arrays[name] = array
    return arrays, code


def _nonneg(value: Any, name: str) -> float:
    v = _real(value, name)
    if not v >= 0.0:  # also rejects NaN
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return v


def _beta(value: Any, name: str) -> float:
    v = _real(value, name)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return v


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def sgd_step(
    param: Any,
    grad: Any,
    momentum_buffer: Any = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
    first_step: bool = False,
) -> None:
    r"""Apply one SGD step in place, exactly as ``torch.optim.SGD`` (single-tensor path) does.

    .. math::
        g &= \pm\nabla + \lambda p \\
        b &= \begin{cases} g & \text{first step} \\ \mu b + (1-\tau) g & \text{otherwise}\end{cases} \\
        p &= p - \gamma\,(g + \mu b \text{ if nesterov else } b)

    Args:
        param: float32 or float64 parameters, updated in place.
        grad: gradient of ``param``'s dtype.
        momentum_buffer: buffer of ``param``'s dtype, required when ``momentum != 0``.
        lr: learning rate :math:`\gamma`.
        momentum: :math:`\mu` (default 0).
        dampening: :math:`\tau` (default 0).
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        weight_decay: L2 penalty :math:`\lambda` (default 0).
        maximize: ascend instead of descend.
        first_step: the buffer has no history yet and is set to the gradient (torch's first step).
    """
    lr, momentum = _nonneg(lr, "lr"), _nonneg(momentum, "momentum")
    dampening, weight_decay = _real(dampening, "dampening"), _nonneg(weight_decay, "weight_decay")
    nesterov, maximize = _flag(nesterov, "nesterov"), _flag(maximize, "maximize")
    first_step = _flag(first_step, "first_step")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    if momentum != 0.0 and momentum_buffer is None:
        raise ValueError("momentum != 0 needs a momentum_buffer")
    a, code = _optimizer_buffers(param, grad, momentum_buffer=momentum_buffer if momentum != 0.0 else None)
    _core.sgd_step(
        a["param"], a["grad"], a["momentum_buffer"], code, lr, momentum, dampening, weight_decay, nesterov,
        maximize, first_step,
    )


def _adam(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    max_exp_avg_sq: Any,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
) -> None:
    """Shared body of :func:`adam_step` and :func:`adamw_step`."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int (1-based step count), got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step is the 1-based step count, got {step}")
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    beta1, beta2 = _beta(betas[0], "betas[0]"), _beta(betas[1], "betas[1]")
    lr, eps, weight_decay = _nonneg(lr, "lr"), _nonneg(eps, "eps"), _nonneg(weight_decay, "weight_decay")
    amsgrad, maximize = _flag(amsgrad, "amsgrad"), _flag(maximize, "maximize")
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("amsgrad=True needs a max_exp_avg_sq buffer")
    a, code = _optimizer_buffers(
        param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
        max_exp_avg_sq=max_exp_avg_sq if amsgrad else None,
    )
    _core.adam_step(
        a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], a["max_exp_avg_sq"], code, int(step), lr,
        beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled,
    )


def adam_step(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    max_exp_avg_sq: Any = None,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
) -> None:
    r"""Apply one Adam step in place, with ``torch.optim.Adam``'s semantics and order of operations.

    .. math::
        g &= \pm\nabla + \lambda p, \quad m = m + (1-\beta_1)(g - m), \quad
        v = \beta_2 v + (1-\beta_2) g^2 \\
        p &= p - \frac{\gamma}{1-\beta_1^t} \cdot
        \frac{m}{\sqrt{\hat v} / \sqrt{1-\beta_2^t} + \epsilon},
        \quad \hat v = \max(v_{\max}, v) \text{ if amsgrad else } v

    Args:
        param: float32 or float64 parameters, updated in place.
        grad: gradient of ``param``'s dtype.
        exp_avg: first moment (``param``'s dtype), updated in place.
        exp_avg_sq: second moment, updated in place.
        max_exp_avg_sq: running maximum of the second moment, required when ``amsgrad``.
        step: 1-based count of this step :math:`t` (torch's ``state["step"]`` after its increment).
        lr: learning rate :math:`\gamma` (default 1e-3).
        betas: :math:`(\beta_1, \beta_2)` (default (0.9, 0.999)).
        eps: :math:`\epsilon` (default 1e-8).
        weight_decay: L2 penalty :math:`\lambda` added to the gradient (default 0).
        amsgrad: use the running maximum of the second moment.
        maximize: ascend instead of descend.
    """
    _adam(
        param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps,
        weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, decoupled=False,
    )


def adamw_step(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    max_exp_avg_sq: Any = None,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
) -> None:
    r"""Apply one AdamW step in place, with ``torch.optim.AdamW``'s semantics.

    As :func:`adam_step`, except that weight decay is decoupled: :math:`p = p(1 - \gamma\lambda)` before
    the update instead of :math:`\lambda p` added to the gradient. Default ``weight_decay`` 1e-2.
    """
    _adam(
        param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps,
        weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, decoupled=True,
    )


def rmsprop_step(
    param: Any,
    grad: Any,
    square_avg: Any,
    momentum_buffer: Any = None,
    grad_avg: Any = None,
    *,
    lr: float = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    maximize: bool = False,
) -> None:
    r"""Apply one RMSprop step in place, with ``torch.optim.RMSprop``'s semantics and order of operations.

    .. math::
        g &= \pm\nabla + \lambda p, \quad s = \alpha s + (1-\alpha) g^2, \quad
        \bar g = \bar g + (1-\alpha)(g - \bar g) \text{ (centered)} \\
        d &= \sqrt{s - \bar g^2} + \epsilon \text{ (centered) or } \sqrt{s} + \epsilon, \quad
        b = \mu b + g / d, \quad p = p - \gamma b \text{ (momentum) or } p - \gamma g / d

    Args:
        param: float32 or float64 parameters, updated in place.
        grad: gradient of ``param``'s dtype.
        square_avg: running average of :math:`g^2` (``param``'s dtype), updated in place.
        momentum_buffer: buffer, required when ``momentum > 0``.
        grad_avg: running average of :math:`g`, required when ``centered``.
        lr: learning rate :math:`\gamma` (default 1e-2).
        alpha: smoothing constant :math:`\alpha` (default 0.99).
        eps: :math:`\epsilon` (default 1e-8).
        weight_decay: L2 penalty :math:`\lambda` (default 0).
        momentum: :math:`\mu` (default 0).
        centered: normalise by the estimated variance of the gradient.
        maximize: ascend instead of descend.
    """
    lr, alpha, eps = _nonneg(lr, "lr"), _nonneg(alpha, "alpha"), _nonneg(eps, "eps")
    weight_decay, momentum = _nonneg(weight_decay, "weight_decay"), _nonneg(momentum, "momentum")
    centered, maximize = _flag(centered, "centered"), _flag(maximize, "maximize")
    if momentum > 0.0 and momentum_buffer is None:
        raise ValueError("momentum > 0 needs a momentum_buffer")
    if centered and grad_avg is None:
        raise ValueError("centered=True needs a grad_avg buffer")
    a, code = _optimizer_buffers(
        param, grad, square_avg=square_avg,
        momentum_buffer=momentum_buffer if momentum > 0.0 else None,
        grad_avg=grad_avg if centered else None,
    )
    _core.rmsprop_step(
        a["param"], a["grad"], a["square_avg"], a["momentum_buffer"], a["grad_avg"], code, lr, alpha, eps,
        weight_decay, momentum, centered, maximize,
    )


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
