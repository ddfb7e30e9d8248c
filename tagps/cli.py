"""`tagps` command line: one subcommand per job (demo, simulate, topology, plan, show, cluster, bench).

Each subcommand lives in a small ``_add_<name>`` function that declares its arguments and points at the
function that runs it; the heavy modules are imported only inside those functions so `tagps --help`
stays fast.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent


def _run_demo(args: argparse.Namespace) -> int:
    # Until the runtime can run a whole job, the demo is the kernel benchmark in quick mode.
    return subprocess.call([sys.executable, str(REPO / "bench" / "kernels.py"), "--quick"])


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job on an embedded default cluster")
    p.set_defaults(func=_run_demo)


def _run_cluster_down(args: argparse.Namespace) -> int:
    from tagps.cluster import ClusterError, down_all

    try:
        removed = down_all()
    except ClusterError as exc:
        print(f"tagps cluster down: {exc}", file=sys.stderr)
        return 1
    print(f"removed {len(removed)} namespaces and links" + (f": {' '.join(removed)}" if removed else ""))
    return 0


def _add_cluster(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="emulated clusters: network namespaces with tc-limited links")
    cluster = p.add_subparsers(dest="cluster_command", required=True)
    down = cluster.add_parser("down", help="remove every tagps- namespace and link (also after a crash)")
    down.set_defaults(func=_run_cluster_down)


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the `tagps` command."""
    parser = argparse.ArgumentParser(prog="tagps", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_cluster(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `tagps` command line and return its exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
