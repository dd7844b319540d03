"""What the optimisation attacks (dlg, inverting-gradients, gradinversion) share: the observer's model prepared for
gradient matching, the observed gradient read from the update (FedSGD gradient or FedAvg delta), fixed labels, and
when their restarts run as one batched computation.

A module whose name starts with '_' is not a plugin (the registry skips it).
"""
from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.wire import Knowledge, Observation, Update

# Label strategies shared with attacks/idlg.py, plus "given" (the attacker is told the labels: needs "labels").
FIXED_LABELS = ("idlg", "bias-sign", "row-sign", "count-aware", "given")


def attack_model(observation: Observation) -> tuple[nn.Module, list[str], list[nn.Parameter]]:
    """A private copy of the observer's model (forward passes may touch BatchNorm buffers) and its trainable
    parameters in the order the update lists them."""
    if observation.model is None:
        raise UnsupportedCase("gradient matching needs the model's architecture and parameters")
    model = copy.deepcopy(observation.model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return model, [n for n, _ in named], [p for _, p in named]


def observed_gradient(update: Update, names: list[str], dtype: torch.dtype) -> tuple[Update, dict[str, Any]]:
    """The update as a gradient of the mean batch loss, one tensor per parameter in `names`.

    FedSGD ("gradient"): as sent. FedAvg ("delta" = w_before - w_after after `local_steps` SGD steps at `lr`, both
    in the update's meta, which the server chose): delta / (lr * local_steps), the mean gradient along the local
    trajectory. That is exact for one local step and an approximation for several (the weights move between steps;
    Geiping et al. 2020 section 6 unroll the steps instead, which these attacks do not).
    """
    missing = [n for n in names if n not in update.tensors]
    if missing:
        raise UnsupportedCase(f"the update has no tensor for parameter(s) {', '.join(missing[:3])}")
    info: dict[str, Any] = {}
    tensors = {n: update.tensors[n].detach().to(dtype) for n in names}
    if update.kind == "delta":
        lr, steps = update.meta.get("lr"), int(update.meta.get("local_steps", 1))
        if not lr:
            raise UnsupportedCase("a FedAvg delta without its local learning rate cannot be read as a gradient")
        scale = 1.0 / (float(lr) * steps)
        tensors = {n: t * scale for n, t in tensors.items()}
        info["delta_steps"] = steps
    elif update.kind != "gradient":
        raise UnsupportedCase(f"update kind {update.kind!r} is neither a gradient nor a FedAvg delta")
    return Update(tensors, "gradient", update.num_samples, dict(update.meta)), info


def fixed_labels(
    strategy: str, gradient: Update, model: nn.Module, knowledge: Knowledge, batch_size: int, rng: torch.Generator
) -> Tensor:
    """The batch's labels from a strategy of attacks/idlg.py, or the true labels when the attacker is given them."""
    if strategy == "given":
        if knowledge.labels is None:
            raise UnsupportedCase("labels = 'given' but the observation holds no labels")
        return knowledge.labels.clone()
    from gleak.attacks.idlg import recover_labels

    return recover_labels(gradient, model, knowledge, batch_size, strategy, rng)


def param_gradients(model: nn.Module, params: list[nn.Parameter], x: Tensor, loss_fn, target: Tensor) -> tuple[Tensor, ...]:
    """The parameter gradient of loss_fn(model(x), target), one tensor per parameter, differentiable in x."""
    return torch.autograd.grad(loss_fn(model(x), target), params, create_graph=True)


# Distances are reduced tensor by tensor: concatenating the gradient first copies every parameter's gradient (and
# splits it again on the way back), which costs a third of an iteration on ResNet-18 (benchmarks/attack_speed.py).
def squared_distance(grads: list[Tensor] | tuple[Tensor, ...], target: list[Tensor]) -> Tensor:
    """sum_l ||grads_l - target_l||^2 (DLG)."""
    return torch.stack([(g - t).pow(2).sum() for g, t in zip(grads, target)]).sum()


def cosine_distance(grads: list[Tensor] | tuple[Tensor, ...], target: list[Tensor], target_norm: Tensor) -> Tensor:
    """1 - <g, t> / (||g|| ||t||) over the concatenation of all parameter gradients (Inverting Gradients)."""
    dot = torch.stack([(g * t).sum() for g, t in zip(grads, target)]).sum()
    norm = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
    return 1 - dot / (norm * target_norm).clamp_min(torch.finfo(dot.dtype).tiny)


def train_mode_batchnorm(model: nn.Module) -> bool:
    """True when a forward pass uses batch statistics (BatchNorm in train mode): such a model's output for one
    sample depends on the others, and torch.func.vmap cannot update its running statistics."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())


# Batch restarts with torch.func.vmap only for models below this size: measured by benchmarks/attack_speed.py, vmap
# is faster for LeNet-sized models and slower for ResNet-18 on the CPU (its batched conv weight-gradient is costly).
VMAP_MAX_PARAMS = 1_000_000
BATCH_RESTARTS = ("auto", "vmap", "loop")


def vmap_restarts(mode: str, restarts: int, model: nn.Module, params: list[nn.Parameter], attack: str,
                  train_bn: bool = False) -> bool:  # fmt: skip
    """Whether an attack's restarts run as one torch.func.vmap computation (option batch_restarts): "loop" never,
    "vmap" always, "auto" where there are several restarts and the model has fewer than VMAP_MAX_PARAMS
    parameters. A model with BatchNorm in train mode runs one restart after another unless `train_bn` (the attack
    can vmap it: gradinversion); UnsupportedCase where "vmap" is forced on it."""
    if mode == "loop":
        return False
    if train_mode_batchnorm(model) and not train_bn:
        if mode == "vmap":
            raise UnsupportedCase(f"{attack}: batch_restarts = 'vmap' cannot run a model with BatchNorm in train mode")
        return False
    if mode == "vmap":
        return True
    return restarts > 1 and sum(p.numel() for p in params) < VMAP_MAX_PARAMS


# What R restarts batched by vmap cost, counted in restarts run one after another: the first, plus this share of one
# for each other restart. Measured by benchmarks/attack_speed.py (LeNet 32 px, one thread): see its "restarts"
# section; the estimate orders trials and sets the default --trial-timeout, so a rough figure does.
VMAP_RESTART_SHARE = 0.25


def restarts_cost(restarts: int, mode: str, case, train_bn: bool = False) -> float:
    """The work of `restarts` restarts in units of one restart's (an attack's `estimated_cost`): `restarts` where
    they run one after another, 1 + VMAP_RESTART_SHARE x (restarts - 1) where vmap_restarts batches them on the
    case's model (mode "auto": several restarts, fewer than VMAP_MAX_PARAMS parameters, and no BatchNorm in train
    mode unless `train_bn`). A case whose model cannot be built here counts as one after another."""
    if restarts <= 1 or mode == "loop":
        return float(restarts)
    facts = _case_model(case)
    if facts is None:
        return float(restarts)
    n_params, train_mode_bn = facts
    if train_mode_bn and not train_bn:
        return float(restarts)
    if mode == "vmap" or n_params < VMAP_MAX_PARAMS:
        return 1.0 + VMAP_RESTART_SHARE * (restarts - 1)
    return float(restarts)


def _case_model(case) -> tuple[int, bool] | None:
    """(trainable parameters, BatchNorm in train mode) of a case's model (a gleak.contracts.config.CaseConfig), or None."""
    try:
        from gleak.mechanics.data import load_dataset

        ds = load_dataset(case.dataset, root=case.data_root, resolution=case.resolution, channels=case.channels,
                          download=case.download)  # fmt: skip  # cached: the suite loaded it to validate
        facts = _model_facts(case.model, json.dumps(case.model_params, sort_keys=True), tuple(ds.input_shape), ds.num_classes)
        return facts[0], facts[1] and case.model_mode == "train"
    except Exception:  # noqa: BLE001 - an estimate only
        return None


