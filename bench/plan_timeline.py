"""Where a plan's step goes: per-module forward and backward timestamps on every rank of its job.

Usage: python bench/plan_timeline.py PLAN [--spec SPEC] [--model M] [--steps N] [--warmup N] [--out FILE]

Runs PLAN's training job (``tagps.cluster.worker``) as ``tagps cluster run --plan`` would: on the emulated
cluster SPEC (needs root: namespaces, tc, cgroups; up if it is not), or without ``--spec`` as local
processes on this host (a plan for ``tagps.cluster.experiment.local_executor``'s topology). Every worker runs
inside a wrapper that stamps, on the wall clock (which the emulated machines share) and on its process's CPU
clock, each convolution's and linear layer's forward start and end, the moment its output's gradient
arrives (its backward starts), and each optimizer step's start and end.

It prints, per device, the median over the timed steps of: the forward (first module's start to last module's
end), the backward (first gradient to the optimizer step: the backward, the syncs and what they waited for),
the optimizer step, and the whole step, each as wall time and CPU time. CPU time much below wall time on a
machine that computes is waiting; wall time below CPU / quota is a burst (a CFS quota lets a machine that
waited run a full core until the period's share is spent). That is how the simulator's over-prediction of
pipelined plans on quota'd machines was traced (docs/simulator.md, Known limits). Writes JSON (default
bench/results/plan_timeline.json) with the machine, the command, every device's per-step phases and medians.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import command_line, machine_info, write_json

REPO = Path(__file__).resolve().parent.parent
EVENTS_ENV = "TAGPS_PLAN_TIMELINE_DIR"  # where each worker writes its events (worker mode)
PHASES = ("forward", "backward", "apply", "step")
# An event: (module or "optimizer", kind, wall seconds, process CPU seconds); kinds: "f0"/"f1" a module's
# forward start/end, "b0" its output's gradient arrived, "a0"/"a1" an optimizer step's start/end.
Event = tuple[str, str, float, float]


def record(model: Any, events: list[Event]) -> list[Any]:
    """Stamp every ``Conv*d`` and ``Linear`` module of ``model`` and every optimizer step into ``events``;
    return the hooks' handles (the optimizer's are global: remove them to stop)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def stamp(name: str, kind: str) -> None:
        events.append((name, kind, time.time(), time.process_time()))

    def after(name: str, out: Any) -> None:
        stamp(name, "f1")
        # The executor infers shapes on fake tensors first: those have no backward to time.
        if isinstance(out, torch.Tensor) and out.requires_grad and not isinstance(out, FakeTensor):
            out.register_hook(lambda grad: stamp(name, "b0"))

    timed = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear)
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, timed):
            handles.append(module.register_forward_pre_hook(lambda m, args, name=name: stamp(name, "f0")))
            handles.append(module.register_forward_hook(lambda m, args, out, name=name: after(name, out)))
    handles.append(register_optimizer_step_pre_hook(lambda opt, a, k: stamp("optimizer", "a0")))
    handles.append(register_optimizer_step_post_hook(lambda opt, a, k: stamp("optimizer", "a1")))
    return handles


def steps(events: list[Event]) -> list[dict[str, tuple[float, float]]]:
    """Cut one rank's events into steps (each ends with an optimizer step's end) and return, per complete
    step, ``{phase: (wall s, CPU s)}`` for :data:`PHASES`; a phase the rank did not run (no module of its
    own computed) is left out, and steps before the first optimizer step's end are skipped (warm-up)."""
    out: list[dict[str, tuple[float, float]]] = []
    current: list[Event] = []
    previous_end: Event | None = None
    for event in events:
        current.append(event)
        if event[1] != "a1":
            continue
        if previous_end is not None:
            out.append(_phases(previous_end, current))
        previous_end, current = event, []
    return out


