"""Measured op profiles: what every op of a model costs, forward and backward, on one device type.

A profile holds, per op, the seconds measured by :func:`~tagps.strategy.graph.profile_graph` at a few batch
sizes and a fit linear in the batch, so that any batch can be costed:

.. math::
    t_{fwd}(op, b) = a_{fwd} + c_{fwd}\\,b, \\qquad t_{bwd}(op, b) = a_{bwd} + c_{bwd}\\,b

fitted by least squares on the relative error, with :math:`a, c \\ge 0`. Profiles are small JSON files
named ``<model>.<device type>.json``; the simulator looks for one in ``TAGPS_CACHE_DIR/profiles`` (what
``tagps profile`` writes), then among the profiles shipped in ``tagps/strategy/profiles/``, and costs a
device type with its profile instead of the roofline where one exists (``docs/simulator.md``).
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tagps.atomic import write_text_atomic
from tagps.heap import keep_freed_buffers
from tagps.strategy import devices
from tagps.strategy.graph import (
    Graph,
    check_device,
    device_name,
    model_graph,
    profile_graph,
    timing_clock,
)
from tagps.strategy.plan import OPTIMIZERS

__all__ = [
    "PROFILE_FORMAT",
    "SHIPPED_DIR",
    "ModelTimes",
    "OpProfile",
    "Profile",
    "build_profile",
    "find_profile",
    "fit_linear",
    "load_profile",
    "local_device_type",
    "median_profile",
    "profile_path",
    "time_model",
]

PROFILE_FORMAT = "tagps-op-profile/2"
SHIPPED_DIR = Path(__file__).resolve().parent / "profiles"


def fit_linear(batches: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Fit ``t(b) = a + c·b`` with ``a, c >= 0``, minimising the squared relative error.

    Relative error, because the times of one op span orders of magnitude over the batch sizes and every
    batch should count. ``(0, 0)`` when every time is 0 (an op without backward).

    Returns:
        ``(a, c)``: seconds, and seconds per sample.
    """
    if len(batches) != len(seconds) or len(set(batches)) < 2:
        raise ValueError("fit_linear needs one time per batch size and at least two distinct batch sizes")
    points = [(b, t) for b, t in zip(batches, seconds, strict=True) if t > 0]
    if not points:
        return 0.0, 0.0
    w = [1 / t**2 for _, t in points]
    sw = sum(w)
    sb = sum(wi * b for wi, (b, _) in zip(w, points, strict=True))
    sbb = sum(wi * b * b for wi, (b, _) in zip(w, points, strict=True))
    st = sum(wi * t for wi, (_, t) in zip(w, points, strict=True))
    sbt = sum(wi * b * t for wi, (b, t) in zip(w, points, strict=True))
    det = sw * sbb - sb * sb
    if det > 0:
        a, c = (sbb * st - sb * sbt) / det, (sw * sbt - sb * st) / det
        if a >= 0 and c >= 0:
            return a, c
    # The unconstrained optimum leaves the quadrant: the best fit lies on one of its edges.
    candidates = [(st / sw, 0.0), (0.0, sbt / sbb)]

    def err(fit: tuple[float, float]) -> float:
        return sum(wi * (fit[0] + fit[1] * b - t) ** 2 for wi, (b, t) in zip(w, points, strict=True))

    return min(candidates, key=err)


@dataclass(frozen=True)
class OpProfile:
    """One op's measured seconds per batch size and the fits ``(a, c)`` of ``t(b) = a + c·b``."""

    name: str
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    fwd_fit: tuple[float, float]
    bwd_fit: tuple[float, float]

    def time(self, batch: float) -> tuple[float, float]:
        """Forward and backward seconds at ``batch`` samples."""
        return self.fwd_fit[0] + self.fwd_fit[1] * batch, self.bwd_fit[0] + self.bwd_fit[1] * batch

    @classmethod
    def fitted(
        cls, name: str, batches: Sequence[int], fwd: tuple[float, ...], bwd: tuple[float, ...]
    ) -> OpProfile:
        """The op ``name`` measured at ``batches``, with the fits of those times."""
        return cls(name, fwd, bwd, fit_linear(batches, fwd), fit_linear(batches, bwd))


