"""Name → model factory, example inputs and default (global) batch size."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tagps.models import cnn, small, transformer

__all__ = [
    "MODELS",
    "ModelSpec",
    "build_model",
    "default_batch_size",
    "example_inputs",
    "model_spec",
    "plan_optimizer",
]

# The torch optimizer behind each of a plan's ``optimizer`` names (tagps.strategy.plan.OPTIMIZERS), as
# training jobs build it and as profiles time its step: (learning rate, momentum) for the SGD ones.
_SGD = {"sgd": (0.05, 0.0), "momentum": (0.05, 0.9)}


@dataclass(frozen=True)
class ModelSpec:
    """How to build one reference model.

    Args:
        name: registry key.
        factory: builds the ``nn.Module``.
        inputs: ``(batch_size, device) -> tuple of input tensors``.
        batch_size: default global batch size (the TAG paper's order of magnitude).
    """

    name: str
    factory: Callable[[], nn.Module]
    inputs: Callable[[int, torch.device | str], tuple[torch.Tensor, ...]]
    batch_size: int


def _images(size: int) -> Callable[[int, torch.device | str], tuple[torch.Tensor, ...]]:
    def make(batch: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch, 3, size, size, device=device),)

    return make


def _vectors(features: int) -> Callable[[int, torch.device | str], tuple[torch.Tensor, ...]]:
    def make(batch: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch, features, device=device),)

    return make


def _tokens(
    vocab: int, seq: int, n: int = 1
) -> Callable[[int, torch.device | str], tuple[torch.Tensor, ...]]:
    def make(batch: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randint(0, vocab, (batch, seq), device=device) for _ in range(n))

    return make


MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec("vgg19", cnn.vgg19, _images(224), 128),
        ModelSpec("resnet101", cnn.resnet101, _images(224), 128),
        ModelSpec("inceptionv3", cnn.inception_v3, _images(299), 128),
        ModelSpec(
            "transformer",
            transformer.transformer_base,
            _tokens(transformer.TRANSFORMER_VOCAB, transformer.TRANSFORMER_SEQ, n=2),
            64,
        ),
        ModelSpec(
            "bert-large", transformer.bert_large, _tokens(transformer.BERT_VOCAB, transformer.BERT_SEQ), 32
        ),
        ModelSpec("gpt2", transformer.gpt2_small, _tokens(transformer.GPT2_VOCAB, transformer.GPT2_SEQ), 32),
        ModelSpec("vgg-mini", small.vgg_mini, _images(32), 64),
        ModelSpec("transformer-mini", small.transformer_mini, _tokens(small.MINI_VOCAB, small.MINI_SEQ), 32),
        ModelSpec("mlp-mini", small.mlp_mini, _vectors(small.MLP_FEATURES), 32),
        ModelSpec("convnet-mini", small.convnet_mini, _images(32), 32),
        ModelSpec(
            "encoder-mini",
            small.encoder_mini,
            _tokens(small.CALIBRATION_VOCAB, small.CALIBRATION_SEQ),
            32,
        ),
    )
}


def model_spec(name: str) -> ModelSpec:
    """Return the spec of model ``name``; ValueError listing the known names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def build_model(name: str) -> nn.Module:
    """Build reference model ``name`` on the current default device (``torch.device("meta")`` is free)."""
    return model_spec(name).factory()


def example_inputs(
    name: str, batch_size: int | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, ...]:
    """Return example inputs of model ``name`` with ``batch_size`` samples (default: the model's)."""
    spec = model_spec(name)
    batch = spec.batch_size if batch_size is None else batch_size
    if batch < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch}")
    return spec.inputs(batch, device)


def default_batch_size(name: str) -> int:
    """Default global batch size of model ``name``."""
    return model_spec(name).batch_size


def plan_optimizer(name: str, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimizer a plan's ``optimizer`` ``name`` (``sgd``, ``momentum``, ``adam``) trains with."""
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name not in _SGD:
        raise ValueError(f"unknown optimizer {name!r}; known: adam, {', '.join(_SGD)}")
    lr, momentum = _SGD[name]
    return torch.optim.SGD(params, lr=lr, momentum=momentum)
