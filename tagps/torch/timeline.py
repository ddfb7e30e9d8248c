"""Horovod's timeline: a Chrome trace of this process's collectives and gradient synchronisations.

:func:`start_timeline` begins recording; every collective of :mod:`tagps.torch.collective_ops` and every
gradient launch of ``DistributedOptimizer`` becomes one complete event (``ph: "X"``) from its start until
its handle completes, on track ``pid`` = rank. :func:`stop_timeline` (or ``shutdown``) writes the events as a
JSON array that ``chrome://tracing`` and Perfetto open. Unlike Horovod, there is no negotiation phase to
show: each event is the whole operation.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from tagps.atomic import write_text_atomic
from tagps.comm.handle import Handle
from tagps.torch import ops

__all__ = ["mark_cycle", "start_timeline", "stop_timeline", "traced"]


class _Timeline:
    """The events recorded so far and where they go."""

    def __init__(self, path: Path, mark_cycles: bool, rank: int) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self.rank = rank
        self.t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()  # handles may complete on other threads

    def micros(self, t: float) -> float:
        return (t - self.t0) * 1e6

    def add(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.events.append({"pid": self.rank, "tid": 0, **event})


_active: _Timeline | None = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a timeline (replacing one being recorded, which is written first).

    Args:
        file_path: where :func:`stop_timeline` writes the Chrome trace (JSON).
        mark_cycles: also mark every ``DistributedOptimizer.step()`` with an instant event ``CYCLE_START``.
    """
    global _active
    st = ops.state()
    if not file_path:
        raise ValueError("start_timeline needs a file path")
    stop_timeline()
    _active = _Timeline(Path(file_path), mark_cycles, st.cfg.rank)


def stop_timeline() -> None:
    """Stop recording and write the timeline (atomically: a reader never sees half a file)."""
    global _active
    timeline, _active = _active, None
    if timeline is None:
        return
    with timeline.lock:
        text = json.dumps(timeline.events)
    write_text_atomic(timeline.path, text)


def traced(handle: Handle, kind: str, name: str) -> Handle:
    """Return ``handle``, recording ``kind`` of ``name`` from now until it completes when a timeline is on."""
    timeline = _active
    if timeline is None:
        return handle
    start = time.perf_counter()

    def finish() -> Any:
        result = handle.wait()
        end = time.perf_counter()
        timeline.add(
            {"name": kind, "ph": "X", "ts": timeline.micros(start), "dur": (end - start) * 1e6,
             "args": {"tensor": name}}
        )  # fmt: skip
        return result

    return Handle([handle], finish)


def mark_cycle() -> None:
    """Record a ``CYCLE_START`` instant event if the timeline marks cycles (one per optimizer step)."""
    timeline = _active
    if timeline is not None and timeline.mark_cycles:
        timeline.add({"name": "CYCLE_START", "ph": "i", "s": "p", "ts": timeline.micros(time.perf_counter())})
