"""iDLG label recovery (Zhao, Mopuri, Bilen 2020, arXiv:2001.02610) and the batch label strategies.

For cross entropy, the last layer's logit gradient is p - onehot(y): at batch size 1 the true class is the only
negative entry, so the row of the last-layer weight gradient with the smallest row sum is the label (when that
layer's inputs are non-negative, as after ReLU or sigmoid). The other attacks reuse `recover_labels`.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, check_choice
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Knowledge, Observation, Reconstruction, Update
from gleak.mechanics.models import last_linear

LabelStrategy = Literal["idlg", "bias-sign", "row-sign", "count-aware", "yin", "llg", "llg+", "geng"]
STRATEGIES: tuple[str, ...] = ("idlg", "bias-sign", "row-sign", "count-aware", "yin", "llg", "llg+", "geng")
LLG_REPEATS = 10  # LLG+'s dummy batches per class (the authors' Predictor.py: n = 10)


def _classifier(model: nn.Module) -> tuple[str, nn.Linear]:
    """The model's last nn.Linear (name, module); UnsupportedCase where it has none."""
    found = last_linear(model)
    if found is None:
        raise UnsupportedCase("label recovery needs a final nn.Linear layer")
    return found


def last_layer_grads(update: Update, model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(dW, db) of the model's last nn.Linear, read from the update by parameter name."""
    name, layer = _classifier(model)
    prefix = f"{name}." if name else ""
    dw = update.tensors.get(f"{prefix}weight")
    if dw is None:
        raise UnsupportedCase(f"update has no gradient for {prefix}weight")
    db = update.tensors.get(f"{prefix}bias") if layer.bias is not None else None
    return dw, db


def _take(order: Tensor, chosen: Tensor, batch_size: int) -> Tensor:
    """`chosen` classes (in `order` of confidence) cut or cycled to exactly batch_size labels."""
    if len(chosen) == 0:
        chosen = order[:1]
    reps = -(-batch_size // len(chosen))
    return chosen.repeat(reps)[:batch_size]


def _dummy_inputs(model: nn.Module, knowledge: Knowledge, rng: torch.Generator) -> Tensor:
    """Client-like inputs the attacker may use: public data where granted, else N(0, 1) dummies (the estimate the
    count-aware literature uses for untrained models)."""
    dtype = next(model.parameters()).dtype
    if knowledge.public_x is not None:
        return knowledge.public_x[:64].to(dtype)
    return torch.randn((64, *knowledge.input_shape), generator=rng, dtype=dtype)


def _mean_output_and_feature_sum(model: nn.Module, knowledge: Knowledge, rng: torch.Generator) -> tuple[Tensor, float]:
    """The attacker's estimates on client-like inputs (`_dummy_inputs`): the model's mean softmax output p (the
    count-aware rule's) and the mean sum O of the last linear layer's input features (Geng et al.'s; non-negative
    after ReLU)."""
    seen: list[Tensor] = []
    handle = _classifier(model)[1].register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0].detach()))
    try:
        with torch.no_grad():
            p = torch.softmax(model(_dummy_inputs(model, knowledge, rng)), dim=-1).mean(0)
    finally:
        handle.remove()
    return p, float(seen[-1].double().flatten(1).sum(1).mean())


def _round_counts(est: Tensor, batch_size: int) -> Tensor:
    """Real-valued per-class counts (clamped at 0) rounded to whole labels that sum to the batch size (largest
    remainder), as class indices."""
    est = est.clamp_min(0)
    counts = est.floor().long()
    rest = batch_size - int(counts.sum())
    if rest > 0:
        counts[torch.argsort(est - counts, descending=True)[:rest]] += 1
    elif rest < 0:
        for c in torch.argsort(est - counts):
            while rest < 0 and counts[c] > 0:
                counts[c] -= 1
                rest += 1
    return torch.repeat_interleave(torch.arange(len(counts)), counts)


def llg_counts(row_sums: Tensor, batch_size: int, impact: float, offset: Tensor | None = None) -> Tensor:
    """Wainakh et al.'s label read-out (PETS 2022, "User-Level Label Leakage from Gradients in Federated Learning";
    the authors' tklab-tud/LLG, Predictor.py): every class whose last-layer weight-gradient row sum is negative is
    in the batch (one label each, most negative first); the rest are drawn one at a time as the class of the
    smallest row sum, each label taking one sample's `impact` (negative) off its class's sum. `offset`: the row
    sums' value for classes absent from a batch (LLG+), subtracted before the draws; the first step reads the
    signs of the sums as observed, as the authors' code does."""
    sums = row_sums.double().clone()
    present = [int(c) for c in torch.argsort(sums) if sums[c] < 0][:batch_size]
    if offset is not None:
        sums = sums - offset.double()
    labels = []
    for c in present:
        labels.append(c)
        sums[c] -= impact
    while len(labels) < batch_size:
        c = int(torch.argmin(sums))
        labels.append(c)
        sums[c] -= impact
    return torch.tensor(sorted(labels), dtype=torch.long)


def _llg_plus_calibration(model: nn.Module, knowledge: Knowledge, batch_size: int, rng: torch.Generator) -> tuple[float, Tensor]:
    """LLG+'s (impact, offset) from dummy batches (the authors' Predictor.LLGp_prediction): for each class i, a batch
    of `batch_size` dummy inputs (N(0, 1); no data of the victim's) all labelled i, its last-layer weight-gradient
    row sums at the observed model; impact: class i's own sum per sample, offset: the other classes' sums, each
    averaged over the classes and LLG_REPEATS repetitions. The impact is scaled by (1 + 1 / classes), as theirs."""
    weight = _classifier(model)[1].weight
    classes = knowledge.num_classes
    dtype = weight.dtype
    impact, offset = 0.0, torch.zeros(classes, dtype=torch.float64)
    for _ in range(LLG_REPEATS):
        for i in range(classes):
            x = torch.randn((batch_size, *knowledge.input_shape), generator=rng, dtype=dtype)
            y = torch.full((batch_size,), i, dtype=torch.long)
            (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), [weight])
            sums = g.double().sum(dim=1)
            impact += float(sums[i]) / batch_size
            offset += sums
            offset[i] -= sums[i]
    impact /= classes * LLG_REPEATS
    return impact * (1 + 1 / classes), offset / (LLG_REPEATS * (classes - 1))


