"""`tagps` command line: one subcommand per job (demo, cluster, simulate, topology, plan, show, profile).

Each subcommand lives in a small ``_add_<name>`` function that declares its arguments and points at the
function that runs it; the heavy modules are imported only inside those functions so `tagps --help`
stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tagps.atomic import write_text_atomic

if TYPE_CHECKING:
    from tagps.cluster.run import Cluster
    from tagps.strategy.calibration import Calibration
    from tagps.strategy.simulator import Simulator
    from tagps.strategy.topology import Topology

__all__ = ["main"]


def _run_demo(args: argparse.Namespace) -> int:
    from tagps.cluster.demo import demo

    if args.steps < 1:
        raise SystemExit("tagps demo: --steps must be >= 1")
    demo(steps=args.steps, local=args.local)
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="plan vgg-mini for an embedded cluster (emulated with root, else local processes), train it "
        "with the plan and with DDP all-reduce, compare measured and predicted step times",
    )
    p.add_argument("--steps", type=int, default=24, help="timed training steps per strategy (default 24)")
    p.add_argument("--local", action="store_true", help="local processes even where root allows namespaces")
    p.set_defaults(func=_run_demo)


def _run_cluster_down(args: argparse.Namespace) -> int:
    from tagps.cluster import ClusterError
    from tagps.cluster.run import down, down_all
    from tagps.cluster.spec import load_spec

    try:
        removed = down(load_spec(args.spec).name) if args.spec else down_all()
    except (ClusterError, ValueError) as exc:
        print(f"tagps cluster down: {exc}", file=sys.stderr)
        return 1
    print(
        f"removed {len(removed)} namespaces, links, cgroups and records"
        + (f": {' '.join(removed)}" if removed else "")
    )
    return 0


def _print_cluster(cluster: Cluster, topology: Topology) -> None:
    print(f"cluster {cluster.spec.name}: {len(cluster.spec.machines)} machines on {cluster.network.bridge}")
    print(
        f"{'machine':<10} {'address':<15} {'netns':<22} {'workers':>7} {'servers':>7} {'cpu':>6} "
        f"{'Mbit/s':>8}"
    )
    for m in cluster.spec.machines:
        print(
            f"{m.name:<10} {cluster.address(m.name):<15} {cluster.network.node(m.name).netns:<22} "
            f"{m.workers:>7} {m.servers:>7} {m.cpu if m.cpu is not None else '-':>6} "
            f"{m.rate_mbit if m.rate_mbit is not None else '-':>8}"
        )
    print("measured:")
    print(topology.describe())


def _run_cluster_up(args: argparse.Namespace) -> int:
    import json

    from tagps.cluster import ClusterError
    from tagps.cluster.run import up

    try:
        cluster = up(args.spec)
    except (ClusterError, ValueError) as exc:
        print(f"tagps cluster up: {exc}", file=sys.stderr)
        return 1
    try:
        topology = cluster.topology(args.probe_seconds)
        path = Path(args.topology or f"{cluster.spec.name}.topology.json")
        write_text_atomic(path, json.dumps(topology.to_dict(), indent=1) + "\n")
    except BaseException:
        cluster.down()
        raise
    _print_cluster(cluster, topology)
    print(
        f"topology written to {path}; `tagps cluster run {args.spec} -- CMD` runs a job, "
        "`tagps cluster down` removes it"
    )
    return 0


def _run_cluster_run(args: argparse.Namespace) -> int:
    from tagps.cluster import ClusterError
    from tagps.cluster.run import running
    from tagps.cluster.spec import load_spec

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("tagps cluster run: give the worker command after --", file=sys.stderr)
        return 2
    devices = servers = None
    env: dict[str, str] = {}
    stack = contextlib.ExitStack()  # takes down a cluster that this run brought up
    try:
        spec = load_spec(args.spec)
        if args.plan:
            from tagps.cluster.experiment import plan_env, plan_servers
            from tagps.strategy.plan import load

            plan = load(args.plan)
            devices, servers, env = plan.worker_devices(), plan_servers(plan), plan_env(plan)
            # Checked before anything starts: a rank on a device the spec lacks would train the wrong layout.
            missing = [d for d in devices if d not in spec.devices()]
            if missing:
                raise ValueError(f"plan {args.plan} runs on {missing}, which cluster {spec.name!r} lacks")
        cluster = stack.enter_context(running(spec))
    except (ClusterError, ValueError) as exc:
        print(f"tagps cluster run: {exc}", file=sys.stderr)
        return 1
    with stack:
        return cluster.run(command, devices=devices, servers=servers, env={**os.environ, **env})


def _add_cluster(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="emulated clusters: network namespaces with tc-limited links")
    cluster = p.add_subparsers(dest="cluster_command", required=True)
    upp = cluster.add_parser(
        "up", help="build the cluster of SPEC.yaml (namespaces, tc limits, cgroup CPU quotas) and measure it"
    )
    upp.add_argument("spec", help="cluster spec (YAML/JSON, see docs/cluster.md)")
    upp.add_argument("--topology", help="where to write the measured topology (default: NAME.topology.json)")
    upp.add_argument("--probe-seconds", type=float, default=0.5, help="seconds per bandwidth probe")
    upp.set_defaults(func=_run_cluster_up)
    run = cluster.add_parser(
        "run", help="run scheduler, servers and workers of SPEC.yaml in their namespaces (up if needed)"
    )
    run.add_argument("spec", help="cluster spec (YAML/JSON)")
    run.add_argument(
        "--plan",
        help="run one worker per device of this plan (rank r on its r-th worker device, TAGPS_DEVICE set) "
        "and the summation servers it needs, at the plan's PS partition size; default: every device and "
        "the spec's servers",
    )
    run.add_argument("command", nargs="*", help="-- CMD: the worker command (main() splits it off at --)")
    run.set_defaults(func=_run_cluster_run)
    down = cluster.add_parser(
        "down", help="remove every tagps- namespace, link, cgroup and record (also after a crash)"
    )
    down.add_argument("spec", nargs="?", help="remove only the cluster of this spec (default: all)")
    down.set_defaults(func=_run_cluster_down)


def _add_calibration(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--calibration",
        metavar="FILE",
        help="simulate with the constants of this calibration (`python -m tagps.calibrate` writes "
        "one; see docs/cluster.md); default: the topology's and device table's own",
    )


def _load_calibration(args: argparse.Namespace) -> Calibration | None:
    """The calibration of ``--calibration`` (None without it); warns on stderr about constants on a bound.

    Raises:
        ValueError: the file is missing or not a valid calibration (the message names it).
    """
    if args.calibration is None:
        return None
    from tagps.strategy.calibration import load_calibration

    cal = load_calibration(args.calibration)
    for line in cal.bound_warnings():
        print(f"tagps {args.command}: calibration {args.calibration}: {line}", file=sys.stderr)
    return cal


def _calibrated(sim: Simulator, cal: Calibration | None) -> Simulator:
    """``sim`` with the calibration's constants (``sim`` itself without one)."""
    return sim if cal is None else cal.simulator(sim.graph, sim.grouping, sim.topology, sim.seed)