@functools.lru_cache(maxsize=None)
def _model_facts(model: str, model_params: str, input_shape: tuple[int, ...], classes: int) -> tuple[int, bool]:
    """(parameters, has BatchNorm) of a model, built on torch's meta device (no arithmetic)."""
    from gleak.mechanics.models import create_model

    net = create_model(model, input_shape, classes, seed=0, **json.loads(model_params)).to("meta")
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    return sum(p.numel() for p in net.parameters() if p.requires_grad), has_bn


def row_gradients(model: nn.Module, names: list[str], params: list[nn.Parameter], loss_fn, batched_labels: bool):
    """A function (x (n, B, ...), labels) -> the parameter gradient of loss_fn(model(x[r]), labels[r]) for every row
    r, one tensor (n, *shape) per parameter in `names` order: one torch.func.vmap pass for all rows, differentiable
    in x (and float labels) by an ordinary backward pass afterwards, which is each row's own derivative because the
    rows do not interact. labels: one per row (batched_labels) or one set shared by every row.

    This is faster than vmapping the derivative of the whole objective (benchmarks/attack_speed.py), but wrong
    through BatchNorm on batch statistics: there the backward pass of the vmapped gradient is off (torch 2.14,
    float64, a small conv-BN net in train mode: 3e-3 against 1.5, where vmap(grad(objective)) agrees with the loop
    to 3e-16). Such models are refused here (gradinversion vmaps its whole objective instead)."""
    from torch.func import functional_call, grad, vmap

    if train_mode_batchnorm(model):
        raise UnsupportedCase("row_gradients cannot differentiate through BatchNorm in train mode")
    weights = {n: p.detach() for n, p in zip(names, params)}
    buffers = dict(model.named_buffers())

    def loss_of(w, x, labels):
        return loss_fn(functional_call(model, (w, buffers), (x,)), labels)

    # randomness="different": a model that samples in its forward (PRECODE's bottleneck) draws anew for every row,
    # as the rows computed one after another do (vmap refuses random operations otherwise).
    per_row = vmap(grad(loss_of), in_dims=(None, 0, 0 if batched_labels else None), randomness="different")

    def gradients(x: Tensor, labels: Tensor) -> list[Tensor]:
        g = per_row(weights, x, labels)
        return [g[n] for n in names]

    return gradients


