"""The strategy IR: what the search produces, the simulator costs and the runtime executes.

A plan is a versioned JSON document (format in ``docs/plan.md``):

- ``topology``: the device groups and bandwidths it was made for (:class:`~tagps.strategy.topology.Topology`);
- ``groups``: op groups, each with its op names, a ``placement`` (non-empty subset of device groups) and an
  ``option`` in {allreduce, ps, duplicate, mp};
- ``gradients``: per parameter, keyed by its fully qualified name from ``model.named_parameters()``, the op
  group that owns it and ``sync`` in {allreduce, ps, sfb, none} (and, for sfb, the duplicated ops);
- ``batch_shares``: samples of the global batch per device (``"<group>:<index>"``), summing to ``batch_size``;
- ``kind``: ``"data-parallel"`` (every op group on the same devices, replicated; what the first runtime
  executes) or ``"general"``;
- ``predicted``: iteration time, peak memory per device and the baseline compared against.

This module imports neither torch nor the runtime: both the search and the runtime import it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tagps.atomic import write_text_atomic
from tagps.strategy.topology import Topology

__all__ = [
    "KINDS",
    "OPTIMIZERS",
    "OPTIONS",
    "PLAN_VERSION",
    "SYNCS",
    "SYNC_ALLOWED",
    "CommSettings",
    "GradientSync",
    "OpGroupPlan",
    "Plan",
    "PlanError",
    "Prediction",
    "load",
]

PLAN_VERSION = 1
OPTIONS = ("allreduce", "ps", "duplicate", "mp")
SYNCS = ("allreduce", "ps", "sfb", "none")
KINDS = ("data-parallel", "general")
OPTIMIZERS = ("sgd", "momentum", "adam")
# Which gradient sync methods each op-group option admits.
SYNC_ALLOWED: dict[str, tuple[str, ...]] = {
    "allreduce": ("allreduce", "sfb"),
    "ps": ("ps", "sfb"),
    "duplicate": ("none",),
    "mp": ("none",),
}


class PlanError(ValueError):
    """A plan document is malformed; the message names the offending entry."""


@dataclass(frozen=True)
class OpGroupPlan:
    """Placement and replication of one op group.

    Args:
        ops: names of the graph ops in the group.
        placement: device-group names the group runs on (non-empty, no repeats).
        option: ``allreduce``/``ps`` (replicate, batch split, sync gradients), ``duplicate`` (full batch on
            every device, no sync) or ``mp`` (ops split over the devices with METIS).
        mp_parts: for ``mp``, the split the simulator costs: ``(device, ops)`` per part in topological
            order, each device (``"<group>:<index>"``) in the placement; together the parts hold the group's
            ops. The runtime runs exactly this split (it never recomputes METIS).
    """

    ops: tuple[str, ...]
    placement: tuple[str, ...]
    option: str
    mp_parts: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class GradientSync:
    """How one parameter's gradient is synchronised.

    Args:
        group: index of the op group that owns the parameter.
        sync: ``allreduce``, ``ps``, ``sfb`` or ``none``.
        sfb_ops: for ``sfb``, the ops duplicated so that only their inputs (the sufficient factors) travel.
    """

    group: int
    sync: str
    sfb_ops: tuple[str, ...] = ()


@dataclass(frozen=True)
class CommSettings:
    """Scheduling of gradient synchronisation.

    Args:
        overlap: start a gradient's sync as soon as backward produced it (else after the whole backward).
        fusion_bytes: fuse consecutive all-reduces up to this many bytes (0: no fusion).
        first_bucket_bytes: the first fused bucket of backward closes at this many bytes instead (0: at
            ``fusion_bytes``), so that the first sync starts early in backward, as
            ``DistributedDataParallel``'s 1 MiB first bucket does.
        partition_bytes: ``ps`` gradients travel in chunks of at most this many bytes (0: the runtime's
            ``BYTEPS_PARTITION_BYTES``, BytePS's 4 096 000 by default). A chunk's pull waits for every
            worker's push of it, so the best size depends on the bytes each server holds; the search picks
            it and the executor runs the plan with it (:func:`tagps.cluster.experiment.plan_env`).
    """

    overlap: bool = True
    fusion_bytes: int = 0
    first_bucket_bytes: int = 0
    partition_bytes: int = 0

    def first_bucket_cap(self) -> int:
        """Return the bytes at which backward's first fused bucket closes: ``first_bucket_bytes``, never
        more than ``fusion_bytes`` (either 0: ``fusion_bytes``). The simulator and the runtime both cut
        with it, so that the plan is costed as it runs."""
        return min(self.first_bucket_bytes or self.fusion_bytes, self.fusion_bytes)


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicted for the plan.

    Args:
        iteration_time_s: simulated time of one training iteration.
        peak_memory_bytes: per device.
        baseline: name of the baseline strategy compared against.
        baseline_time_s: its simulated iteration time.
    """

    iteration_time_s: float
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    baseline: str = ""
    baseline_time_s: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A complete strategy; see the module docstring. Build with the constructor, then :meth:`validate`."""

    topology: Topology
    model: str
    batch_size: int
    groups: tuple[OpGroupPlan, ...]
    gradients: dict[str, GradientSync]
    batch_shares: dict[str, int]
    kind: str = "general"
    optimizer: str = "adam"
    comm: CommSettings = CommSettings()
    ps_servers: tuple[str, ...] = ()
    predicted: Prediction | None = None
    version: int = PLAN_VERSION

    # ------------------------------------------------------------------ queries
    def devices(self) -> list[str]:
        """Devices with a non-zero batch share, in topology order."""
        return [d for d in self.topology.devices() if self.batch_shares.get(d, 0) > 0]

    def worker_devices(self) -> list[str]:
        """Devices that run some op group, in topology order: rank ``r`` of a job is the ``r``-th.

        A replicated (``allreduce``/``ps``) group runs on the devices of its placement with a batch share;
        ``duplicate`` runs on every device of its placement; ``mp`` on the devices of its parts. For a
        data-parallel plan this equals :meth:`devices`.
        """
        used = {d for i in range(len(self.groups)) for d in self.group_devices(i)}
        return [d for d in self.topology.devices() if d in used]

    def group_devices(self, index: int) -> list[str]:
        """Devices that run op group ``index``: for ``allreduce``/``ps`` the placement's devices with a batch
        share, for ``duplicate`` every device of the placement (both in topology order), for ``mp`` the
        devices of its parts (in part order)."""
        g = self.groups[index]
        if g.option == "mp":
            return [dev for dev, _ in g.mp_parts]
        placed = [d for d in self.topology.devices() if d.split(":", 1)[0] in g.placement]
        if g.option == "duplicate":
            return placed
        return [d for d in placed if self.batch_shares.get(d, 0) > 0]

    def sync_of(self, param: str) -> str:
        """Sync method of parameter ``param``; KeyError naming it when the plan does not have it."""
        try:
            return self.gradients[param].sync
        except KeyError:
            raise KeyError(f"plan has no gradient entry for parameter {param!r}") from None

    def ps_groups(self) -> set[int]:
        """Indices of the op groups with a gradient synced by ``ps`` (empty: the plan needs no servers)."""
        return {g.group for g in self.gradients.values() if g.sync == "ps"}

    def sync_map(self) -> dict[str, str]:
        """``{parameter name: sync method}`` for every gradient (the runtime's view)."""
        return {name: g.sync for name, g in self.gradients.items()}

    # ------------------------------------------------------------------ validation
    def validate(self) -> Plan:
        """Check the plan; raise :class:`PlanError` naming the offending entry. Returns ``self``."""
        if self.version != PLAN_VERSION:
            raise PlanError(f"plan version {self.version!r} is not supported (reads {PLAN_VERSION})")
        if self.kind not in KINDS:
            raise PlanError(f"kind {self.kind!r} is not one of {KINDS}")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"optimizer {self.optimizer!r} is not one of {OPTIMIZERS}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise PlanError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not isinstance(self.comm.overlap, bool):
            raise PlanError(f"comm.overlap must be a boolean, got {self.comm.overlap!r}")
        for name in ("fusion_bytes", "first_bucket_bytes", "partition_bytes"):
            fb = getattr(self.comm, name)
            if isinstance(fb, bool) or not isinstance(fb, int) or fb < 0:
                raise PlanError(f"comm.{name} must be an integer >= 0, got {fb!r}")
        group_names = {g.name for g in self.topology.groups}
        if not self.groups:
            raise PlanError("plan has no op groups")
        seen_ops: dict[str, int] = {}
        for i, g in enumerate(self.groups):
            if g.option not in OPTIONS:
                raise PlanError(f"groups[{i}]: option {g.option!r} is not one of {OPTIONS}")
            if not g.placement:
                raise PlanError(f"groups[{i}]: empty placement")
            if len(set(g.placement)) != len(g.placement):
                raise PlanError(f"groups[{i}]: placement {list(g.placement)} repeats a device group")
            for dg in g.placement:
                if dg not in group_names:
                    raise PlanError(f"groups[{i}]: unknown device group {dg!r} in placement")
            for op in g.ops:
                if op in seen_ops:
                    raise PlanError(f"groups[{i}]: op {op!r} is already in groups[{seen_ops[op]}]")
                seen_ops[op] = i
            self._validate_mp_parts(i, g)
        for name, grad in self.gradients.items():
            if not isinstance(grad.group, int) or not 0 <= grad.group < len(self.groups):
                raise PlanError(f"gradient {name!r}: group {grad.group!r} is not an op group index")
            if grad.sync not in SYNCS:
                raise PlanError(f"gradient {name!r}: sync {grad.sync!r} is not one of {SYNCS}")
            option = self.groups[grad.group].option
            if grad.sync not in SYNC_ALLOWED[option]:
                raise PlanError(
                    f"gradient {name!r}: sync {grad.sync!r} not allowed for option {option!r} of "
                    f"groups[{grad.group}] (allowed: {', '.join(SYNC_ALLOWED[option])})"
                )
            if grad.sfb_ops and grad.sync != "sfb":
                raise PlanError(f"gradient {name!r}: sfb_ops given but sync is {grad.sync!r}")
        devices = set(self.topology.devices())
        for dev, share in self.batch_shares.items():
            if dev not in devices:
                raise PlanError(f"batch_shares: unknown device {dev!r}")
            if isinstance(share, bool) or not isinstance(share, int) or share < 0:
                raise PlanError(f"batch_shares[{dev!r}]: share must be an integer >= 0, got {share!r}")
        total = sum(self.batch_shares.values())
        if total != self.batch_size:
            raise PlanError(f"batch_shares sum to {total}, not to batch_size {self.batch_size}")
        for i, g in enumerate(self.groups):
            if g.option in ("allreduce", "ps") and not any(
                self.batch_shares.get(f"{dg}:{k}", 0) > 0
                for dg in g.placement
                for k in range(self.topology.group(dg).count)
            ):
                raise PlanError(
                    f"groups[{i}]: replicated on {list(g.placement)} but none of their devices "
                    "has a batch share"
                )
        for dg in self.ps_servers:
            if dg not in group_names:
                raise PlanError(f"ps_servers: unknown device group {dg!r}")
        if self.kind == "data-parallel":
            first = set(self.groups[0].placement)
            for i, g in enumerate(self.groups):
                if set(g.placement) != first or g.option not in ("allreduce", "ps"):
                    raise PlanError(
                        f"groups[{i}]: a data-parallel plan replicates every group "
                        "(allreduce/ps) "
                        f"on the same device groups {sorted(first)}"
                    )
            used = {d.split(":", 1)[0] for d, s in self.batch_shares.items() if s > 0}
            if not used <= first:
                raise PlanError(
                    f"batch_shares: devices of {sorted(used - first)} have shares but no op group runs there"
                )
        return self

    def _validate_mp_parts(self, i: int, g: OpGroupPlan) -> None:
        if g.option != "mp":
            if g.mp_parts:
                raise PlanError(f"groups[{i}]: mp_parts given but option is {g.option!r}")
            return
        if not g.mp_parts:
            return  # a search-side plan; the runtime refuses an mp group without its split
        placed = {f"{dg}:{k}" for dg in g.placement for k in range(self.topology.group(dg).count)}
        in_parts: list[str] = []
        for j, (dev, ops) in enumerate(g.mp_parts):
            if dev not in placed:
                raise PlanError(
                    f"groups[{i}].mp_parts[{j}]: device {dev!r} is not in placement {list(g.placement)}"
                )
            if not ops:
                raise PlanError(f"groups[{i}].mp_parts[{j}]: a part needs at least one op")
            in_parts.extend(ops)
        if sorted(in_parts) != sorted(g.ops):
            missing = sorted(set(g.ops) - set(in_parts))
            extra = sorted(set(in_parts) - set(g.ops))
            raise PlanError(
                f"groups[{i}].mp_parts must hold each op of the group once (missing {missing[:3]}, "
                f"unknown or repeated {extra[:3] or 'ops repeated'})"
            )

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form."""
        return {
            "version": self.version,
            "kind": self.kind,
            "model": self.model,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "comm": dataclasses.asdict(self.comm),
            "ps_servers": list(self.ps_servers),
            "topology": self.topology.to_dict(),
            "groups": [_group_dict(g) for g in self.groups],
            "gradients": {
                name: (
                    {"group": g.group, "sync": g.sync, "sfb_ops": list(g.sfb_ops)}
                    if g.sfb_ops
                    else {"group": g.group, "sync": g.sync}
                )
                for name, g in self.gradients.items()
            },
            "batch_shares": dict(self.batch_shares),
            "predicted": None
            if self.predicted is None
            else {
                "iteration_time_s": self.predicted.iteration_time_s,
                "peak_memory_bytes": dict(self.predicted.peak_memory_bytes),
                "baseline": self.predicted.baseline,
                "baseline_time_s": self.predicted.baseline_time_s,
            },
        }

    def to_json(self, indent: int | None = 1) -> str:
        """Return the plan as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        """Write the plan to ``path`` as JSON (atomically: a reader sees the old plan or the new one)."""
        write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Build a plan from its dict form and validate it; :class:`PlanError` names what is wrong."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        required = {
            "version",
            "kind",
            "model",
            "batch_size",
            "topology",
            "groups",
            "gradients",
            "batch_shares",
        }
        missing = required - set(data)
        if missing:
            raise PlanError(f"plan is missing {sorted(missing)}")
        unknown = set(data) - required - {"optimizer", "comm", "ps_servers", "predicted"}
        if unknown:
            raise PlanError(f"plan has unknown keys {sorted(unknown)}")
        if data["version"] != PLAN_VERSION:
            raise PlanError(f"plan version {data['version']!r} is not supported (reads {PLAN_VERSION})")
        try:
            topology = Topology.from_dict(data["topology"])
        except ValueError as exc:
            raise PlanError(f"topology: {exc}") from None
        groups = []
        if not isinstance(data["groups"], list):
            raise PlanError("groups must be a list")
        for i, g in enumerate(data["groups"]):
            if not isinstance(g, Mapping) or not {"ops", "placement", "option"} <= set(g) <= {
                "ops",
                "placement",
                "option",
                "mp_parts",
            }:
                raise PlanError(f"groups[{i}] must have ops, placement, option and optionally mp_parts")
            if not isinstance(g["ops"], list) or not isinstance(g["placement"], list):
                raise PlanError(f"groups[{i}]: ops and placement must be lists")
            parts_raw = g.get("mp_parts", [])
            if not isinstance(parts_raw, list) or any(
                not isinstance(p, Mapping) or set(p) != {"device", "ops"} or not isinstance(p["ops"], list)
                for p in parts_raw
            ):
                raise PlanError(f"groups[{i}].mp_parts must be a list of {{device, ops}} objects")
            groups.append(
                OpGroupPlan(
                    tuple(map(str, g["ops"])),
                    tuple(map(str, g["placement"])),
                    g["option"],
                    tuple((str(p["device"]), tuple(map(str, p["ops"]))) for p in parts_raw),
                )
            )
        if not isinstance(data["gradients"], Mapping):
            raise PlanError("gradients must be an object keyed by parameter name")
        gradients = {}
        for name, g in data["gradients"].items():
            keys = set(g) if isinstance(g, Mapping) else set()
            if not {"group", "sync"} <= keys or keys - {"group", "sync", "sfb_ops"}:
                raise PlanError(f"gradient {name!r} must have group, sync and optionally sfb_ops")
            if isinstance(g["group"], bool) or not isinstance(g["group"], int):
                raise PlanError(f"gradient {name!r}: group must be an integer, got {g['group']!r}")
            gradients[str(name)] = GradientSync(g["group"], g["sync"], tuple(map(str, g.get("sfb_ops", ()))))
        if not isinstance(data["batch_shares"], Mapping):
            raise PlanError("batch_shares must be an object keyed by device name")
        comm_raw = data.get("comm", {})
        comm_keys = {f.name for f in dataclasses.fields(CommSettings)}
        if not isinstance(comm_raw, Mapping) or set(comm_raw) - comm_keys:
            raise PlanError(f"comm must be an object with keys among {sorted(comm_keys)}")
        pred_raw = data.get("predicted")
        predicted = None
        if pred_raw is not None:
            if not isinstance(pred_raw, Mapping) or "iteration_time_s" not in pred_raw:
                raise PlanError("predicted must be null or an object with iteration_time_s")
            predicted = Prediction(
                pred_raw["iteration_time_s"],
                dict(pred_raw.get("peak_memory_bytes", {})),
                pred_raw.get("baseline", ""),
                pred_raw.get("baseline_time_s", 0.0),
            )
        plan = cls(
            topology=topology,
            model=str(data["model"]),
            batch_size=data["batch_size"],
            groups=tuple(groups),
            gradients=gradients,
            batch_shares=dict(data["batch_shares"]),
            kind=data["kind"],
            optimizer=data.get("optimizer", "adam"),
            comm=CommSettings(**comm_raw),
            ps_servers=tuple(data.get("ps_servers", ())),
            predicted=predicted,
            version=data["version"],
        )
        return plan.validate()

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse JSON text; see :meth:`from_dict`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from None
        return cls.from_dict(data)


def _group_dict(g: OpGroupPlan) -> dict[str, Any]:
    out: dict[str, Any] = {"ops": list(g.ops), "placement": list(g.placement), "option": g.option}
    if g.mp_parts:
        out["mp_parts"] = [{"device": dev, "ops": list(ops)} for dev, ops in g.mp_parts]
    return out


def load(source: str | Path | Mapping[str, Any] | Plan) -> Plan:
    """Return a validated plan from a path, JSON text, a dict or a plan object."""
    if isinstance(source, Plan):
        return source.validate()
    if isinstance(source, Mapping):
        return Plan.from_dict(source)
    text = str(source)
    if text.lstrip().startswith("{"):
        return Plan.from_json(text)
    path = Path(text)
    if not path.is_file():
        raise PlanError(f"plan file {text!r} does not exist")
    return Plan.from_json(path.read_text())
