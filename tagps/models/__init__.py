"""Reference models in plain ``torch.nn`` (no torchvision), each buildable by name.

>>> from tagps.models import build_model, example_inputs
>>> model = build_model("vgg19")
>>> inputs = example_inputs("vgg19", batch_size=2)

Every model traces with ``torch.fx`` (attention reshapes use ``unflatten``/``flatten`` rather than
sizes read from tensors) so that the strategy layer can extract its graph.
"""

from __future__ import annotations

from tagps.models.registry import (
    MODELS,
    ModelSpec,
    build_model,
    default_batch_size,
    example_inputs,
    model_spec,
    plan_optimizer,
)

__all__ = [
    "MODELS",
    "ModelSpec",
    "build_model",
    "default_batch_size",
    "example_inputs",
    "model_spec",
    "plan_optimizer",
]