# --- Defense-aware matching (option defense_aware of dlg and inverting-gradients) -------------------------
# Kerckhoffs: the attacker knows which defense shaped the update and its public parameters (knowledge
# "knows_defense"). For the defenses below the wire then says more than "the gradient is t": it names, entry by
# entry, an interval [lo, hi] that the client's true gradient lies in, and the attack matches the candidate gradient
# to that set instead of to the point t (the distance of g to its projection clamp(g, lo, hi) on the box).
SPARSIFYING = ("topk", "dgp", "soteria")
# MixUp and InstaHide with their `prune` option set: the mixed gradient pruned per parameter tensor, read as Top-k's
# scope "layer" (the mixing itself is answered by the attack, e.g. inverting-gradients' unmixing).
PRUNING_MIXERS = ("mixup", "instahide")
QUANTIZING = ("quantization",)
# Protocols whose single client update is what the defense produced (an aggregate of several has no such structure).
SINGLE_UPDATE = ("fedsgd", "fedavg")
# Below 8 bits the rounding cells are so wide (at 4 bits every entry under max/14 is sent as 0) that the gradients
# consistent with the wire include many wrong images, and matching the cell centre (plain matching) does better:
# DLG (idlg labels, 20 L-BFGS steps, one start) on the 8 px MLP (256 units), median PSNR over seeds 0-2: int-8 62.0
# dB plain, 72.4 dB in the cells; int-4 35.4 plain, 27.4 in the cells (a pull towards the centre inside the cells,
# weight 0.1 or 0.01, did not close the gap: 32.0 / 27.7). So below QUANT_MIN_BITS the attack falls back.
QUANT_MIN_BITS = 8


@dataclass(frozen=True)
class WireBox:
    """Per parameter tensor, the interval [lo, hi] (elementwise) the client's true gradient lies in, given the wire.

    `free[l]` marks the entries the cosine distance leaves out (None: none): the pruned ones. Where they have no
    finite bound the candidate could otherwise inflate the cosine by growing them; where they have one (Top-k), the
    pruned entries inside it would count as agreeing whatever the image, and at 99% pruning they dilute the sent
    ones (measured: inverting-gradients on the 8 px MLP through Top-k 0.99, median PSNR 13.3 dB with the bounded
    entries in the cosine against 16.3 dB for plain matching, 3 seeds). The squared distance uses the bounds.
    `reading` names the rule.
    """

    lo: list[Tensor]
    hi: list[Tensor]
    free: list[Tensor | None]
    reading: str


