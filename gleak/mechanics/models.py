"""Models the attacks run against. Each is a factory registered with `register_model`.

    create_model("lenet", input_shape=(3, 32, 32), num_classes=10, seed=0)
    list_plugins("model")

Factories take ``(input_shape, num_classes, **params)``; `create_model` builds them under a fixed seed so that a
trial's model is a function of its config and seed alone.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from gleak.contracts.registry import create, register_model


def create_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0, dtype: torch.dtype = torch.float32, **params
) -> nn.Module:
    """Build model `name` deterministically: same (name, shape, classes, params, seed) -> same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = create("model", name, tuple(input_shape), int(num_classes), **params)
    return model.to(dtype)


def first_linear(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """The first trainable layer if it is an nn.Linear, with its qualified name; else None."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            return name, module
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            return None  # the first trainable layer is something else (a convolution, say)
    return None


def last_linear(model: nn.Module) -> tuple[str, nn.Linear] | None:
    found = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            found = (name, module)
    return found


def _flat_dim(input_shape: tuple[int, ...]) -> int:
    return int(math.prod(input_shape))


@register_model("linear")
def linear(
    input_shape: tuple[int, ...],
    num_classes: int,
    init: Literal["torch", "normal"] = "torch",
    init_std: float = 0.5,
) -> nn.Module:
    """One linear layer with bias on the flattened input (the closed-form notes' setting; init='normal' draws W, b ~ N(0, init_std))."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(_flat_dim(input_shape), num_classes))
    if init == "normal":
        for p in model.parameters():
            nn.init.normal_(p, 0.0, init_std)
    return model


@register_model("mlp")
def mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    hidden: list[int] = [256],  # noqa: B006 - read only; a list so that TOML can set it
    activation: Literal["relu", "sigmoid", "tanh"] = "relu",
) -> nn.Module:
    """Fully connected network on flattened input, first layer Linear with bias (CGD's 256-unit ReLU FNN by default)."""
    act = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}[activation]
    layers: list[nn.Module] = [nn.Flatten()]
    width = _flat_dim(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, int(h)), act()]
        width = int(h)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class DLGLeNet(nn.Module):
    """The LeNet of DLG's released code: three 5x5 sigmoid convolutions then one linear layer."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        self.body = nn.Sequential(
            nn.Conv2d(c, 12, 5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, padding=2, stride=1),
            nn.Sigmoid(),
        )
        with torch.no_grad():
            flat = self.body(torch.zeros(1, c, h, w)).numel()
        self.fc = nn.Linear(flat, num_classes)  # 768 at 32x32, as in DLG

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).flatten(1))


@register_model("lenet")
def lenet(input_shape: tuple[int, ...], num_classes: int, init: Literal["dlg", "torch"] = "dlg") -> nn.Module:
    """DLG's LeNet (Zhu et al. 2019, mit-han-lab/dlg): sigmoid convs; init='dlg' sets every weight and bias U(-0.5, 0.5)."""
    model = DLGLeNet(input_shape, num_classes)
    if init == "dlg":
        for p in model.parameters():
            nn.init.uniform_(p, -0.5, 0.5)
    return model


class CNN6(nn.Module):
    """R-GAP's CNN6 (Zhu and Blaschko, ICLR 2021; JunyiZhu-AI/R-GAP models/CNN6.py): six convolutions without bias,
    each followed by LeakyReLU(0.2), then one linear classifier without bias on the flattened features."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, bias: bool = False):
        super().__init__()
        c, h, w = input_shape
        act = nn.LeakyReLU(negative_slope=0.2)
        spec = [(c, 12, 4, 2, 2), (12, 36, 3, 1, 2), (36, 36, 3, 1, 1), (36, 36, 3, 1, 1), (36, 64, 3, 1, 2),
                (64, 128, 3, 1, 1)]  # (in, out, kernel, padding, stride), as the reference  # fmt: skip
        layers: list[nn.Module] = []
        for cin, cout, k, pad, stride in spec:
            layers += [nn.Conv2d(cin, cout, k, padding=pad, stride=stride, bias=bias), act]
        self.body = nn.Sequential(*layers)
        with torch.no_grad():
            flat = self.body(torch.zeros(1, c, h, w)).numel()
        self.fc = nn.Linear(flat, num_classes, bias=bias)  # 3200 features at 32x32, as the reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).flatten(1))


@register_model("cnn6")
def cnn6(input_shape: tuple[int, ...], num_classes: int, bias: bool = False) -> nn.Module:
    """R-GAP's CNN6 (Zhu and Blaschko 2021): LeakyReLU(0.2) convs, no bias, a linear softmax classifier; torch's default init.

    The reference's weights are torch's default initialisation (its attack script draws them under
    torch.manual_seed(0) unless a trained checkpoint is loaded); here under the trial's model seed. Deviation: the
    reference's classifier has one output under a logistic loss; gleak's loss is cross entropy over the data set's
    classes, so the classifier has one output per class (R-GAP's softmax form, attacks/rgap.py). bias=True adds
    biases to every layer (not the reference)."""
    return CNN6(input_shape, num_classes, bias)


@register_model("convnet")
def convnet(input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> nn.Module:
    """A small ConvNet: three 3x3 conv + ReLU stages (width, 2 width, 4 width; max-pool after the first two), global
    average pool, one linear layer. Twice differentiable almost everywhere, no normalisation layers."""
    c = input_shape[0]
    w = int(width)
    return nn.Sequential(
        nn.Conv2d(c, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, num_classes),
    )  # fmt: skip


class BasicBlock(nn.Module):
    """Two 3x3 conv + BatchNorm layers with an identity shortcut (a 1x1 conv + BN one when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet of BasicBlocks: 3x3 stem at stride 1 (no max-pool), stages of `blocks[i]` blocks of width
    `widths[i]` (the first of each stage after the first at stride 2), global average pool, one linear layer."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, blocks: list[int], widths: list[int]):
        super().__init__()
        c = input_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(c, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, cin = [], widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths)):
            for j in range(n):
                layers.append(BasicBlock(cin, w, 2 if (i > 0 and j == 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))


@register_model("resnet20")
def resnet20(input_shape: tuple[int, ...], num_classes: int, width: int = 4) -> nn.Module:
    """ResNet-20 of width k (He et al. 2016; Geiping et al. 2020 attack k=4): 3 stages of 3 blocks, 16k/32k/64k
    channels, 1x1-conv shortcuts where the shape changes (as Geiping et al.'s torchvision-block ResNet)."""
    k = int(width)
    return ResNet(input_shape, num_classes, [3, 3, 3], [16 * k, 32 * k, 64 * k])


@register_model("resnet18")
def resnet18(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-18 with the CIFAR stem (3x3 conv at stride 1, no max-pool): 4 stages of 2 blocks, 64-512 channels."""
    return ResNet(input_shape, num_classes, [2, 2, 2, 2], [64, 128, 256, 512])


# The text modality's models (a text data set's input shape is (seq_len, vocab)) register on import.
from gleak.mechanics.text import models as textmodels  # noqa: E402,F401
