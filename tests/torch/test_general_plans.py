"""The general-plan executor: parity with one process for every op-group option, and refusals before step 0.

Every case runs as a real job (``bpslaunch --local``, gloo on 127.0.0.1) and compares the parameters each
rank holds after a few SGD-momentum steps with one process training the global batch.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from torch import fx

from tagps.strategy.plan import Plan, PlanError
from tagps.strategy.topology import DeviceGroup, Topology
from tagps.torch.layout import plan_stages, split_rows

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("general_worker.py")
sys.path.insert(0, str(Path(__file__).parent))
import general_worker  # noqa: E402
from bpslaunch_job import PS_ENGINES, ps_engine_env, run_job  # noqa: E402

TOL = 1e-5


def topology(counts: dict[str, int]) -> Topology:
    groups = tuple(DeviceGroup(name, "CPU", n, 10.0) for name, n in counts.items())
    return Topology("test", groups, 1.0)


def op_names(kind: str) -> list[str]:
    gm = fx.symbolic_trace(general_worker.make_model(kind))
    return [n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]


def param_owner(kind: str, cuts: list[int]) -> dict[str, int]:
    """Op group of every parameter: the group of the first op that uses it."""
    model = general_worker.make_model(kind)
    gm = fx.symbolic_trace(model)
    names = {id(p): n for n, p in model.named_parameters()}
    calls = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    group_of = {n: sum(i >= c for c in cuts) for i, n in enumerate(calls)}
    owner: dict[str, int] = {}
    for n in calls:
        used = []
        if n.op == "call_module":
            used = list(gm.get_submodule(str(n.target)).parameters())
        for a in n.all_input_nodes:
            attr = gm.get_submodule("").get_parameter(str(a.target)) if _is_param(gm, a) else None
            if attr is not None:
                used.append(attr)
        for p in used:
            owner.setdefault(names[id(p)], group_of[n])
    return owner


def _is_param(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "get_attr" and str(node.target) in dict(gm.named_parameters())


def make_plan(
    kind: str,
    counts: dict[str, int],
    groups: list[tuple[int, tuple[str, ...], str]],
    shares: dict[str, int],
    sync: dict[int, str] | None = None,
    mp_parts: dict[int, list[tuple[str, int]]] | None = None,
    fusion_bytes: int = 0,
) -> dict[str, Any]:
    """A plan: ``groups`` as ``(first op index, placement, option)``; ``mp_parts[g]`` as (device, ops)."""
    ops = op_names(kind)
    cuts = [g[0] for g in groups[1:]]
    bounds = [g[0] for g in groups] + [len(ops)]
    plan_groups = []
    for i, (start, placement, option) in enumerate(groups):
        entry: dict[str, Any] = {
            "ops": ops[start : bounds[i + 1]],
            "placement": list(placement),
            "option": option,
        }
        if option == "mp":
            parts, at = [], start
            for dev, n in (mp_parts or {})[i]:
                parts.append({"device": dev, "ops": ops[at : at + n]})
                at += n
            entry["mp_parts"] = parts
        plan_groups.append(entry)
    default = {"allreduce": "allreduce", "ps": "ps", "duplicate": "none", "mp": "none"}
    gradients = {
        name: {"group": g, "sync": (sync or {}).get(g, default[groups[g][2]])}
        for name, g in param_owner(kind, cuts).items()
    }
    batch = sum(shares.values())
    return Plan.from_dict(
        {
            "version": 1,
            "kind": "general",
            "model": kind,
            "batch_size": batch,
            "optimizer": "momentum",
            "comm": {"overlap": True, "fusion_bytes": fusion_bytes},
            "topology": topology(counts).to_dict(),
            "groups": plan_groups,
            "gradients": gradients,
            "batch_shares": shares,
        }
    ).to_dict()


def run(
    tmp: Path,
    cases: list[dict[str, Any]],
    workers: int,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    servers: int = 0,
) -> list[dict[str, Any]]:
    return run_job(WORKER, tmp, cases, workers=workers, servers=servers, env=env, timeout=timeout)


def assert_parity(results: list[dict[str, Any]], name: str) -> None:
    held: set[str] = set()
    for rank, res in enumerate(results):
        case = res[name]
        assert "error" not in case, f"{name} rank {rank}: {case['error']}"
        assert case["max_diff"] <= TOL, f"{name} rank {rank}: parameters differ by {case['max_diff']}"
        held.update(case["params"])
    for step, ref in enumerate(results[0][name]["ref_losses"]):
        total = sum(r[name]["losses"][step] for r in results)
        assert abs(total - ref) < 1e-4, f"{name} step {step}: global loss {total}, one process {ref}"
    assert held, f"{name}: no rank holds a parameter"


# ---------------------------------------------------------------- layout (no processes)


def test_split_rows_is_exact_for_shares_and_proportional_otherwise() -> None:
    assert split_rows(12, [5, 7]) == [(0, 5), (5, 12)]
    assert split_rows(12, [1, 1, 1]) == [(0, 4), (4, 8), (8, 12)]
    assert split_rows(10, [3, 3, 3]) == [(0, 4), (4, 7), (7, 10)]


def test_stages_merge_when_layouts_match_and_mp_needs_its_parts() -> None:
    counts = {"a": 2, "b": 1}
    dp = make_plan("mlp", counts, [(0, ("a",), "allreduce"), (3, ("a",), "allreduce")], {"a:0": 4, "a:1": 4})
    stages = plan_stages(Plan.from_dict(dp))
    assert len(stages) == 1 and stages[0].op_groups == (0, 1) and stages[0].rows == ((0, 4), (4, 8))
    mixed = make_plan(
        "mlp", counts, [(0, ("a",), "allreduce"), (3, ("a", "b"), "duplicate")], {"a:0": 4, "a:1": 4}
    )
    stages = plan_stages(Plan.from_dict(mixed))
    assert [s.devices for s in stages] == [("a:0", "a:1"), ("a:0", "a:1", "b:0")]
    assert stages[1].rows == ((0, 8),) * 3
    no_parts = dict(mixed, groups=[dict(g) for g in mixed["groups"]])
    no_parts["groups"][1] = {**no_parts["groups"][1], "option": "mp"}
    no_parts["gradients"] = {
        k: dict(v, sync="none") if v["group"] == 1 else v for k, v in mixed["gradients"].items()
    }
    with pytest.raises(PlanError, match=r"groups\[1\] is mp but has no mp_parts"):
        plan_stages(Plan.from_dict(no_parts))


# ---------------------------------------------------------------- parity on real processes


def parity_cases() -> list[dict[str, Any]]:
    two = {"a": 2}
    three = {"a": 2, "b": 1}
    cases = [
        # each option alone
        ("allreduce-uneven", "mlp", make_plan("mlp", two, [(0, ("a",), "allreduce")], {"a:0": 3, "a:1": 7})),
        ("duplicate", "mlp", make_plan("mlp", two, [(0, ("a",), "duplicate")], {"a:0": 5, "a:1": 5})),
        (
            "mp",
            "mlp",
            make_plan(
                "mlp", two, [(0, ("a",), "mp")], {"a:0": 6, "a:1": 0}, mp_parts={0: [("a:0", 4), ("a:1", 3)]}
            ),
        ),
        # mixed: replicated body, a classifier on one device, then duplicated
        (
            "mlp-replicated-then-one",
            "mlp",
            make_plan(
                "mlp",
                three,
                [(0, ("a",), "allreduce"), (5, ("b",), "allreduce")],
                {"a:0": 3, "a:1": 4, "b:0": 3},
            ),
        ),
        (
            "mlp-one-then-duplicate",
            "mlp",
            make_plan("mlp", three, [(0, ("b",), "allreduce"), (3, ("a", "b"), "duplicate")], {"b:0": 6}),
        ),
        (
            "mlp-mp-then-replicated-fused",
            "mlp",
            make_plan(
                "mlp",
                three,
                [(0, ("a", "b"), "mp"), (5, ("a", "b"), "allreduce")],
                {"a:0": 2, "a:1": 3, "b:0": 4},
                mp_parts={0: [("b:0", 2), ("a:1", 3)]},
                fusion_bytes=1 << 20,
            ),
        ),
        (
            "cnn-weird-trick",
            "cnn",
            make_plan(
                "cnn",
                three,
                [(0, ("a", "b"), "allreduce"), (7, ("b",), "allreduce")],
                {"a:0": 3, "a:1": 3, "b:0": 2},
            ),
        ),
        (
            "cnn-sfb-classifier",
            "cnn",
            make_plan(
                "cnn",
                three,
                [(0, ("a", "b"), "allreduce"), (7, ("a",), "allreduce")],
                {"a:0": 3, "a:1": 3, "b:0": 2},
                sync={1: "sfb"},
            ),
        ),
        (
            "transformer-replicated-duplicate-one",
            "transformer-mini",
            make_plan(
                "transformer-mini",
                three,
                [(0, ("a",), "allreduce"), (20, ("a", "b"), "duplicate"), (40, ("b",), "allreduce")],
                {"a:0": 2, "a:1": 2, "b:0": 2},
            ),
        ),
    ]
    return [{"name": n, "model": m, "plan": p, "steps": 2} for n, m, p in cases]


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    cases = parity_cases()
    by_size: dict[int, list[dict[str, Any]]] = {}
    for case in cases:
        by_size.setdefault(len(Plan.from_dict(case["plan"]).worker_devices()), []).append(case)
    out = {}
    for size, group in by_size.items():
        out[size] = run(tmp_path_factory.mktemp(f"general{size}"), group, size)
    return out


@pytest.mark.parametrize("name", [c["name"] for c in parity_cases()])
def test_general_plan_matches_one_process(parity_results: dict[int, list[dict[str, Any]]], name: str) -> None:
    for results in parity_results.values():
        if name in results[0]:
            assert_parity(results, name)
            return
    raise AssertionError(f"case {name} did not run")


# ---------------------------------------------------------------- refusals, before step 0, on every rank


def refused_cases() -> list[tuple[str, str, dict[str, Any], str]]:
    three = {"a": 2, "b": 1}
    mlp_plan = make_plan("mlp", three, [(0, ("a", "b"), "allreduce")], {"a:0": 2, "a:1": 2, "b:0": 2})
    ps_subset = make_plan(
        "mlp", three, [(0, ("a", "b"), "allreduce"), (5, ("a",), "ps")], {"a:0": 2, "a:1": 2, "b:0": 2}
    )
    two_devices = make_plan("mlp", {"a": 2}, [(0, ("a",), "allreduce")], {"a:0": 2, "a:1": 2})
    both = ("a", "b")
    sfb_more = make_plan(
        "mlp",
        three,
        [(0, both, "allreduce"), (5, both, "allreduce")],
        {"a:0": 2, "a:1": 2, "b:0": 2},
        {1: "sfb"},
    )
    sfb_more["gradients"]["fc3.weight"]["sfb_ops"] = ["relu", "fc3"]
    return [
        (
            "another model",
            "cnn",
            mlp_plan,
            r"the plan's op 'mul' .* is not an op of the traced model WideCNN",
        ),
        ("ps without servers", "mlp", ps_subset, r"syncs by ps but the job has no summation servers"),
        ("job size", "mlp", two_devices, r"the plan runs on 2 devices \(a:0, a:1\) but the job has 3"),
        ("sfb_ops", "mlp", sfb_more, r"sfb_ops \['relu', 'fc3'\] asks to duplicate more than its nn.Linear"),
    ]


def test_plans_the_runtime_cannot_run_fail_before_step_0_on_every_rank(tmp_path: Path) -> None:
    cases = [{"name": n, "model": m, "plan": p, "steps": 1} for n, m, p, _ in refused_cases()]
    results = run(tmp_path, cases, 3)
    for name, _, _, pattern in refused_cases():
        for rank, res in enumerate(results):
            assert res[name].get("type") == "PlanError", f"{name} rank {rank}: {res[name]}"
            assert re.search(pattern, res[name]["error"]), f"{name} rank {rank}: {res[name]['error']}"


def test_ranks_launched_on_the_wrong_devices_are_refused_naming_both(tmp_path: Path) -> None:
    plan = make_plan("mlp", {"a": 2}, [(0, ("a",), "allreduce")], {"a:0": 2, "a:1": 2})
    results = run(tmp_path, [{"name": "swap", "model": "mlp", "plan": plan}], 2, env={"TAGPS_DEVICE": "a:1"})
    for res in results:
        assert res["swap"].get("type") == "PlanError"
        assert "rank 0 is plan device 'a:0' but was launched as TAGPS_DEVICE='a:1'" in res["swap"]["error"]


# ---------------------------------------------------------------- random plans from the search space


def random_cases(count: int = 8) -> list[dict[str, Any]]:
    """Random general plans (placement and option per op group) on a 2 + 1 device topology."""
    import random

    import torch

    from tagps.strategy.baselines import random_plan
    from tagps.strategy.graph import extract_graph
    from tagps.strategy.grouping import group_ops
    from tagps.strategy.simulator import Simulator

    rng = random.Random(7)
    cases = []
    for kind, example in (("mlp", torch.zeros(1, 12)), ("cnn", torch.zeros(1, 3, 16, 16))):
        graph = extract_graph(general_worker.make_model(kind), (example,), kind)
        sim = Simulator(graph, group_ops(graph, 4), topology({"a": 2, "b": 1}))
        for i in range(count // 2):
            plan = random_plan(sim, 6, rng, sfb_fraction=0.15)
            cases.append({"name": f"{kind}-{i}", "model": kind, "plan": plan.to_dict(), "steps": 2})
    return cases


def test_random_plans_train_exactly_or_are_refused_by_name(tmp_path: Path) -> None:
    cases = random_cases()
    by_size: dict[int, list[dict[str, Any]]] = {}
    for case in cases:
        by_size.setdefault(len(Plan.from_dict(case["plan"]).worker_devices()), []).append(case)
    trained = 0
    for size, group in sorted(by_size.items()):
        results = run(tmp_path / str(size), group, size, servers=1)
        for case in group:
            name = case["name"]
            if results[0][name].get("type") == "PlanError":
                assert all(r[name].get("type") == "PlanError" for r in results), (name, results)
                continue
            assert_parity(results, name)
            trained += 1
    assert trained >= len(cases) // 2, f"only {trained} of {len(cases)} random plans trained"


@pytest.mark.parametrize("engine", PS_ENGINES)
def test_ps_among_a_subset_of_the_workers_matches_one_process(tmp_path: Path, engine: str) -> None:
    three = {"a": 2, "b": 1}
    shares = {"a:0": 2, "a:1": 3, "b:0": 2}
    plans = {
        "ps-subset": make_plan("mlp", three, [(0, ("a", "b"), "allreduce"), (5, ("a",), "ps")], shares),
        "ps-all-then-subset": make_plan("cnn", three, [(0, ("a", "b"), "ps"), (7, ("a",), "ps")], shares),
    }
    cases = [{"name": n, "model": p["model"], "plan": p, "steps": 2} for n, p in plans.items()]
    results = run(tmp_path, cases, 3, servers=1, env=ps_engine_env(engine))
    for name in plans:
        assert_parity(results, name)
