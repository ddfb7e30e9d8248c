"""Small models that train in seconds on a CPU core: the demo's and the end-to-end benchmark's workloads.

``vgg-mini`` keeps VGG's shape (3x3 conv stacks, then a wide fully connected classifier that holds most of
the parameters, so that gradient traffic dominates) at 32x32 images; ``transformer-mini`` is a 2-layer causal
Transformer language model. ``mlp-mini``, ``convnet-mini`` and ``encoder-mini`` are the calibration set of
the simulator (``tagps.calibrate``): the benchmarks validate on the other two.
"""

from __future__ import annotations

from torch import nn

from tagps.models.transformer import Encoder

__all__ = [
    "CALIBRATION_SEQ",
    "CALIBRATION_VOCAB",
    "MINI_SEQ",
    "MINI_VOCAB",
    "MLP_FEATURES",
    "convnet_mini",
    "encoder_mini",
    "mlp_mini",
    "transformer_mini",
    "vgg_mini",
]

MINI_VOCAB, MINI_SEQ = 1024, 32
CALIBRATION_VOCAB, CALIBRATION_SEQ = 512, 16
MLP_FEATURES = 512


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


def mlp_mini() -> nn.Module:
    """Calibration model: MLP 512-1024-1024-10 (1.6M params)."""
    return nn.Sequential(
        nn.Linear(MLP_FEATURES, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def convnet_mini() -> nn.Module:
    """Calibration model: conv 16-M-32-M on 3x32x32 images, then a linear classifier (0.03M params)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def encoder_mini() -> nn.Module:
    """Calibration model: one causal Transformer layer of width 64, vocabulary 512, 16 tokens."""
    return Encoder(CALIBRATION_VOCAB, CALIBRATION_SEQ, 64, 2, 256, 1, causal=True)
