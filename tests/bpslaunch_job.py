"""Run a test's worker script as a real ``bpslaunch --local`` job and collect every rank's results.

The worker takes ``--cases FILE`` (the JSON the test passes: a list of cases or one case object) and
``--out DIR``, and writes ``DIR/rank<R>.json``. Tests of jobs with summation servers run them under each
PS data plane, :data:`PS_ENGINES`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tagps import _core

REPO = Path(__file__).resolve().parents[1]
#: The PS data planes (TAGPS_PS_ENGINE) that jobs with summation servers run with.
PS_ENGINES = ("python", "cpp")


def ps_engine_env(engine: str) -> dict[str, str]:
    """``TAGPS_PS_ENGINE`` for every server and worker of a job; skips ``cpp`` when the core lacks libzmq."""
    if engine == "cpp" and not _core.HAVE_NET:
        pytest.skip("TAGPS_PS_ENGINE=cpp: tagps._core was built without libzmq (HAVE_NET is False)")
    return {"TAGPS_PS_ENGINE": engine}


def run_job(
    worker: Path,
    tmp: Path,
    cases: Any,
    *,
    workers: int,
    servers: int = 0,
    local_size: int | Sequence[int] = 1,
    env: dict[str, str] | None = None,
    timeout: float = 150.0,
) -> list[dict[str, Any]]:
    """Run ``worker`` on ``workers`` machines of ``local_size`` processes each (or as many as each
    machine's entry, ``bpslaunch --local-size 1,2``) with ``servers`` summation servers.

    Returns:
        Each rank's ``rank<R>.json``, in rank order.

    Raises:
        AssertionError: the job failed or timed out (with its output).
    """
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "cases.json").write_text(json.dumps(cases))
    sizes = [local_size] * workers if isinstance(local_size, int) else list(local_size)
    cmd = [
        sys.executable, "-m", "tagps.launcher", "--local", str(workers), "--servers", str(servers),
        "--local-size", ",".join(map(str, sizes)), "--grace", "2", "--",
        sys.executable, str(worker), "--cases", str(tmp / "cases.json"), "--out", str(tmp),
    ]  # fmt: skip
    child_env = {**os.environ, "TAGPS_DIST_TIMEOUT": "60", **(env or {})}
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=child_env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"job timed out after {timeout} s:\n{exc.stdout}\n{exc.stderr}") from None
    output = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{output}"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(sum(sizes))]
