"""Where a plan puts each op: the stages of a general plan and the rows of the batch each device runs.

A *stage* is a piece of the model (a set of fx nodes) that one set of plan devices runs with one layout of the
global batch: an ``allreduce``/``ps`` op group is one stage over the placement's devices that have a batch
share, each on a contiguous block of samples; a ``duplicate`` op group is one stage over every device of the
placement, each on the whole batch; an ``mp`` op group is one stage per part of its ``mp_parts``, each on one
device with the whole batch. Adjacent stages with the same devices and rows are merged (nothing crosses
between them), so a plan whose op groups all sit on the same devices runs as one stage.

This module only computes; it neither communicates nor imports the search (see ``docs/simulator.md``, "The
training graph", for the semantics it shares with the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass

from tagps.strategy.plan import Plan, PlanError

__all__ = ["Stage", "plan_stages", "split_rows"]


@dataclass(frozen=True)
class Stage:
    """One stage of a general plan.

    Args:
        ops: fx node names of the ops it runs, in plan order.
        op_groups: indices of the plan's op groups it holds (several after merging).
        devices: plan devices (``"<device group>:<index>"``) running it, in topology order.
        rows: per device, the block ``[lo, hi)`` of the global batch it processes.
    """

    ops: tuple[str, ...]
    op_groups: tuple[int, ...]
    devices: tuple[str, ...]
    rows: tuple[tuple[int, int], ...]

    def rows_of(self, device: str) -> tuple[int, int]:
        """The block of samples ``device`` processes in this stage."""
        return self.rows[self.devices.index(device)]


def split_rows(batch: int, weights: list[int]) -> list[tuple[int, int]]:
    """Cut ``batch`` samples into contiguous blocks proportional to ``weights`` (largest remainder).

    Blocks equal the weights when they sum to ``batch``; otherwise each is ``batch * w / sum(w)`` rounded so
    that the blocks still sum to ``batch`` (ties go to the earlier device).
    """
    total = sum(weights)
    exact = [batch * w / total for w in weights]
    sizes = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_remainder[: batch - sum(sizes)]:
        sizes[i] += 1
    blocks, lo = [], 0
    for n in sizes:
        blocks.append((lo, lo + n))
        lo += n
    return blocks


def plan_stages(plan: Plan) -> list[Stage]:
    """The stages of ``plan`` in execution order (the plan's op-group order, mp parts in their order).

    Raises:
        PlanError: an ``mp`` op group without ``mp_parts`` (from a search that did not record its split).
    """
    batch = plan.batch_size
    stages: list[Stage] = []
    for i, g in enumerate(plan.groups):
        placed = plan.group_devices(i)
        if g.option == "mp":
            if not g.mp_parts:
                raise PlanError(
                    f"groups[{i}] is mp but has no mp_parts: the runtime needs the split the simulator "
                    "costs; make the plan again with `tagps plan`"
                )
            pieces = [((dev,), ((0, batch),), ops) for dev, ops in g.mp_parts]
        elif g.option == "duplicate":
            pieces = [(tuple(placed), tuple((0, batch) for _ in placed), g.ops)]
        else:
            rows = split_rows(batch, [plan.batch_shares[d] for d in placed])
            pieces = [(tuple(placed), tuple(rows), g.ops)]
        for devices, rows, ops in pieces:
            last = stages[-1] if stages else None
            if last is not None and last.devices == devices and last.rows == rows:
                groups = last.op_groups if last.op_groups[-1] == i else (*last.op_groups, i)
                stages[-1] = Stage((*last.ops, *ops), groups, devices, rows)
            else:
                stages.append(Stage(tuple(ops), (i,), devices, rows))
    return stages
