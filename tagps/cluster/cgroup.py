"""CPU quotas for emulated machines: one CPU cgroup per machine (cgroup v2 ``cpu.max`` or v1 CFS quota).

A quota of ``c`` cores lets the cgroup's processes run ``c * period`` microseconds per ``period`` (10 ms,
longer only where ``c * 10 ms`` would be under the kernel's 1 ms minimum quota) in all; that is how a
"machine" of a :mod:`tagps.cluster` is made slower than another on one host. The period is short because a
quota is a burst allowance, not a speed: a machine idle for a while runs at full speed until the period's
quota is spent. With the kernel's default 100 ms period a 0.35-core machine that waited on the network ran
35 ms at a whole core, so a pipelined plan whose machines take turns ran up to a third faster than machines
of that speed would, and a step that met the end of a period's quota waited for the next one (bimodal step
times: 0.21 and 0.28 s alternating in one run). 10 ms periods keep bursts within one op's time. The
kernel's shortest (``1 ms / c``) was tried and dropped: it cut the bursts (a 5 ms burst of CPU after
idling at 0.35 cores took 11 ms of wall against 7 at 10 ms) but a busy machine then got less than its
quota (transformer-mini's steps 18 % slower at 8 % more CPU a step), which the simulator's probes miss
(docs/simulator.md, Known limits).
Cgroups are named ``tagps-<k>-<machine>`` like the machine's namespace, so :func:`remove_all` finds
exactly the project's own after a crash. A process enters its cgroup before it execs its command
(``python -m tagps.cluster.cgroup CGROUP -- CMD``), so everything it forks later is held too.

Needs root and a CPU controller (cgroup v2 with ``cpu`` enabled at the root, or a v1 ``cpu`` hierarchy).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tagps.cluster.netns import PREFIX, ClusterError

__all__ = ["CPU_PERIOD_US", "CpuCgroup", "cgroup_root", "create", "join_argv", "remove_all"]

CPU_PERIOD_US = 10_000
_MIN_QUOTA_US = 1_000  # the kernel's smallest cfs quota
_ROOT = Path("/sys/fs/cgroup")


def cgroup_root() -> tuple[Path, int]:
    """Return the directory under which CPU cgroups are made and the cgroup version (1 or 2).

    Raises:
        ClusterError: not root, or neither a v2 ``cpu`` controller nor a v1 ``cpu`` hierarchy is mounted.
    """
    if os.geteuid() != 0:
        raise ClusterError("CPU quotas need root (cgroups): run as root, or give no machine a cpu quota")
    controllers = _ROOT / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        return _ROOT, 2
    for name in ("cpu", "cpu,cpuacct"):
        if (_ROOT / name / "cpu.cfs_quota_us").is_file():
            return _ROOT / name, 1
    raise ClusterError(
        f"no CPU cgroup controller under {_ROOT} (neither cgroup v2 with 'cpu' in cgroup.controllers nor a "
        "v1 'cpu' hierarchy): CPU quotas are not possible here; give no machine a cpu quota"
    )


class CpuCgroup:
    """One CPU cgroup with a quota; made by :func:`create`, removed by :meth:`remove`.

    Args:
        path: the cgroup's directory.
        version: 1 or 2.
        cores: the quota in cores.
    """

    def __init__(self, path: Path, version: int, cores: float) -> None:
        self.path, self.version, self.cores = path, version, cores

    def __repr__(self) -> str:
        return f"CpuCgroup({str(self.path)!r}, v{self.version}, {self.cores:g} cores)"

    def pids(self) -> list[int]:
        """Processes in the cgroup now (empty once it is removed)."""
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def remove(self) -> None:
        """Kill what still runs in the cgroup and remove it; idempotent."""
        _remove(self.path)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise ClusterError(f"cannot write {text!r} to {path}: {exc}") from None


def create(name: str, cores: float) -> CpuCgroup:
    """Create (or reset) CPU cgroup ``name`` limited to ``cores`` cores.

    Args:
        name: the cgroup's name; must start with ``tagps-``.
        cores: the quota in cores (> 0; more than the host's cores is allowed and means no throttling).

    Raises:
        ValueError: a bad name or quota.
        ClusterError: no CPU controller, not root, or the kernel refused.
    """
    if not name.startswith(PREFIX) or "/" in name:
        raise ValueError(f"cgroup name must start with {PREFIX!r} and contain no '/', got {name!r}")
    if not cores > 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    root, version = cgroup_root()
    path = root / name
    period = max(CPU_PERIOD_US, math.ceil(_MIN_QUOTA_US / cores))
    quota = max(_MIN_QUOTA_US, round(cores * period))
    if version == 2:
        subtree = root / "cgroup.subtree_control"
        if "cpu" not in subtree.read_text().split():
            _write(subtree, "+cpu")
        path.mkdir(exist_ok=True)
        _write(path / "cpu.max", f"{quota} {period}")
    else:
        path.mkdir(exist_ok=True)
        _write(path / "cpu.cfs_period_us", str(period))
        _write(path / "cpu.cfs_quota_us", str(quota))
    return CpuCgroup(path, version, cores)


def join_argv(cgroup: CpuCgroup | None, argv: Sequence[str]) -> list[str]:
    """Return the command line that runs ``argv`` inside ``cgroup`` (``argv`` itself when ``None``)."""
    if not argv:
        raise ValueError("empty command")
    if cgroup is None:
        return list(argv)
    return [sys.executable, "-m", "tagps.cluster.cgroup", str(cgroup.path), "--", *argv]


def _remove(path: Path) -> None:
    pids: list[int] = []
    for _ in range(50):  # a killed process leaves the cgroup once it is reaped: wait up to 5 s
        procs = path / "cgroup.procs"
        if not procs.is_file():
            return
        pids = [int(x) for x in procs.read_text().split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    raise ClusterError(f"cannot remove cgroup {path}: processes {pids} do not exit")


def remove_all() -> list[str]:
    """Remove every CPU cgroup named ``tagps-...`` (killing what runs inside); idempotent.

    Returns:
        The paths removed; empty where there is no CPU controller.
    """
    try:
        root, _ = cgroup_root()
    except ClusterError:
        return []
    removed = []
    for path in sorted(root.glob(f"{PREFIX}*")):
        if path.is_dir():
            _remove(path)
            removed.append(str(path))
    return removed


def _main(argv: Sequence[str]) -> None:
    """``python -m tagps.cluster.cgroup CGROUP -- CMD...``: enter CGROUP, then exec CMD."""
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m tagps.cluster.cgroup CGROUP_DIR -- CMD [ARGS...]")
    procs = Path(argv[0]) / "cgroup.procs"
    try:
        procs.write_text(str(os.getpid()))
    except OSError as exc:
        raise SystemExit(f"tagps.cluster.cgroup: cannot enter {argv[0]}: {exc}") from None
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    _main(sys.argv[1:])
