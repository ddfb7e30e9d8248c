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


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the `tagps` command."""
    parser = argparse.ArgumentParser(prog="tagps", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `tagps` command line and return its exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
