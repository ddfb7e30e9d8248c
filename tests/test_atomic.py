"""Atomic writes (``tagps.atomic``) and the files written through them: plans and calibrations."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tagps import atomic
from tagps.strategy.calibration import Calibration
from tagps.strategy.plan import PLAN_VERSION, Plan
from tagps.strategy.topology import paper_testbed


def _plan() -> Plan:
    topology = paper_testbed()
    shares = dict.fromkeys(topology.devices(), 0)
    shares["v100:0"] = 4
    return Plan.from_dict({
        "version": PLAN_VERSION, "kind": "data-parallel", "model": "mlp", "batch_size": 4,
        "topology": topology.to_dict(), "gradients": {}, "batch_shares": shares, "comm": {},
        "groups": [{"ops": ["_0"], "placement": ["v100"], "option": "allreduce"}],
    })  # fmt: skip


SAVERS: dict[str, Callable[[Path], None]] = {
    "text": lambda path: atomic.write_text_atomic(path, "new\n" * 1000),
    "plan": lambda path: _plan().save(path),
    "calibration": lambda path: Calibration(100e9, 20e9, 1.0, 0.3, 20e-6, 300e-6, 50e-6, 0.8, 0.5).save(path),
}


@pytest.mark.parametrize("saver", list(SAVERS))
def test_a_reader_of_the_old_file_still_sees_all_of_it(tmp_path: Path, saver: str) -> None:
    path = tmp_path / "out.json"
    old = "old contents\n" * 1000
    path.write_text(old)
    with open(path) as reader:  # opened before the write: an in-place rewrite would change what it reads
        SAVERS[saver](path)
        assert reader.read() == old
    assert path.read_text() != old
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old")

    def crash(fd: int) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(atomic.os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        _plan().save(path)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_atomic_open_creates_parents_and_writes_bytes(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state.bin"
    with atomic.atomic_open(path) as fh:
        fh.write(b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    atomic.write_bytes_atomic(path, b"2")
    assert path.read_bytes() == b"2"
