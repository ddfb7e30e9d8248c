"""Session-wide test set-up: the suite sees no per-user tagps cache.

``TAGPS_CACHE_DIR`` points at a fresh empty directory for the whole run, and every process the tests start
inherits it. Without it, profiles that ``tagps profile`` left in ``~/.cache/tagps`` replace the shipped ones,
and so do a calibration and cached graphs: the simulator's recorded regression figures then fail on a
developer's machine while CI, which has no such cache, passes. Tests that need a cache of their own still
set one.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE_DIR_KEY = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    path = tempfile.mkdtemp(prefix="tagps-test-cache-")
    config.stash[_CACHE_DIR_KEY] = path
    os.environ["TAGPS_CACHE_DIR"] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_CACHE_DIR_KEY, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
