"""What `tagps plan` and `tagps show` print and draw for a plan.

:func:`summary` returns the table: the option and placement of every op group, the devices used per
device type, the share of gradients (count and bytes) per sync method, the predicted iteration time and the
speed-up over each baseline (all simulated on the same simulator). :func:`render_png` draws the placement
heatmap (op groups × device groups, coloured by option) above the simulated timeline (one row per compute
stream and channel), with matplotlib's Agg backend.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

from tagps.strategy.baselines import BASELINES
from tagps.strategy.plan import Plan
from tagps.strategy.simulator import SimResult, Simulator

__all__ = ["OPTION_COLOURS", "baseline_times", "render_png", "summary"]

OPTION_COLOURS = {"allreduce": "#1f77b4", "ps": "#ff7f0e", "duplicate": "#9467bd", "mp": "#2ca02c"}


def baseline_times(sim: Simulator, batch: int, optimizer: str = "adam") -> dict[str, SimResult]:
    """Simulated results of every baseline of :data:`~tagps.strategy.baselines.BASELINES`.

    A baseline that cannot be built (DP-NCCL-P when the batch does not fit the devices' memory) is left out.
    """
    out = {}
    for name, build in BASELINES.items():
        try:
            plan = replace(build(sim, batch), optimizer=optimizer)
        except ValueError:
            continue
        out[name] = sim.evaluate(plan)
    return out


def summary(plan: Plan, sim: Simulator, result: SimResult | None = None) -> str:
    """The plan as a table (see the module docstring).

    Args:
        plan: the plan.
        sim: a simulator for its model, grouping and topology.
        result: the plan's simulation (computed when None).
    """
    result = result or sim.evaluate(plan)
    lines = [
        f"plan for {plan.model} on {plan.topology.name}: batch {plan.batch_size}, kind {plan.kind}, "
        f"{len(plan.groups)} op groups, optimizer {plan.optimizer}, "
        f"overlap {'on' if plan.comm.overlap else 'off'}, fusion {plan.comm.fusion_bytes >> 20} MiB",
        "",
        f"{'group':>5} {'ops':>4} {'params MiB':>10} {'option':<9} placement",
    ]
    for i, g in enumerate(plan.groups):
        mib = sim.groups[i].param_bytes / 2**20
        lines.append(f"{i:>5} {len(g.ops):>4} {mib:>10.1f} {g.option:<9} {','.join(g.placement)}")
    options = Counter(g.option for g in plan.groups)
    lines.append("options: " + ", ".join(f"{k} {v}" for k, v in sorted(options.items())))
    lines += ["", f"{'device type':<12} {'used':>5} {'of':>4}"]
    used = _used_devices(plan)
    per_type: dict[str, list[int]] = {}
    for dg in plan.topology.groups:
        row = per_type.setdefault(dg.device, [0, 0])
        row[0] += sum(1 for d in dg.devices() if d in used)
        row[1] += dg.count
    for dev, (n_used, total) in per_type.items():
        lines.append(f"{dev:<12} {n_used:>5} {total:>4}")
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for name, grad in plan.gradients.items():
        counts[grad.sync] += 1
        nbytes[grad.sync] += sim.graph.params.get(name, 0)
    total_n = sum(counts.values()) or 1
    total_b = sum(nbytes.values()) or 1
    lines += ["", f"{'sync':<10} {'gradients':>9} {'share':>7} {'bytes share':>11}"]
    for sync, label in (("allreduce", "AllReduce"), ("ps", "PS"), ("sfb", "SFB"), ("none", "none (MP)")):
        lines.append(
            f"{label:<10} {counts[sync]:>9} {counts[sync] / total_n:>7.1%} {nbytes[sync] / total_b:>11.1%}"
        )
    t = result.iteration_time
    state = "" if result.feasible else f"  (OUT OF MEMORY on {', '.join(result.oom_devices)})"
    lines += ["", f"predicted iteration time {t * 1e3:.2f} ms, {plan.batch_size / t:.1f} samples/s{state}"]
    lines.append(f"{'baseline':<14} {'time ms':>9} {'speed-up':>9}")
    for name, base in baseline_times(sim, plan.batch_size, plan.optimizer).items():
        shown = f"{base.iteration_time / t:>8.2f}x" if base.feasible else "      OOM"
        lines.append(f"{name:<14} {base.iteration_time * 1e3:>9.2f} {shown}")
    return "\n".join(lines)


def _used_devices(plan: Plan) -> set[str]:
    """Devices that run something: shares of replicated groups, every device of mp/duplicate groups."""
    used: set[str] = set()
    for g in plan.groups:
        for name in g.placement:
            devices = plan.topology.group(name).devices()
            if g.option in ("mp", "duplicate"):
                used.update(devices)
            else:
                used.update(d for d in devices if plan.batch_shares.get(d, 0) > 0)
    return used


def render_png(plan: Plan, sim: Simulator, path: str | Path) -> SimResult:
    """Draw the placement heatmap and the simulated timeline of ``plan`` into ``path`` (PNG).

    Returns:
        The traced simulation that was drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    result = sim.evaluate(plan, trace=True)
    names = [g.name for g in plan.topology.groups]
    options = list(OPTION_COLOURS)
    grid = [[0] * len(plan.groups) for _ in names]
    for i, g in enumerate(plan.groups):
        for dg in g.placement:
            grid[names.index(dg)][i] = options.index(g.option) + 1
    resources = sorted({t.resource for t in result.tasks})
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12, 3 + 0.3 * (len(names) + len(resources))),
        gridspec_kw={"height_ratios": [len(names) + 2, len(resources) + 2]},
    )
    cmap = ListedColormap(["#f0f0f0", *OPTION_COLOURS.values()])
    top.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=len(options), interpolation="nearest")
    top.set_yticks(range(len(names)), names)
    top.set_xlabel("op group")
    top.set_title(f"{plan.model} on {plan.topology.name}: placement (colour = option)")
    top.legend(
        handles=[Patch(color=c, label=o) for o, c in OPTION_COLOURS.items()],
        loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small",
    )
    colours = {"forward": "#1f77b4", "backward": "#d62728", "allreduce": "#2ca02c", "ps": "#ff7f0e",
               "ps-nic": "#ff7f0e", "sfb": "#9467bd", "apply": "#8c564b", "transfer": "#7f7f7f"}
    row = {r: k for k, r in enumerate(resources)}
    for task in result.tasks:
        bottom.barh(
            row[task.resource], (task.end - task.start) * 1e3, left=task.start * 1e3, height=0.8,
            color=colours.get(task.category, "#bcbd22"),
        )
    bottom.set_yticks(range(len(resources)), resources, fontsize="small")
    bottom.invert_yaxis()
    bottom.set_xlabel("ms")
    steps = max((t.step for t in result.tasks), default=1)
    bottom.set_title(f"{steps} simulated steps; iteration time {result.iteration_time * 1e3:.1f} ms")
    bottom.legend(
        handles=[Patch(color=c, label=k) for k, c in colours.items()],
        loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return result
