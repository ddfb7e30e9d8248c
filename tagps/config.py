"""The one place that reads environment variables (DMLC_*, BYTEPS_*, TAGPS_*, PS_*).

Every other module asks this one for a frozen, validated config object. A missing or malformed variable
raises :class:`ConfigError` naming the variable (BytePS silently exits 0 in that case; we fail loudly).
The variables are documented in ``docs/environment.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["ConfigError", "KernelConfig", "kernel_config"]

T = TypeVar("T")


class ConfigError(ValueError):
    """An environment variable is missing or malformed."""


def _read(
    env: Mapping[str, str],
    name: str,
    parse: Callable[[str], T],
    default: T | None = None,
    required: bool = False,
) -> T:
    raw = env.get(name)
    if raw is None or raw == "":
        if required:
            raise ConfigError(f"{name} is required but not set")
        return default  # type: ignore[return-value]
    try:
        return parse(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}={raw!r} is malformed: {exc}") from None


def _int(minimum: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw.strip())
        if minimum is not None and value < minimum:
            raise ValueError(f"must be >= {minimum}")
        return value

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 0/1 (or true/false)")


@dataclass(frozen=True)
class KernelConfig:
    """Settings of the C++ kernels.

    Args:
        simd: ``"auto"`` (AVX2/FMA/F16C when the CPU has them) or ``"scalar"`` (portable path).
        num_threads: OpenMP threads for large arrays; 0 means all cores.
    """

    simd: str = "auto"
    num_threads: int = 0


def kernel_config(env: Mapping[str, str] = os.environ) -> KernelConfig:
    """Read ``TAGPS_SIMD`` and ``TAGPS_NUM_THREADS``."""
    return KernelConfig(
        simd=_read(env, "TAGPS_SIMD", _choice("auto", "avx2", "scalar"), "auto"),
        num_threads=_read(env, "TAGPS_NUM_THREADS", _int(0), 0),
    )
