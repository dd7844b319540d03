"""Algorithms 1 and 2 of Confined Gradient Descent (Zhang, Bai, Li, Nepal and Ko) written out participant by participant: plain loops,
autograd, float64, the secure sum as the share protocol computes it. The vectorised engine (protocols/cgd_training.py)
is tested equal to it (tests/test_cgd.py)."""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from gleak.mechanics.secret_sharing import FixedPoint
from gleak.protocols.cgd_training import PREACT_FRAC_BITS, InitLaw, Partition, Vertical, blocks, participant_init


def _participants(
    x: Tensor, y: Tensor, partition: Partition, sizes: list[int], deltas: Tensor, seed: int, init_law: InitLaw,
) -> tuple[list[list[Tensor]], list[tuple[Tensor, Tensor]]]:  # fmt: skip
    """Every participant's initial confined model (leaf tensors, float64) and its data, participant l = j * rows + i
    holding sample block i on feature block j."""
    rows, cols = partition.rows, partition.cols
    sb, fb = blocks(len(y), rows), blocks(x.shape[1], cols)
    models, data = [], []
    for j, (flo, fhi) in enumerate(fb):
        for i, (lo, hi) in enumerate(sb):
            l = j * rows + i
            init = participant_init(l, fhi - flo, fhi - flo, sizes, float(deltas[l]), seed, torch.float64, init_law)
            models.append([t.clone().requires_grad_(True) for t in init])
            data.append((x[lo:hi, flo:fhi].to(torch.float64), y[lo:hi]))
    return models, data


def reference_train(
    x: Tensor, y: Tensor, *, partition: Partition, sizes: list[int], deltas: Tensor, seed: int, alphas: list[float],
    mode: Literal["cgd", "local"] = "cgd", vertical: Vertical = "vfl", grad_scale: Literal["data", "local"] = "data",
    secure_sum: Literal["protocol", "float"] = "protocol", frac_bits: int = 24, preact_frac_bits: int = PREACT_FRAC_BITS,
    init_law: InitLaw = "interval",
) -> list[list[Tensor]]:  # fmt: skip
    """Algorithms 1 and 2 written out participant by participant (plain loops, autograd, float64), the reference
    the vectorised engine is tested against. Returns every participant's confined model [W1 (d_j, h1), b1, W2, ...]
    after len(alphas) iterations, participant l = j * rows + i (sample block i, feature block j).

    Per iteration: each participant computes the partial pre-activation of its samples on its own features; in the
    vfl reading (cgd, cols > 1) the block's partials are summed by the secure sum and each participant continues
    from that sum (as a received constant: its gradient reaches only its own first layer); each participant's loss
    from its own upper layers; its gradients by autograd, scaled as grad_scale says; the sums (first layer within
    the feature group, the rest across all; fixed point over Z_2^32 for "protocol"); every participant's step."""
    from gleak.mechanics.secret_sharing import fixed_point_sum

    fp = FixedPoint(frac_bits)
    rows, cols = partition.rows, partition.cols
    n, m = len(y), partition.m
    vfl = mode == "cgd" and vertical == "vfl" and cols > 1
    models, data = _participants(x, y, partition, sizes, deltas, seed, init_law)

    def add(values: list[Tensor], enc: FixedPoint = fp) -> Tensor:
        stacked = torch.stack([v.detach() for v in values])
        # One participant alone (centralized training) shares nothing, so nothing is encoded.
        return stacked.sum(0) if secure_sum == "float" or m == 1 else fixed_point_sum(stacked, enc)

    for alpha in alphas:
        partials = [xb @ w[0] + w[1] for w, (xb, _) in zip(models, data)]
        grads = []
        for l, (params, (_, yb)) in enumerate(zip(models, data)):
            z = partials[l]
            if vfl:
                i = l % rows
                total = add([partials[j * rows + i] for j in range(cols)], FixedPoint(preact_frac_bits))
                z = z + (total - z).detach()  # the received sum: its value, with this participant's own gradient
            h = torch.relu(z)
            for r in range(2, len(params), 2):
                h = h @ params[r] + params[r + 1]
                if r < len(params) - 2:
                    h = torch.relu(h)
            local = mode == "local" or grad_scale == "local"
            loss = F.cross_entropy(h, yb, reduction="sum") / (len(yb) if local else n)
            g = list(torch.autograd.grad(loss, params))
            if not local:
                g = [t / cols if r >= 2 or (r == 1 and vfl) else t for r, t in enumerate(g)]
            grads.append(g)
        with torch.no_grad():
            if mode == "local":
                steps = grads
            else:
                first = [[add([grads[j * rows + i][r] for i in range(rows)]) for r in range(2)] for j in range(cols)]
                upper = [add([g[r] for g in grads]) for r in range(2, len(sizes) * 2 - 2)]
                steps = [first[l // rows] + upper for l in range(m)]
            for params, step in zip(models, steps):
                for p_, s_ in zip(params, step):
                    p_ -= alpha * s_.to(p_.dtype)
    return [[t.detach() for t in params] for params in models]
