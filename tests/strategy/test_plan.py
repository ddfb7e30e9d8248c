import copy
import dataclasses
import json

import pytest

from tagps.strategy.plan import PLAN_VERSION, CommSettings, Plan, PlanError, load
from tagps.strategy.topology import paper_testbed


def base() -> dict:
    """A valid general plan over the testbed: two op groups, three gradients."""
    t = paper_testbed()
    shares = dict.fromkeys(t.devices(), 0)
    shares.update({"v100:0": 6, "v100:1": 6, "1080ti-0:0": 4})
    return {
        "version": PLAN_VERSION,
        "kind": "general",
        "model": "mlp",
        "batch_size": 16,
        "optimizer": "adam",
        "comm": {"overlap": True, "fusion_bytes": 0, "first_bucket_bytes": 0, "partition_bytes": 262144},
        "ps_servers": ["v100"],
        "topology": t.to_dict(),
        "groups": [
            {"ops": ["fc1", "relu"], "placement": ["v100", "1080ti-0"], "option": "allreduce"},
            {"ops": ["fc2"], "placement": ["v100"], "option": "ps"},
        ],
        "gradients": {
            "0.weight": {"group": 0, "sync": "sfb", "sfb_ops": ["fc1"]},
            "0.bias": {"group": 0, "sync": "allreduce"},
            "2.weight": {"group": 1, "sync": "ps"},
        },
        "batch_shares": shares,
        "predicted": {
            "iteration_time_s": 0.125,
            "peak_memory_bytes": {"v100:0": 123},
            "baseline": "dp-nccl",
            "baseline_time_s": 0.25,
        },
    }


def test_round_trip_is_exact(tmp_path):
    plan = Plan.from_dict(base())
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    assert json.loads(text) == base()
    # Files written before first_bucket_bytes or partition_bytes existed still load, with them at 0 (a first
    # bucket like the rest, the runtime's partition size).
    older = base()
    del older["comm"]["first_bucket_bytes"], older["comm"]["partition_bytes"]
    assert Plan.from_dict(older) == dataclasses.replace(plan, comm=CommSettings(overlap=True))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load(path) == plan
    assert load(text) == plan
    assert load(plan.to_dict()) == plan
    assert plan.sync_map() == {"0.weight": "sfb", "0.bias": "allreduce", "2.weight": "ps"}
    assert plan.ps_groups() == {1}
    assert plan.devices() == ["v100:0", "v100:1", "1080ti-0:0"]


def test_sync_of_names_a_missing_parameter():
    plan = Plan.from_dict(base())
    assert plan.sync_of("2.weight") == "ps"
    with pytest.raises(KeyError, match="'nope'"):
        plan.sync_of("nope")


def _set(path: str, value):
    def edit(d: dict) -> None:
        keys = path.split("/")
        target = d
        for k in keys[:-1]:
            target = target[int(k)] if isinstance(target, list) else target[k]
        last = keys[-1]
        if value is _DELETE:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return edit


_DELETE = object()

