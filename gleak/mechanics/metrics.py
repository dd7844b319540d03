"""Scores of a reconstruction against the truth.

All image metrics take images in [0, 1] of shape (N, C, H, W) (denormalised and clamped by the caller).
Functional forms live here; `score` scores a trial against its whole victim batch and returns every column of
results.csv.

Scoring rules (the leaderboard states them):
- Whole batch: every image of the victim's batch is scored. Reconstructions are paired with the images by optimal
  assignment; an image left without a reconstruction (the attack returned fewer than the batch) is scored against
  the blind guess, so returning one good image of four does not score as four.
- Blind guess: the data set's mean image (the per-pixel mean of the split the victims are drawn from: the guess
  that minimises the expected MSE without looking at the update). Every trial records what it scores
  (extra: blind_mse, blind_psnr, blind_ssim) so that a verdict can say whether the attack beat it.
- PSNR per image is capped at PSNR_CEILING (an exact recovery gives inf or float round-off of 150-300 dB), so
  that means are finite; aggregates rank by the median.
- Verdicts: gleak.mechanics.verdicts (one per trial, `trial_verdict`); LPIPS: gleak.mechanics.perceptual.

>>> import torch
>>> a = torch.zeros(1, 1, 4, 4); b = torch.full((1, 1, 4, 4), 0.1)
>>> round(float(mse(a, b)[0]), 4), round(float(psnr(a, b)[0]), 2)
(0.01, 20.0)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from gleak.mechanics.perceptual import lpips
from gleak.mechanics.registration import registered_psnr
from gleak.mechanics.verdicts import trial_verdict

# A reconstruction at PSNR above 40 dB counts as exact (Robbing the Fed reports the share of a batch recovered so).
EXACT_PSNR = 40.0
# Per-image PSNR above this is float round-off of an exact recovery (MSE 1e-12); capped so that means stay finite.
PSNR_CEILING = 120.0
# An image identified by its nearest neighbour: the neighbour within this L2 distance of it (breaching's fudge; a
# victim image, normalised for the model and back, is within 1e-5 of its copy in the data set).
IIP_FUDGE = 1e-3


def mse(a: Tensor, b: Tensor) -> Tensor:
    """Per-image mean squared error, (N,)."""
    return ((a.double() - b.double()) ** 2).flatten(1).mean(1)


def psnr(a: Tensor, b: Tensor, data_range: float = 1.0, ceiling: float | None = None) -> Tensor:
    """Per-image PSNR in dB (inf for identical images, unless capped at `ceiling`)."""
    m = mse(a, b)
    out = 10 * torch.log10(data_range**2 / m)
    return out if ceiling is None else out.clamp(max=ceiling)


def mean_image(images: Tensor) -> Tensor:
    """The blind guess: the per-pixel mean (1, C, H, W) of a split's images in [0, 1]."""
    return images.double().mean(0, keepdim=True)


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Per-image cosine similarity of the flattened images."""
    a, b = a.double().flatten(1), b.double().flatten(1)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-30)


def ssim(a: Tensor, b: Tensor) -> Tensor:
    """Per-image SSIM: scikit-image structural_similarity, data_range 1, Gaussian weights sigma 1.5, no sample
    covariance (Wang et al. 2004), channel_axis for colour. Images smaller than 7x7 use the largest odd window."""
    from skimage.metrics import structural_similarity

    out = []
    for x, y in zip(a.double().cpu().numpy(), b.double().cpu().numpy()):
        x, y = np.moveaxis(x, 0, -1), np.moveaxis(y, 0, -1)
        side = min(x.shape[0], x.shape[1])
        kw: dict[str, Any] = dict(data_range=1.0, gaussian_weights=True, sigma=1.5, use_sample_covariance=False)
        if side < 11:  # gaussian weights use an 11-pixel window at sigma 1.5; shrink it for tiny images
            kw["win_size"] = side if side % 2 else side - 1
            kw["gaussian_weights"] = False
        if x.shape[2] == 1:
            out.append(structural_similarity(x[..., 0], y[..., 0], **kw))
        else:
            out.append(structural_similarity(x, y, channel_axis=-1, **kw))
    return torch.tensor(out, dtype=torch.float64)


def label_accuracy(y_true: Tensor, y_pred: Tensor | None) -> float | None:
    """Order-free label accuracy: the multiset overlap of predicted and true labels divided by the batch size."""
    if y_pred is None:
        return None
    t = torch.bincount(y_true.long().flatten(), minlength=1)
    p = torch.bincount(y_pred.long().flatten(), minlength=1)
    n = max(len(t), len(p))
    t, p = torch.nn.functional.pad(t, (0, n - len(t))), torch.nn.functional.pad(p, (0, n - len(p)))
    return float(torch.minimum(t, p).sum()) / float(len(y_true))


def identified(rec: Tensor, targets: Tensor, target_y: Tensor, pool_x: Tensor, pool_y: Tensor,
               fudge: float = IIP_FUDGE) -> Tensor | None:
    """Image identifiability (Yin et al., CVPR 2021, GradInversion; breaching's `image_identifiability_precision`,
    its pixel score): for each reconstruction rec[i], its nearest neighbour (L2, in [0, 1] pixels) among the images
    of `pool_x` whose label is target_y[i]; True where that neighbour is targets[i] (within `fudge`). (N,) bools,
    or None where a target is not in the pool at all (the question is then undefined)."""
    out = []
    for r, t, y in zip(rec.double(), targets.double(), target_y.tolist()):
        cand = pool_x[pool_y == y].double().flatten(1)
        if not len(cand):
            return None
        own = (cand - t.flatten()).norm(dim=1)
        if float(own.min()) >= fudge:
            return None
        nearest = int((cand - r.flatten()).norm(dim=1).argmin())
        out.append(bool(own[nearest] < fudge))
    return torch.tensor(out, dtype=torch.bool)


def feature_mse(a: Tensor, b: Tensor, features: Callable[[Tensor], Tensor]) -> Tensor:
    """Per-image feature-space MSE (breaching's FMSE, Geiping et al.'s framework code,
    `breaching.analysis.report`): the mean squared difference of the attacked model's outputs on the two images,
    (N,). `features(images)`: the model's output on images in [0, 1] (the caller normalises them for the model).

    breaching feeds the attack's raw output (normalised, unclamped) and the truth to the server's model as sent; here
    the images every other metric scores (denormalised and clamped to [0, 1]) are normalised again, so that a value
    outside the data range an attack returns does not count for or against it."""
    with torch.no_grad():
        fa, fb = features(a), features(b)
    return ((fa.double() - fb.double()) ** 2).flatten(1).mean(1)


def relative_distance(true: Tensor, sent: Tensor) -> float:
    """||g - g~|| / ||g|| over the flattened update (Xue et al., AAAI 2024, Fig. 1)."""
    true, sent = true.double(), sent.double()
    n = float(true.norm())
    return float((true - sent).norm()) / n if n > 0 else 0.0


@dataclass(frozen=True)
class Metric:
    """A metric's declaration, as torchmetrics' `higher_is_better`: its function and which way it leaks.

    leaks_higher: True where a higher value means a closer reconstruction (PSNR, SSIM, cosine, label accuracy),
    False where a lower one does (MSE, LPIPS). Every ranking, worst case and best cell reads it from here."""

    name: str
    fn: Callable[..., Any]
    leaks_higher: bool


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("psnr", psnr, True), Metric("mse", mse, False), Metric("ssim", ssim, True), Metric("cosine", cosine, True),
    Metric("lpips", lpips, False), Metric("label_acc", label_accuracy, True),
    Metric("rpsnr", registered_psnr, True), Metric("iip", identified, True), Metric("feat_mse", feature_mse, False),
)}  # fmt: skip
# Aggregate columns are named after their metric: psnr_median, mse_median, psnr_undefended, label_acc_std, ...
_AGGREGATES = ("_median", "_mean", "_undefended", "_lo", "_hi")


def metric_of(column: str) -> Metric:
    """The metric a results or aggregate column holds (KeyError naming it where none does)."""
    base = column
    for suffix in _AGGREGATES:
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    if base not in METRICS:
        raise KeyError(f"{column!r} is not a column of a metric ({', '.join(METRICS)})")
    return METRICS[base]


def leakiest_first(*columns: str) -> list[bool]:
    """`ascending` for DataFrame.sort_values(columns): the most leaky row first (a worst case, a best attack)."""
    return [not metric_of(c).leaks_higher for c in columns]


def safest_first(*columns: str) -> list[bool]:
    """`ascending` for DataFrame.sort_values(columns): the least leaky row first (the defense ranking)."""
    return [metric_of(c).leaks_higher for c in columns]


def pairwise_mse(truth: Tensor, rec: Tensor) -> Tensor:
    """(len(truth), len(rec)) MSE of every pair."""
    return ((truth.double().flatten(1)[:, None, :] - rec.double().flatten(1)[None, :, :]) ** 2).mean(-1)


def match(truth: Tensor, rec: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Optimal one-to-one pairing of reconstructions with true images by MSE (linear_sum_assignment).

    Returns (truth_idx, rec_idx) of min(len(truth), len(rec)) pairs.
    """
    from scipy.optimize import linear_sum_assignment  # imported where used: 0.35 s that most processes never need

    rows, cols = linear_sum_assignment(pairwise_mse(truth, rec).cpu().numpy())
    return rows, cols


