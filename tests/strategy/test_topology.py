import json

import pytest

from tagps.strategy.devices import DEVICE_TYPES, calibrated, device_type
from tagps.strategy.topology import (
    DeviceGroup,
    Link,
    Topology,
    load_topology,
    paper_cloud,
    paper_testbed,
    random_topology,
)


def test_paper_testbed_matches_the_paper():
    t = paper_testbed()
    counts = {}
    for g in t.groups:
        counts[g.device] = counts.get(g.device, 0) + g.count
    assert counts == {"V100-32GB": 4, "1080Ti": 8, "P100": 4}
    assert len(t.groups) == 7
    assert t.bandwidth("v100", "p100-0") == 100e9 / 8
    assert t.bandwidth("v100", "v100") > t.bandwidth("1080ti-0", "1080ti-0")  # NVLink vs PCIe


def test_paper_cloud():
    t = paper_cloud()
    assert t.num_devices == 32
    assert t.bandwidth("v100-0", "t4-3") == 10e9 / 8


@pytest.mark.parametrize("seed", range(20))
def test_random_topology_ranges_and_determinism(seed):
    t = random_topology(seed)
    assert t == random_topology(seed)
    assert 1 <= len(t.groups) <= 6
    assert len({g.device for g in t.groups} - {"V100-32GB", "1080Ti", "P100"}) == 0
    for g in t.groups:
        assert 1 <= g.count <= 8
        assert 64 <= g.intra_bandwidth_gbps <= 160
    for a in t.groups:
        for b in t.groups:
            if a is not b:
                assert 20e9 / 8 <= t.bandwidth(a.name, b.name) <= 50e9 / 8


@pytest.mark.parametrize("make", [paper_testbed, paper_cloud, lambda: random_topology(5)])
def test_dict_round_trip(make, tmp_path):
    t = make()
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t.to_dict()))
    assert load_topology(path) == t


def test_yaml_file(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(
        "name: two\ninter_bandwidth_gbps: 10\ngroups:\n"
        "  - {name: a, device: T4, count: 2, intra_bandwidth_gbps: 96}\n"
        "  - {name: b, device: CPU, count: 1, intra_bandwidth_gbps: 50, memory_bytes: 1000}\n"
        "links:\n  - {a: a, b: b, bandwidth_gbps: 1}\n"
    )
    t = load_topology(path)
    assert t.bandwidth("a", "b") == 1e9 / 8
    assert t.group("b").memory_bytes == 1000
    assert t.group("a").memory_bytes == DEVICE_TYPES["T4"].memory_bytes
    assert t.devices() == ["a:0", "a:1", "b:0"]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"name": "x", "inter_bandwidth_gbps": 1, "groups": []}, "non-empty list"),
        (
            {"name": "x", "groups": [{"name": "a", "device": "T4", "count": 1, "intra_bandwidth_gbps": 1}]},
            "inter_bandwidth_gbps",
        ),
        (
            {
                "name": "x",
                "inter_bandwidth_gbps": 1,
                "groups": [{"name": "a", "device": "K80", "count": 1, "intra_bandwidth_gbps": 1}],
            },
            "unknown device type",
        ),
        (
            {
                "name": "x",
                "inter_bandwidth_gbps": 1,
                "groups": [{"name": "a", "device": "T4", "count": 0, "intra_bandwidth_gbps": 1}],
            },
            "count",
        ),
        (
            {
                "name": "x",
                "inter_bandwidth_gbps": 1,
                "groups": [{"name": "a", "device": "T4", "count": 1, "intra_bandwidth_gbps": -1}],
            },
            "intra_bandwidth",
        ),
        (
            {
                "name": "x",
                "inter_bandwidth_gbps": 1,
                "groups": [{"name": "a", "device": "T4", "count": 1, "intra_bandwidth_gbps": 1}] * 2,
            },
            "duplicate",
        ),
        (
            {"name": "x", "inter_bandwidth_gbps": 1, "groups": [{"name": "a", "device": "T4", "count": 1}]},
            "missing",
        ),
        (
            {
                "name": "x",
                "inter_bandwidth_gbps": 1,
                "groups": [{"name": "a", "device": "T4", "count": 1, "intra_bandwidth_gbps": 1}],
                "links": [{"a": "a", "b": "zz", "bandwidth_gbps": 1}],
            },
            "unknown device group 'zz'",
        ),
        (
            {
                "name": "x",
                "inter_bandwidth_gbps": 0,
                "groups": [{"name": "a", "device": "T4", "count": 1, "intra_bandwidth_gbps": 1}],
            },
            "inter_bandwidth",
        ),
        (
            {
                "name": "x",
                "inter_bandwidth_gbps": 1,
                "bogus": 1,
                "groups": [{"name": "a", "device": "T4", "count": 1, "intra_bandwidth_gbps": 1}],
            },
            "unknown keys",
        ),
    ],
)
def test_invalid_topologies_name_the_problem(data, match):
    with pytest.raises(ValueError, match=match):
        Topology.from_dict(data)