@dataclass(frozen=True)
class ModelTimes:
    """The whole model measured, next to its ops: what per-op timings miss.

    Ops timed alone, each at its fastest, add up to less than a pass over the model (1.3-1.7x less for the
    mini models at batch 32 on a CPU): a pass also runs autograd's engine, allocates, and finds its caches
    cold after the previous op. The optimizer step is not an op at all.

    Args:
        fwd_s: the model's fastest forward pass, per batch size of the profile.
        bwd_s: its fastest backward pass (``autograd`` from the summed output), per batch size.
        apply_s: optimizer name (``tagps.strategy.plan.OPTIMIZERS``) → the fastest step over every parameter.
        param_bytes: the bytes of those parameters.
    """

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    apply_s: dict[str, float]
    param_bytes: int


@dataclass(frozen=True)
class Profile:
    """Measured op times of one model on one device type.

    Args:
        model: reference model name (the graph's name).
        device_type: the device-type name of the simulator's table (``"CPU"``, ``"H200"``).
        peak_flops: the table's peak FLOP/s of that type when profiled; a device group with another peak
            (a CPU under a cgroup quota) is another device and keeps the roofline.
        batch_sizes: the batch sizes measured.
        ops: per op of the graph, in graph order.
        whole: the whole model's passes and optimizer steps, measured on the same device.
        core_flops: for a CPU profile, the float32 matmul rate of one thread of the host's core measured when
            it was profiled (None: not measured). A shared host runs slower under load (30 % on this 2-core
            host's CPU, ops and matmul alike): the profile's times are in units of that core's speed.
        host: where it was measured (device name, torch version, date), for people.
        source: the file it was read from ("" when built in memory); not saved.
    """

    model: str
    device_type: str
    peak_flops: float
    batch_sizes: tuple[int, ...]
    ops: tuple[OpProfile, ...]
    whole: ModelTimes
    core_flops: float | None
    host: dict[str, str]
    source: str = ""

    def __post_init__(self) -> None:
        where = self._where
        if not self.model or not self.device_type:
            raise ValueError(f"{where}: model and device_type must not be empty")
        if not (isinstance(self.peak_flops, int | float) and self.peak_flops > 0):
            raise ValueError(f"{where}: peak_flops must be a positive number, got {self.peak_flops!r}")
        if len(set(self.batch_sizes)) < 2 or min(self.batch_sizes) < 1:
            raise ValueError(f"{where}: needs at least two distinct batch sizes >= 1, got {self.batch_sizes}")
        seen: set[str] = set()
        for op in self.ops:
            if op.name in seen:
                raise ValueError(f"{where}: op {op.name!r} appears twice")
            seen.add(op.name)
            if len(op.fwd_s) != len(self.batch_sizes) or len(op.bwd_s) != len(self.batch_sizes):
                raise ValueError(f"{where}: op {op.name!r} needs one time per batch size {self.batch_sizes}")
            values = (*op.fwd_s, *op.bwd_s, *op.fwd_fit, *op.bwd_fit)
            if not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"{where}: op {op.name!r} has a time that is not a finite number >= 0")
        whole = self.whole
        if len(whole.fwd_s) != len(self.batch_sizes) or len(whole.bwd_s) != len(self.batch_sizes):
            raise ValueError(f"{where}: the whole model needs one time per batch size {self.batch_sizes}")
        values = (*whole.fwd_s, *whole.bwd_s, *whole.apply_s.values())
        if not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"{where}: the whole model has a time that is not a finite number >= 0")
        core = self.core_flops
        if core is not None and not (isinstance(core, int | float) and math.isfinite(core) and core > 0):
            raise ValueError(f"{where}: core_flops must be a positive number or null, got {core!r}")
        unknown = set(whole.apply_s) - set(OPTIMIZERS)
        if unknown:
            raise ValueError(f"{where}: apply_s names unknown optimizers {sorted(unknown)}")
        if not (isinstance(whole.param_bytes, int) and whole.param_bytes >= 0):
            raise ValueError(f"{where}: param_bytes must be an integer >= 0, got {whole.param_bytes!r}")

    @property
    def _where(self) -> str:
        return f"profile {self.source or self.model + '.' + self.device_type}"

    def coefficients(self, graph: Graph) -> list[tuple[float, float, float, float]]:
        """Per op of ``graph``, in its order: ``(a_fwd, c_fwd, a_bwd, c_bwd)``.

        Each op's fit is scaled so that the ops of a pass add up to the whole model's measured pass: the
        intercepts by the whole pass's intercept over theirs, the per-sample slopes likewise (the fits of
        ``whole.fwd_s`` / ``whole.bwd_s``). An op keeps its share of the pass, and op groups that split the
        model split its real time.

        Raises:
            ValueError: the profile is for another model, or its ops are not the graph's (names the op).
        """
        where = self._where
        if graph.name != self.model:
            raise ValueError(f"{where} is for model {self.model!r}, not {graph.name!r}")
        by_name = {op.name: op for op in self.ops}
        for op in graph.ops:
            if op.name not in by_name:
                raise ValueError(f"{where}: op {op.name!r} ({op.kind}) of {graph.name} is not in the profile")
        names = {op.name for op in graph.ops}
        for op in self.ops:
            if op.name not in names:
                raise ValueError(f"{where}: op {op.name!r} is not an op of {graph.name}; profile it again")
        ops = [by_name[op.name] for op in graph.ops]
        fwd = _match_pass([op.fwd_fit for op in ops], fit_linear(self.batch_sizes, self.whole.fwd_s))
        bwd = _match_pass([op.bwd_fit for op in ops], fit_linear(self.batch_sizes, self.whole.bwd_s))
        return [(*f, *b) for f, b in zip(fwd, bwd, strict=True)]

    def apply_time(self, optimizer: str, param_bytes: float) -> float | None:
        """Seconds of ``optimizer``'s step over ``param_bytes`` of the model's parameters (its measured
        step over all of them, pro rata); None when the profile did not time that optimizer."""
        whole = self.whole
        if optimizer not in whole.apply_s or whole.param_bytes == 0:
            return None
        return whole.apply_s[optimizer] * param_bytes / whole.param_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "device_type": self.device_type,
            "peak_flops": self.peak_flops,
            "core_flops": self.core_flops,
            "batch_sizes": list(self.batch_sizes),
            "host": dict(self.host),
            "whole": {
                "fwd_s": list(self.whole.fwd_s),
                "bwd_s": list(self.whole.bwd_s),
                "apply_s": dict(self.whole.apply_s),
                "param_bytes": self.whole.param_bytes,
            },
            "ops": [
                {
                    "name": op.name,
                    "fwd_s": list(op.fwd_s),
                    "bwd_s": list(op.bwd_s),
                    "fwd_fit": list(op.fwd_fit),
                    "bwd_fit": list(op.bwd_fit),
                }
                for op in self.ops
            ],
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> Profile:
        """Inverse of :meth:`to_dict`; ValueError naming the file and the field or op that is wrong."""
        where = f"profile {source}" if source else "profile"
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            again = " (an older format: make it again with `tagps profile`)" if _older(found) else ""
            raise ValueError(f"{where}: not a {PROFILE_FORMAT} file (format {found!r}){again}")
        try:
            w = data["whole"]
            whole = ModelTimes(
                tuple(w["fwd_s"]),
                tuple(w["bwd_s"]),
                {str(k): v for k, v in w["apply_s"].items()},
                w["param_bytes"],
            )
            ops = tuple(
                OpProfile(
                    str(o["name"]),
                    tuple(o["fwd_s"]),
                    tuple(o["bwd_s"]),
                    _pair(o["fwd_fit"], o["name"], where),
                    _pair(o["bwd_fit"], o["name"], where),
                )
                for o in data["ops"]
            )
            return cls(
                str(data["model"]),
                str(data["device_type"]),
                data["peak_flops"],
                tuple(int(b) for b in data["batch_sizes"]),
                ops,
                whole,
                data["core_flops"],
                {str(k): str(v) for k, v in data.get("host", {}).items()},
                source,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: missing or malformed field {exc}") from None

    @classmethod
    def from_times(
        cls,
        graph: Graph,
        device_type: str,
        batch_sizes: Sequence[int],
        times: dict[int, dict[str, tuple[float, float]]],
        whole: ModelTimes,
        host: dict[str, str] | None = None,
        core_flops: float | None = None,
    ) -> Profile:
        """Fit a profile to ``{batch: {op: (forward s, backward s)}}`` (:func:`profile_graph`'s answer) and
        the whole model's times (:func:`time_model`, at the same ``batch_sizes`` in sorted order).

        Raises:
            ValueError: an op of ``graph`` has no time at some batch size, or ``device_type`` is unknown.
        """
        batches = sorted(batch_sizes)
        ops = []
        for op in graph.ops:
            missing = [b for b in batches if op.name not in times.get(b, {})]
            if missing:
                raise ValueError(f"no time for op {op.name!r} of {graph.name} at batch sizes {missing}")
            fwd = tuple(times[b][op.name][0] for b in batches)
            bwd = tuple(times[b][op.name][1] for b in batches)
            ops.append(OpProfile.fitted(op.name, batches, fwd, bwd))
        peak = devices.device_type(device_type).peak_flops
        return cls(
            graph.name, device_type, peak, tuple(batches), tuple(ops), whole, core_flops, dict(host or {})
        )

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON to ``path`` (atomically)."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")


