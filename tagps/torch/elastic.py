"""``horovod.torch.elastic``'s names, which tagps does not implement.

Elastic training needs a job whose workers can join and leave while it runs (Horovod's driver re-forms the
ring and restores committed state). A tagps job has a fixed layout from ``bpslaunch``, so every name here
raises :class:`NotImplementedError` saying so, instead of an ``AttributeError`` deep in a script.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]


def _missing(name: str) -> NoReturn:
    raise NotImplementedError(
        f"tagps.torch.elastic.{name}: elastic training (workers joining or leaving a running job, state "
        "restored on reset) is not implemented in tagps; run a fixed-size job under bpslaunch and "
        "checkpoint with torch.save instead"
    )


def run(func: Any) -> NoReturn:
    """Raise :class:`NotImplementedError` (Horovod's ``@hvd.elastic.run``)."""
    _missing("run")


class State:
    """Raises :class:`NotImplementedError` when created (Horovod's elastic state)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _missing(type(self).__name__)


class ObjectState(State):
    """Raises :class:`NotImplementedError` when created."""


class TorchState(ObjectState):
    """Raises :class:`NotImplementedError` when created."""


class ElasticSampler(State):
    """Raises :class:`NotImplementedError` when created."""
