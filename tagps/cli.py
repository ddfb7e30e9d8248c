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


def _run_simulate(args: argparse.Namespace) -> int:
    from tagps.models import default_batch_size
    from tagps.strategy.baselines import BASELINES
    from tagps.strategy.plan import load
    from tagps.strategy.simulator import Simulator, summarize
    from tagps.strategy.topology import load_topology

    if args.strategy in BASELINES:
        if not args.model:
            raise SystemExit("tagps simulate: --model is required with a baseline strategy")
        sim = Simulator.for_model(args.model, load_topology(args.topology), args.groups)
        batch = args.batch or default_batch_size(args.model)
        plan = BASELINES[args.strategy](sim, batch)
    else:
        plan = load(args.strategy)
        if args.batch and args.batch != plan.batch_size:
            raise SystemExit(f"tagps simulate: --batch {args.batch} is not the plan's {plan.batch_size}")
        sim = Simulator.for_plan(plan)
    result = sim.evaluate(plan, trace=bool(args.trace))
    print(f"model {sim.graph.name}, topology {sim.topology.name}, strategy {args.strategy}, "
          f"batch {plan.batch_size}, {len(sim.groups)} op groups")
    print(summarize(result, plan.batch_size))
    if args.trace:
        result.save_chrome_trace(args.trace)
        print(f"Chrome trace written to {args.trace}")
    return 0 if result.feasible else 1


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate one training iteration of a strategy")
    p.add_argument("--model", help="reference model (see tagps.models.MODELS), needed with a baseline")
    p.add_argument("--topology", default="paper-testbed", help="preset, random:<seed> or a YAML/JSON file")
    p.add_argument("--strategy", default="dp-nccl",
                   help="dp-nccl, dp-nccl-p, horovod-like, byteps-like or a plan file")
    p.add_argument("--batch", type=int, default=0, help="global batch size (default: the model's)")
    p.add_argument("--groups", type=int, default=60, help="op groups for baselines (METIS)")
    p.add_argument("--trace", help="write a Chrome trace (chrome://tracing, Perfetto) to this file")
    p.set_defaults(func=_run_simulate)


def _run_topology(args: argparse.Namespace) -> int:
    from tagps.strategy.topology import load_topology

    print(load_topology(args.spec).describe())
    return 0


def _add_topology(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("topology", help="inspect device topologies")
    actions = p.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="print a topology (preset, random:<seed> or file)")
    show.add_argument("spec")
    show.set_defaults(func=_run_topology)


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the `tagps` command."""
    parser = argparse.ArgumentParser(prog="tagps", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_cluster(sub)
    _add_simulate(sub)
    _add_topology(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `tagps` command line and return its exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
