"""Registered PSNR: PSNR after the reconstruction is aligned to the truth by a similarity transform, robust to the
shifts, rotations and rescalings an optimisation attack often returns (breaching's R-PSNR, Geiping et al.'s
framework code, `breaching.analysis.metrics.registered_psnr_compute`).

breaching registers each reconstruction onto its image with kornia's `ImageRegistrator("similarity",
num_iterations=2500)` and reflection padding, and reports per image the better of the plain and the registered
PSNR. This module is that procedure, batched, without the kornia dependency:

- Model: a similarity transform per image (rotation in degrees, 2-D shift and isotropic scale in the [-1, 1]
  normalised coordinates of the grid), starting at the identity.
- Loss: the symmetric mean absolute error (L1), the reconstruction warped onto the image plus the image warped
  back onto the reconstruction by the inverse transform, each over the pixels the warp covers (with reflection
  padding: all of them).
- Optimiser: Adam, learning rate 1e-3, over a Gaussian pyramid of 5 levels (5x5 binomial blur with reflected
  borders, then half size), coarse to fine, at most 2500 steps per level; an image stops at a level once its loss
  changes by less than 1e-4 between steps (the last loss carried into the next level, as kornia does).
- Batched: every image has its own parameters, Adam moments and step count, and stops on its own; the result is
  that of registering each image alone.

One deviation, named: breaching's code scores the warped image against the whole ground-truth batch
(`ref_batch`), not its own image; that is taken as a slip and each image is scored against its own.

>>> import torch
>>> a = torch.rand(2, 1, 16, 16)
>>> bool((registered_psnr(a, a, ceiling=120.0) == 120.0).all())
True
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

LEVELS = 5
STEPS = 2500
LR = 1e-3
TOLERANCE = 1e-4
_BETAS = (0.9, 0.999)
_EPS = 1e-8


def _blur(x: Tensor) -> Tensor:
    k1 = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0], dtype=x.dtype)
    k = (k1[:, None] * k1[None, :]) / 256.0
    c = x.shape[1]
    return F.conv2d(F.pad(x, (2, 2, 2, 2), mode="reflect"), k.expand(c, 1, 5, 5), groups=c)


def pyramid(x: Tensor, levels: int = LEVELS) -> list[Tensor]:
    """Finest first: x, then each level blurred and halved (floor), as kornia's build_pyramid; it stops early where
    a level is too small to blur with reflected borders (under 3 pixels)."""
    out = [x]
    for _ in range(levels - 1):
        h, w = out[-1].shape[-2:]
        if min(h, w) < 3:
            break
        out.append(F.interpolate(_blur(out[-1]), size=(h // 2, w // 2), mode="bilinear", align_corners=False))
    return out


def _matrices(p: Tensor) -> Tensor:
    """(N, 3, 3) similarity matrices from the parameters (N, 4): rotation (degrees), shift x, shift y, scale."""
    a = p[:, 0] * (math.pi / 180.0)
    c, s = torch.cos(a) * p[:, 3], torch.sin(a) * p[:, 3]
    zero, one = torch.zeros_like(c), torch.ones_like(c)
    return torch.stack([c, s, p[:, 1], -s, c, p[:, 2], zero, zero, one], -1).reshape(-1, 3, 3)


def _grid(h: int, w: int, dtype: torch.dtype) -> Tensor:
    """The normalised coordinates of the pixel centres ((2i + 1) / n - 1, as grid_sample reads them without
    align_corners, so that the identity changes nothing), homogeneous: (1, H*W, 3)."""
    ys = (2 * torch.arange(h, dtype=dtype) + 1) / h - 1
    xs = (2 * torch.arange(w, dtype=dtype) + 1) / w - 1
    gy, gx = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([gx, gy, torch.ones_like(gx)], -1).reshape(1, -1, 3)


def _warp(src: Tensor, m: Tensor, grid: Tensor | None = None) -> Tensor:
    """src sampled at m applied to the target's pixel centres (`_grid`), bilinear, reflection padding."""
    n, _, h, w = src.shape
    pts = _grid(h, w, src.dtype) if grid is None else grid
    moved = pts @ m.transpose(1, 2)  # (N, HW, 3)
    xy = (moved[..., :2] / moved[..., 2:].clamp_min(1e-8)).reshape(n, h, w, 2)
    return F.grid_sample(src, xy, mode="bilinear", padding_mode="reflection", align_corners=False)


