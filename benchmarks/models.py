"""AlexNet, VGG16 and a transformer language model for the training benchmark, defined here because
torchvision does not install beside torch 2.13 on the machines this project targets.

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


MAX_SEQ_LEN = 512  # the language model's positions


class TransformerLM(nn.Module):
    """A GPT-style causal language model of many small tensors, the other shape of gradient traffic:
    token and position embeddings, ``layers`` pre-norm transformer blocks (PyTorch's
    ``TransformerEncoderLayer`` under a causal mask), a final layer norm and an untied output
    projection. At the defaults (a 32,000-token vocabulary, width 512, 6 layers, 8 heads, 2048-wide
    feed-forward, 512 positions) it has 51,977,472 parameters in 78 tensors.
    """

    def __init__(self, num_classes=32000, width=512, layers=6, heads=8, feedforward=2048, max_len=MAX_SEQ_LEN,
                 dropout=0.1):
        super().__init__()
        self.max_len = max_len
        self.tokens = nn.Embedding(num_classes, width)
        self.positions = nn.Embedding(max_len, width)
        block = nn.TransformerEncoderLayer(width, heads, feedforward, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens):
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens; this model has {self.max_len} positions")
        x = self.tokens(tokens) + self.positions(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


MODELS = {"alexnet": AlexNet, "vgg16": VGG16, "transformer": TransformerLM}
LANGUAGE_MODELS = ("transformer",)
MIN_IMAGE_SIZE = 32


def build_model(name, num_classes=1000):
    """Return a freshly initialised model by name ("alexnet", "vgg16" or "transformer", whose
    ``num_classes`` is its vocabulary)."""
    try:
        return MODELS[name](num_classes=num_classes)
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}") from None


def default_classes(name):
    """The classifier outputs a model has by default: ImageNet's 1000, a language model's vocabulary."""
    return 32000 if name in LANGUAGE_MODELS else 1000


def synthetic_batch(name, batch_size, num_classes, image_size=224, seq_len=256):
    """One random batch for model `name`: (inputs, targets) and the loss that compares them.
    Images and labels for the image models; for a language model, ``seq_len + 1`` random tokens per
    sequence, of which the model reads the first ``seq_len`` and predicts the last ``seq_len``."""
    if name not in LANGUAGE_MODELS:
        images = torch.randn(batch_size, 3, image_size, image_size)
        labels = torch.randint(num_classes, (batch_size,))
        return images, labels, nn.CrossEntropyLoss()
    tokens = torch.randint(num_classes, (batch_size, seq_len + 1))
    cross_entropy = nn.CrossEntropyLoss()

    def loss(logits, targets):
        return cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return tokens[:, :-1], tokens[:, 1:], loss
