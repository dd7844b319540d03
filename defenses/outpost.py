"""Outpost (Wang, Hugh and Li, INFOCOM 2023, "More than Enough is Too Much: Adaptive Defenses against Gradient
Leakage in Production Federated Learning"): iteration-dependent probabilistic perturbation of the client's gradient,
pruning plus Gaussian noise scaled by each layer's leakage risk and placed by the empirical Fisher information.

The authors' code is Plato's examples/gradient_leakage_attacks (TL-System/plato: dlg_trainer.py, the "Outpost"
branch, and defense/Outpost/perturb.py); its README gives the defaults used here (beta 0.125, phi 40, prune_base 80,
noise_base 0.8)."""
from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from gleak.contracts.plugin import Defense, batch_gradient, check_choice, trainable
from gleak.contracts.registry import register_defense


def perturb_probability(iteration: int, beta: float) -> float:
    """The probability that iteration t (1-based) is perturbed: 1 / (1 + beta t) (Plato's 'probability decay')."""
    return 1.0 / (1.0 + beta * iteration)


def layer_risk(param: Tensor) -> float:
    """A layer's privacy-leakage risk: the variance of its weights, capped at 1 (Plato's compute_risk; torch.var,
    unbiased). A one-entry tensor has no spread: risk 0."""
    if param.numel() < 2:
        return 0.0
    return min(float(torch.var(param.detach())), 1.0)


def fisher_diagonal(g: Tensor, fim: str) -> Tensor:
    """The empirical Fisher information of each entry, in g's shape: g^2 ("entry"), or g^2 averaged over dim 0 and
    broadcast back ("code": Plato's perturb.py, which takes grad.pow(2).mean(0) as if dim 0 were the batch)."""
    sq = g.pow(2)
    if fim == "code" and sq.dim() > 0:
        return sq.mean(0, keepdim=True).expand_as(sq)
    return sq


def percentile(values: Tensor, q: float) -> float:
    """numpy's default (linear) percentile q in [0, 100] of a tensor's entries (numpy: no size limit, unlike
    torch.quantile)."""
    return float(np.percentile(values.detach().reshape(-1).double().numpy(), q))


def outpost_perturb(
    grads: dict[str, Tensor], risks: dict[str, float], prune: float, phi: float, noise_base: float, fim: str,
    rng: torch.Generator,
) -> dict[str, Tensor]:  # fmt: skip
    """One Outpost perturbation (Plato's perturb.noise, with the perturbed tensors actually returned):

    1. prune: in each layer, zero the entries with |g| below the layer's `prune` percentile of |g|;
    2. noise: Gaussian of std risk_layer x noise_base, added to the entries whose empirical Fisher information is at
       or above the (100 - phi) percentile over all entries of all layers (the phi% most informative ones)."""
    fims = {n: fisher_diagonal(g, fim) for n, g in grads.items()}
    thresh = percentile(torch.cat([f.reshape(-1) for f in fims.values()]), 100.0 - phi)
    out = {}
    for n, g in grads.items():
        cut = percentile(g.abs(), prune)
        pruned = torch.where(g.abs() < cut, torch.zeros_like(g), g)
        noise = torch.randn(g.shape, generator=rng, dtype=g.dtype) * (risks[n] * noise_base)
        out[n] = pruned + noise * (fims[n] >= thresh).to(g.dtype)
    return out


@register_defense("outpost")
class Outpost(Defense):
    """Outpost: with probability 1 / (1 + beta t) at the client's t-th gradient, prune and add Fisher-placed noise.

    At each gradient the client computes (every FedSGD round, every local step of FedAvg; t counts them from 1 since
    `reset`), a coin with probability 1 / (1 + beta t) decides whether this gradient is perturbed (early training,
    when the weights are still narrowly spread and leakage is easiest, is perturbed most often). A perturbed gradient
    is pruned per layer (entries below the `prune_base` percentile of |g| set to 0) and gets Gaussian noise of
    standard deviation risk x noise_base on the phi% of all entries with the largest empirical Fisher information
    (g^2), where a layer's risk is the variance of its weights, capped at 1. Not perturbed: the plain gradient.

    Parameters (defaults from the authors' Plato README)
    ----------
    beta: decay speed of the perturbation probability. Default 0.125.
    phi: percentage of entries (by Fisher information, over the whole model) that receive noise. Default 40.
    prune_base: per-layer pruning percentile of |g|. Default 80 (80% of each layer's entries zeroed).
    noise_base: noise scale; the std in a layer is risk x noise_base. Default 0.8.
    fim: "entry" (default: the diagonal empirical Fisher g^2 of each entry, as the paper describes it) or "code"
        (Plato's perturb.py: g^2 averaged over the tensor's first dimension, one value per column; a bias gets one
        value for the whole vector).

    Known deviations from Plato's code: (1) its perturb.noise assigns the perturbed tensor to a local name and returns
    the input list unchanged, so as published the gradient is never perturbed; here the perturbed gradient is what
    the client uses, as the paper intends. (2) Plato's iteration index is current_epoch x (batch + 1) within one
    round's local training; here t is the client's count of gradients over the whole training, so that the decay is
    iteration-dependent across rounds (the paper's motivation: leakage risk falls as training proceeds).
    (3) Randomness (the coin and the noise) comes from the client's generator, not from a fixed global seed.
    """

    stateful = True

    def __init__(
        self, beta: float = 0.125, phi: float = 40.0, prune_base: float = 80.0, noise_base: float = 0.8,
        fim: Literal["entry", "code"] = "entry",
    ):  # fmt: skip
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        for name, v in (("phi", phi), ("prune_base", prune_base)):
            if not 0.0 <= v <= 100.0:
                raise ValueError(f"{name} must be a percentage in [0, 100], got {v}")
        if noise_base < 0:
            raise ValueError(f"noise_base must be >= 0, got {noise_base}")
        check_choice("fim", fim, ("entry", "code"))
        self.beta, self.phi, self.prune_base, self.noise_base, self.fim = beta, phi, prune_base, noise_base, fim
        self.iteration = 0

    def reset(self) -> None:
        self.iteration = 0

    def client_gradient(self, model: nn.Module, x: Tensor, y: Tensor, rng: torch.Generator) -> dict[str, Tensor]:
        grads = batch_gradient(model, x, y)
        self.iteration += 1
        coin = float(torch.rand((), generator=rng, dtype=torch.float64))
        if coin >= perturb_probability(self.iteration, self.beta):
            return grads
        risks = {n: layer_risk(p) for n, p in trainable(model)}
        return outpost_perturb(grads, risks, self.prune_base, self.phi, self.noise_base, self.fim, rng)
