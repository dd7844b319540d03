"""The label query of an active server: how many samples of each class are behind what it observes, read from the
update of one round at a model whose classifier it zeroed.

With the classifier's weights and bias zero every logit is 0, so every sample's softmax is uniform whatever its
input, and its gradient on the classifier's bias is (1/C - e_y) / B (B: its client's batch, the mean loss). The
observed update's bias entry j is then (n/C - count_j) / B for n samples behind it, whether the update is one
client's (the server sees it alone) or a sum over clients (secure aggregation): count_j = n/C - B * b_j, exact
without a defense, and as noisy as the defense makes the round with one. This is the first query of the Fishing
reference server (Wen et al., ICML 2022), read from what the protocol exposes instead of from the user's labels:
through a secure sum it gives the label histogram of the sum, never the victim's own labels.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.wire import Update


def classifier(model: nn.Module, num_classes: int) -> tuple[str, nn.Linear]:
    """(name, module) of the last trainable layer, a linear classifier over `num_classes` with a bias."""
    layers = [(n, m) for n, m in model.named_modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    if not layers or not isinstance(layers[-1][1], nn.Linear) or layers[-1][1].bias is None \
            or layers[-1][1].out_features != num_classes:  # fmt: skip
        raise UnsupportedCase("the label query reads the bias of a last linear classifier over the classes")
    return layers[-1]  # type: ignore[return-value]


def query_model(model: nn.Module, num_classes: int) -> nn.Module:
    """A copy of `model` whose classifier's weight and bias are zero: every sample's softmax is uniform."""
    out = copy.deepcopy(model)
    _, last = classifier(out, num_classes)
    with torch.no_grad():
        last.weight.zero_()
        last.bias.zero_()
    return out


def read_counts(update: Update, model: nn.Module, num_classes: int, batch_size: int) -> torch.Tensor:
    """The label counts behind `update` (computed at `query_model`), rounded to whole non-negative samples.
    `batch_size`: each client's batch (every client of a case holds as many). A FedAvg delta is divided by its
    public step (lr x local steps), exact for one local step."""
    name, _ = classifier(model, num_classes)
    b = update[f"{name}.bias"].double().cpu()
    if update.kind != "gradient":
        b = b / (float(update.meta.get("lr", 1.0)) * float(update.meta.get("local_steps", 1)))
    n = float(update.num_samples or batch_size)
    counts = n / num_classes - batch_size * b
    return counts.round().clamp_min(0).to(torch.long)
