"""Undoing MixUp's mixing from the soft labels it sends along (used by the defense-aware inverting gradients).

A MixUp client's encoding i is sum_j lam_ij x_j and its label sum_j lam_ij onehot(y_j) (gleak.defenses._mixing). An
attacker handed those soft labels reads the mixing matrix off them: where the batch's classes are distinct, the
label's entry for class c is the coefficient of the one image of class c, so the encodings E (B x pixels) are A Z
with A (B x classes present) the soft labels' columns and Z the images, one per class: Z = A^+ E (least squares).
Where a class repeats, its column mixes those images and Z's row is their combination (one image per class is
returned, within the batch's output budget). The step is linear, so it holds in normalised units as in pixels
(every row of A sums to 1, so the normalisation's shift passes through)."""
from __future__ import annotations

import torch
from torch import Tensor

PRESENT = 1e-6  # a class whose coefficients never exceed this entered no encoding


def unmix(encodings: Tensor, soft: Tensor) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(one image per class present (n, ...), those classes (n,), {"unmix_condition": cond(A)}) from the recovered
    encodings (B, ...) and the soft labels (B, classes) they were sent with."""
    classes = torch.nonzero(soft.amax(0) > PRESENT).flatten()
    a = soft[:, classes].to(torch.float64)
    flat = encodings.reshape(len(encodings), -1).to(torch.float64)
    z = torch.linalg.lstsq(a, flat, driver="gelsd").solution
    cond = float(torch.linalg.cond(a)) if a.shape[0] >= a.shape[1] else float("inf")
    return z.reshape(len(classes), *encodings.shape[1:]).to(encodings.dtype), classes, {"unmix_condition": cond}
