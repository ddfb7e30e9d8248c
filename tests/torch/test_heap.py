"""tagps.torch.init() keeps freed buffers in the C heap, so a training step does not fault them in afresh."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tagps.heap import glibc_env

# An Adam step of an 8 MiB weight: its sqrt and division temporaries are allocated and freed every step.
_STEPS = r"""
import resource, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "init":
    import tagps.torch as bps
    bps.init()
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
opt = torch.optim.Adam(model.parameters())
x = torch.randn(16, 1024)
def step():
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def _faults_per_step(mode: str, env: dict[str, str] | None = None) -> float:
    done = subprocess.run(
        [sys.executable, "-c", _STEPS, mode],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (mallopt) is Linux's")
def test_init_keeps_freed_buffers(no_job_layout: None) -> None:  # init(): a job of one process
    plain = _faults_per_step("plain")
    if plain < 1000:
        pytest.skip(f"this C library's malloc does not fault temporaries in afresh ({plain:.0f} a step)")
    # glibc's defaults: about 4,000 faults a step (the two 8 MiB temporaries, page by page); kept: 0, but
    # for the heap's growth, once (4,096 faults seen in one run).
    assert _faults_per_step("init") < plain / 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (mallopt) is Linux's")
def test_glibc_env_gives_a_process_without_tagps_the_same_heap() -> None:
    # What the benchmarks give Horovod: the heap of init() without calling it.
    plain = _faults_per_step("plain")
    if plain < 1000:
        pytest.skip(f"this C library's malloc does not fault temporaries in afresh ({plain:.0f} a step)")
    assert _faults_per_step("plain", glibc_env()) < plain / 4