def test_link_to_itself_and_unknown_spec():
    g = DeviceGroup("a", "T4", 1, 10)
    with pytest.raises(ValueError, match="itself"):
        Topology("x", (g,), 1, (Link("a", "a", 1),))
    with pytest.raises(ValueError, match="neither a preset"):
        load_topology("no-such-topology")
    with pytest.raises(ValueError, match="no device group"):
        paper_testbed().bandwidth("v100", "nope")


def test_device_table_and_roofline():
    assert set(DEVICE_TYPES) >= {"V100-32GB", "V100-16GB", "1080Ti", "P100", "T4", "A100", "H100", "CPU"}
    v100 = device_type("V100-32GB")
    compute_bound = v100.op_time(1e12, 1.0)
    assert compute_bound == pytest.approx(1e12 / (v100.peak_flops * v100.efficiency) + v100.op_overhead_s)
    memory_bound = v100.op_time(1.0, 1e9)
    assert memory_bound == pytest.approx(
        1e9 / (v100.memory_bandwidth * v100.memory_efficiency) + v100.op_overhead_s
    )
    faster = calibrated(v100, efficiency=0.9)
    assert faster.op_time(1e12, 1.0) < compute_bound
    with pytest.raises(ValueError, match="not calibration constants"):
        calibrated(v100, peak_flops=1.0)
    with pytest.raises(ValueError, match="unknown device type"):
        device_type("K80")


def test_server_only_machines_load_and_round_trip(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(
        "name: spare\ninter_bandwidth_gbps: 1\ngroups:\n"
        "  - {name: w, device: T4, count: 2, intra_bandwidth_gbps: 96}\n"
        "  - {name: cpu0, count: 0}\n"
        "links:\n  - {a: w, b: cpu0, bandwidth_gbps: 10}\n"
    )
    t = load_topology(path)
    spare = t.group("cpu0")
    assert spare.server_only and not t.group("w").server_only
    assert spare.device == "CPU" and spare.devices() == []
    assert t.server_only == ("cpu0",) and t.worker_indices == (0,)
    assert t.devices() == ["w:0", "w:1"] and t.num_devices == 2
    assert t.bandwidth("w", "cpu0") == 10e9 / 8
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ([{"name": "s", "count": 0}], "every device group is server-only"),
        ([{"name": "a", "device": "T4", "count": -1, "intra_bandwidth_gbps": 1}], "integer >= 0"),
        # Only a server-only machine may leave out the device fields.
        ([{"name": "a", "count": 1}], r"missing \['device', 'intra_bandwidth_gbps'\]"),
        (
            [
                {"name": "a", "device": "T4", "count": 1, "intra_bandwidth_gbps": 1},
                {"name": "s", "count": 0, "role": "server"},
            ],
            r"unknown \['role'\]",
        ),
    ],
)
def test_invalid_server_only_machines_name_the_problem(groups, match):
    with pytest.raises(ValueError, match=match):
        Topology.from_dict({"name": "x", "inter_bandwidth_gbps": 1, "groups": groups})


def test_a_machines_cpu_cores_round_trip_and_stay_out_of_files_when_unknown():
    quota = DeviceGroup("m", "CPU", 2, 40.0, peak_flops=50e9, cpu_cores=0.7)
    t = Topology("q", (quota, DeviceGroup("n", "CPU", 1, 40.0)), 1.0)
    data = t.to_dict()
    assert data["groups"][0]["cpu_cores"] == 0.7 and "cpu_cores" not in data["groups"][1]
    assert Topology.from_dict(json.loads(json.dumps(data))) == t
    for bad in (-0.5, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="cpu_cores must be >= 0"):
            DeviceGroup("m", "CPU", 2, 40.0, cpu_cores=bad)
