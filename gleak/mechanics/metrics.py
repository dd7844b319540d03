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
- Verdict, rule "margin" (default): recovered needs the MSE band of the closed-form notes (MSE < 0.03) AND a margin of at least
  RECOVERED_MARGIN_DB over the blind guess AND a reconstruction for every image of the batch; partial needs
  MSE < 0.2 and at least PARTIAL_MARGIN_DB over the blind guess; else defended. Rule "seed002": the MSE bands
  alone (DLG Fig. 6 as used in the closed-form notes), kept so that suites reproducing the closed-form notes are judged by their rule.
- One verdict per trial: `trial_verdict`. The trial computes it under its suite's rule and stores the rule beside it
  (extra verdict_rule); `gleak rescore` and the leaderboard call the same function, so a stored verdict reads the
  same before and after a rescore.

>>> import torch
>>> a = torch.zeros(1, 1, 4, 4); b = torch.full((1, 1, 4, 4), 0.1)
>>> round(float(mse(a, b)[0]), 4), round(float(psnr(a, b)[0]), 2)
(0.01, 20.0)
>>> verdict(0.01), verdict(0.1), verdict(0.5)
('recovered', 'partial', 'defended')
>>> verdict(0.01, blind_mse=0.05), verdict(0.001, blind_mse=0.05), verdict(0.001, blind_mse=0.05, rule="seed002")
('partial', 'recovered', 'recovered')
>>> verdict(0.01, blind_mse=0.0), verdict(0.0, blind_mse=0.0), verdict(0.0, blind_mse=0.05)
('defended', 'defended', 'recovered')
"""
from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from gleak.contracts.errors import InputError

# Verdict bands of DLG Fig. 6 as used in the closed-form notes: MSE below 0.03 recovered, below 0.2 partial, else defended.
RECOVERED_MSE = 0.03
PARTIAL_MSE = 0.2
# A reconstruction at PSNR above 40 dB counts as exact (Robbing the Fed reports the share of a batch recovered so).
EXACT_PSNR = 40.0
# Per-image PSNR above this is float round-off of an exact recovery (MSE 1e-12); capped so that means stay finite.
PSNR_CEILING = 120.0
# "margin" verdicts: recovered needs at least 10 dB (a tenth of the MSE) over the blind guess, partial 3 dB (half).
RECOVERED_MARGIN_DB = 10.0
PARTIAL_MARGIN_DB = 3.0
VERDICT_RULES = ("margin", "seed002")
VERDICT_ORDER = {"defended": 0, "partial": 1, "recovered": 2}


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


def relative_distance(true: Tensor, sent: Tensor) -> float:
    """||g - g~|| / ||g|| over the flattened update (Xue et al., AAAI 2024, Fig. 1)."""
    true, sent = true.double(), sent.double()
    n = float(true.norm())
    return float((true - sent).norm()) / n if n > 0 else 0.0


def pairwise_mse(truth: Tensor, rec: Tensor) -> Tensor:
    """(len(truth), len(rec)) MSE of every pair."""
    return ((truth.double().flatten(1)[:, None, :] - rec.double().flatten(1)[None, :, :]) ** 2).mean(-1)


def match(truth: Tensor, rec: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Optimal one-to-one pairing of reconstructions with true images by MSE (linear_sum_assignment).

    Returns (truth_idx, rec_idx) of min(len(truth), len(rec)) pairs.
    """
    rows, cols = linear_sum_assignment(pairwise_mse(truth, rec).cpu().numpy())
    return rows, cols


