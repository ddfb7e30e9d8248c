"""Shared by the cluster tests: what of an emulated network is left on this host."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest


def _names(index: int) -> list[str]:
    """The namespaces and links of network ``index`` that exist now, as ``ip`` lists them."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    found = [line.split()[0] for line in ns.splitlines() if line.startswith(f"tagps-{index}-")]
    found += [
        line.split(": ")[1].split("@")[0]
        for line in links.splitlines()
        if line.split(": ")[1].startswith((f"tagps-{index}b", f"tagps-{index}v"))
    ]
    return found


@pytest.fixture
def netns_names() -> Callable[[int], list[str]]:
    """A function: the namespaces and links of network ``index`` that exist now (``ip`` lists them)."""
    return _names