def wire_box(
    knowledge: Knowledge, target: list[Tensor], names: list[str], model: nn.Module, quantization: bool = True
) -> WireBox | None:
    """The set of gradients consistent with the wire under the described defense, or None (plain matching) where
    the attack has no answer to it: no description, another defense, a protocol that aggregates clients, or
    quantization where `quantization` is False or the integer format has fewer than 8 bits (QUANT_MIN_BITS).

    - topk: an entry sent is the gradient itself (lo = hi = t). A zero is a pruned entry, whose magnitude is at most
      the smallest one sent (over the whole update for scope "global", within its tensor for "layer"): [-tau, tau].
    - dgp (Xue et al. (AAAI 2024) Algorithm 1): sent entries exact; a zero was dropped either from the top k1 or from the bottom k2
      of its layer, which is not a box: left free (masked matching). With error feedback (Algorithm 2) the sent
      entries are g + e with the client's residual e, unknown to the attacker; that residual is zero in the first
      round (so exact in cases without warm-up rounds) and corrupts the sent entries after warm-up rounds, which this
      reading does not model (it matches g + e as if it were g). Measured on the 8 px MLP of 256 units, seeds 0-2,
      median PSNR plain -> masked: without warm-up DLG 13.9 -> 100.2 dB, inverting-gradients 14.5 -> 66.8; after 4
      warm-up rounds (server step 0.01) DLG 15.6 -> 28.8, inverting-gradients 18.1 -> 28.5. At 32x32 (2,000
      iterations, seed 0 only): without warm-up inverting-gradients 16.2 -> 26.3 dB; after 4 warm-up rounds (the
      dgp-table1 case) 13.9 -> 12.4, both at the blind guess: there the residual undoes the masked reading.
    - outpost is not answered (plain matching): its pruned zeros are known, but the noise it adds to the sent
      entries is not modelled, and masking the zeros alone gained nothing (8 px MLP of 256 units, seeds 0-2, median
      PSNR: DLG 31.6 dB plain and masked, inverting-gradients 30.6 plain, 30.4 masked).
    - mixup, instahide with `prune` > 0: as topk with scope "layer" (Huang et al.'s pruning is per tensor).
    - soteria: the whole-zero columns of the last linear layer's weight gradient are the pruned features, free; every
      other entry is sent as computed.
    - quantization: every entry lies in its rounding cell. int-b symmetric: step s = max|t| / (2^(b-1) - 1) per
      tensor (or per output channel), recovered exactly from the wire (the largest entry maps to the top level);
      round-to-nearest: [t - s/2, t + s/2], stochastic rounding: [t - s, t + s]. fp16 / bf16: half a unit in the last
      place of t (a whole unit with stochastic bf16), from t's binary exponent (10 / 7 mantissa bits).
    """
    d = knowledge.defense
    if d is None or d.protocol not in SINGLE_UPDATE:
        return None
    pruned_mix = d.defense in PRUNING_MIXERS and float(d.param("prune", 0.0) or 0.0) > 0
    if d.defense not in SPARSIFYING + QUANTIZING and not pruned_mix:
        return None
    if d.defense in QUANTIZING:
        coarse = d.param("format", "int") == "int" and int(d.param("bits", 8)) < QUANT_MIN_BITS
        return None if coarse or not quantization else _quantization_box(d, target)
    free = [t == 0 for t in target]
    if d.defense == "soteria":
        from gleak.mechanics.models import last_linear

        found = last_linear(model)
        weight = (f"{found[0]}.weight" if found[0] else "weight") if found is not None else None
        free = [(t == 0).all(0, keepdim=True).expand_as(t) if n == weight and t.dim() == 2 else torch.zeros_like(t, dtype=torch.bool)
                for n, t in zip(names, target)]  # fmt: skip
    if d.defense == "topk" or pruned_mix:
        sent = [t[t != 0].abs() for t in target]
        if d.defense == "topk" and d.param("scope", "global") == "global":
            nonempty = [s for s in sent if s.numel()]
            tau = [torch.cat(nonempty).min() if nonempty else None] * len(target)
        else:
            tau = [s.min() if s.numel() else None for s in sent]
        inf = float("inf")
        lo = [torch.where(f, -a if a is not None else t.new_tensor(-inf), t) for f, a, t in zip(free, tau, target)]
        hi = [torch.where(f, a if a is not None else t.new_tensor(inf), t) for f, a, t in zip(free, tau, target)]
        # The cosine leaves every pruned entry out (masked), bounded or not: see WireBox.
        return WireBox(lo, hi, [f if bool(f.any()) else None for f in free], "topk-box")
    inf = float("inf")
    lo = [torch.where(f, t.new_tensor(-inf), t) for f, t in zip(free, target)]
    hi = [torch.where(f, t.new_tensor(inf), t) for f, t in zip(free, target)]
    return WireBox(lo, hi, [f if bool(f.any()) else None for f in free], "masked")


