"""What the benchmarks in ``bench/`` share: the machine description, interleaved timing and the JSON file.

The benchmarks run as ``python bench/NAME.py``, so this folder is on ``sys.path`` and they import this
module as ``benchlib``.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Fresh processes a benchmark's op profile is the median of (tagps.strategy.profiles.build_profile): on a
# shared host each process draws its own speed.
PROFILE_PROCESSES = 3


def _cpuinfo(field: str) -> str | None:
    """The value of the first ``field`` line of /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> list[str]:
    """The CPU feature flags of the first processor in /proc/cpuinfo (empty where there is none)."""
    return (_cpuinfo("flags") or "").split()


def machine_info(cpu_key: str = "cpu_model", **extra: Any) -> dict[str, Any]:
    """CPU model (under ``cpu_key``), core count, Python and torch versions, then ``extra`` as given."""
    import torch

    return {
        cpu_key: _cpuinfo("model name") or platform.processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **extra,
    }


def command_line() -> str:
    """How this benchmark was started, as a shell command (the interpreter by its file name)."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def repo_relative(path: Path) -> str:
    """``path`` as recorded commands name it: relative to the repository root when inside it."""
    root, full = Path(__file__).resolve().parent.parent, path.resolve()
    return str(full.relative_to(root)) if full.is_relative_to(root) else str(path)


def write_json(path: Path, payload: dict[str, Any], indent: int = 2) -> None:
    """Write ``payload`` to ``path`` as JSON with a final newline, making the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent) + "\n")


def best_times(
    candidates: dict[str, Callable[[], object]], rounds: int, medians: dict[str, float]
) -> dict[str, float]:
    """Fastest seconds per call of each candidate, timed in interleaved rounds after one warm-up call;
    the medians are added to ``medians``."""
    for fn in candidates.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    medians.update({name: statistics.median(times) for name, times in samples.items()})
    return {name: min(times) for name, times in samples.items()}
