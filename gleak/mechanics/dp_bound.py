"""What an (epsilon, delta)-DP guarantee implies for reconstruction: the bound no attack can beat.

Balle, Cherubin & Hayes, "Reconstructing Training Data with Informed Adversaries" (IEEE S&P 2022), Theorem 2 (their
"reconstruction robustness" of DP): for an (epsilon, delta)-DP mechanism, a target example z drawn from a prior pi,
and any reconstruction attack R,

    P[ loss(z, R(M(D + z))) <= eta ] <= e^epsilon * kappa + delta,
    kappa = sup_{z0} P_{z ~ pi}[ loss(z, z0) <= eta ]

kappa is the baseline: the success of the best attacker who outputs one fixed guess without seeing anything. (Hayes,
Mahloujifar & Balle, NeurIPS 2023, tighten this for DP-SGD from its noise multiplier and sampling rate; gleak uses the
(epsilon, delta) form because it holds for every mechanism whose trials report extra.epsilon.)

gleak's event and prior (our reading, stated in the leaderboard): the event is the trial verdict "recovered" for one
example (gleak.mechanics.metrics: MSE < RECOVERED_MSE and at least RECOVERED_MARGIN_DB under the blind guess's MSE on that
image); the prior is uniform over the images of the split the victims are drawn from. `baseline_kappa` bounds kappa
from above over every fixed guess z0, not only the data's own images: a guess z0 can make images i and j both
"recovered" only if RMSE(x_i, x_j) < r_i + r_j (triangle inequality; r_i the largest RMSE that still counts as
recovered for image i), so kappa <= max_i #{j : RMSE(x_i, x_j) < r_i + r_j} / N. The bound is per example: DP
protects each example of a batch, and the leaderboard's batch-level "recovered" (every image) is rarer still.

>>> reconstruction_bound(0.0, 0.0, 0.01)
0.01
>>> round(reconstruction_bound(1.0, 1e-5, 0.005), 5)
0.0136
>>> reconstruction_bound(10.0, 1e-5, 0.005)
1.0
>>> import torch
>>> imgs = torch.stack([torch.full((1, 2, 2), v) for v in (0.0, 0.16, 1.0, 0.84)])
>>> baseline_kappa(imgs)  # a guess near 0.08 may recover 0.0 and 0.16 both: at most 2 of 4
0.5
>>> attained_kappa(imgs)  # guessing one of the images themselves recovers only that one
0.25
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from gleak.mechanics.metrics import mean_image

from gleak.mechanics.verdicts import RECOVERED_MARGIN_DB, RECOVERED_MSE


def reconstruction_bound(epsilon: float, delta: float, kappa: float) -> float:
    """The most any attack's success probability can be under (epsilon, delta)-DP: min(1, e^epsilon kappa + delta)
    (Balle, Cherubin & Hayes 2022, Theorem 2)."""
    if epsilon < 0 or not 0 <= delta <= 1 or not 0 <= kappa <= 1:
        raise ValueError(f"need epsilon >= 0, delta and kappa in [0, 1]; got {epsilon}, {delta}, {kappa}")
    if epsilon > 700:  # e^epsilon overflows; the bound is vacuous long before
        return 1.0
    return min(1.0, math.exp(epsilon) * kappa + delta)


def recovered_radius(images: Tensor, blind: Tensor | None = None) -> Tensor:
    """Per image (N, C, H, W in [0, 1]), the largest RMSE to it that still counts as 'recovered' under the margin
    rule: sqrt(min(RECOVERED_MSE, blind MSE / 10^(margin / 10))), the blind guess the split's mean image."""
    guess = mean_image(images) if blind is None else blind.double()
    blind_mse = ((images.double() - guess) ** 2).flatten(1).mean(1)
    return torch.sqrt(torch.clamp(blind_mse / 10 ** (RECOVERED_MARGIN_DB / 10), max=RECOVERED_MSE))


def baseline_kappa(images: Tensor) -> float:
    """An upper bound on kappa, the best fixed guess's chance to 'recover' an image drawn uniformly from `images`
    (see the module docstring): max_i #{j : RMSE(x_i, x_j) < r_i + r_j} / N."""
    flat = images.double().flatten(1)
    rmse = torch.cdist(flat, flat) / math.sqrt(flat.shape[1])
    r = recovered_radius(images)
    reach = rmse < r.unsqueeze(0) + r.unsqueeze(1)
    return float(reach.sum(1).max()) / len(images)


def attained_kappa(images: Tensor) -> float:
    """What the best of the images themselves attains as the fixed guess (a lower bound on kappa, beside
    `baseline_kappa`'s upper one): max_k #{i : RMSE(x_i, x_k) <= r_i} / N."""
    flat = images.double().flatten(1)
    rmse = torch.cdist(flat, flat) / math.sqrt(flat.shape[1])
    return float((rmse <= recovered_radius(images).unsqueeze(1)).sum(0).max()) / len(images)