def _run_simulate(args: argparse.Namespace) -> int:
    from tagps.models import default_batch_size
    from tagps.strategy.baselines import BASELINES
    from tagps.strategy.plan import load
    from tagps.strategy.simulator import Simulator, summarize
    from tagps.strategy.topology import load_topology

    try:
        cal = _load_calibration(args)
        if args.strategy in BASELINES:
            if not args.model:
                raise ValueError("--model is required with a baseline strategy")
            sim = _calibrated(Simulator.for_model(args.model, load_topology(args.topology), args.groups), cal)
            batch = args.batch or default_batch_size(args.model)
            plan = BASELINES[args.strategy](sim, batch)
        else:
            plan = load(args.strategy)
            if args.batch and args.batch != plan.batch_size:
                raise ValueError(f"--batch {args.batch} is not the plan's batch size {plan.batch_size}")
            sim = _calibrated(Simulator.for_plan(plan), cal)
            # The file names the measured topology; a calibrated simulator has its calibrated copy.
            plan = dataclasses.replace(plan, topology=sim.topology)
        result = sim.evaluate(plan, trace=bool(args.trace))
    except ValueError as exc:
        print(f"tagps simulate: {exc}", file=sys.stderr)
        return 2
    print(
        f"model {sim.graph.name}, topology {sim.topology.name}, strategy {args.strategy}, "
        f"batch {plan.batch_size}, {len(sim.groups)} op groups"
        + (f", calibration {args.calibration}" if cal is not None else "")
    )
    print(summarize(result, plan.batch_size))
    if args.trace:
        result.save_chrome_trace(args.trace)
        print(f"Chrome trace written to {args.trace}")
    return 0 if result.feasible else 1


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate one training iteration of a strategy")
    p.add_argument("--model", help="reference model (see tagps.models.MODELS), needed with a baseline")
    p.add_argument("--topology", default="paper-testbed", help="preset, random:<seed> or a YAML/JSON file")
    p.add_argument(
        "--strategy", default="dp-nccl", help="dp-nccl, dp-nccl-p, horovod-like, byteps-like or a plan file"
    )
    p.add_argument("--batch", type=int, default=0, help="global batch size (default: the model's)")
    p.add_argument("--groups", type=int, default=60, help="op groups for baselines (METIS)")
    p.add_argument("--trace", help="write a Chrome trace (chrome://tracing, Perfetto) to this file")
    _add_calibration(p)
    p.set_defaults(func=_run_simulate)


