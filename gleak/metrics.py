"""Scores of a reconstruction against the truth.

All image metrics take images in [0, 1] of shape (N, C, H, W) (denormalised and clamped by the caller).
Functional forms live here; `score` pairs a batch by optimal assignment and returns every column of results.csv.

>>> import torch
>>> a = torch.zeros(1, 1, 4, 4); b = torch.full((1, 1, 4, 4), 0.1)
>>> round(float(mse(a, b)[0]), 4), round(float(psnr(a, b)[0]), 2)
(0.01, 20.0)
>>> verdict(0.01), verdict(0.1), verdict(0.5)
('recovered', 'partial', 'defended')
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

# Verdict bands of DLG Fig. 6 as used in seed 002: MSE below 0.03 recovered, below 0.2 partial, else defended.
RECOVERED_MSE = 0.03
PARTIAL_MSE = 0.2
# A reconstruction at PSNR above 40 dB counts as exact (Robbing the Fed reports the share of a batch recovered so).
EXACT_PSNR = 40.0


def mse(a: Tensor, b: Tensor) -> Tensor:
    """Per-image mean squared error, (N,)."""
    return ((a.double() - b.double()) ** 2).flatten(1).mean(1)


def psnr(a: Tensor, b: Tensor, data_range: float = 1.0) -> Tensor:
    """Per-image PSNR in dB (inf for identical images)."""
    m = mse(a, b)
    return 10 * torch.log10(data_range**2 / m)


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
    """||g - g~|| / ||g|| over the flattened update (seed 001, Fig. 1)."""
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


def verdict(mse_value: float | None) -> str | None:
    if mse_value is None or (isinstance(mse_value, float) and math.isnan(mse_value)):
        return None
    if mse_value < RECOVERED_MSE:
        return "recovered"
    if mse_value < PARTIAL_MSE:
        return "partial"
    return "defended"


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


def lpips(a: Tensor, b: Tensor, weights: str | os.PathLike | None = None) -> Tensor | None:
    """Per-image LPIPS v0.1 (AlexNet), or None when the backbone weights are not on this machine."""
    path = alexnet_weights_path(weights)
    if path is None:
        return None
    model = _lpips_model(str(path))
    a3, b3 = a.float(), b.float()
    if a3.shape[1] == 1:
        a3, b3 = a3.expand(-1, 3, -1, -1), b3.expand(-1, 3, -1, -1)
    with torch.no_grad():
        return model(a3 * 2 - 1, b3 * 2 - 1).flatten().double()


def score(
    truth_images: Tensor,
    truth_labels: Tensor,
    rec_images: Tensor | None,
    rec_labels: Tensor | None,
    lpips_weights: str | None = None,
) -> dict[str, Any]:
    """Pair reconstructions with the truth by optimal assignment and average each metric over the pairs.

    Images in [0, 1]. Returns mse, psnr, ssim, lpips, cosine, label_acc, verdict, matched, and share_psnr40 (see
    `exact_share`) (None where undefined).
    """
    out: dict[str, Any] = dict(mse=None, psnr=None, ssim=None, lpips=None, cosine=None, verdict=None, matched=0)
    out["share_psnr40"] = None
    out["label_acc"] = label_accuracy(truth_labels, rec_labels)
    if rec_images is None or len(rec_images) == 0:
        return out
    if rec_images.shape[1:] != truth_images.shape[1:]:
        raise ValueError(f"reconstruction shape {tuple(rec_images.shape[1:])} != data shape {tuple(truth_images.shape[1:])}")
    ti, ri = match(truth_images, rec_images)
    t, r = truth_images[ti], rec_images[ri]
    m = mse(t, r)
    out["mse"] = float(m.mean())
    out["psnr"] = float(psnr(t, r).mean())
    out["share_psnr40"] = exact_share(truth_images, rec_images)
    out["ssim"] = float(ssim(t, r).mean())
    out["cosine"] = float(cosine(t, r).mean())
    lp = lpips(t, r, lpips_weights)
    out["lpips"] = float(lp.mean()) if lp is not None else None
    out["verdict"] = verdict(out["mse"])
    out["matched"] = int(len(ti))
    return out
