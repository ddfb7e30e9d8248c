"""Emulated clusters on one host: each machine a network namespace, links limited with ``tc``.

See :mod:`tagps.cluster.netns` and ``docs/launcher.md``. Needs root; :func:`check_support` says why not.
"""

from tagps.cluster import netns
from tagps.cluster.netns import *  # noqa: F403  # re-exports exactly netns.__all__

__all__ = netns.__all__
