"""Emulated clusters on one host: each machine a network namespace, links limited with ``tc``.

See :mod:`tagps.cluster.netns` and ``docs/launcher.md``. Needs root; :func:`check_support` says why not.
"""

from tagps.cluster.netns import (
    NETWORK,
    PREFIX,
    ClusterError,
    LinkLimit,
    Network,
    Node,
    check_support,
    down_all,
    up,
)

__all__ = [
    "NETWORK",
    "PREFIX",
    "ClusterError",
    "LinkLimit",
    "Network",
    "Node",
    "check_support",
    "down_all",
    "up",
]