def _inverse(m: Tensor) -> Tensor:
    """The inverse of similarity matrices [[a, b, x], [-b, a, y], [0, 0, 1]], in closed form (no batched solve)."""
    a, b, x, y = m[:, 0, 0], m[:, 0, 1], m[:, 0, 2], m[:, 1, 2]
    d = a * a + b * b
    ia, ib = a / d, -b / d  # the inverse's own a and b: R^-1 = [[a, -b], [b, a]] / d
    zero, one = torch.zeros_like(a), torch.ones_like(a)
    return torch.stack([ia, ib, -(ia * x + ib * y), -ib, ia, ib * x - ia * y, zero, zero, one], -1).reshape(-1, 3, 3)


def _loss(src: Tensor, dst: Tensor, m: Tensor, grid: Tensor | None = None) -> Tensor:
    """Per image: mean |warp(src, m) - dst| plus mean |warp(dst, m^-1) - src| (reflection covers every pixel); both
    warps in one grid_sample call."""
    n = len(src)
    warped = _warp(torch.cat([src, dst]), torch.cat([m, _inverse(m)]), grid)
    err = (warped - torch.cat([dst, src])).abs().flatten(1).mean(1)
    return err[:n] + err[n:]


def register(src: Tensor, dst: Tensor, steps: int = STEPS, levels: int = LEVELS, lr: float = LR,
             tolerance: float = TOLERANCE) -> Tensor:  # fmt: skip
    """The similarity matrices (N, 3, 3) that warp each src image onto its dst image (module docstring)."""
    n = len(src)
    src, dst = src.double(), dst.double()
    p = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64).repeat(n, 1)  # the identity
    m1, m2 = torch.zeros_like(p), torch.zeros_like(p)  # Adam's moments
    t = torch.zeros(n, 1, dtype=torch.float64)  # each image's own Adam step count
    b1, b2 = _BETAS
    prev = torch.full((n,), 1e10, dtype=torch.float64)
    for s_level, d_level in zip(pyramid(src, levels)[::-1], pyramid(dst, levels)[::-1]):
        grid = _grid(*s_level.shape[-2:], s_level.dtype)
        active = torch.ones(n, dtype=torch.bool)
        for _ in range(steps):
            leaf = p.detach().requires_grad_(True)
            loss = _loss(s_level, d_level, _matrices(leaf), grid)
            cur = loss.detach()
            active &= (cur - prev).abs() >= tolerance
            if not active.any():
                break
            prev = torch.where(active, cur, prev)
            (g,) = torch.autograd.grad(loss.sum(), leaf)
            on = active[:, None]
            t = t + on
            m1 = torch.where(on, b1 * m1 + (1 - b1) * g, m1)
            m2 = torch.where(on, b2 * m2 + (1 - b2) * g * g, m2)
            tt = t.clamp_min(1)
            p = torch.where(on, p - lr * (m1 / (1 - b1**tt)) / ((m2 / (1 - b2**tt)).sqrt() + _EPS), p)
    return _matrices(p).detach()


def registered_psnr(rec: Tensor, truth: Tensor, ceiling: float | None = None, **kw) -> Tensor:
    """Per image (N,): the better of the PSNR of `rec` against `truth` and that of `rec` registered onto `truth`
    (images in [0, 1], (N, C, H, W); capped at `ceiling` where given). `kw`: `register`'s settings."""
    rec, truth = rec.double(), truth.double()
    plain = ((rec - truth) ** 2).flatten(1).mean(1)
    warped = _warp(rec, register(rec, truth, **kw)) if len(rec) else rec
    moved = ((warped - truth) ** 2).flatten(1).mean(1)
    out = 10 * torch.log10(1.0 / torch.minimum(plain, moved))
    return out if ceiling is None else out.clamp(max=ceiling)
