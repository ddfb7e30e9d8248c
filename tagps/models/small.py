"""Small models that train in seconds on a CPU core: the demo's and the end-to-end benchmark's workloads.

``vgg-mini`` keeps VGG's shape (3x3 conv stacks, then a wide fully connected classifier that holds most of
the parameters, so that gradient traffic dominates) at 32x32 images; ``transformer-mini`` is a 2-layer causal
Transformer language model.
"""

from __future__ import annotations

from torch import nn

from tagps.models.transformer import Encoder

__all__ = ["MINI_SEQ", "MINI_VOCAB", "transformer_mini", "vgg_mini"]

MINI_VOCAB, MINI_SEQ = 1024, 32


def vgg_mini(num_classes: int = 10) -> nn.Module:
    """VGG-style net for 3x32x32 images: conv 32-M-64-M-128-M, FC 2048-1024-1024-classes; 3.3M params."""
    layers: list[nn.Module] = []
    channels = 3
    for width in (32, 64, 128):
        layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2)]
        channels = width
    return nn.Sequential(
        *layers,
        nn.Flatten(),
        nn.Linear(128 * 4 * 4, 1024),
        nn.ReLU(inplace=True),
        nn.Linear(1024, 1024),
        nn.ReLU(inplace=True),
        nn.Linear(1024, num_classes),
    )


def transformer_mini() -> nn.Module:
    """Causal Transformer LM: vocabulary 1024, 32 tokens, 2 pre-norm layers of width 128, 4 heads, FFN 512."""
    return Encoder(MINI_VOCAB, MINI_SEQ, 128, 4, 512, 2, causal=True)