def exact_share(truth: Tensor, rec: Tensor, threshold: float = EXACT_PSNR) -> float:
    """The share of the batch recovered exactly: the most one-to-one pairs (reconstruction, image) with PSNR above
    `threshold`, over the batch size. A pairing of its own, because the MSE pairing of `match` may trade an exact
    pair for a lower total MSE elsewhere."""
    exact = (10 * torch.log10(1.0 / pairwise_mse(truth, rec)) > threshold).cpu().numpy()
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(-exact.astype(np.float64))
    return float(exact[rows, cols].sum()) / len(truth)


def victim_share(observed: list[Tensor], rec_images: Tensor) -> tuple[Tensor, float]:
    """Where the observed update carries several clients' samples (a sum), the attack's rows paired one-to-one with
    all of them (by MSE, `match`), so that no row counts for two samples: (the indices of the rows paired with the
    victim's samples, observed[0], for `score`; the share of all observed samples recovered exactly,
    `exact_share`)."""
    everyone = torch.cat(observed)
    if not len(rec_images):
        return torch.zeros(0, dtype=torch.long), 0.0
    ti, ri = match(everyone, rec_images)
    mine = np.sort(ri[ti < len(observed[0])])
    return torch.as_tensor(mine, dtype=torch.long), exact_share(everyone, rec_images)


