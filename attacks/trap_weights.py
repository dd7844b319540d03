"""Trap weights: a malicious initialisation of the first layer whose rows fire for few inputs, so that rows of an
aggregated gradient hold single samples (Boenisch, Dziedzic, Schuster, Shamsabadi, Shumailov, Papernot, EuroS&P
2023, "When the Curious Abandon Honesty: Federated Learning Is Not Private")."""
from __future__ import annotations

import copy
import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, check_choice
from gleak.contracts.registry import create, register_attack
from gleak.contracts.wire import Knowledge, Observation, Reconstruction
from gleak.mechanics.models import first_linear


def trap_rows(rows: int, inputs: int, sigma: float, scale_factor: float, rng: torch.Generator) -> Tensor:
    """Trap weights (rows, inputs): per row, a random half of the entries -|N(0, sigma^2)| and the other half the
    same magnitudes times scale_factor, positive, so that on non-negative inputs of even brightness a row's output
    leans negative and it fires only for the inputs whose positive half is the brighter."""
    half = inputs // 2
    out = torch.zeros(rows, inputs, dtype=torch.float64)
    for r in range(rows):
        order = torch.randperm(inputs, generator=rng)
        mags = (torch.randn(half, generator=rng, dtype=torch.float64) * sigma).abs()
        out[r, order[:half]] = -mags
        out[r, order[half : 2 * half]] = scale_factor * mags
    return out


@register_attack("trap-weights")
class TrapWeights(Attack):
    """Trap weights (Boenisch et al., EuroS&P 2023): first-layer rows that few inputs activate, read row by row.

    Active: `prepare` returns the model with its first linear layer re-initialised (the architecture unchanged, as in
    the paper's adversarial initialisation) and every other layer as it was. Each row: a random half of its weights
    negative, -|N(0, sigma^2)|, the other half those magnitudes times scale_factor (< 1: the negative half
    outweighs), bias mu: on images (non-negative pixels) a row fires only where its positive half is the brighter by
    enough, a few inputs. The gradient row of a unit that one sample alone activates is that sample's [x, 1] times
    a scalar, so x = dW_i / db_i exactly; rows that several samples activate hold their mixture.
    Defaults from the reference (JonasGeiping/breaching, cases/malicious_modifications/imprint.py
    CuriousAbandonHonesty._init_trap_weights as of its fix of the trap-weight initialisation, with the config
    case/server/malicious-model-cah.yaml): sigma 0.5, scale_factor 0.95, mu 0.

    Parameters
    ----------
    scale_factor: the positive half's magnitudes relative to the negative half's (0.95).
    sigma: the weights' scale (0.5).
    mu: every row's bias (0), on the pixel scale.
    inputs: "pixels" (default): the trap acts on the pixels in [0, 1], the normalisation folded into the layer
        (weight W / std per input channel, bias mu - W (mean / std)), so that what reaches the layer is the paper's
        non-negative image whatever the data set's normalisation (needs "data_stats"); "model": on the model's
        normalised input directly, as the reference block does (there the inputs are centred, so rows fire for
        about half of them and few rows hold one sample).
    rows: which row inversions x_i = dW_i / db_i become the batch's images, at most as many as the update has
        samples. "consistent" (default, ours): a candidate is kept only if every trap row it would activate (the
        server knows its own weights, "parameters") has a non-zero gradient, which every real sample passes and
        most mixtures fail; rows whose inversions agree (one sample alone in several rows) merge, largest groups
        first. "closed-form": the closed-form plugin's rule for a sum of several samples (agreeing rows, then by
        |db|). The paper scores every row's inversion against the batch; here the attack names its images.
    Needs a first linear layer reading the raw input (the MLP) and "batch_size" (how many images to name).
    Deviations: the paper's convolutional variant is not built; the reference places the trap in a block added
    before the model, here it is the model's own first layer.
    """

    active = True

    def __init__(self, scale_factor: float = 0.95, sigma: float = 0.5, mu: float = 0.0,
                 inputs: Literal["pixels", "model"] = "pixels", rows: Literal["consistent", "closed-form"] = "consistent"):  # fmt: skip
        check_choice("inputs", inputs, ("pixels", "model"))
        check_choice("rows", rows, ("consistent", "closed-form"))
        if not scale_factor > 0 or not sigma > 0:
            raise ValueError("scale_factor and sigma must be > 0")
        self.scale_factor, self.sigma, self.mu, self.inputs, self.rows = float(scale_factor), float(sigma), float(mu), inputs, rows
        self._reader = create("attack", "closed-form") if rows == "closed-form" else None
        needs = {"architecture", "batch_size"} | ({"data_stats"} if inputs == "pixels" else set())
        self.needs = frozenset(needs | ({"parameters"} if rows == "consistent" else set()))

    def prepare(self, model: nn.Module, knowledge: Knowledge, rng: torch.Generator) -> nn.Module:
        out = copy.deepcopy(model)
        found = first_linear(out)
        d = math.prod(knowledge.input_shape)
        if found is None or found[1].bias is None or found[1].in_features != d:
            raise UnsupportedCase("trap-weights initialises a first linear layer (with bias) that reads the raw input")
        layer = found[1]
        w = trap_rows(layer.out_features, d, self.sigma, self.scale_factor, rng)
        b = torch.full((layer.out_features,), self.mu, dtype=torch.float64)
        if self.inputs == "pixels":  # W pixels + mu, pixels = x * std + mean per channel
            per = d // knowledge.input_shape[0]
            std = knowledge.std.double().repeat_interleave(per)
            mean = knowledge.mean.double().repeat_interleave(per)
            b = b + w @ mean
            w = w * std
        with torch.no_grad():
            layer.weight.copy_(w.to(layer.weight.dtype))
            layer.bias.copy_(b.to(layer.bias.dtype))
        return out

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        if self._reader is not None:
            return self._reader.reconstruct(observation, rng)
        found = first_linear(observation.model) if observation.model is not None else None
        if found is None:
            raise UnsupportedCase("trap-weights reads the first linear layer its prepare step initialised")
        name, layer = found
        u, k = observation.update, observation.knowledge
        dw, db = u[f"{name}.weight"].double(), u[f"{name}.bias"].double()
        x, extra = consistent_rows(dw, db, layer.weight.detach().double(), layer.bias.detach().double(),
                                   int(u.num_samples or 1))  # fmt: skip
        return Reconstruction(x=x.to(u[f"{name}.weight"].dtype).reshape(len(x), *k.input_shape), extra=extra)


