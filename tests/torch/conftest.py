"""Shared fixtures of the torch-adapter tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tagps.torch as bps

# The job layout a launcher sets; without them tagps.torch.init() makes a job of one process.
LAYOUT_VARS = ("DMLC_NUM_WORKER", "DMLC_WORKER_ID", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI",
               "DMLC_PS_ROOT_PORT", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE", "TAGPS_DIST_PORT",
               "DMLC_ROLE")  # fmt: skip


@pytest.fixture
def no_job_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove the launcher's layout variables for this test."""
    for name in LAYOUT_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def world_of_one(no_job_layout: None) -> Iterator[None]:
    """tagps.torch initialised as a job of one process, shut down afterwards."""
    bps.init()
    try:
        yield
    finally:
        bps.shutdown()