def exact_share(truth: Tensor, rec: Tensor, threshold: float = EXACT_PSNR) -> float:
    """The share of the batch recovered exactly: the most one-to-one pairs (reconstruction, image) with PSNR above
    `threshold`, over the batch size. A pairing of its own, because the MSE pairing of `match` may trade an exact
    pair for a lower total MSE elsewhere."""
    exact = (10 * torch.log10(1.0 / pairwise_mse(truth, rec)) > threshold).cpu().numpy()
    rows, cols = linear_sum_assignment(-exact.astype(np.float64))
    return float(exact[rows, cols].sum()) / len(truth)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _gain_db(m: float, blind: float) -> float:
    """How far (dB) the attack's MSE `m` is under the blind guess's `blind`: 10 log10(blind / m). An exact recovery
    (m = 0) beats any blind guess that is not exact itself (+inf); a blind guess that is exact (the images all equal
    the mean image) cannot be beaten (-inf for m > 0, 0 dB for m = 0: no gain over it)."""
    if m > 0 and blind > 0:
        return 10 * math.log10(blind / m)
    if m == 0:
        return math.inf if blind > 0 else 0.0
    return -math.inf


def verdict(mse_value: float | None, blind_mse: float | None = None, rule: str = "margin", complete: bool = True) -> str | None:
    """The verdict band of one MSE (see the module docstring). `blind_mse`: the blind guess's MSE on the same batch
    (None: unknown, the bands alone decide); `complete`: every image of the batch had a reconstruction. A trial's
    verdict is `trial_verdict`, which picks the MSE this reads."""
    if rule not in VERDICT_RULES:
        raise ValueError(f"verdict rule must be one of {', '.join(VERDICT_RULES)}, got {rule!r}")
    if _missing(mse_value):
        return None
    m = float(mse_value)
    if rule == "seed002" or _missing(blind_mse):
        band = "recovered" if m < RECOVERED_MSE else "partial" if m < PARTIAL_MSE else "defended"
    else:
        gain = _gain_db(m, float(blind_mse))
        if m < RECOVERED_MSE and gain >= RECOVERED_MARGIN_DB:
            band = "recovered"
        elif m < PARTIAL_MSE and gain >= PARTIAL_MARGIN_DB:
            band = "partial"
        else:
            band = "defended"
    if band == "recovered" and not complete:  # an image the attack did not return was not recovered
        band = "partial"
    return band


def trial_verdict(mse_value: float | None, half_mse: float | None, blind_mse: float | None, matched: Any,
                  batch_size: Any, rule: str = "margin") -> str | None:  # fmt: skip
    """A trial's verdict under `rule`, from what its row stores: the batch-mean MSE, the MSE at least half of the
    batch reaches (extra.half_mse), the blind guess's MSE (extra.blind_mse), the images paired with one of the
    attack's reconstructions (matched) and the batch size. The one verdict of a trial: the trial (`score`),
    `gleak rescore` and the leaderboard (for a row stored under another rule) all call it. Unknown matched or
    batch size: taken as complete (rows stored before `matched` existed)."""
    if _missing(mse_value):
        return None
    complete = _missing(matched) or _missing(batch_size) or float(matched) >= float(batch_size)
    return verdict(verdict_mse(mse_value, half_mse, rule), blind_mse, rule, complete)


def verdict_rule_text(rule: str) -> str:
    """The rule in words, for the leaderboard."""
    if rule == "seed002":
        return (f"Verdict rule 'seed002' (DLG Fig. 6 bands as used in the closed-form notes): MSE < {RECOVERED_MSE} recovered, "
                f"< {PARTIAL_MSE} partial, else defended; a trial missing a reconstruction is at best partial.")  # fmt: skip
    return (f"Verdict rule 'margin', on the MSE that at least half of the batch's images reach (each image scored "
            f"alone, after the optimal pairing): recovered needs it below {RECOVERED_MSE} and at least "
            f"{RECOVERED_MARGIN_DB:g} dB under the blind guess's MSE (the data set's mean image, scored on the same "
            f"batch), and a reconstruction for every image of the batch; partial needs it below {PARTIAL_MSE} and "
            f"{PARTIAL_MARGIN_DB:g} dB under the blind guess; else defended.")  # fmt: skip