def _quantization_box(d, target: list[Tensor]) -> WireBox:
    fmt, stochastic = d.param("format", "int"), bool(d.param("stochastic", False))
    half: list[Tensor] = []
    for t in target:
        if fmt == "int":
            levels = 2 ** (int(d.param("bits", 8)) - 1) - 1
            if d.param("per_channel", False) and t.dim() > 1:
                amax = t.abs().flatten(1).amax(1).view(-1, *([1] * (t.dim() - 1)))
            else:
                amax = t.abs().max()
            step = torch.where(amax > 0, amax / levels, torch.zeros_like(amax))
            h = (step if stochastic else step / 2).expand_as(t)
        else:
            mantissa = 10 if fmt == "fp16" else 7
            tiny = 2.0**-24 if fmt == "fp16" else float(torch.finfo(torch.bfloat16).tiny)  # below it: subnormal spacing
            exponent = torch.floor(torch.log2(t.abs().clamp_min(tiny)))
            ulp = torch.pow(2.0, exponent - mantissa).to(t.dtype)
            if fmt == "fp16":
                ulp = ulp.clamp_min(2.0**-24)
            h = ulp if stochastic else ulp / 2
        half.append(h)
    return WireBox([t - h for t, h in zip(target, half)], [t + h for t, h in zip(target, half)], [None] * len(target),
                   f"dequantized-{fmt}")  # fmt: skip


def box_squared_distance(grads: list[Tensor] | tuple[Tensor, ...], box: WireBox) -> Tensor:
    """sum_l ||g_l - clamp(g_l, lo_l, hi_l)||^2: the squared distance of the candidate gradient to the set the wire
    allows (zero inside it). With lo = hi = t it is DLG's squared_distance."""
    return torch.stack([(g - torch.clamp(g, lo, hi)).pow(2).sum() for g, lo, hi in zip(grads, box.lo, box.hi)]).sum()


def box_cosine_distance(grads: list[Tensor] | tuple[Tensor, ...], box: WireBox) -> Tensor:
    """1 - cos(g, clamp(g, lo, hi)) over the entries with a finite bound: the cosine distance of the candidate
    gradient to its projection on the set the wire allows, 0 when the candidate is in it. With lo = hi = t it is
    Inverting Gradients' cosine_distance; free entries (masked) are dropped from both vectors."""
    gs, ps = [], []
    for g, lo, hi, free in zip(grads, box.lo, box.hi, box.free):
        p = torch.clamp(g, lo, hi)
        if free is not None:
            keep = (~free).to(g.dtype)
            g, p = g * keep, p * keep
        gs.append(g)
        ps.append(p)
    dot = torch.stack([(g * p).sum() for g, p in zip(gs, ps)]).sum()
    norm = torch.stack([g.pow(2).sum() for g in gs]).sum().sqrt() * torch.stack([p.pow(2).sum() for p in ps]).sum().sqrt()
    return 1 - dot / norm.clamp_min(torch.finfo(dot.dtype).tiny)
