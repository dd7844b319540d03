"""What the optimisation attacks (dlg, inverting-gradients) share: the observer's model prepared for gradient
matching, the observed gradient read from the update (FedSGD gradient or FedAvg delta), and fixed labels.

A module whose name starts with '_' is not a plugin (the registry skips it).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from gleak.errors import UnsupportedCase
from gleak.threat import Knowledge, Observation, Update

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
