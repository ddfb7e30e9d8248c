"""init() / shutdown() cycles: a job re-initialises 50 times and every cycle's all-reduce is exact."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CYCLES = 50
WORKER = textwrap.dedent(
    f"""
    import torch
    import tagps.torch as bps

    for cycle in range({CYCLES}):
        bps.init()
        out = bps.allreduce(torch.full((4,), float(bps.rank() + 1)), average=False, name="x")
        expected = sum(range(1, bps.size() + 1))
        if float(out[0]) != expected:
            raise SystemExit(f"cycle {{cycle}}: {{out.tolist()}} != {{expected}}")
        bps.shutdown()
    print("cycles done", {CYCLES}, flush=True)
    """
)


def test_fifty_init_shutdown_cycles_rebind_nothing(tmp_path: Path) -> None:
    script = tmp_path / "cycles.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "tagps.launcher", "--local", "2", "--servers", "0", "--grace", "2", "--",
           sys.executable, str(script)]  # fmt: skip
    env = {**os.environ, "TAGPS_DIST_TIMEOUT": "30"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert output.count(f"cycles done {CYCLES}") == 2, output[-3000:]
