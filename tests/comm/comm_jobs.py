"""Run a comm-test worker script as a real ``bpslaunch --local`` job; collect every rank's result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_job(
    worker: Path, tmp: Path, case: dict[str, Any], *, workers: int, servers: int, local_size: int | list[int]
) -> list[dict[str, Any]]:
    """Run ``worker --case FILE --out DIR`` on ``workers`` machines of ``local_size`` processes (or as many
    as each machine's entry, ``bpslaunch --local-size 1,2``).

    Returns:
        Each rank's ``DIR/rank<R>.json``.

    Raises:
        AssertionError: the job failed or timed out (with its output).
    """
    (tmp / "case.json").write_text(json.dumps(case))
    sizes = [local_size] * workers if isinstance(local_size, int) else local_size
    cmd = [
        sys.executable, "-m", "tagps.launcher", "--local", str(workers), "--servers", str(servers),
        "--local-size", ",".join(map(str, sizes)), "--grace", "2", "--",
        sys.executable, str(worker), "--case", str(tmp / "case.json"), "--out", str(tmp),
    ]  # fmt: skip
    env = {**os.environ, "TAGPS_DIST_TIMEOUT": "60", "BYTEPS_PARTITION_BYTES": "4096"}
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"job timed out:\n{exc.stdout}\n{exc.stderr}") from None
    assert proc.returncode == 0, (
        f"job failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(sum(sizes))]
