"""The device-type table: peak FP32 FLOP/s, memory and memory bandwidth of the devices TAG plans for.

Per-op time is a roofline estimate (see ``docs/simulator.md``):

.. math::
    t_{op}(b) = \\max\\Big(\\frac{F_{op}\\,b}{P\\,\\eta},\\ \\frac{M_{op} + D_{op}\\,b}{W\\,\\eta_m}\\Big) + o

with ``F`` FLOPs and ``D`` bytes moved per sample, ``M`` parameter bytes, ``P`` peak FLOP/s, ``W`` memory
bandwidth, ``η``/``η_m`` efficiency factors and ``o`` a fixed per-op launch overhead. The efficiency
factors are the calibrated constants; :func:`calibrated` returns a copy with new ones. Where a measured
profile of the model exists for a device type (``tagps.strategy.profiles``), the simulator uses it instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEVICE_TYPES", "DeviceType", "calibrated", "device_type", "fit_device"]

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceType:
    """One kind of device.

    Args:
        name: table key (``"V100-32GB"``).
        peak_flops: peak FP32 FLOP/s.
        memory_bytes: device memory.
        memory_bandwidth: bytes/s of device memory.
        efficiency: fraction of ``peak_flops`` that compute-bound ops reach.
        memory_efficiency: fraction of ``memory_bandwidth`` that memory-bound ops reach.
        op_overhead_s: fixed time per op (kernel launch, framework dispatch).
    """

    name: str
    peak_flops: float
    memory_bytes: int
    memory_bandwidth: float
    efficiency: float = 0.6
    memory_efficiency: float = 0.7
    op_overhead_s: float = 8e-6

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("device type name must not be empty")
        for field in ("peak_flops", "memory_bytes", "memory_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"device type {self.name!r}: {field} must be > 0")
        for field in ("efficiency", "memory_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"device type {self.name!r}: {field} must be in (0, 1]")
        if self.op_overhead_s < 0:
            raise ValueError(f"device type {self.name!r}: op_overhead_s must be >= 0")

    def op_time(self, flops: float, bytes_moved: float) -> float:
        """Return the roofline time in seconds of one op that does ``flops`` and moves ``bytes_moved``."""
        return (
            max(
                flops / (self.peak_flops * self.efficiency),
                bytes_moved / (self.memory_bandwidth * self.memory_efficiency),
            )
            + self.op_overhead_s
        )


# Vendor figures (FP32, no tensor cores); the CPU row is the 2-core AVX2/FMA EPYC these tests run on
# (2 cores x 2.5 GHz x 32 FLOP/cycle) with its measured ~17 GB/s copy bandwidth.
DEVICE_TYPES: dict[str, DeviceType] = {
    d.name: d
    for d in (
        DeviceType("V100-32GB", 15.7e12, 32 * GIB, 900e9),
        DeviceType("V100-16GB", 15.7e12, 16 * GIB, 900e9),
        DeviceType("1080Ti", 11.3e12, 11 * GIB, 484e9),
        DeviceType("P100", 9.3e12, 16 * GIB, 732e9),
        DeviceType("T4", 8.1e12, 16 * GIB, 320e9),
        DeviceType("A100", 19.5e12, 40 * GIB, 1555e9),
        DeviceType("H100", 51.2e12, 80 * GIB, 2000e9),
        DeviceType("H200", 67e12, 139 * GIB, 4800e9),  # SXM; the GPU `tagps profile --device cuda` may meet
        DeviceType("CPU", 160e9, 24 * GIB, 17e9, efficiency=0.5, memory_efficiency=0.5, op_overhead_s=20e-6),
    )
}


def device_type(name: str) -> DeviceType:
    """Return the table entry ``name``; raise ValueError listing the known types otherwise."""
    try:
        return DEVICE_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown device type {name!r}; known: {', '.join(DEVICE_TYPES)}") from None


def calibrated(base: DeviceType, **constants: float) -> DeviceType:
    """Return ``base`` with new calibration constants.

    Args:
        base: the table entry.
        constants: ``efficiency``, ``memory_efficiency`` and/or ``op_overhead_s``.
    """
    allowed = {"efficiency", "memory_efficiency", "op_overhead_s"}
    unknown = set(constants) - allowed
    if unknown:
        raise ValueError(f"not calibration constants: {sorted(unknown)}; allowed: {sorted(allowed)}")
    return dataclasses.replace(base, **constants)


def fit_device(base: DeviceType, samples: Sequence[tuple[float, float, float]]) -> DeviceType:
    """Fit ``efficiency``, ``memory_efficiency`` and ``op_overhead_s`` of ``base`` to measured op times.

    A grid search (log-spaced efficiencies in [0.005, 1], overheads in [0, 1] ms) minimising the squared
    log error of the roofline against the measurements.

    Args:
        base: the device type whose peak FLOP/s and memory bandwidth stay fixed.
        samples: ``(flops, bytes moved, measured seconds)`` per op run.

    Returns:
        ``base`` with the fitted constants.

    Raises:
        ValueError: no sample with a positive measured time.
    """
    import numpy as np

    data = np.array([s for s in samples if s[2] > 0], dtype=np.float64).reshape(-1, 3)
    if not len(data):
        raise ValueError("fit_device needs at least one sample with a positive measured time")
    flops, moved, seconds = data[:, 0], data[:, 1], data[:, 2]
    effs = np.geomspace(0.005, 1.0, 48)
    overheads = np.concatenate([[0.0], np.geomspace(1e-7, 1e-3, 28)])
    compute = flops[None, :] / (base.peak_flops * effs[:, None])  # (eff, op)
    memory = moved[None, :] / (base.memory_bandwidth * effs[:, None])  # (mem eff, op)
    roof = np.maximum(compute[:, None, :], memory[None, :, :])  # (eff, mem eff, op)
    log_meas = np.log(seconds)
    best = (np.inf, 0, 0, 0)
    for k, overhead in enumerate(overheads):
        err = ((np.log(roof + overhead) - log_meas) ** 2).sum(axis=-1)
        i, j = np.unravel_index(int(np.argmin(err)), err.shape)
        if err[i, j] < best[0]:
            best = (float(err[i, j]), int(i), int(j), k)
    _, i, j, k = best
    return calibrated(
        base, efficiency=float(effs[i]), memory_efficiency=float(effs[j]), op_overhead_s=float(overheads[k])
    )