def recover_labels(
    update: Update,
    model: nn.Module,
    knowledge: Knowledge,
    batch_size: int,
    strategy: str = "idlg",
    rng: torch.Generator | None = None,
) -> Tensor:
    """Labels of the batch behind `update` (a FedSGD gradient), as a (batch_size,) tensor.

    idlg: the classes with the smallest last-layer weight row sums (exactly iDLG at batch size 1).
    yin: the classes whose last-layer weight-gradient row has the smallest minimum (Yin et al., CVPR 2021, "See
        through Gradients", label restoration: the row minimum survives averaging over a batch better than the row
        sum; exact when the labels are distinct and the layer's inputs non-negative).
    bias-sign: classes whose last-layer bias gradient is negative, most negative first.
    row-sign: classes whose weight row sum is negative (the row-sum sign count), most negative first.
    count-aware: per-class counts from db_c = mean_p_c - n_c / B, with mean_p estimated by running the model on
        public data (or dummy inputs); rounded so that the counts sum to the batch size.
    llg: Wainakh et al.'s LLG (PETS 2022; `llg_counts`): the negative row sums' classes, then the rest drawn by
        the smallest row sum, one sample's impact taken off each draw; the impact: the negative row sums' total over
        the batch size, times 1 + 1 / classes.
    llg+: LLG with the impact and the absent classes' offset calibrated on dummy batches at the observed model
        (`_llg_plus_calibration`; no data of the victim's).
    geng: Geng et al. ("Towards General Deep Leakage in Federated Learning", 2021), for a FedSGD gradient: the row
        sum of class j is sum_i (p_ij - y_ij) O_i / B with O_i the sum of sample i's last-layer input features;
        taking p_ij and O_i at their means p_j and O over dummy inputs, n_j = B (p_j - row_sum_j / O), rounded to
        the batch size (largest remainder). No bias needed. Their FedAvg form (the mean output over the local
        steps) is not built: an update is read as one gradient.
    When a sign strategy finds fewer classes than the batch size, the found classes are repeated.
    """
    dw, db = last_layer_grads(update, model)
    row_sums = dw.double().sum(dim=1)
    if strategy == "yin":
        order = torch.argsort(dw.double().min(dim=1).values)
        return _take(order, order, batch_size)
    if strategy == "idlg":
        order = torch.argsort(row_sums)
        return _take(order, order, batch_size)
    if strategy in ("bias-sign", "count-aware") and db is None:
        raise UnsupportedCase(f"label strategy {strategy!r} needs a bias on the last layer")
    if strategy == "bias-sign":
        order = torch.argsort(db.double())
        return _take(order, order[db.double()[order] < 0], batch_size)
    if strategy == "row-sign":
        order = torch.argsort(row_sums)
        return _take(order, order[row_sums[order] < 0], batch_size)
    if strategy == "llg":
        negative = float(row_sums[row_sums < 0].sum())
        return llg_counts(row_sums, batch_size, negative / batch_size * (1 + 1 / len(row_sums)))
    gen = rng if rng is not None else torch.Generator().manual_seed(0)
    if strategy == "llg+":
        with torch.enable_grad():
            impact, offset = _llg_plus_calibration(model, knowledge, batch_size, gen)
        return llg_counts(row_sums, batch_size, impact, offset)
    if strategy == "count-aware":
        p = _mean_output_and_feature_sum(model, knowledge, gen)[0].double()
        return _round_counts(batch_size * (p - db.double()), batch_size)
    if strategy == "geng":
        p, feature_sum = _mean_output_and_feature_sum(model, knowledge, gen)
        if not feature_sum > 0:
            raise UnsupportedCase("label strategy 'geng' needs the last layer's inputs to have a positive mean sum")
        return _round_counts(batch_size * (p.double() - row_sums / feature_sum), batch_size)
    raise ValueError(f"unknown label strategy {strategy!r} (known: {', '.join(STRATEGIES)})")


@register_attack("idlg")
class IDLG(Attack):
    """iDLG label recovery from the last layer's gradient (Zhao et al. 2020); batch strategies as options.

    Parameters
    ----------
    labels: which rule reads the labels. "idlg" (default, the paper's rule: smallest row sum of the last-layer
        weight gradient), "bias-sign", "row-sign", "count-aware", "yin", Wainakh et al.'s (PETS 2022) "llg" and
        "llg+", or Geng et al.'s (2021) "geng" (see `recover_labels`). iDLG's 100% claim holds for per-sample
        gradients (batch size 1); the others are batch extensions, not from the paper. Deviation, named: LLG's and
        Geng et al.'s multi-step readings (for FedAvg's local iterations) are not built: an update is read as one
        gradient.
    Returns labels only: the image columns of its trials are empty.
    """

    needs = frozenset({"architecture", "parameters", "batch_size"})

    def __init__(self, labels: LabelStrategy = "idlg"):
        check_choice("labels", labels, STRATEGIES)
        self.labels = labels

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        k = observation.knowledge
        y = recover_labels(observation.update, observation.model, k, k.batch_size or 1, self.labels, rng)
        return Reconstruction(x=None, y=y)
