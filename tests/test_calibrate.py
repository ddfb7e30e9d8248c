"""`python -m tagps.calibrate`'s report: each fitted constant beside its micro-benchmark, bounds flagged."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tagps.calibrate import (
    CALIBRATION_CLUSTER,
    Reference,
    constants_table,
    measure_dispatch,
    measure_ps_message_s,
    measure_runtime_cpu,
    measure_sum_bandwidth,
)
from tagps.strategy.calibration import FITTED, HOST_CPU, Calibration


def test_constants_table_sets_each_constant_beside_its_micro_benchmark() -> None:
    # efficiency and intra_bandwidth_efficiency on their upper / lower ends, the rest inside.
    cal = Calibration(100e9, 20e9, 1.0, 0.25, 20e-6, 300e-6, 50e-6, 0.8, 0.1)
    refs = {
        "efficiency": Reference("matmul, one core", 100e9, "FLOP/s"),
        "memory_efficiency": Reference("copy, one core", 20e9, "B/s"),
        "op_overhead_s": Reference("one op on one element", 2e-6, "s"),
        "inter_bandwidth_efficiency": Reference("TCP goodput ca-cb", 50e6, "B/s"),
    }
    cal = dataclasses.replace(cal, message_copies=4.0, sum_bandwidth=30e9)
    refs["message_copies"] = Reference("TCP goodput, loopback", 4e9, "B/s")
    lines = constants_table(cal, refs).splitlines()
    assert len(lines) == 1 + len(FITTED) + len(HOST_CPU)
    rows = {line.split()[0]: line for line in lines[1:]}
    assert "copy, one core: 20 GB/s" in rows["memory_efficiency"] and "5 GB/s" in rows["memory_efficiency"]
    assert "one op on one element: 2 us" in rows["op_overhead_s"]
    assert "[500 ns, 1 ms]" in rows["op_overhead_s"] and "[0.05, 1]" in rows["efficiency"]
    assert "TCP goodput ca-cb: 50 MB/s" in rows["inter_bandwidth_efficiency"]
    assert "40 MB/s" in rows["inter_bandwidth_efficiency"]
    assert rows["intra_latency_s"].split()[1:3] == ["50", "us"]  # no micro-benchmark given: "-"
    assert " - " in rows["intra_latency_s"]
    assert "TCP goodput, loopback: 4 GB/s" in rows["message_copies"] and "5 GB/s" in rows["message_copies"]
    assert "not costed" in rows["collective_step_s"]
    flagged = {name for name, line in rows.items() if line.endswith("ON BOUND")}
    assert flagged == {"efficiency", "intra_bandwidth_efficiency"} == set(cal.at_bound)


def test_measure_dispatch_is_a_few_microseconds() -> None:
    assert 1e-8 < measure_dispatch(0.05) < 1e-3


def test_measure_sum_bandwidth_is_a_memory_rate() -> None:
    assert 0.5e9 < measure_sum_bandwidth(1 << 20, reps=3) < 1e12


@pytest.mark.timeout(90)
def test_measure_ps_message_s_is_a_servers_cpu_per_message() -> None:
    # The server's process (not the scheduler's, which idles): some microseconds of CPU per message.
    per_message = measure_ps_message_s(keys=8, seconds=0.5)
    assert HOST_CPU["message_overhead_s"].low < per_message < HOST_CPU["message_overhead_s"].high


class _RecordingCluster:
    """Stands in for the calibration cluster: each run writes the CPU per call its ring size is given (one
    value for every rank, or a list of each rank's)."""

    def __init__(self, per_call: dict[int, dict[str, float | list[float]]]) -> None:
        self.per_call, self.jobs = per_call, []

    def run(self, argv: list[str], devices: list[str], servers: dict[str, int], out: Any) -> int:
        self.jobs.append((devices, servers))
        given = self.per_call[len(devices)]
        data = {m: v if isinstance(v, list) else [v] * len(devices) for m, v in given.items()}
        Path(argv[argv.index("--runtime-cpu-probe") + 1]).write_text(json.dumps(data))
        return 0


# Push_pulls: 0.23 ms per call on a machine of one rank (0.2 ms and 2 messages of 15 us); on machines of
# two, the root 1.2 ms and the other 0.5 ms: 1.27 ms a machine beyond its calls and messages; on machines of
# three, the root 1.3 ms and the others 0.7 ms: 2.07 ms. So 0.8 ms per further rank and 0.47 ms once.
_PS = {2: {"allreduce": 0.6e-3, "ps": 0.23e-3}, 4: {"allreduce": 1.6e-3, "ps": [1.2e-3, 0.5e-3] * 2}}
_PS_6 = [1.3e-3, 0.7e-3, 0.7e-3] * 2


def test_runtime_cpu_solves_rings_of_3_and_6_for_step_and_call_and_machine_sizes_for_push_pulls() -> None:
    # 1 ms per call on 3 ranks (4 steps), 2.2 ms on 6 (10 steps): 0.2 ms per step, 0.2 ms per call.
    cluster = _RecordingCluster({3: {"allreduce": 1.0e-3}, 6: {"allreduce": 2.2e-3, "ps": _PS_6}, **_PS})
    measured, refs = measure_runtime_cpu(cluster, calls=10, message_s=15e-6)
    assert measured == pytest.approx(
        {
            "collective_step_cpu_s": 0.2e-3,
            "collective_call_cpu_s": 0.2e-3,
            "ps_call_s": 0.2e-3,
            "ps_shared_call_s": 0.47e-3,
            "ps_local_call_s": 0.8e-3,
        }
    )
    assert refs["collective_step_s"].value == pytest.approx(0.2e-3)
    assert refs["collective_call_s"].value == pytest.approx(0.2e-3)
    machines = [m["name"] for m in CALIBRATION_CLUSTER["machines"]]
    (three, no_servers), (six, servers), (lone, lone_servers), (pair, pair_servers) = cluster.jobs
    assert len(three) == 3 and {d.split(":")[0] for d in three} == {machines[0]} and no_servers == {}
    assert len(six) == 6 and servers == dict.fromkeys(machines, 1)
    assert lone == [f"{m}:0" for m in machines] and lone_servers == servers
    assert pair == [f"{m}:{i}" for m in machines for i in range(2)] and pair_servers == servers


def test_runtime_cpu_reading_under_zero_is_not_costed() -> None:
    # 1 ms per call on 3 ranks, 2.6 ms on 6: 0.267 ms per step, leaving -0.067 ms per call (noise); and
    # machines of two and three ranks that cost no more than as many lone ones.
    per_call = {3: {"allreduce": 1.0e-3}, 6: {"allreduce": 2.6e-3, "ps": 0.19e-3}, **_PS}
    per_call[4] = {"allreduce": 1.6e-3, "ps": 0.2e-3}
    measured, refs = measure_runtime_cpu(_RecordingCluster(per_call), calls=10, message_s=15e-6)
    assert measured["collective_call_cpu_s"] == 0.0 and refs["collective_call_s"].value < 0
    assert measured["collective_step_cpu_s"] == pytest.approx(1.6e-3 / 6)
    assert measured["ps_local_call_s"] == 0.0 and measured["ps_shared_call_s"] == 0.0
    assert measured["ps_call_s"] == pytest.approx(0.2e-3)


def test_runtime_cpu_leaves_a_root_cost_that_does_not_grow_to_the_machine() -> None:
    # Machines of three that cost what machines of two do beyond their calls: no cost per further rank,
    # the whole of it once per machine.
    per_call = {3: {"allreduce": 1.0e-3}, 6: {"allreduce": 2.2e-3, "ps": [1.2e-3, 0.5e-3, 0.2e-3] * 2}, **_PS}
    measured, _ = measure_runtime_cpu(_RecordingCluster(per_call), calls=10, message_s=15e-6)
    assert measured["ps_local_call_s"] == 0.0
    assert measured["ps_shared_call_s"] == pytest.approx(1.27e-3)


@pytest.mark.timeout(120)
def test_runtime_cpu_probe_measures_each_ranks_cpu_per_call(tmp_path: Path) -> None:
    from tagps.launcher import local_job, run_processes

    out = tmp_path / "cpu.json"
    argv = [sys.executable, "-m", "tagps.calibrate", "--runtime-cpu-probe", str(out), "--reps", "50"]
    with (tmp_path / "log").open("wb") as log:
        assert run_processes(local_job(argv, 2, 1, 1, dict(os.environ)), out=log) == 0
    data = json.loads(out.read_text())
    assert sorted(data) == ["allreduce", "ps"]
    # Some microseconds to some milliseconds of CPU per call on each of the 2 ranks (a 1 KiB tensor).
    assert all(len(v) == 2 and all(1e-6 < x < 20e-3 for x in v) for v in data.values())