def _run_topology(args: argparse.Namespace) -> int:
    from tagps.strategy.topology import load_topology

    try:
        print(load_topology(args.spec).describe())
    except ValueError as exc:
        print(f"tagps topology: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_topology(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("topology", help="inspect device topologies")
    actions = p.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="print a topology (preset, random:<seed> or file)")
    show.add_argument("spec")
    show.set_defaults(func=_run_topology)


def _run_plan(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tagps.models import default_batch_size
    from tagps.strategy.grouping import group_ops
    from tagps.strategy.mcts import SearchConfig, search
    from tagps.strategy.planner import graph_for, parse_budget, plan_model
    from tagps.strategy.report import summary
    from tagps.strategy.topology import load_topology

    try:
        cal = _load_calibration(args)
        budget = parse_budget(args.budget)
        config = SearchConfig(
            iterations=budget.iterations,
            seconds=budget.seconds,
            seed=args.seed,
            data_parallel=args.data_parallel,
            sfb=not args.no_sfb,
        )
        topology = load_topology(args.topology)
        if args.batch:
            batch = args.batch
        elif ":" in args.model:
            raise ValueError("--batch is required for a model given as pkg.module:factory")
        else:
            batch = default_batch_size(args.model)  # ValueError naming the known models
        prior = None
        if args.prior == "gnn":
            from tagps.strategy.gnn import DEFAULT_WEIGHTS, load_prior

            prior = load_prior(args.weights or DEFAULT_WEIGHTS)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tagps plan: {exc}", file=sys.stderr)
        return 2
    total = config.total_iterations if budget.iterations is not None else budget.seconds
    unit = "it" if budget.iterations is not None else "s"
    with tqdm(total=total, unit=unit, desc="searching", disable=args.quiet) as bar:
        clock = [0.0]

        def progress(iteration: int, best: float | None) -> None:
            if budget.iterations is not None:
                bar.update(1)
            else:
                now = bar.format_dict["elapsed"]
                bar.update(min(now, total) - clock[0])
                clock[0] = min(now, total)
            if best is not None and iteration % 10 == 0:
                bar.set_postfix_str(f"best {best * 1e3:.2f} ms", refresh=False)

        try:
            if cal is None:
                result, sim = plan_model(args.model, topology, batch, config, prior, args.groups, progress)
            else:  # plan_model's steps, on the calibrated simulator
                graph = graph_for(args.model)
                grouping = group_ops(graph, args.groups, config.seed)
                sim = cal.simulator(graph, grouping, topology, config.seed)
                result = search(sim, batch, config, model=prior, progress=progress)
        except ValueError as exc:
            print(f"tagps plan: {exc}", file=sys.stderr)
            return 2
    if result.plan is None:
        print(f"tagps plan: no plan fits in memory after {result.iterations} iterations", file=sys.stderr)
        return 1
    print(summary(result.plan, sim))
    print(
        f"search: {result.iterations} iterations, {result.evaluations} simulations, "
        f"{result.seconds:.1f} s, prior {args.prior}"
        + (f", calibration {args.calibration}" if cal is not None else "")
    )
    # The file names the given topology (the runtime's); a calibrated search ran on its calibrated copy.
    dataclasses.replace(result.plan, topology=topology).save(args.output)
    print(f"plan written to {args.output}")
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search a strategy with MCTS (GNN prior) and write it as JSON")
    p.add_argument("--model", required=True, help="reference model or pkg.module:factory")
    p.add_argument("--topology", default="paper-testbed", help="preset, random:<seed> or a YAML/JSON file")
    p.add_argument("--batch", type=int, default=0, help="global batch size (default: the model's)")
    p.add_argument("--budget", default="60s", help="wall time (60s, 2m) or iterations (500, 500it)")
    p.add_argument("--groups", type=int, default=60, help="op groups (METIS)")
    p.add_argument("--seed", type=int, default=0, help="seed of METIS and the search")
    p.add_argument("--prior", choices=("gnn", "uniform"), default="gnn", help="MCTS prior")
    p.add_argument("--weights", help="GNN weights (default: the shipped ones)")
    p.add_argument(
        "--data-parallel",
        action="store_true",
        help="only plans the first runtime executes (every group on the same devices)",
    )
    p.add_argument("--no-sfb", action="store_true", help="skip the SFB solver")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan")
    _add_calibration(p)
    p.set_defaults(func=_run_plan)


def _run_show(args: argparse.Namespace) -> int:
    from tagps.strategy.plan import PlanError, load
    from tagps.strategy.planner import simulator_for_plan
    from tagps.strategy.report import render_png, summary

    try:
        plan = load(args.plan)
        sim = simulator_for_plan(plan)
    except (PlanError, ValueError) as exc:
        print(f"tagps show: {exc}", file=sys.stderr)
        return 2
    png = args.png or str(Path(args.plan).with_suffix(".png"))
    result = render_png(plan, sim, png)
    print(summary(plan, sim, result))
    print(f"picture written to {png}")
    return 0


def _add_show(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print a plan and draw its placement and simulated timeline (PNG)")
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--png", help="picture to write (default: the plan's name with .png)")
    p.set_defaults(func=_run_show)


def _run_profile(args: argparse.Namespace) -> int:
    from tagps.strategy.graph import model_graph
    from tagps.strategy.grouping import grouping_from_names
    from tagps.strategy.profiles import build_profile, profile_path
    from tagps.strategy.simulator import Simulator
    from tagps.strategy.topology import DeviceGroup, Topology

    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
        if args.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        profile = build_profile(
            args.model,
            args.device,
            batches,
            args.repeats,
            args.device_type,
            args.threads or None,
            progress=not args.quiet,
            processes=args.processes,
        )
        path = Path(args.output) if args.output else profile_path(profile.model, profile.device_type)
        profile.save(path)
    except ValueError as exc:  # bad input
        print(f"tagps profile: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a profiling process failed
        print(f"tagps profile: {exc}", file=sys.stderr)
        return 1
    # What the simulator would say without the profile: one device of that type, every op in one group.
    graph = model_graph(profile.model)
    one = Topology("profiled", (DeviceGroup("device", profile.device_type, 1, 1.0),), 1.0)
    roofline = Simulator(graph, grouping_from_names(graph, [[op.name for op in graph.ops]]), one, profiles={})
    print(
        f"profiled {profile.model} on {profile.device_type} ({profile.host['device']}), "
        f"{len(profile.ops)} ops, forward + backward summed:"
    )
    print(f"{'batch':>6} {'measured ms':>12} {'fitted ms':>10} {'whole pass ms':>14} {'roofline ms':>12}")
    for k, b in enumerate(profile.batch_sizes):
        measured = sum(op.fwd_s[k] + op.bwd_s[k] for op in profile.ops)
        fitted = sum(sum(op.time(b)) for op in profile.ops)
        whole = profile.whole.fwd_s[k] + profile.whole.bwd_s[k]
        roof = sum(roofline.group_time(0, 0, float(b)))
        ms = (measured * 1e3, fitted * 1e3, whole * 1e3, roof * 1e3)
        print(f"{b:>6} {ms[0]:>12.3f} {ms[1]:>10.3f} {ms[2]:>14.3f} {ms[3]:>12.3f}")
    steps = ", ".join(f"{name} {s * 1e3:.3f} ms" for name, s in profile.whole.apply_s.items())
    print(f"optimizer step over {profile.whole.param_bytes / 2**20:.1f} MiB of parameters: {steps}")
    print("(the simulator scales the ops' fits to add up to the whole passes)")
    print(f"profile written to {path}; the simulator costs {profile.model} on {profile.device_type} with it")
    return 0


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="time every op of a model, forward and backward, on this CPU or GPU at a few batch "
        "sizes; the simulator then uses the profile instead of its roofline for that device type",
    )
    p.add_argument("--model", required=True, help="reference model (see tagps.models.MODELS)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="local device to time on")
    p.add_argument(
        "--device-type",
        help="device-table row the profile describes (default: CPU, or the GPU's row by its name)",
    )
    p.add_argument("--batches", default="1,8,32", help="batch sizes, comma separated (default 1,8,32)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per op; the fastest counts (default 5)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: a CPU device is one single-threaded worker; 0: torch's)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="profile in this many fresh processes one after another and keep each time's median "
        "(a shared host gives each process its own speed; default 1)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "-o",
        "--output",
        help="where to write it (default: TAGPS_CACHE_DIR/profiles/<model>.<device type>.json)",
    )
    p.set_defaults(func=_run_profile)


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the `tagps` command."""
    parser = argparse.ArgumentParser(prog="tagps", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_cluster(sub)
    _add_simulate(sub)
    _add_topology(sub)
    _add_plan(sub)
    _add_show(sub)
    _add_profile(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `tagps` command line and return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is a worker command (tagps cluster run): split it off before
    # argparse, which would otherwise stop matching options after SPEC or swallow the command's own.
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if command:
        if not hasattr(args, "command"):
            build_parser().error("only `tagps cluster run` takes a command after --")
        args.command = command
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