# ---- LPIPS -----------------------------------------------------------------------------------------------------
LPIPS_ENV = "GLEAK_LPIPS_BACKBONE"
_ALEXNET_FILE = "alexnet-owt-7be5be79.pth"  # torchvision's ImageNet AlexNet weights
LPIPS_HOWTO = (
    "LPIPS needs torchvision's ImageNet AlexNet weights: put alexnet-owt-7be5be79.pth in the torch hub cache "
    "($TORCH_HOME/hub/checkpoints) or name the file with $GLEAK_LPIPS_BACKBONE or --lpips-backbone"
)


def alexnet_weights_path(explicit: str | os.PathLike | None = None) -> Path | None:
    """Where the AlexNet backbone weights are, or None. Order: explicit path, $GLEAK_LPIPS_BACKBONE, hub cache."""
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"LPIPS backbone weights not found at {p}")
        return p
    env = os.environ.get(LPIPS_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"${LPIPS_ENV} names {p}, which does not exist")
        return p
    hub = Path(torch.hub.get_dir()) / "checkpoints" / _ALEXNET_FILE
    return hub if hub.is_file() else None


def check_lpips_weights(path: str | os.PathLike, name: str) -> None:
    """InputError (one line naming `name`, the flag or variable that gave the file) unless `path` is a file that
    torch reads as AlexNet's state dict (every key of torchvision's AlexNet, each of its shape): checked once
    before any trial runs, so that a wrong file is one line and not a failure of every trial."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"{name}: {path} not found")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - random bytes, a truncated zip, a pickle of other objects: all one line
        raise InputError(f"{name}: {path} is not a weights file torch can read ({type(exc).__name__}); "
                         f"it must be torchvision's {_ALEXNET_FILE}") from None  # fmt: skip
    import torchvision

    with torch.device("meta"):  # the shapes only: nothing allocated
        want = {k: tuple(v.shape) for k, v in torchvision.models.alexnet().state_dict().items()}
    if not isinstance(state, dict):
        raise InputError(f"{name}: {path} holds a {type(state).__name__}, not AlexNet's state dict ({_ALEXNET_FILE})")
    for key, shape in want.items():
        got = state.get(key)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != shape or not got.is_floating_point():
            what = "missing" if got is None else f"of shape {tuple(getattr(got, 'shape', ()))}, not {shape}"
            raise InputError(f"{name}: {path} is not AlexNet's state dict ({_ALEXNET_FILE}): {key} is {what}")


@lru_cache(maxsize=2)
def _lpips_model(weights: str):
    import lpips
    import torchvision

    # Build the LPIPS skeleton without fetching anything, then load the real backbone from `weights`:
    # the random initialisation below is overwritten before the model is used.
    skeleton = True
    model = lpips.LPIPS(net="alex", version="0.1", pretrained=True, pnet_rand=skeleton, verbose=False)
    alex = torchvision.models.alexnet()
    alex.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    feats = alex.features
    slices = [model.net.slice1, model.net.slice2, model.net.slice3, model.net.slice4, model.net.slice5]
    for sl in slices:
        for idx, layer in sl._modules.items():
            layer.load_state_dict(feats[int(idx)].state_dict())
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def lpips_available(explicit: str | None = None) -> bool:
    try:
        return alexnet_weights_path(explicit) is not None
    except FileNotFoundError:
        return False


# AlexNet's feature stack needs about 31 px; gradient-inversion papers report LPIPS on CIFAR's 32 px images.
LPIPS_MIN_SIDE = 32


def lpips(a: Tensor, b: Tensor, weights: str | os.PathLike | None = None, model: Any = None) -> Tensor | None:
    """Per-image LPIPS v0.1 (AlexNet), or None when the backbone weights are not on this machine.

    Images whose shorter side is under LPIPS_MIN_SIDE (32 px) are upsampled bilinearly (antialias off,
    align_corners False) until it is 32 px, aspect kept, before the backbone: the CIFAR size at which the
    gradient-inversion literature reports LPIPS (Geiping et al. 2020 and breaching compute it on 32 px images), and
    the usual way to score MNIST's 28 px and smaller images with the AlexNet backbone, which rejects them otherwise
    ("Output size is too small"). Grey images are repeated over three channels. `model`: an LPIPS module to use
    instead of the one built from `weights` (tests only)."""
    if model is None:
        path = alexnet_weights_path(weights)
        if path is None:
            return None
        model = _lpips_model(str(path))
    a3, b3 = a.float(), b.float()
    if a3.shape[1] == 1:
        a3, b3 = a3.expand(-1, 3, -1, -1), b3.expand(-1, 3, -1, -1)
    side = min(a3.shape[-2:])
    if side < LPIPS_MIN_SIDE:
        size = tuple(int(math.ceil(s * LPIPS_MIN_SIDE / side)) for s in a3.shape[-2:])
        up = lambda t: torch.nn.functional.interpolate(t, size=size, mode="bilinear", align_corners=False)  # noqa: E731
        a3, b3 = up(a3), up(b3)
    with torch.no_grad():
        return model(a3 * 2 - 1, b3 * 2 - 1).flatten().double()


def score(
    truth_images: Tensor,
    truth_labels: Tensor,
    rec_images: Tensor | None,
    rec_labels: Tensor | None,
    lpips_weights: str | None = None,
    blind: Tensor | None = None,
    rule: str = "margin",
) -> dict[str, Any]:
    """Score a trial against its whole victim batch (module docstring): reconstructions paired with the images by
    optimal assignment, images without one scored against the blind guess `blind` (1, C, H, W) (None: the batch's
    own mean image, which an attacker could not know: a stand-in for tests only), each metric averaged over the
    batch. Images in [0, 1].

    Returns mse, psnr (per image capped at PSNR_CEILING), ssim, lpips, cosine, label_acc, verdict, matched (images
    paired with a reconstruction of the attack's), blind (blind_mse, blind_psnr, blind_ssim of the blind guess on
    this batch) and share_psnr40 (see `exact_share`); None where undefined (label-only attacks have no image
    metrics)."""
    out: dict[str, Any] = dict(mse=None, psnr=None, ssim=None, lpips=None, cosine=None, verdict=None, matched=0)
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
                    lpips_weights: str | None = None, blind: Tensor | None = None, rule: str = "margin") -> dict[str, float]:  # fmt: skip
    """{"mse_original": ..., "psnr_original": ..., "ssim_original": ..., "lpips_original": ...} (metrics that are
    defined): the reconstruction scored against the untransformed `images`, the same way as against the truth."""
    if rec_images is None:
        return {}
    s = score(images, labels, rec_images, rec_labels, lpips_weights, blind, rule)
    return {f"{k}_original": s[k] for k in ORIGINAL_METRICS if s[k] is not None}


def verdict_mse(mean_mse: float | None, half_mse: float | None, rule: str) -> float | None:
    """The MSE a trial's verdict reads: under "margin" the MSE at least half of the batch's images reach (an image is
    a person's data: half the batch recovered exactly is a leak); under "seed002" the batch mean, as the closed-form notes do."""
    return half_mse if rule == "margin" and not _missing(half_mse) else mean_mse


def blind_scores(truth_images: Tensor, guess: Tensor) -> dict[str, float]:
    """What the blind guess scores on this batch: blind_mse, blind_psnr (capped), blind_ssim (batch means)."""
    g = guess.double().expand(len(truth_images), *truth_images.shape[1:])
    return {
        "blind_mse": float(mse(truth_images, g).mean()),
        "blind_psnr": float(psnr(truth_images, g, ceiling=PSNR_CEILING).mean()),
        "blind_ssim": float(ssim(truth_images, g).mean()),
    }