def _pair(value: Any, op: Any, where: str) -> tuple[float, float]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"{where}: op {op!r}: a fit is [a, c], got {value!r}")
    return value[0], value[1]


def _match_pass(fits: list[tuple[float, float]], whole: tuple[float, float]) -> list[tuple[float, float]]:
    """Scale op fits ``(a, c)`` so that they sum to the whole pass's fit ``(A, C)``.

    Intercepts scale by ``A / sum(a)`` and slopes by ``C / sum(c)``; where the ops have none of a part
    (every ``a`` is 0), the whole's part is spread over the ops by their share of the other part.
    """
    total_a, total_c = sum(a for a, _ in fits), sum(c for _, c in fits)
    out = []
    for a, c in fits:
        new_a = a * whole[0] / total_a if total_a > 0 else (whole[0] * c / total_c if total_c > 0 else 0.0)
        new_c = c * whole[1] / total_c if total_c > 0 else (whole[1] * a / total_a if total_a > 0 else 0.0)
        out.append((new_a, new_c))
    return out


def _older(found: Any) -> bool:
    return isinstance(found, str) and found.startswith("tagps-op-profile/") and found != PROFILE_FORMAT


def load_profile(path: str | Path) -> Profile:
    """Read a profile file; ValueError naming the file when it is not valid JSON or not a profile."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {path}: not valid JSON ({exc})") from None
    return Profile.from_dict(data, str(path))


def _cache_profiles() -> Path:
    from tagps.config import strategy_config

    return Path(strategy_config().cache_dir) / "profiles"


def profile_path(model: str, device_type: str, folder: str | Path | None = None) -> Path:
    """Where the profile of ``model`` on ``device_type`` lives in ``folder`` (default: the cache's)."""
    return (Path(folder) if folder is not None else _cache_profiles()) / f"{model}.{device_type}.json"


def find_profile(model: str, device_type: str) -> Path | None:
    """The profile file of ``model`` on ``device_type``: the cache's (``tagps profile``), else the shipped.

    A cached profile of an older format is passed over with a warning (the shipped one, if any, serves),
    so that an upgrade does not leave every plan failing on a stale cache.
    """
    for folder in (_cache_profiles(), SHIPPED_DIR):
        path = profile_path(model, device_type, folder)
        if not path.is_file():
            continue
        if folder != SHIPPED_DIR and _older(_format_of(path)):
            warnings.warn(
                f"profile {path} has an older format: ignored; make it again with "
                f"`tagps profile --model {model}`",
                stacklevel=2,
            )
            continue
        return path
    return None


def _format_of(path: Path) -> Any:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # load_profile names the problem
    return data.get("format") if isinstance(data, dict) else None


def local_device_type(device: str) -> str:
    """The device-type name of the table that the local ``device`` (``"cpu"``/``"cuda"``) is.

    The CPU is the table's ``CPU`` row; a GPU is the row whose name its CUDA name contains (the longest
    such name; V100s by their memory).

    Raises:
        ValueError: CUDA is absent, or the GPU is not in the table (pass the type explicitly).
    """
    check_device(device)
    if device == "cpu":
        return "CPU"
    import torch

    gpu = torch.cuda.get_device_name()
    if "V100" in gpu:
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        return "V100-32GB" if gib > 20 else "V100-16GB"
    known = [name for name in devices.DEVICE_TYPES if name != "CPU" and name.upper() in gpu.upper()]
    if not known:
        raise ValueError(
            f"GPU {gpu!r} is not in the device table ({', '.join(devices.DEVICE_TYPES)}); pass --device-type"
        )
    return max(known, key=len)


def build_profile(
    model: str,
    device: str = "cpu",
    batch_sizes: Sequence[int] = (1, 8, 32),
    repeats: int = 5,
    device_type: str | None = None,
    threads: int | None = 1,
    progress: bool = False,
    processes: int = 1,
) -> Profile:
    """Time every op of reference model ``model`` on the local ``device`` and fit its profile.

    Args:
        model: reference model name.
        device: ``"cpu"`` or ``"cuda"``.
        batch_sizes: at least two batch sizes (default 1, 8, 32).
        repeats: timed passes over the model per batch size; each op's fastest run counts (default 5).
        device_type: the table row the profile describes (default: :func:`local_device_type`).
        threads: torch threads while profiling (None: torch's setting). Default 1: a CPU device is one
            single-threaded worker process, as the runtime runs it; and on a shared host a second thread
            waits for a free core at every op, which makes small ops 100x slower.
        progress: show a progress bar.
        processes: profile in this many fresh processes, one after another, and keep the median of every
            time (:func:`median_profile`): on a shared host one process's speed is one draw (vgg-mini's
            batch-32 backward took 20-37 ms in six single-process profilings of the 2-core host within
            half an hour).

    Raises:
        ValueError: fewer than two batch sizes, CUDA absent, unknown device type, ``threads < 1``,
            ``processes < 1``; RuntimeError: a profiling process failed.
    """
    import torch

    if len(set(batch_sizes)) < 2:
        raise ValueError(f"a profile needs at least two distinct batch sizes, got {list(batch_sizes)}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    dtype = device_type or local_device_type(device)
    devices.device_type(dtype)  # an unknown name fails before minutes of profiling
    if processes > 1:
        args = (model, device, list(batch_sizes), repeats, dtype, threads)
        return median_profile([_profile_in_process(args, k, processes, progress) for k in range(processes)])
    # As a worker runs (tagps.torch.init): a pass's gradients and temporaries then reuse freed heap
    # instead of faulting fresh pages in (vgg-mini's backward at batch 32: 26-29 ms kept, 35-38 not).
    keep_freed_buffers()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        core = _core_flops() if device == "cpu" else None
        times = profile_graph(model, batch_sizes, repeats, device=device, progress=progress)
        whole = time_model(model, batch_sizes, repeats, device)
        if core is not None:
            core = max(core, _core_flops())  # before and after: the host's faster moment (load only slows)
        host = {
            "device": device_name(device),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        }
    finally:
        torch.set_num_threads(previous)
    return Profile.from_times(model_graph(model), dtype, batch_sizes, times, whole, host, core)


def _profile_in_process(args: tuple[Any, ...], index: int, count: int, progress: bool) -> Profile:
    """:func:`build_profile` of ``args`` in a fresh Python process (``index`` of ``count``)."""
    import os
    import subprocess
    import sys
    import tempfile

    if progress:
        print(f"profiling {args[0]} in process {index + 1} of {count} ...", file=sys.stderr, flush=True)
    code = (
        "import json, sys\n"
        "from tagps.strategy.profiles import build_profile\n"
        "build_profile(*json.loads(sys.argv[1])).save(sys.argv[2])\n"
    )
    with tempfile.TemporaryDirectory(prefix="tagps-profile-") as tmp:
        out = Path(tmp) / "profile.json"
        env = {**os.environ, "TAGPS_CACHE_DIR": tmp}  # its own op-time cache: every process measures afresh
        done = subprocess.run([sys.executable, "-c", code, json.dumps(args), str(out)], capture_output=True,
                              text=True, env=env)  # fmt: skip
        if done.returncode != 0:
            tail = done.stderr.strip()[-2000:]
            raise RuntimeError(f"profiling {args[0]} in process {index + 1} of {count} failed: {tail}")
        return load_profile(out)


def median_profile(profiles: Sequence[Profile]) -> Profile:
    """One profile from several of the same model, device type and batch sizes: the median of each op's
    times (refitted), of each whole pass and optimizer step, and of the core speeds.

    Raises:
        ValueError: no profiles, or profiles of different models, device types or batch sizes.
    """
    if not profiles:
        raise ValueError("median_profile needs at least one profile")
    first = profiles[0]
    for p in profiles[1:]:
        if (p.model, p.device_type, p.batch_sizes) != (first.model, first.device_type, first.batch_sizes):
            raise ValueError(
                f"median_profile: {p.model} on {p.device_type} at {p.batch_sizes} does not match "
                f"{first.model} on {first.device_type} at {first.batch_sizes}"
            )
    batches = first.batch_sizes
    k = range(len(batches))
    ops = []
    for i, op in enumerate(first.ops):
        fwd = tuple(statistics.median(p.ops[i].fwd_s[j] for p in profiles) for j in k)
        bwd = tuple(statistics.median(p.ops[i].bwd_s[j] for p in profiles) for j in k)
        ops.append(OpProfile.fitted(op.name, batches, fwd, bwd))
    whole = ModelTimes(
        tuple(statistics.median(p.whole.fwd_s[j] for p in profiles) for j in k),
        tuple(statistics.median(p.whole.bwd_s[j] for p in profiles) for j in k),
        {name: statistics.median(p.whole.apply_s[name] for p in profiles) for name in first.whole.apply_s},
        first.whole.param_bytes,
    )
    cores = [p.core_flops for p in profiles if p.core_flops is not None]
    core = statistics.median(cores) if cores else None
    host = {**first.host, "processes": str(len(profiles))}
    return Profile(first.model, first.device_type, first.peak_flops, batches, tuple(ops), whole, core, host)


def _core_flops() -> float:
    # The same probe as a calibration's core_flops, so that the two compare (tagps.cluster.measure).
    from tagps.cluster.measure import measure_core

    return measure_core()[0]


def time_model(model: str, batch_sizes: Sequence[int], repeats: int, device: str = "cpu") -> ModelTimes:
    """Time whole passes of reference model ``model`` and a step of each optimizer on the local ``device``.

    Like :func:`~tagps.strategy.graph.profile_graph`: training mode, one warm-up then ``repeats`` runs,
    thread CPU time with one CPU thread, but the median pass counts, not the fastest: the ops' fits are
    scaled to add up to these passes, and training pays the typical pass (vgg-mini at batch 48 on this
    host: 71 ms the fastest step of 12, 83 ms the median). Backward starts from the summed output (the
    loss's own cost is the loss op's, not the model's). Optimizers are built as training jobs build them
    (:func:`tagps.models.plan_optimizer`); each timed step follows a forward and backward pass, and the
    median step counts too.
    """
    import torch

    from tagps.models import build_model, example_inputs, plan_optimizer

    sync, clock = timing_clock(device)
    torch.manual_seed(0)
    net = build_model(model).to(device).train()
    fwd, bwd = [], []
    for batch in sorted(batch_sizes):
        inputs = example_inputs(model, batch, device)
        passes = []
        for k in range(repeats + 1):
            net.zero_grad(set_to_none=True)  # as training does: backward allocates the gradients
            sync()
            start = clock()
            loss = net(*inputs).float().sum()
            sync()
            mid = clock()
            loss.backward()
            sync()
            if k:
                passes.append((mid - start, clock() - mid))
        fwd.append(statistics.median(f for f, _ in passes))
        bwd.append(statistics.median(b for _, b in passes))
    # Each step follows a pass at the largest batch, as in training: steps back to back would find the
    # parameters, gradients and optimizer state in cache (2x faster for vgg-mini's Adam on this host's CPU).
    # Each step starts from the initial weights: the summed output is no loss to descend, and a few steps
    # on it left vgg-mini's weights NaN, on which Adam's step ran 2x faster (11 against 20 ms here).
    params = [p for p in net.parameters() if p.requires_grad]
    initial = [p.detach().clone() for p in params]
    inputs = example_inputs(model, max(batch_sizes), device)
    apply = {}
    for name in OPTIMIZERS:
        optimizer = plan_optimizer(name, params)
        times = []
        for k in range(repeats + 1):
            with torch.no_grad():
                for p, p0 in zip(params, initial, strict=True):
                    p.copy_(p0)
            optimizer.zero_grad(set_to_none=True)
            net(*inputs).float().sum().backward()
            sync()
            start = clock()
            optimizer.step()
            sync()
            if k:
                times.append(clock() - start)
        # The typical step, not the fastest: a memory-bound step varies with what the pass left in cache
        # (vgg-mini's Adam: 12-17 ms over 8 steps here), and training pays the typical one.
        apply[name] = statistics.median(times)
    return ModelTimes(tuple(fwd), tuple(bwd), apply, sum(p.numel() * p.element_size() for p in params))