CASES = [
    ("version", _set("version", 99), "version 99"),
    ("kind", _set("kind", "pipeline"), "kind 'pipeline'"),
    ("optimizer", _set("optimizer", "lamb"), "optimizer 'lamb'"),
    ("batch type", _set("batch_size", 0), "batch_size"),
    ("overlap", _set("comm/overlap", "yes"), "comm.overlap"),
    ("fusion", _set("comm/fusion_bytes", -1), "comm.fusion_bytes"),
    ("partition", _set("comm/partition_bytes", 1.5), "comm.partition_bytes"),
    ("no groups", _set("groups", []), "no op groups"),
    ("bad option", _set("groups/0/option", "pipeline"), r"groups\[0\]: option 'pipeline'"),
    ("empty placement", _set("groups/1/placement", []), r"groups\[1\]: empty placement"),
    (
        "repeated placement",
        _set("groups/1/placement", ["v100", "v100"]),
        r"groups\[1\]: placement .* repeats",
    ),
    ("unknown device group", _set("groups/1/placement", ["tpu"]), r"groups\[1\]: unknown device group 'tpu'"),
    ("op twice", _set("groups/1/ops", ["relu"]), r"groups\[1\]: op 'relu' is already in groups\[0\]"),
    ("gradient group", _set("gradients/0.bias/group", 7), "gradient '0.bias': group 7"),
    ("bad sync", _set("gradients/0.bias/sync", "gossip"), "gradient '0.bias': sync 'gossip'"),
    (
        "sync vs option",
        _set("gradients/2.weight/sync", "allreduce"),
        "gradient '2.weight': sync 'allreduce' not allowed for option 'ps'",
    ),
    (
        "none on replicated",
        _set("gradients/0.bias/sync", "none"),
        "sync 'none' not allowed for option 'allreduce'",
    ),
    (
        "sfb ops without sfb",
        _set("gradients/0.bias/sfb_ops", ["fc1"]),
        "sfb_ops given but sync is 'allreduce'",
    ),
    ("unknown device", _set("batch_shares/gpu:9", 0), "batch_shares: unknown device 'gpu:9'"),
    ("negative share", _set("batch_shares/v100:3", -1), r"batch_shares\['v100:3'\]"),
    ("shares sum", _set("batch_shares/v100:0", 7), "sum to 17, not to batch_size 16"),
    ("ps server", _set("ps_servers", ["tpu"]), "ps_servers: unknown device group 'tpu'"),
    ("missing key", _set("gradients", _DELETE), r"missing \['gradients'\]"),
    ("unknown key", _set("extra", 1), r"unknown keys \['extra'\]"),
    ("bad topology", _set("topology/groups/0/device", "K80"), "topology: unknown device type 'K80'"),
    ("group keys", _set("groups/0/extra", 1), r"groups\[0\] must have ops, placement, option"),
    (
        "mp_parts on allreduce",
        _set("groups/0/mp_parts", [{"device": "m0:0", "ops": ["x"]}]),
        "mp_parts given",
    ),
    ("gradient keys", _set("gradients/0.bias/extra", 1), "gradient '0.bias' must have"),
    ("predicted", _set("predicted", {"baseline": "x"}), "predicted must be null or"),
]


@pytest.mark.parametrize(("what", "edit", "match"), CASES, ids=[c[0] for c in CASES])
def test_every_validation_error_names_the_entry(what, edit, match):
    data = copy.deepcopy(base())
    edit(data)
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(data)


def test_replicated_group_needs_a_device_with_a_share():
    data = base()
    data["groups"][1]["placement"] = ["p100-0"]
    with pytest.raises(PlanError, match=r"groups\[1\]: replicated on \['p100-0'\] but none"):
        Plan.from_dict(data)


def test_data_parallel_kind_is_checked():
    data = base()
    data["kind"] = "data-parallel"
    with pytest.raises(PlanError, match="data-parallel plan replicates every group"):
        Plan.from_dict(data)
    data["groups"][1]["placement"] = ["v100", "1080ti-0"]
    data["groups"][1]["option"] = "ps"
    Plan.from_dict(data)
    data["batch_shares"]["p100-0:0"] = 1
    data["batch_shares"]["v100:0"] = 5
    with pytest.raises(PlanError, match="have shares but no op group runs there"):
        Plan.from_dict(data)


def test_load_errors(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        load(tmp_path / "missing.json")
    with pytest.raises(PlanError, match="not valid JSON"):
        load("{not json")
    with pytest.raises(PlanError, match="must be a JSON object"):
        Plan.from_dict([1, 2])  # type: ignore[arg-type]


def test_plan_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, tagps.strategy.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("fusion", "first", "cap"), [(0, 0, 0), (2048, 0, 2048), (2048, 16, 16), (16, 2048, 16), (0, 16, 0)]
)
def test_the_first_bucket_closes_at_first_bucket_bytes_never_past_fusion_bytes(
    fusion: int, first: int, cap: int
) -> None:
    assert CommSettings(fusion_bytes=fusion, first_bucket_bytes=first).first_bucket_cap() == cap
