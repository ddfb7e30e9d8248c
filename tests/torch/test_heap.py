"""tagps.torch.init() keeps freed buffers in the C heap, so a training step does not fault them in afresh."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from tagps.heap import glibc_env

# Adam steps of a WIDTH x 1024 weight: its gradient (zero_grad sets it to None) and the step's sqrt and
# division temporaries are allocated and freed every step. Width 2048: 8 MiB each, below glibc's largest
# mmap threshold (32 MiB); 9216: 36 MiB, above it, as VGG19's largest weight (64 MiB).
_STEPS = r"""
import resource, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "init":
    import tagps.torch as bps
    bps.init()
width = int(sys.argv[2])
model = torch.nn.Sequential(torch.nn.Linear(1024, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
opt = torch.optim.Adam(model.parameters())
x = torch.randn(16, 1024)
def step():
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def _faults_per_step(mode: str, width: int, env: dict[str, str] | None = None) -> float:
    done = subprocess.run(
        [sys.executable, "-c", _STEPS, mode, str(width)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout)


LINUX_ONLY = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc (mallopt) is Linux's"
)


@functools.cache  # both tests compare with the same run
def _plain_faults(width: int) -> float:
    """Faults a step under glibc's defaults; skips where the C library does not fault the buffers in."""
    plain = _faults_per_step("plain", width)
    if plain < 1000:
        pytest.skip(f"this C library's malloc does not fault temporaries in afresh ({plain:.0f} a step)")
    return plain


@LINUX_ONLY
@pytest.mark.parametrize("width", [2048, 9216])
def test_init_keeps_freed_buffers(no_job_layout: None, width: int) -> None:  # init(): a job of one process
    plain = _plain_faults(width)
    # glibc's defaults: about 4,000 faults a step at width 2048 (the 8 MiB temporaries, page by page), about
    # 27,000 at 9216; kept: 0, but for the heap's growth, once (4,096 faults seen in one run).
    assert _faults_per_step("init", width) < plain / 4


@LINUX_ONLY
@pytest.mark.parametrize("width", [2048, 9216])
def test_glibc_env_gives_a_process_without_tagps_the_same_heap(width: int) -> None:
    # What the benchmarks give Horovod: the heap of init() without calling it.
    plain = _plain_faults(width)
    assert _faults_per_step("plain", width, glibc_env()) < plain / 4
