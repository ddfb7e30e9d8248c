"""`python -m tagps.calibrate`'s report: each fitted constant beside its micro-benchmark, bounds flagged."""

from __future__ import annotations

import dataclasses

import pytest

from tagps.calibrate import (
    Reference,
    constants_table,
    measure_dispatch,
    measure_ps_message_s,
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
