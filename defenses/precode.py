"""PRECODE (Scheliga, Mäder and Seeland, WACV 2022, "PRECODE - A Generic Model Extension to Prevent Deep Gradient
Leakage"; authors' code dAI-SY-Group/PRECODE): a variational bottleneck inserted before the model's classifier."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gleak.contracts.plugin import Defense, loss_fn, trainable
from gleak.contracts.registry import register_defense
from gleak.mechanics.models import last_linear


def _uniform_init(layer: nn.Linear, rng: torch.Generator) -> None:
    """torch's default nn.Linear initialisation (weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))), from rng."""
    bound = 1.0 / math.sqrt(layer.in_features)
    with torch.no_grad():
        for p in (layer.weight, layer.bias):
            p.copy_((torch.rand(p.shape, generator=rng, dtype=p.dtype) * 2 - 1) * bound)


class VariationalBottleneck(nn.Module):
    """Encoder Linear(F, 2K) to (mu, std = softplus), a reparameterised sample z = mu + eps std, decoder Linear(K, F).

    Every forward pass samples eps (training and evaluation alike, as the authors' module); the client's passes keep
    the KL divergence of N(mu, std^2) from N(0, I) in bits, summed over the K latents and averaged over the batch,
    in `kl`. eps comes
    from `generator` while the client computes (set by Precode.client_gradient), else from torch's global generator
    (the observer's and the evaluation's passes: they do not know the client's noise)."""

    def __init__(self, features: int, latent: int, dtype: torch.dtype):
        super().__init__()
        self.latent = latent
        self.encoder = nn.Linear(features, 2 * latent, dtype=dtype)
        self.decoder = nn.Linear(latent, features, dtype=dtype)
        self.generator: torch.Generator | None = None
        self.kl: Tensor | None = None

    def forward(self, h: Tensor) -> Tensor:
        stats = self.encoder(h.flatten(1))
        mu, std = stats[:, : self.latent], F.softplus(stats[:, self.latent :])
        eps = torch.randn(mu.shape, generator=self.generator, dtype=mu.dtype, device=mu.device)
        if self.generator is not None:  # only the client's own passes keep it (a graph in an attribute blocks deepcopy)
            self.kl = (-0.5 * (1 + 2 * std.log() - mu.pow(2) - std.pow(2))).sum(1).mean() / math.log(2)
        return self.decoder(mu + eps * std).view_as(h)


def bottlenecks(model: nn.Module) -> list[VariationalBottleneck]:
    return [m for m in model.modules() if isinstance(m, VariationalBottleneck)]


def insert_bottleneck(model: nn.Module, latent: int, rng: torch.Generator) -> nn.Module:
    """A copy of `model` whose last nn.Linear (the classifier) reads from a new VariationalBottleneck on its input."""
    model = copy.deepcopy(model)
    found = last_linear(model)
    if found is None:
        raise ValueError("precode: the model has no nn.Linear classifier to put the bottleneck in front of")
    name, fc = found
    vb = VariationalBottleneck(fc.in_features, latent, fc.weight.dtype)
    _uniform_init(vb.encoder, rng)
    _uniform_init(vb.decoder, rng)
    wrapped = nn.Sequential(vb, fc)
    if not name:
        return wrapped
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, wrapped)
    return model


@register_defense("precode")
class Precode(Defense):
    """PRECODE: a variational bottleneck before the classifier, trained with beta x KL added to the loss.

    The defense changes the model (`wrap_model`): the input of the last nn.Linear layer goes through an encoder to
    2K values (mean and, through softplus, standard deviation of K latents), a reparameterised sample, and a decoder
    back to the layer's input size. Every client trains the wrapped model: its loss is the cross entropy plus
    beta x KL(N(mu, std^2) || N(0, I)) (in bits, as the authors' code), and its noise eps is drawn from the client's
    generator. The observer holds the wrapped architecture and sees the wrapped model's gradients, bottleneck
    included; it does not know the client's eps.

    Parameters
    ----------
    latent: K, the bottleneck size. Default 256 (the authors' VariationalBottleneck default).
    beta: the KL term's weight. Default 1e-3 (the authors' default).

    Known deviations: the authors' module parameterises the standard deviation by softplus (kept here), where a VAE
    often uses a log-variance; their convolutional variant (a 1x1 reducer for a 4-D input) is not needed, since the
    bottleneck here always sits on the classifier's (flat) input. The bottleneck's weights are drawn from the
    trial's generator with torch's default Linear law (a trained case: from the case's train_seed). A model trained
    before the trial (case model_state = "trained") is trained with the bottleneck, as the paper trains its models:
    gleak.mechanics.pretrain wraps the case's model first and takes this defense's client gradient (cross entropy plus
    beta KL) at every step; those trials' ids carry "pretrained": "with-defense" (gleak.contracts.config).
    """

    def __init__(self, latent: int = 256, beta: float = 1e-3):
        if latent < 1:
            raise ValueError(f"latent must be >= 1, got {latent}")
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        self.latent, self.beta = latent, beta

    def wrap_model(self, model: nn.Module, rng: torch.Generator) -> nn.Module:
        return insert_bottleneck(model, self.latent, rng)

    def client_gradient(self, model: nn.Module, x: Tensor, y: Tensor, rng: torch.Generator) -> dict[str, Tensor]:
        vbs = bottlenecks(model)
        for vb in vbs:
            vb.generator = rng
        try:
            loss = loss_fn(model(x), y)
            for vb in vbs:
                loss = loss + self.beta * vb.kl
        finally:
            for vb in vbs:
                vb.generator, vb.kl = None, None
        params = trainable(model)
        grads = torch.autograd.grad(loss, [p for _, p in params])
        return {n: g.detach() for (n, _), g in zip(params, grads)}
