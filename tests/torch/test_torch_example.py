"""examples/train_synthetic.py runs unchanged under ``bpslaunch --local`` with Horovod's flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("servers", [0, 1])
def test_synthetic_benchmark_under_bpslaunch(tmp_path: Path, servers: int) -> None:
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "tagps.launcher", "--local", "2", "--servers", str(servers), "--",
        sys.executable, str(REPO / "examples" / "train_synthetic.py"), "--model", "vgg-mini",
        "--batch-size", "4", "--image-size", "32", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
        "--num-iters", "2", "--fp16-allreduce", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Total img/sec on 2 worker(s)" in proc.stdout
    result = json.loads(out.read_text())
    assert result["workers"] == 2 and result["method"] == "auto" and result["samples_per_s"] > 0