def _phases(start: Event, step: list[Event]) -> dict[str, tuple[float, float]]:
    def span(a: Event, b: Event) -> tuple[float, float]:
        return b[2] - a[2], b[3] - a[3]

    kinds = {kind: [e for e in step if e[1] == kind] for kind in ("f0", "f1", "b0", "a0", "a1")}
    phases = {"step": span(start, kinds["a1"][-1])}
    if kinds["a0"]:
        phases["apply"] = span(kinds["a0"][-1], kinds["a1"][-1])
    if kinds["f0"] and kinds["f1"]:
        phases["forward"] = span(kinds["f0"][0], kinds["f1"][-1])
    if kinds["b0"] and kinds["a0"]:
        phases["backward"] = span(kinds["b0"][0], kinds["a0"][-1])
    return phases


def medians(per_step: list[dict[str, tuple[float, float]]]) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of each phase over ``per_step`` (phases no step has are left out)."""
    out = {}
    for phase in PHASES:
        seen = [s[phase] for s in per_step if phase in s]
        if seen:
            out[phase] = {
                "wall_s": statistics.median(w for w, _ in seen),
                "cpu_s": statistics.median(c for _, c in seen),
            }
    return out


def _worker(argv: list[str]) -> int:
    """Worker mode: ``tagps.cluster.worker`` with :func:`record` on its model; the events written at exit."""
    import tagps.cluster.worker as worker
    import tagps.models as models

    events: list[Event] = []
    build = models.build_model

    def build_recorded(*args: Any, **kwargs: Any) -> Any:
        model = build(*args, **kwargs)
        record(model, events)
        return model

    models.build_model = build_recorded  # the worker looks it up when it builds its model
    name = os.environ.get("TAGPS_DEVICE") or f"rank{os.environ.get('DMLC_WORKER_ID', '0')}"
    path = Path(os.environ[EVENTS_ENV]) / f"{name}.json"
    atexit.register(lambda: path.write_text(json.dumps(events)))
    return worker.main(argv)


def _run(args: argparse.Namespace, folder: Path) -> tuple[int, dict[str, Any]]:
    """Run the plan's job with every worker in worker mode; return its status and the cluster spec used
    (empty for local processes)."""
    from tagps.cluster.experiment import plan_env, plan_servers
    from tagps.launcher import local_job, run_processes
    from tagps.strategy.plan import load

    plan = load(args.plan)
    env = {**os.environ, **plan_env(plan), "OMP_NUM_THREADS": "1", EVENTS_ENV: str(folder)}
    command = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model or plan.model,
        "--plan", str(Path(args.plan).resolve()), "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]  # fmt: skip
    devices, servers = plan.worker_devices(), plan_servers(plan)
    if args.spec is None:
        return run_processes(local_job(command, len(devices), sum(servers.values()), 1, env)), {}
    from tagps.cluster.run import running
    from tagps.cluster.spec import load_spec

    spec = load_spec(args.spec)
    with running(spec) as cluster:
        return cluster.run(command, devices=devices, servers=servers, env=env), spec.to_dict()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="a plan file (tagps plan -o)")
    parser.add_argument("--spec", help="emulated cluster spec (default: local processes on this host)")
    parser.add_argument("--model", help="registry model (default: the plan's)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "plan_timeline.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        status, spec = _run(args, Path(tmp))
        recorded = {p.stem: json.loads(p.read_text()) for p in sorted(Path(tmp).glob("*.json"))}
    if status != 0 or not recorded:
        print(f"the plan's job failed with status {status}", file=sys.stderr)
        return 1
    per_device = {device: steps(events)[-args.steps :] for device, events in recorded.items()}
    summary = {device: medians(s) for device, s in per_device.items()}
    print(f"{'device':<10} " + " ".join(f"{p + ' wall/cpu ms':>22}" for p in PHASES))
    for device, phases in summary.items():
        cells = [
            f"{phases[p]['wall_s'] * 1e3:>10.1f} /{phases[p]['cpu_s'] * 1e3:>9.1f}"
            if p in phases
            else f"{'-':>22}"
            for p in PHASES
        ]
        print(f"{device:<10} " + " ".join(cells))
    write_json(Path(args.out), {
        "machine": machine_info(),
        "command": command_line(),
        "plan": json.loads(Path(args.plan).read_text()),
        "cluster": spec,
        "steps": {dev: [{p: list(v) for p, v in s.items()} for s in st] for dev, st in per_device.items()},
        "medians": summary,
    })  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
