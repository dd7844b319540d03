"""SPEAR: exact recovery of a whole batch from a ReLU linear layer's gradient (Dimitrov et al., "SPEAR: Exact Gradient
Inversion of Batches in Federated Learning", NeurIPS 2024; built from the paper's description of its algorithm: the
low-rank factorisation, sampling and sparsity filtering, greedy selection by sparsity matching, the bias-gradient
scale; the authors' repository could not be read here).

For a linear layer z = W x + b read by ReLU, the gradient of a batch of b samples is dL/dW = L X with L = dL/dZ
(m x b; a column per sample) and X the inputs (b x n): it has rank b, and L is sparse, because ReLU zeroes the
entries of the units a sample leaves inactive (about half). SPEAR writes dL/dW = L' R' by an SVD and looks for the
disaggregation matrix Q with L = L' Q: each column q of Q makes L' q sparse, so q lies in the kernel of the b - 1
rows of L' at which its sample is inactive. The steps, as in the paper:
1. Sampling: draw b - 1 rows of L' at random; if they have rank b - 1, their kernel is a proposal q.
2. Filtering: keep q when L' q has at least `min_sparsity` * m zeros (a true direction has one zero per unit the
   sample leaves inactive, a spurious one only the b - 1 it was drawn from).
3. Greedy selection of b proposals by the sparsity-matching coefficient: the share of (unit, sample) entries where
   the zeros of L agree with the inactive units of the forward pass W x + b of the inputs the proposals decode to
   (first by sparsity, then by single swaps while the coefficient rises: the paper's two greedy stages).
4. Scale: the bias gradient dL/db = L 1 fixes each column's scale and sign; then X = (L' Q diag(s))^+ dL/dW.

Choices of ours, each named: L' is taken as the coordinates of the augmented rows [dW | db] in their top-b right
singular vectors (the paper's factorisation up to an invertible b x b factor, which leaves the kernels unchanged),
and the scale is read from the augmented rows' last coordinate (the bias gradient, as step 4) rather than by a
separate least-squares solve; "zero" is judged per unit against its gradient row's own noise (its part outside
the rank-b span, as subspace-demix does), not a fixed threshold, so float32 gradients and quantization are read
alike; proposals are refit on all the units they vanish at; sampling stops once b proposals decode to inputs whose
forward pass agrees with the observed zeros (`match_done`), or after `max_draws` draws. Where fewer than b
directions are found the others are completed orthogonally (the samples found are then approximate) and
extra['directions'] says how many were found.

Needs the architecture (the first linear layer), its parameters (the sparsity-matching forward pass, as the
paper's honest-but-curious server has them) and the batch size (the rank, b).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from gleak.attacks._relu_rows import input_layer, one_thread, span_coordinates, unit_bias
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Observation, Reconstruction
from gleak.mechanics.progress import report as report_progress


@register_attack("spear")
class Spear(Attack):
    """A whole batch recovered exactly from a ReLU linear layer's gradient (Dimitrov et al., NeurIPS 2024).

    Parameters
    ----------
    max_draws: most submatrices of b - 1 rows sampled (the expected number grows as about 2^b; at b = 16 and 256
        units a few hundred thousand).
    draws_per_step: submatrices whose kernels are computed together (the paper's parallel evaluation).
    min_sparsity: a proposal is kept when at least this share of the live units are zeros of L' q (paper: tau).
    zero_tol: an entry of L' q is zero when below zero_tol times its unit's noise (see the module docstring).
    match_done: stop sampling once the b directions chosen have at least this sparsity-matching coefficient.
    decode_last: also try the last direction decoded from the other b - 1 (ours; false: the paper's sampling alone).
    """

    needs = frozenset({"architecture", "parameters", "batch_size"})
    conformance_params = {"max_draws": 8192}

    def __init__(
        self, max_draws: int = 1_048_576, draws_per_step: int = 4096, min_sparsity: float = 0.2, zero_tol: float = 30.0,
        match_done: float = 0.999, decode_last: bool = True,
    ):  # fmt: skip
        if max_draws < 1 or draws_per_step < 1:
            raise ValueError("max_draws and draws_per_step must be >= 1")
        if not 0 < min_sparsity < 1 or not 0 < match_done <= 1:
            raise ValueError("min_sparsity must be in (0, 1) and match_done in (0, 1]")
        if not zero_tol > 0:
            raise ValueError(f"zero_tol must be > 0, got {zero_tol}")
        self.max_draws, self.draws_per_step = max_draws, draws_per_step
        self.min_sparsity, self.zero_tol, self.match_done = min_sparsity, zero_tol, match_done
        self.decode_last = decode_last

    @classmethod
    def estimated_cost(cls, params, case) -> float:
        # Batched small SVDs; the draws needed grow as about 2^b (a few seconds at b = 16 on a CPU).
        b = int(getattr(case, "batch_size", 1) or 1) * int(getattr(case, "clients", 1) or 1)
        return 2.0 + 2.0 ** min(b, 24) / 2e4

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        k = observation.knowledge
        prefix, layer = input_layer(observation, "spear")
        dw, db = observation.update[f"{prefix}weight"], observation.update[f"{prefix}bias"]
        b = int(observation.update.num_samples)
        r = torch.cat([dw, db.unsqueeze(1)], 1).to(torch.float64)
        norms = r.norm(dim=1)
        live = norms > 1e-12 * norms.max().clamp_min(1e-300)  # units no sample activates carry nothing
        r = r[live]
        weight, bias = layer.weight.detach().to(torch.float64)[live], layer.bias.detach().to(torch.float64)[live]
        if r.shape[0] == 0:
            raise UnsupportedCase("spear: the first layer's gradient is zero")
        _, sv, vh = torch.linalg.svd(r, full_matrices=False)
        rank = int((sv > 1e-7 * sv[0]).sum())
        dim = min(b, rank)
        extra: dict = {"units": int(r.shape[0]), "rank": rank, "draws": 0}
        if dim > r.shape[0] // 2:
            raise UnsupportedCase(f"spear needs more than 2 b live units in the first layer ({r.shape[0]} for b = {dim})")
        y, v, noise = span_coordinates(r, vh, dim)
        tol = self.zero_tol * noise.clamp_min(1e-15 * float(r.norm(dim=1).max()))
        forward = _Forward(y, v, weight, bias, tol)
        if dim == 1:
            q = torch.ones(1, 1, dtype=torch.float64)
            extra.update(directions=1, sparsity_match=forward.match(q))
            return Reconstruction(x=self._inputs(q, v, dw.dtype, k.input_shape), extra=extra)
        need = max(dim, math.ceil(self.min_sparsity * y.shape[0]))
        proposals = torch.empty(0, dim, dtype=torch.float64)  # unit vectors q (rows), sparsest first
        sparsity = torch.empty(0, dtype=torch.long)
        chosen, score = None, 0.0
        yn = y / tol.unsqueeze(1)
        # Rows where two samples are both inactive have rank b - 2 and a plane of kernels: only the noise would make
        # one of them look unique, so a kernel counts only where the (b-1)-th singular value clears the noise.
        floor = float(tol.median())
        while extra["draws"] < self.max_draws:
            batch = min(self.draws_per_step, self.max_draws - extra["draws"])
            extra["draws"] += batch
            rows = torch.rand(batch, y.shape[0], generator=rng).topk(dim - 1, dim=1).indices
            with one_thread():  # batched SVD of small matrices is slow with several threads
                _, s, vq = torch.linalg.svd(y[rows])
            q = vq[s[:, -1] > floor][:, -1]  # rank b - 1 above the noise: a unique kernel direction
            q = q[((yn @ q.T).abs() < 1.0).sum(0) >= need]
            pool = proposals[: 2 * dim]
            for p in q:
                p, count = _refit(p, y, yn, floor)
                if p is None:
                    continue
                same = (proposals @ p).abs() > 0.999 if len(proposals) else torch.zeros(0, dtype=torch.bool)
                if bool(same.any()):  # one direction found again: keep the copy that vanishes at more units
                    j = int(same.nonzero()[0])
                    if count <= int(sparsity[j]):
                        continue
                    keep = torch.arange(len(proposals)) != j
                    proposals, sparsity = proposals[keep], sparsity[keep]
                at = int((sparsity >= count).sum())
                proposals = torch.cat([proposals[:at], p[None], proposals[at:]])
                sparsity = torch.cat([sparsity[:at], torch.tensor([count]), sparsity[at:]])
            # The greedy choice runs again only when the candidates it considers (the 2 b sparsest) changed.
            if len(proposals) >= dim - 1 and not torch.equal(pool, proposals[: 2 * dim]):
                last = _last_decoded(proposals, dim, forward) if self.decode_last else None
                for cand in (_greedy(proposals[: 2 * dim], dim, forward), last):
                    if cand is not None and cand[1] > score:
                        chosen, score = cand
                if score >= self.match_done:
                    break
            report_progress(extra["draws"], self.max_draws, 1.0 - score)  # the loss shown: 1 - sparsity matching
        extra["proposals"] = len(proposals)
        if chosen is None:
            chosen = _complete(proposals, dim)
            score = forward.match(chosen)
        extra.update(directions=min(len(proposals), dim), sparsity_match=score)
        return Reconstruction(x=self._inputs(chosen, v, dw.dtype, k.input_shape), extra=extra)

    @staticmethod
    def _inputs(q: Tensor, v: Tensor, dtype: torch.dtype, shape) -> Tensor:
        """The samples the directions q (columns) decode to: rows of Q^-1 V, scaled by their bias coordinate."""
        x = _decode(q, v)
        return x[:, :-1].to(dtype).reshape(-1, *shape)


def _decode(q: Tensor, v: Tensor) -> Tensor:
    """Rows [x_s, 1] for the directions q (dim x dim, columns): L = y Q diag(s) gives dW = L X, so Q diag(s) X = V."""
    cand = torch.linalg.lstsq(q, v).solution
    out = unit_bias(cand)
    if out.shape[0] < cand.shape[0]:  # a row with no bias coordinate: keep it unscaled rather than drop a sample
        keep = cand[:, -1].abs() <= 1e-12 * cand.abs().amax(1)
        out = torch.cat([out, cand[keep]])
    return out


class _Forward:
    """The sparsity-matching coefficient of directions Q: the share of (unit, sample) pairs where L = y Q is zero
    exactly where the forward pass W x + b of the decoded inputs leaves the unit inactive."""

    def __init__(self, y: Tensor, v: Tensor, weight: Tensor, bias: Tensor, tol: Tensor):
        self.y, self.v, self.weight, self.bias, self.tol = y, v, weight, bias, tol

    def match(self, q: Tensor) -> float:
        try:
            x = _decode(q, self.v)
        except RuntimeError:  # singular Q
            return 0.0
        if x.shape[0] != q.shape[1]:
            return 0.0
        inactive = (x[:, :-1] @ self.weight.T + self.bias) <= 0  # (b, m)
        zero = ((self.y @ q).abs() < self.tol.unsqueeze(1)).T  # (b, m)
        return float((inactive == zero).double().mean())


def _refit(q: Tensor, y: Tensor, yn: Tensor, floor: float, rounds: int = 2) -> tuple[Tensor | None, int]:
    """q refit (twice) as the kernel of every unit it vanishes at, and that count: a kernel drawn from b - 1 rows
    carries their noise, the fit on all its zeros does not. None where that kernel is not unique (the zeros shared
    by two or more samples: their second smallest singular value within the noise)."""
    for _ in range(rounds):
        zeros = (yn @ q).abs() < 1.0
        _, s, vh = torch.linalg.svd(y[zeros], full_matrices=True)
        if len(s) < y.shape[1] or float(s[y.shape[1] - 2]) <= floor:
            return None, 0
        q = vh[-1]
    return q, int(((yn @ q).abs() < 1.0).sum())


def _independent(proposals: Tensor, count: int, rtol: float = 1e-6) -> list[int]:
    """Up to `count` proposals (rows, sparsest first), each independent of those before it. Two samples that share
    most of their inactive units give a plane of spurious proposals (a mix of their two directions vanishes where
    both are inactive and at one more unit of its choosing, so it looks sparse): once the two true directions are
    in, every such mix lies in their span, which the tolerance (well above the noise of a refit direction) sees."""
    pick: list[int] = []
    for i in range(len(proposals)):
        if len(pick) == count:
            break
        if int(torch.linalg.matrix_rank(proposals[[*pick, i]], rtol=rtol)) == len(pick) + 1:
            pick.append(i)
    return pick


def _last_decoded(proposals: Tensor, dim: int, forward: _Forward) -> tuple[Tensor, float] | None:
    """Ours: b directions from the b - 1 sparsest independent proposals. The sample of the missing direction has the
    decoding row p (Q^-1's row) orthogonal to the other b - 1 directions, so its input is known up to scale (fixed by
    the bias coordinate); its forward pass names the units it leaves inactive, whose rows give its direction as
    their kernel. Saves the draws for the sample with the fewest inactive units, the last one sampling finds."""
    pick = _independent(proposals, dim - 1)
    if len(pick) < dim - 1:
        return None
    known = proposals[pick]
    p = torch.linalg.svd(known, full_matrices=True)[2][-1]  # orthogonal to the b - 1 directions
    x = unit_bias((p @ forward.v)[None])
    if x.shape[0] == 0:
        return None
    inactive = (x[0, :-1] @ forward.weight.T + forward.bias) <= 0
    if int(inactive.sum()) < dim - 1:
        return None
    q = torch.linalg.svd(forward.y[inactive], full_matrices=True)[2][-1]
    chosen = torch.cat([known, q[None]]).T
    return chosen, forward.match(chosen)


def _greedy(proposals: Tensor, dim: int, forward: _Forward) -> tuple[Tensor, float]:
    """b of the proposals (rows, sparsest first): the sparsest independent ones, then single swaps while the
    sparsity-matching coefficient rises (the paper's two greedy stages)."""
    pick = _independent(proposals, dim)
    if len(pick) < dim:
        return _complete(proposals[pick], dim), 0.0
    best = forward.match(proposals[pick].T)
    improved = True
    while improved and best < 1.0:
        improved = False
        for slot in range(dim):
            for i in range(len(proposals)):
                if i in pick:
                    continue
                cand = pick.copy()
                cand[slot] = i
                score = forward.match(proposals[cand].T)
                if score > best:
                    pick, best, improved = cand, score, True
    return proposals[pick].T, best


def _complete(proposals: Tensor, dim: int) -> Tensor:
    """The directions found (rows), completed to dim independent columns by an orthonormal complement."""
    if len(proposals) == 0:
        return torch.eye(dim, dtype=torch.float64)
    found = proposals[:dim].T
    u = torch.linalg.svd(found, full_matrices=True)[0]
    return torch.cat([found, u[:, found.shape[1]:]], 1)
