"""Convolutional reference models: VGG19, ResNet101, InceptionV3 (ImageNet shapes, 1000 classes)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["inception_v3", "resnet101", "vgg19"]

VGG19_CFG = (
    64,
    64,
    "M",
    128,
    128,
    "M",
    256,
    256,
    256,
    256,
    "M",
    512,
    512,
    512,
    512,
    "M",
    512,
    512,
    512,
    512,
    "M",
)


class VGG(nn.Module):
    """VGG with batch-norm-free 3x3 conv stacks and the 4096-wide classifier."""

    def __init__(self, cfg: tuple[int | str, ...], num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(channels, int(v), 3, padding=1), nn.ReLU(inplace=True)]
                channels = int(v)
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def vgg19() -> nn.Module:
    """VGG19 (143.7M parameters)."""
    return VGG(VGG19_CFG)


class Bottleneck(nn.Module):
    """ResNet bottleneck block (1x1, 3x3, 1x1) with an optional projection shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.down(x))


class ResNet(nn.Module):
    """ResNet with bottleneck blocks."""

    def __init__(self, blocks: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        stages = []
        cin = 64
        for i, n in enumerate(blocks):
            width = 64 << i
            layer = []
            for j in range(n):
                layer.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layer))
        self.layers = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)))


def resnet101() -> nn.Module:
    """ResNet-101 (44.5M parameters)."""
    return ResNet((3, 4, 23, 3))


def _conv(
    cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1, padding: int | tuple[int, int] = 0
) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, padding, bias=False),
        nn.BatchNorm2d(cout, eps=1e-3),
        nn.ReLU(inplace=True),
    )


class _InceptionA(nn.Module):
    def __init__(self, cin: int, pool: int) -> None:
        super().__init__()
        self.b1 = _conv(cin, 64, 1)
        self.b5 = nn.Sequential(_conv(cin, 48, 1), _conv(48, 64, 5, padding=2))
        self.b3 = nn.Sequential(_conv(cin, 64, 1), _conv(64, 96, 3, padding=1), _conv(96, 96, 3, padding=1))
        self.bp = nn.Sequential(nn.AvgPool2d(3, 1, 1), _conv(cin, pool, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), self.bp(x)], 1)


class _InceptionB(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b3 = _conv(cin, 384, 3, 2)
        self.b3d = nn.Sequential(_conv(cin, 64, 1), _conv(64, 96, 3, padding=1), _conv(96, 96, 3, 2))
        self.pool = nn.MaxPool2d(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3(x), self.b3d(x), self.pool(x)], 1)


class _InceptionC(nn.Module):
    def __init__(self, cin: int, c7: int) -> None:
        super().__init__()
        self.b1 = _conv(cin, 192, 1)
        self.b7 = nn.Sequential(
            _conv(cin, c7, 1), _conv(c7, c7, (1, 7), padding=(0, 3)), _conv(c7, 192, (7, 1), padding=(3, 0))
        )
        self.b7d = nn.Sequential(
            _conv(cin, c7, 1),
            _conv(c7, c7, (7, 1), padding=(3, 0)),
            _conv(c7, c7, (1, 7), padding=(0, 3)),
            _conv(c7, c7, (7, 1), padding=(3, 0)),
            _conv(c7, 192, (1, 7), padding=(0, 3)),
        )
        self.bp = nn.Sequential(nn.AvgPool2d(3, 1, 1), _conv(cin, 192, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b7(x), self.b7d(x), self.bp(x)], 1)


class _InceptionD(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b3 = nn.Sequential(_conv(cin, 192, 1), _conv(192, 320, 3, 2))
        self.b7 = nn.Sequential(
            _conv(cin, 192, 1),
            _conv(192, 192, (1, 7), padding=(0, 3)),
            _conv(192, 192, (7, 1), padding=(3, 0)),
            _conv(192, 192, 3, 2),
        )
        self.pool = nn.MaxPool2d(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3(x), self.b7(x), self.pool(x)], 1)


class _InceptionE(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b1 = _conv(cin, 320, 1)
        self.b3 = _conv(cin, 384, 1)
        self.b3a = _conv(384, 384, (1, 3), padding=(0, 1))
        self.b3b = _conv(384, 384, (3, 1), padding=(1, 0))
        self.bd = nn.Sequential(_conv(cin, 448, 1), _conv(448, 384, 3, padding=1))
        self.bda = _conv(384, 384, (1, 3), padding=(0, 1))
        self.bdb = _conv(384, 384, (3, 1), padding=(1, 0))
        self.bp = nn.Sequential(nn.AvgPool2d(3, 1, 1), _conv(cin, 192, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.b3(x)
        bd = self.bd(x)
        return torch.cat([self.b1(x), self.b3a(b3), self.b3b(b3), self.bda(bd), self.bdb(bd), self.bp(x)], 1)


class InceptionV3(nn.Module):
    """Inception-v3 without the auxiliary classifier (input 299x299)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            _conv(3, 32, 3, 2),
            _conv(32, 32, 3),
            _conv(32, 64, 3, padding=1),
            nn.MaxPool2d(3, 2),
            _conv(64, 80, 1),
            _conv(80, 192, 3),
            nn.MaxPool2d(3, 2),
        )
        self.blocks = nn.Sequential(
            _InceptionA(192, 32),
            _InceptionA(256, 64),
            _InceptionA(288, 64),
            _InceptionB(288),
            _InceptionC(768, 128),
            _InceptionC(768, 160),
            _InceptionC(768, 160),
            _InceptionC(768, 192),
            _InceptionD(768),
            _InceptionE(1280),
            _InceptionE(2048),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(), nn.Linear(2048, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def inception_v3() -> nn.Module:
    """Inception-v3 (23.8M parameters without the auxiliary head)."""
    return InceptionV3()
