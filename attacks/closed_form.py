"""Closed-form inversion of a linear layer with bias (Phong et al. 2017; the closed-form notes; breaching's `analytic`).

For z = W x + b, dL/dW = (dL/dz) x^T and dL/db = dL/dz, so every row i with dL/db_i != 0 gives x = dW[i] / db[i].
At batch size 1 this is exact to machine precision. At batch size B each row is exact for the (dL/dz_i)-weighted
mixture of the batch. Two ways to pick B reconstructions from the rows:
- per-class: when the layer is the classifier (rows are classes), the rows of the classes present (negative bias
  gradient) are each dominated by their own class;
- agreement: in a hidden layer, a unit that only one sample of the batch activates (ReLU) yields that sample
  exactly, and several such units yield the same vector; rows whose inversions agree are grouped and the largest
  groups win (the observation behind Fowl et al.'s imprint attack, applied to the units the model already has).
  How close "agree" is adapts to the observed gradient: quantization (fp16, bf16, int8) and small noise perturb
  every row's inversion by an amount set by the defense, not the attacker, so a fixed tolerance mistakes them for
  a defense at batch sizes above 1 (the closed-form notes' error, repeated). gleak's agreement (its own choices, each named):
  (1) the rows are first projected onto the top-B right singular vectors of dW (dW = delta^T X has rank B, so this
  removes the perturbation outside the inputs' span); (2) for each tolerance of a ladder (1e-6 to 0.3, four a
  decade) rows are grouped around the densest rows, and each group's reconstruction pools its rows,
  sum(sign(db) dW) / sum(|db|), exact without a defense; (3) the tolerance kept is the one whose B reconstructions
  make the rows sparsest (`_density_cost`: most units then belong to one sample, as a ReLU unit that one sample
  alone activates does). `tol` fixes one tolerance instead (steps 1 and 2 still apply; the attack's default before
  this was a fixed 1e-3 on unprojected rows, each group represented by its largest-|db| row).
The batch size is the count of samples behind the observed update (Update.num_samples: summed over clients by
aggregation) where the threat model grants it ("batch_size"), not the victim's own batch size.

Defense-aware variants (`defense_aware = True`; the attacker knows the defense's name and parameters,
Kerckhoffs, never its random draws), at batch size 1 (one input behind the update), each our own use of the rank-one
structure dW = db x^T that Phong et al. 2017 and the closed-form notes invert one row at a time:
- noise (DLG's absolute noise, DP-SGD's Gaussian): every row is a noisy view of the same x, so all rows are pooled
  by least squares weighted by their bias gradients, x = sum_i db_i dW_i / (sum_i db_i^2 - n v), where v is the
  per-entry noise variance the description implies (sigma^2, 2 b^2 for Laplace, (z C)^2 for DP-SGD at batch 1) and
  n the rows pooled: the subtraction removes the noise's own share of sum db_i^2 (the errors-in-variables
  correction of a regression whose regressor, db, is itself noisy; Fuller 1987, "Measurement Error Models", ch. 1),
  without which x would shrink towards the mean image; then the estimate is shrunk by the positive-part James-Stein
  factor 1 - (noise energy left on x) / ||x||^2 (James & Stein 1961), so that where the pooled rows are mostly noise
  the answer tends to the data mean rather than to amplified noise. The noise left on x is var D / sum_i db_i^2
  (D pixels), against var D / db_max^2 for the one row: the gain is the bias-gradient energy of all rows over the
  largest one's, which grows with the first layer's width. In absolute terms both decline with width in gleak's MLP
  (PyTorch's default init scales the next layer by 1/sqrt(width), so sum_i db_i^2 stays put while the pooled
  noise does not shrink): benchmarks/adaptive_closed_form.txt, sigma 1e-2, widths 64 / 256 / 1024 / 4096: one row
  30.5 / 25.3 / 18.6 / 13.4 dB (recovered in 100 / 100 / 20 / 0% of 5 seeds), pooled 41.9 / 37.6 / 39.6 / 32.6 dB
  (100% at every width).
- sparsification (Top-k, DGP: a zero on the wire is a pruned entry, as a non-zero is an exact one): each pixel is
  read from the rows in which it survived (pooled as above over those rows), and a row whose bias entry was pruned
  gets its db from the ratios to the pixels already known (dW_ij / x_j, pooled by least squares), which then lets
  it contribute its own surviving pixels; repeated until no new pixel or row is gained. A pixel pruned in every row
  is left at 0 (the data mean in normalised input). This is rank-one matrix completion with the bias entries as
  anchors of the scale. What it gains depends on the pruning rule: DGP drops every layer's largest entries, so the
  rows with the largest bias gradients lose their bias entry and their brightest pixels, which other rows keep
  (batch 1, median of seeds 0-2: from 10.7 dB to 35.8 dB). Magnitude Top-k keeps pixel j in row i exactly where
  |db_i x_j| clears one threshold, so the largest-|db| row already holds every pixel that survives anywhere and
  the variant equals the plain closed form (measured: identical PSNR at 90% and 99%, global and per layer); it
  adds nothing where every bias entry was pruned either (no anchor fixes the scale: then the plain fallback).
Any other defense (or a batch above 1) falls back to the plain closed form exactly, and says so in
extra['adaptive'] = 0 (1 where a variant ran).
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, DefenseAware, check_choice
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Observation, Reconstruction
from gleak.mechanics.models import first_linear


@register_attack("closed-form")
class ClosedForm(DefenseAware, Attack):
    """Exact input recovery from the first linear layer's gradient: x = dW[i] / db[i] (the closed-form notes).

    Parameters
    ----------
    rows: "auto" (default): the row with the largest |db| at batch size 1; for batches "per-class" when the first
        linear layer is also the classifier, else "agreement".
        "largest": always the single row with the largest |db| (one reconstruction, the batch's mixture).
        "per-class": rows with negative db (one per class present), most negative first, then the remaining rows by
        |db|, up to the batch size.
        "agreement": group rows whose inversions agree (relative distance below `tol`), largest groups first, then
        the remaining rows by |db|, up to the batch size.
    tol: relative distance under which two row inversions count as the same sample (agreement only).
    defense_aware: use the defense's public description (needs "knows_defense"): against noise and against Top-k /
        DGP the variants of the module docstring (batch size 1), otherwise exactly the plain closed form. Default
        False (and then left out of the stored parameters, so that earlier trial ids stay valid).
    Needs a model whose first trainable layer is nn.Linear with bias (an MLP on flattened images); other models
    raise UnsupportedCase. Where no row has a non-zero bias gradient (for example everything pruned) the attacker
    falls back to the mean image and says so in extra['usable_rows'] = 0.
    """

    needs = frozenset({"architecture", "batch_size"})

    def __init__(self, rows: Literal["auto", "largest", "per-class", "agreement"] = "auto", tol: float | None = None,
                 defense_aware: bool = False):  # fmt: skip
        check_choice("rows", rows, ("auto", "largest", "per-class", "agreement"))
        if tol is not None and not tol > 0:
            raise ValueError(f"tol must be > 0, got {tol}")
        self.rows, self.tol = rows, tol
        self.use_defense_knowledge(defense_aware)

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        model, k = observation.model, observation.knowledge
        found = first_linear(model) if model is not None else None
        if found is None:
            raise UnsupportedCase("closed-form needs a model whose first trainable layer is nn.Linear with bias")
        name, layer = found
        if layer.bias is None:
            raise UnsupportedCase(f"closed-form needs a bias on the first linear layer {name!r}")
        prefix = f"{name}." if name else ""
        dw = observation.update[f"{prefix}weight"]
        db = observation.update[f"{prefix}bias"]
        if dw.shape[1] != torch.Size(k.input_shape).numel():
            raise UnsupportedCase(f"first linear layer {name!r} does not read the raw input (in_features {dw.shape[1]})")

        usable = torch.nonzero(db != 0).flatten()
        # The samples behind what was observed (an aggregate counts every client's), where the threat model says.
        batch = int(observation.update.num_samples) if k.batch_size is not None else 1
        mode = self.rows
        if mode == "auto":
            is_classifier = dw.shape[0] == k.num_classes and name == _last_linear_name(model)
            mode = "largest" if batch == 1 else ("per-class" if is_classifier else "agreement")
        extra: dict = {"usable_rows": int(len(usable))}
        if self.defense_aware:
            extra["adaptive"] = 0
            variant = _aware_variant(k.defense) if batch == 1 else None
            if variant is not None:
                x = variant(dw, db, k.defense)
                if x is not None:
                    extra.update(adaptive=1, pixels_read=float((x != 0).double().mean()))
                    return Reconstruction(x=x.to(dw.dtype).reshape(1, *k.input_shape), extra=extra)
        if len(usable) == 0:
            x = torch.zeros((1, *k.input_shape), dtype=dw.dtype)
            return Reconstruction(x=x, extra=extra)
        by_size = usable[torch.argsort(db[usable].abs(), descending=True)]
        if mode == "agreement":
            groups, tol, dwp, dbp = self._agreeing_groups(dw, db, by_size, batch)
            x = torch.stack([_pooled(dwp, dbp, g) for g in groups]).to(dw.dtype)
            best = int(by_size[groups[0][0]])
            extra.update(row_kept=float((dw[best] != 0).double().mean()), rows_used=len(groups), tol=tol,
                         group_rows=float(min(len(g) for g in groups)))  # fmt: skip
            return Reconstruction(x=x.reshape(len(groups), *k.input_shape), extra=extra)
        if mode == "largest":
            rows = by_size[:1]
        else:
            negative = usable[db[usable] < 0]
            negative = negative[torch.argsort(db[negative])]
            rest = by_size[~torch.isin(by_size, negative)]
            rows = torch.cat([negative, rest])[:batch]
        x = dw[rows] / db[rows].unsqueeze(1)
        best = int(rows[0])
        # row_kept: the share of the attacker's main row that reached it (the closed-form notes, section 6, under pruning).
        extra.update(row_kept=float((dw[best] != 0).double().mean()), rows_used=int(len(rows)))
        return Reconstruction(x=x.reshape(len(rows), *k.input_shape), extra=extra)

    def _agreeing_groups(self, dw: torch.Tensor, db: torch.Tensor, by_size: torch.Tensor, batch: int
                         ) -> tuple[list[torch.Tensor], float, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Up to `batch` groups of agreeing rows (positions into by_size), largest groups first, the tolerance used,
        and the projected dW and db rows (in by_size order) the groups index."""
        want = min(batch, len(by_size))
        # Every row of dW is a combination of the B inputs (dW = delta^T X), so its rows span at most B dimensions:
        # projecting onto the top-B right singular vectors removes the part of the defense's perturbation outside
        # that span (all but B of the input's dimensions) before rows are compared and pooled.
        dw64, db64 = dw[by_size].double(), db[by_size].double()
        basis = torch.linalg.svd(dw64, full_matrices=False).Vh[:want]
        dw64 = (dw64 @ basis.T) @ basis
        cand = dw64 / db64.unsqueeze(1)
        norms = cand.norm(dim=1).clamp_min(1e-30)
        dist = torch.cdist(cand, cand) / norms.unsqueeze(1)
        tried = []
        for tol in [self.tol] if self.tol is not None else TOL_LADDER:
            groups = _merge(_group(dist, tol), dw64, db64, tol)
            if len(groups) >= want:
                tried.append((_density_cost(torch.stack([_pooled(dw64, db64, g) for g in groups[:want]]), dw64, db64), tol, groups))
        if not tried:  # fewer distinct inversions than samples at every tolerance (rows of one sample agree): the finest
            tol = self.tol if self.tol is not None else TOL_LADDER[0]
            return _merge(_group(dist, tol), dw64, db64, tol)[:want], float(tol), dw64, db64
        # The smallest tolerance within 1% of the sparsest: without a defense the exact groups, not pooled neighbours.
        least = min(c for c, _, _ in tried)
        chosen = next((g, t) for c, t, g in tried if c <= least * (1 + COST_SLACK))
        groups, tol = chosen
        return [g for g in groups[:want]], float(tol), dw64, db64


def noise_variance(described) -> float | None:
    """The per-entry variance of the noise on a batch-1 update that the defense's public description implies, or
    None where it names no additive noise (noise: sigma^2, Laplace 2 b^2; DP-SGD: (z C)^2, z from its parameters
    as the defense derives it)."""
    if described is None or described.defense != "noise":
        return None
    from gleak.contracts.registry import create

    defense = create("defense", "noise", **described.defense_params)
    if defense.mode == "dp":
        return float((defense.z * defense.clip) ** 2)
    return float(defense.scale**2 * (2.0 if defense.distribution == "laplace" else 1.0))


def pooled_under_noise(dw: torch.Tensor, db: torch.Tensor, var: float) -> torch.Tensor | None:
    """x from every row of a noisy rank-one dW = db x^T: sum_i db_i dW_i / (sum_i db_i^2 - n var) (least squares
    weighted by the bias gradients, with the noise's share of the denominator removed), shrunk towards the data mean
    by the share of its energy that is noise. None where the bias gradients hold no more energy than the noise
    alone would (nothing to pool)."""
    dw64, db64 = dw.double(), db.double()
    energy = float((db64**2).sum())
    denom = energy - len(db64) * var
    if not denom > 0:
        return None
    x = (db64 @ dw64) / denom
    # The pooled noise left on x: variance var * energy / denom^2 per pixel. Where it rivals the image's own energy
    # the unbiased estimate is worse than the mean image, so shrink towards 0 (the data mean) by the positive-part
    # James-Stein factor (James & Stein 1961): 1 at high signal-to-noise, 0 where x is all noise.
    noise = x.numel() * var * energy / denom**2
    return x * max(0.0, 1.0 - noise / max(float((x**2).sum()), 1e-300))


def completed_under_pruning(dw: torch.Tensor, db: torch.Tensor) -> torch.Tensor | None:
    """x from a pruned rank-one dW = db x^T whose zeros are pruned entries: each pixel pooled over the rows where it
    survived, sum_i db_i dW_ij / sum_i db_i^2 (exact on exact entries), and each row whose db was pruned given
    db_i = sum_j x_j dW_ij / sum_j x_j^2 over its surviving pixels already read; repeated while it gains rows or
    pixels. None where no bias entry survived (nothing fixes the scale)."""
    dw64 = dw.double()
    mask = (dw64 != 0).double()
    c = db.double().clone()
    anchored = c != 0
    if not bool(anchored.any()):
        return None
    rows = anchored.clone()
    x = torch.zeros(dw64.shape[1], dtype=torch.float64)
    seen = torch.zeros(dw64.shape[1], dtype=torch.bool)
    for _ in range(MAX_COMPLETION_PASSES):
        cr = torch.where(rows, c, torch.zeros_like(c))
        den = (cr**2) @ mask
        seen_now = den > 0
        x = torch.where(seen_now, (cr @ dw64) / den.clamp_min(1e-300), torch.zeros_like(x))
        overlap = mask * seen_now.double()
        x2 = overlap @ (x**2)
        fill = (~anchored) & (x2 > 0)
        c = torch.where(fill, (dw64 * overlap) @ x / x2.clamp_min(1e-300), c)
        rows_now = anchored | fill
        if bool((rows_now == rows).all()) and bool((seen_now == seen).all()):
            break
        rows, seen = rows_now, seen_now
    return x


def _aware_variant(described):
    """The defense-aware estimator for the described defense (batch size 1), or None (then: the plain closed form)."""
    if described is None:
        return None
    if described.defense == "noise":
        var = noise_variance(described)
        return lambda dw, db, _: pooled_under_noise(dw, db, var)
    if described.defense in ("topk", "dgp"):
        return lambda dw, db, _: completed_under_pruning(dw, db)
    return None


MAX_COMPLETION_PASSES = 20
COST_SLACK = 0.01
# Tolerances tried by the adaptive agreement, smallest first: 1e-6 to 0.3, four a decade.
TOL_LADDER = tuple(float(10 ** (e / 4)) for e in range(-24, -1))


def _group(dist: torch.Tensor, tol: float) -> list[torch.Tensor]:
    """Greedy groups (positions into the candidate order, which is by |db|): the candidate with the most
    neighbours within `tol` (the densest: rows of one sample crowd around it, mixtures of several scatter) takes
    every unassigned candidate within `tol`, then the densest of the rest, and so on; largest groups first."""
    close = dist < tol
    close.fill_diagonal_(True)
    density = close.sum(1)
    order = sorted(range(len(dist)), key=lambda i: (-int(density[i]), i))
    unassigned = torch.ones(len(dist), dtype=torch.bool)
    groups = []
    for i in order:
        if not unassigned[i]:
            continue
        members = unassigned & close[i]
        groups.append(torch.nonzero(members).flatten())
        unassigned &= ~members
    groups.sort(key=lambda g: (-len(g), int(g[0])))
    return groups


def _pooled(dw: torch.Tensor, db: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A group's reconstruction: sum(sign(db) dW) / sum(|db|) over its rows (exact for rows of one sample; each
    row weighted by |db|, which sets how far the defense's perturbation moves its inversion)."""
    sign = torch.sign(db[g]).unsqueeze(1)
    return (sign * dw[g]).sum(0) / db[g].abs().sum()


def _density_cost(est: torch.Tensor, dw: torch.Tensor, db: torch.Tensor) -> float:
    """How far from sparse every row is when written in the candidate samples `est` (B, D): sum |c_i| over the rows
    i, c_i solving c_i est = dW_i, over sum |db_i|. A unit that only one sample activates is one sample (c_i has one
    entry, db_i): with the true samples most rows are that sparse and the cost is near 1; a candidate that mixes
    samples, or two candidates of one sample (ill-conditioned), cost more."""
    c = torch.linalg.lstsq(est.T, dw.T).solution.T
    return float(c.abs().sum() / db.abs().sum().clamp_min(1e-300))


def _separated(groups: list[torch.Tensor], dw: torch.Tensor, db: torch.Tensor, tol: float) -> bool:
    """The groups' reconstructions are pairwise further apart than 3 tol (relative distance)."""
    if len(groups) < 2:
        return True
    est = torch.stack([_pooled(dw, db, g) for g in groups])
    d = torch.cdist(est, est) / est.norm(dim=1, keepdim=True).clamp_min(1e-30)
    d.fill_diagonal_(math.inf)
    return bool(d.min() > 3 * tol)


def _merge(groups: list[torch.Tensor], dw: torch.Tensor, db: torch.Tensor, tol: float) -> list[torch.Tensor]:
    """Join groups of two or more rows whose pooled reconstructions lie within 3 tol of each other: one sample's
    rows split by a tolerance at the scale of the defense's perturbation."""
    big = [g for g in groups if len(g) >= 2]
    rest = [g for g in groups if len(g) < 2]
    if len(big) < 2:
        return groups
    est = torch.stack([_pooled(dw, db, g) for g in big])
    d = torch.cdist(est, est) / est.norm(dim=1, keepdim=True).clamp_min(1e-30)
    merged, used = [], torch.zeros(len(big), dtype=torch.bool)
    for i in range(len(big)):  # largest first: it absorbs the smaller pieces near it
        if used[i]:
            continue
        near = (~used) & (d[i] < 3 * tol)
        near[i] = True
        merged.append(torch.cat([big[j] for j in torch.nonzero(near).flatten().tolist()]))
        used |= near
    out = merged + rest
    out.sort(key=lambda g: (-len(g), int(g.min())))
    return out


def _last_linear_name(model) -> str | None:
    from gleak.mechanics.models import last_linear

    found = last_linear(model)
    return found[0] if found else None