SAME_SAMPLE = 1e-3  # rows whose inversions lie this close (relative) hold one sample
ACTIVE_MARGIN = 1e-4  # a candidate activates a row where its pre-activation exceeds this share of its largest


def consistent_rows(dw: Tensor, db: Tensor, w: Tensor, b: Tensor, batch: int) -> tuple[Tensor, dict[str, Any]]:
    """Up to `batch` images from the live rows' inversions: groups of agreeing rows, those whose candidate would
    activate no dead row (zero gradient) first, then by group size and |db|; each group's rows pooled."""
    live = db != 0
    idx = torch.nonzero(live).flatten()
    if len(idx) == 0:
        return torch.zeros(1, dw.shape[1], dtype=dw.dtype), {"usable_rows": 0, "consistent": 0}
    cand = dw[idx] / db[idx].unsqueeze(1)
    pre = cand @ w.T + b
    active = pre > ACTIVE_MARGIN * pre.abs().amax(1, keepdim=True)
    dead_hits = (active & ~live).sum(1)
    dist = torch.cdist(cand, cand) / cand.norm(dim=1, keepdim=True).clamp_min(1e-30)
    free = torch.ones(len(idx), dtype=torch.bool)
    groups = []
    for i in torch.argsort(db[idx].abs(), descending=True).tolist():
        if free[i]:
            g = torch.nonzero(free & (dist[i] < SAME_SAMPLE)).flatten()
            free[g] = False
            groups.append(g)
    key = lambda g: (int(dead_hits[g].min()), -len(g), -float(db[idx[g]].abs().sum()))  # noqa: E731
    groups = sorted(groups, key=key)[:batch]
    x = torch.stack([(torch.sign(db[idx[g]]).unsqueeze(1) * dw[idx[g]]).sum(0) / db[idx[g]].abs().sum() for g in groups])
    kept = sum(int(dead_hits[g].min()) == 0 for g in groups)
    return x, {"usable_rows": int(len(idx)), "consistent": kept}
