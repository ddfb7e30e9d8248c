"""``tagps demo``: plan a small model for the cluster at hand, train it with the plan and with DDP, compare.

On an emulated cluster when root allows (a fast machine with two devices on 1 Gbit/s and a slow one with a
quarter core on 200 Mbit/s), otherwise on two local processes: measure the topology, load (or make) the
simulator's calibration, search a plan with MCTS guided by the shipped GNN prior (``load_prior()``, as
`tagps plan` and ``bench/e2e_cluster.py`` do) on the calibrated simulator (op groups may get their own
devices and options: ``tagps.torch.distribute`` runs such plans), train ``vgg-mini`` for a few dozen steps
with the plan (``tagps.torch``) and with ``DistributedDataParallel`` (gloo all-reduce), and print measured
and predicted step times and the loss of each.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEMO_CLUSTER", "DemoRow", "demo", "format_table"]

DEMO_CLUSTER = {
    "name": "demo",
    "machines": [
        {"name": "fast", "workers": 2, "cpu": 1.0, "rate_mbit": 1000},
        {"name": "slow", "workers": 1, "cpu": 0.25, "rate_mbit": 200},
    ],
}
MODEL, BATCH, GROUPS = "vgg-mini", 48, 8


@dataclass(frozen=True)
class DemoRow:
    """One line of the demo's table.

    Args:
        strategy: its name.
        detail: devices and sync methods.
        measured_s: mean measured step time (``MEASURED_STEP``).
        predicted_s: the calibrated simulator's prediction.
        loss_first: global loss of the first step.
        loss_last: global loss of the last step.
    """

    strategy: str
    detail: str
    measured_s: float
    predicted_s: float
    loss_first: float
    loss_last: float

    @property
    def error(self) -> float:
        """Relative prediction error."""
        return self.predicted_s / self.measured_s - 1


def _describe(plan: Any) -> str:
    """Devices and shares, then the sync methods (data-parallel) or the op groups' layouts (general)."""
    shares = ",".join(str(plan.batch_shares.get(d, 0)) for d in plan.worker_devices())
    if plan.kind == "general":
        from tagps.cluster.experiment import plan_layout

        return f"{len(plan.worker_devices())} dev [{shares}] {plan_layout(plan)}"
    syncs: dict[str, int] = {}
    for g in plan.gradients.values():
        syncs[g.sync] = syncs.get(g.sync, 0) + 1
    methods = " ".join(f"{k}:{v}" for k, v in sorted(syncs.items()))
    return f"{len(plan.devices())} dev [{shares}] {methods}"


def format_table(rows: list[DemoRow], batch: int) -> str:
    """The demo's table as text."""
    lines = [
        f"{'strategy':<14} {'devices, shares, syncs':<36} {'measured ms':>11} {'predicted ms':>12} "
        f"{'error':>7} {'samples/s':>9} {'loss first -> last':>20}"
    ]
    for r in rows:
        lines.append(
            f"{r.strategy:<14} {r.detail:<36} {r.measured_s * 1e3:>11.1f} {r.predicted_s * 1e3:>12.1f} "
            f"{r.error:>+7.1%} {batch / r.measured_s:>9.1f} {r.loss_first:>9.3f} -> {r.loss_last:<7.3f}"
        )
    return "\n".join(lines)


def demo(steps: int = 24, local: bool = False, log: Callable[[str], None] = print) -> list[DemoRow]:
    """Run the demo and return its rows (also printed through ``log``).

    Args:
        steps: timed training steps per strategy (3 untimed ones come first).
        local: use local processes even where an emulated cluster is possible.
        log: where progress and the table go.
    """
    from tagps.calibrate import calibrate, default_path
    from tagps.cluster import ClusterError, check_support
    from tagps.cluster.experiment import MEASURED_STEP, Executor, ddp_plan, local_executor, run_plan
    from tagps.strategy.calibration import load_calibration
    from tagps.strategy.gnn import load_prior
    from tagps.strategy.graph import model_graph
    from tagps.strategy.grouping import group_ops
    from tagps.strategy.mcts import SearchConfig, search
    from tagps.strategy.simulator import Simulator

    started = time.monotonic()
    path = default_path()
    if path.is_file():
        cal = load_calibration(path)
        log(f"calibration: {path}")
    else:
        log(
            f"calibration: none at {path}; a quick one without the fit on whole jobs follows "
            "(`python -m tagps.calibrate` makes the full one)"
        )
        cal = calibrate(quick=True, jobs=False, log=lambda line: log("  " + line))
        path.parent.mkdir(parents=True, exist_ok=True)
        cal.save(path)
    cluster = None
    if not local:
        try:
            check_support()
            from tagps.cluster.run import up

            cluster = up(DEMO_CLUSTER)
        except ClusterError as exc:
            log(f"no emulated cluster ({exc}); using local processes")
    try:
        if cluster is not None:
            executor = Executor(cluster.topology(0.3), cluster)
        else:
            executor = local_executor(2)
        log(f"running on {executor.where}; measured topology:")
        log(executor.topology.describe())
        graph = model_graph(MODEL)
        grouping = group_ops(graph, GROUPS)
        sim = cal.simulator(graph, grouping, executor.topology)
        found = search(sim, BATCH, SearchConfig(iterations=200, seed=0), model=load_prior())
        if found.plan is None:
            raise RuntimeError(f"the search found no feasible plan for {MODEL} on {executor.where}")
        plan = dataclasses.replace(found.plan, topology=executor.topology)
        ddp = ddp_plan(Simulator(graph, grouping, executor.topology), BATCH)
        log(f"plan for {MODEL} (batch {BATCH}): {_describe(plan)}; searched in {found.seconds:.1f} s")
        rows = []
        for name, p, runtime in (("tagps plan", plan, "tagps"), ("DDP all-reduce", ddp, "ddp")):
            result = run_plan(executor, MODEL, p, runtime, steps=steps, env={"OMP_NUM_THREADS": "1"})
            losses = result["losses"]
            predicted = cal.evaluate(sim, p)
            measured = result[MEASURED_STEP]
            rows.append(DemoRow(name, _describe(p), measured, predicted, losses[0], losses[-1]))
            log(f"  {name}: {len(losses)} steps done")
    finally:
        if cluster is not None:
            cluster.down()
    log(format_table(rows, BATCH))
    log(f"demo finished in {time.monotonic() - started:.0f} s (load average {os.getloadavg()[0]:.1f})")
    return rows
