"""AlexNet and VGG16 for the training benchmark, defined here because torchvision does not install
beside torch 2.13 on the machines this project targets.

The layer shapes follow torchvision's ``alexnet`` and ``vgg16`` exactly, so at 1000 classes the
parameter counts match (AlexNet 61,100,840; VGG16 138,357,544) and so does the gradient volume a
training step allreduces. The classifier sits behind an adaptive average pool, so the parameter
count does not depend on the image size and any size from 32 px up runs: at 224 px the feature maps
are the ImageNet ones (AlexNet 6x6, VGG16 7x7 before the pool).

    >>> model = build_model("vgg16", num_classes=1000)
"""
import torch
from torch import nn
import torch.nn.functional as F


class _MaxPool(nn.Module):
    """Max pool whose window shrinks to fit feature maps smaller than itself.

    AlexNet's three 3x3/stride-2 pools need inputs of 63 px or more; below that a map would be
    smaller than the window. At 63 px and up this is exactly ``nn.MaxPool2d(3, 2)``.
    """

    def __init__(self, kernel_size, stride):
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride

    def forward(self, x):
        kernel = min(self.kernel_size, x.shape[-2], x.shape[-1])
        return F.max_pool2d(x, kernel, self.stride)


class AlexNet(nn.Module):
    """torchvision's AlexNet (the single-tower "One weird trick" variant)."""

    def __init__(self, num_classes=1000, dropout=0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            _MaxPool(3, 2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True),
            _MaxPool(3, 2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            _MaxPool(3, 2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


# VGG16 is configuration "D" of Simonyan & Zisserman: channel counts of the 3x3 convolutions,
# "M" for a 2x2 max pool.
_VGG16_LAYERS = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG16(nn.Module):
    """torchvision's VGG16 without batch norm."""

    def __init__(self, num_classes=1000, dropout=0.5):
        super().__init__()
        layers, channels = [], 3
        for width in _VGG16_LAYERS:
            if width == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(channels, width, kernel_size=3, padding=1),
                           nn.ReLU(inplace=True)]
                channels = width
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


MODELS = {"alexnet": AlexNet, "vgg16": VGG16}
MIN_IMAGE_SIZE = 32


def build_model(name, num_classes=1000):
    """Return a freshly initialised model by name ("alexnet" or "vgg16")."""
    try:
        return MODELS[name](num_classes=num_classes)
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}") from None
