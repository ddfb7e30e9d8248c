"""``horovod.torch.elastic``'s names, which tagps does not support yet.

Elastic training needs a job whose workers can join and leave while it runs (Horovod's driver re-forms the
ring and restores committed state). A tagps job keeps the workers ``bpslaunch`` started, so every name a
Horovod elastic script touches (``run``, ``TorchState``, ``ElasticSampler``, and ``State`` and
``ObjectState`` for subclasses) raises :class:`ElasticNotSupported` with one message that says what to do
instead, at the first line that uses it rather than as an ``AttributeError`` deep in a script.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["ElasticNotSupported", "ElasticSampler", "ObjectState", "State", "TorchState", "run"]


class ElasticNotSupported(NotImplementedError):
    """Raised by every name of :mod:`tagps.torch.elastic`."""


def _unsupported(name: str) -> NoReturn:
    raise ElasticNotSupported(
        f"hvd.elastic.{name}: elastic training is not supported by tagps yet (a job keeps the workers "
        "bpslaunch started). Run the script without hvd.elastic instead: call the training function "
        "directly, with a plain sampler (torch.utils.data.DistributedSampler) and a model and optimizer "
        "instead of the state object. To recover from a failed node, restart the job from checkpoints: "
        "run the summation servers with `python -m tagps.server --checkpoint PATH --checkpoint-every N` "
        "and restart them with `--restore PATH` (they resume from their last checkpoint), and save what "
        "the workers hold with torch.save"
    )


def run(func: Any) -> NoReturn:
    """Raise :class:`ElasticNotSupported` (Horovod's ``@hvd.elastic.run`` decorator), when applied."""
    _unsupported("run")


class State:
    """Raises :class:`ElasticNotSupported` when created (Horovod's elastic state), subclasses included."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # A script's subclass is named by the Horovod class it derives from.
        _unsupported(next(c.__name__ for c in type(self).__mro__ if c.__module__ == __name__))


class ObjectState(State):
    """Raises :class:`ElasticNotSupported` when created."""


class TorchState(ObjectState):
    """Raises :class:`ElasticNotSupported` when created."""


class ElasticSampler(State):
    """Raises :class:`ElasticNotSupported` when created."""
