"""Re-predict the runs of a committed ``bench/e2e_cluster.py`` result with the simulator as it is now.

Usage: python bench/repredict.py [RESULT_JSON] [--calibration FILE] [--profiles DIR] [--refit] [--quota-share]

The fast way to iterate on the cost model: the measured step times, the plans (with the measured topology
inside them) and the calibration are all in the result and its ``*-plans/`` folder, so a change to the
simulator is checked against real runs in seconds instead of a 25-minute cluster run. Prints, per run, the
measured step time, the prediction recorded then and the prediction now, and the error figures of both
(Horovod's runs are left out of the figures, as ``bench/e2e_cluster.py`` does). The op profiles are the
ones the run made on its host, in ``<result>-plans/profiles`` (older results: found as ``tagps plan`` finds
them, ``TAGPS_CACHE_DIR`` and then the shipped ones); ``--profiles DIR`` takes another run's instead (a
folder holding ``profiles/``, such as another result's ``*-plans/``), to tell how much of an error is the
profile's. A result that records the median of its measured inputs (``median_inputs``: the topology, and
the profiles in ``<result>-plans/median``) is re-predicted from those, as ``bench/e2e_cluster.py`` predicts
it; ``--profiles`` overrides the profiles there too. ``--refit`` refits the calibration's runtime CPU
constants on the jobs it recorded (``job_runs``) before predicting: the way to check a change to the CPU
cost model, whose constants were fitted under the old one. ``--quota-share`` prices every quota'd CPU device
at its quota's share of the profiled core (``cpu_cores / count`` times the profile's ``core_flops``; the
calibration's for ``--refit``'s jobs) instead of the matmul probe's reading: what the simulator would
predict if an op under a quota took the CPU it takes on a free core.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GROUPS = 8  # the op groups bench/e2e_cluster.py plans with


def at_quota_share(topology: dict[str, Any], core_flops: float) -> dict[str, Any]:
    """A copy of a topology record whose quota'd CPU device groups run at their quota's share of a core of
    ``core_flops`` FLOP/s (``--quota-share``)."""
    topology = copy.deepcopy(topology)
    for group in topology["groups"]:
        if group["device"] == "CPU" and group.get("count") and group.get("cpu_cores"):
            group["peak_flops"] = round(group["cpu_cores"] / group["count"] * core_flops, -6)
    return topology


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "result", type=Path, nargs="?", default=REPO / "bench" / "results" / "e2e_cluster.json"
    )
    parser.add_argument("--calibration", type=Path, help="a calibration file instead of the recorded one")
    parser.add_argument(
        "--profiles", type=Path, help="a folder holding profiles/ (another result's *-plans/) instead",
    )
    parser.add_argument(
        "--refit", action="store_true", help="first refit the calibration's runtime CPU constants on the "
        "jobs it recorded, with the simulator as it is now (`python -m tagps.calibrate --refit`)"
    )  # fmt: skip
    parser.add_argument(
        "--quota-share", action="store_true", help="price every quota'd CPU device at its quota's share of "
        "the profiled core instead of the matmul probe's reading (the jobs of --refit too)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.profiles is not None and not (args.profiles / "profiles").is_dir():
        parser.error(f"--profiles {args.profiles}: no profiles/ folder in it")

    from tagps.strategy.calibration import Calibration, load_calibration, refit_runs
    from tagps.strategy.graph import model_graph
    from tagps.strategy.grouping import group_ops
    from tagps.strategy.plan import load
    from tagps.strategy.profiles import find_profile, load_profile, profile_path
    from tagps.strategy.topology import Topology

    plans = args.result.parent / f"{args.result.stem}-plans"
    if args.profiles is not None:
        os.environ["TAGPS_CACHE_DIR"] = str(args.profiles)
    elif (plans / "profiles").is_dir():
        os.environ["TAGPS_CACHE_DIR"] = str(plans)
    data = json.loads(args.result.read_text())
    cal = (
        load_calibration(args.calibration) if args.calibration else Calibration.from_dict(data["calibration"])
    )
    if args.refit:
        if args.quota_share:
            runs = copy.deepcopy(cal.job_runs)
            for run in runs:
                run["plan"]["topology"] = at_quota_share(run["plan"]["topology"], cal.core_flops)
            cal = dataclasses.replace(cal, job_runs=runs)
        try:
            cal = refit_runs(cal)
        except ValueError as exc:
            parser.error(f"--refit: {exc}")
        print(f"refitted on {len(cal.job_runs)} recorded jobs (mean error {cal.fit_error['jobs']:.1%}): "
              f"collective step {cal.collective_step_s * 1e6:.0f} us, "
              f"call {cal.collective_call_s * 1e6:.0f} us, "
              f"PS message {cal.message_overhead_s * 1e6:.0f} us")  # fmt: skip
    then: list[float] = []
    now: list[float] = []
    row = "{:<17} {:<18} {:>9} {:>9} {:>9} {:>9} {:>8}"
    print(row.format("model", "strategy", "measured", "then", "now", "err then", "err now"))
    for run in data["runs"]:
        argv_ = shlex.split(run["command"])
        recorded = REPO / argv_[argv_.index("--plan") + 1]
        # A run made outside the repo names its plan where it was then; the committed copy is in `plans`.
        plan = load(recorded if recorded.is_file() else plans / recorded.name)
        graph = model_graph(run["model"])
        topology, profiles = plan.topology, None
        if "median_inputs" in data:  # the median of the run's measured inputs
            topology = Topology.from_dict(data["median_inputs"]["topology"])
            folder = (args.profiles or plans / "median") / "profiles"
            profiles = {"CPU": load_profile(profile_path(run["model"], "CPU", folder))}
        if args.quota_share:
            found = None if profiles else find_profile(run["model"], "CPU")
            profile = profiles["CPU"] if profiles else load_profile(found) if found else None
            if profile is None or not profile.core_flops:
                parser.error(f"--quota-share: no CPU profile of {run['model']} that records its core's speed")
            topology = Topology.from_dict(at_quota_share(topology.to_dict(), profile.core_flops))
        sim = cal.simulator(graph, group_ops(graph, GROUPS), topology, profiles=profiles)
        predicted = cal.evaluate(sim, plan)
        measured = run["measured_s"]
        error = predicted / measured - 1
        if run["runtime"] != "horovod":
            then.append(abs(run["rel_error"]))
            now.append(abs(error))
        times = (f"{t * 1e3:7.1f}ms" for t in (measured, run["predicted_s"], predicted))
        print(row.format(run["model"], run["strategy"], *times, f"{run['rel_error']:+.3f}", f"{error:+.3f}"))
    print(f"|error| mean: then {statistics.mean(then):.3f}, now {statistics.mean(now):.3f}")
    print(f"|error| max:  then {max(then):.3f}, now {max(now):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
