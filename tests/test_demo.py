"""`tagps demo` runs end to end and prints its table: plan and DDP rows, measured and predicted, losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tagps.cluster import ClusterError, check_support
from tagps.strategy.calibration import Calibration

ROW = re.compile(
    r"^(tagps plan|DDP all-reduce)\s+(\d+) dev \[[\d,]+\] .*?\s([\d.]+)\s+([\d.]+)\s+[+-][\d.]+%\s+[\d.]+\s+"
    r"([\d.]+) -> ([\d.]+)",
    re.M,
)


def _root() -> str | None:
    try:
        check_support()
    except ClusterError as exc:
        return str(exc)
    return None


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize("where", ["local", "cluster"])
def test_demo_prints_measured_and_predicted_rows(where: str, tmp_path: Path) -> None:
    if where == "cluster" and (reason := _root()):
        pytest.skip(f"the emulated-cluster demo needs root and network namespaces: {reason}")
    # A calibration in a private cache, so the test neither calibrates nor reads the user's cache.
    Calibration(100e9, 20e9, 0.7, 0.2, 10e-6, 100e-6, 50e-6, 0.9, 0.9).save(tmp_path / "calibration.json")
    env = {**os.environ, "TAGPS_CACHE_DIR": str(tmp_path)}
    local = ["--local"] if where == "local" else []
    argv = [sys.executable, "-m", "tagps.cli", "demo", "--steps", "4", *local]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=270)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert ("local processes" if where == "local" else "emulated cluster 'demo'") in out
    rows = {m.group(1): m for m in ROW.finditer(out)}
    assert set(rows) == {"tagps plan", "DDP all-reduce"}, out
    for m in rows.values():
        measured, predicted = float(m.group(3)), float(m.group(4))
        assert measured > 0 and predicted > 0
    ddp = rows["DDP all-reduce"]
    assert int(ddp.group(2)) == (2 if where == "local" else 3)  # DDP uses every device
    assert float(ddp.group(6)) < float(ddp.group(5))  # the loss goes down


def test_demo_rejects_bad_steps() -> None:
    from tagps.cli import main

    with pytest.raises(SystemExit, match="--steps must be >= 1"):
        main(["demo", "--steps", "0"])