def score(
    truth_images: Tensor,
    truth_labels: Tensor,
    rec_images: Tensor | None,
    rec_labels: Tensor | None,
    lpips_weights: str | None = None,
    blind: Tensor | None = None,
    rule: str = "margin",
    search: tuple[Tensor, Tensor] | None = None,
    targets: Tensor | None = None,
    registered: bool = True,
    features: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, Any]:
    """Score a trial against its whole victim batch (module docstring): reconstructions paired with the images by
    optimal assignment, images without one scored against the blind guess `blind` (1, C, H, W) (None: the batch's
    own mean image, which an attacker could not know: a stand-in for tests only), each metric averaged over the
    batch. Images in [0, 1].

    Returns mse, psnr (per image capped at PSNR_CEILING), rpsnr (registered PSNR, gleak.mechanics.registration,
    capped alike), ssim, lpips, cosine, label_acc, iip, verdict, matched (images paired with a reconstruction of the
    attack's), blind (blind_mse, blind_psnr, blind_ssim of the blind guess on this batch) and share_psnr40 (see
    `exact_share`); None where undefined (label-only attacks have no image metrics).

    iip: the share of the batch whose paired reconstruction (of the attack's, not a blind guess) identifies it in
    `search` (the split's images and labels, `identified`); `targets`: the images to identify, row by row with the
    batch (the untransformed images where a defense transformed them; default the truth). None without `search`,
    or where the batch's images are not in it. registered=False: rpsnr not computed (None), for a second scoring
    that does not report it.

    feat_mse: the attacked model's outputs on each pair compared (`feature_mse`; `features` maps images in [0, 1] to
    them), averaged over the batch like the rest; None without `features` (text, a rescore: the store keeps no
    model)."""
    out: dict[str, Any] = dict(mse=None, psnr=None, rpsnr=None, ssim=None, lpips=None, cosine=None, iip=None,
                               feat_mse=None, verdict=None, matched=0)  # fmt: skip
    out["share_psnr40"] = None
    out["blind"] = {}
    out["label_acc"] = label_accuracy(truth_labels, rec_labels)
    if rec_images is None:
        return out
    if len(rec_images) and rec_images.shape[1:] != truth_images.shape[1:]:
        raise ValueError(f"reconstruction shape {tuple(rec_images.shape[1:])} != data shape {tuple(truth_images.shape[1:])}")
    n = len(truth_images)
    guess = (mean_image(truth_images) if blind is None else blind.double().reshape(1, *truth_images.shape[1:]))
    guesses = guess.expand(n, *truth_images.shape[1:])
    # The blind guess fills in for every image the attack did not return; the assignment decides which.
    padded = torch.cat([rec_images.double(), guesses[: max(0, n - len(rec_images))]])
    ti, ri = match(truth_images, padded)
    order = np.argsort(ti)
    ti, ri = ti[order], ri[order]
    t, r = truth_images[ti], padded[ri]
    m = mse(t, r)
    out["matched"] = int((ri < len(rec_images)).sum())
    out["mse"] = float(m.mean())
    out["psnr"] = float(psnr(t, r, ceiling=PSNR_CEILING).mean())
    if registered:
        out["rpsnr"] = float(registered_psnr(r, t, ceiling=PSNR_CEILING).mean())
    if features is not None:
        out["feat_mse"] = float(feature_mse(r, t, features).mean())
    if search is not None:
        own = ri < len(rec_images)  # pairs whose reconstruction is the attack's
        targets = truth_images if targets is None else targets
        hit = identified(padded[ri[own]], targets[ti[own]], truth_labels[ti[own]], *search)
        out["iip"] = None if hit is None else float(hit.sum()) / n
    out["share_psnr40"] = exact_share(truth_images, rec_images) if len(rec_images) else 0.0
    out["ssim"] = float(ssim(t, r).mean())
    out["cosine"] = float(cosine(t, r).mean())
    lp = lpips(t, r, lpips_weights)
    out["lpips"] = float(lp.mean()) if lp is not None else None
    out["blind"] = blind_scores(truth_images, guess)
    # The MSE that at least half of the batch's images reach (the ceil(n/2)-th smallest): a batch of which half is
    # recovered exactly (the imprint's bins) leaks, though its mean MSE is that of the images it missed.
    out["blind"]["half_mse"] = float(m.sort().values[(n + 1) // 2 - 1])
    out["verdict"] = trial_verdict(out["mse"], out["blind"]["half_mse"], out["blind"]["blind_mse"], out["matched"], n, rule)
    return out


# The scores of a transforming defense's trial against the client's untransformed batch, in the row's extra.
ORIGINAL_METRICS = ("mse", "psnr", "ssim", "lpips")


def original_scores(images: Tensor, labels: Tensor, rec_images: Tensor | None, rec_labels: Tensor | None,
                    lpips_weights: str | None = None, blind: Tensor | None = None, rule: str = "margin",
                    suffix: str = "original") -> dict[str, float]:  # fmt: skip
    """{"mse_original": ..., "psnr_original": ..., "ssim_original": ..., "lpips_original": ...} (metrics that are
    defined): the reconstruction scored against the untransformed `images`, the same way as against the truth;
    suffix "sent": against the transformed batch, where the untransformed one is the truth (MixUp)."""
    if rec_images is None:
        return {}
    s = score(images, labels, rec_images, rec_labels, lpips_weights, blind, rule, registered=False)
    return {f"{k}_{suffix}": s[k] for k in ORIGINAL_METRICS if s[k] is not None}


def blind_scores(truth_images: Tensor, guess: Tensor) -> dict[str, float]:
    """What the blind guess scores on this batch: blind_mse, blind_psnr (capped), blind_ssim (batch means)."""
    g = guess.double().expand(len(truth_images), *truth_images.shape[1:])
    return {
        "blind_mse": float(mse(truth_images, g).mean()),
        "blind_psnr": float(psnr(truth_images, g, ceiling=PSNR_CEILING).mean()),
        "blind_ssim": float(ssim(truth_images, g).mean()),
    }
