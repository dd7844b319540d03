"""Subspace demixing: every sample behind a summed first-layer gradient, from the ReLU zeros, over several rounds.

Our design, built for protocols that reveal only a sum of gradients computed at models the observer does not know
(CGD's confined models, Zhang et al.; secure aggregation). It needs no model parameters at all.

For a first layer z = W x + b followed by ReLU, the gradient row of unit i is r_i = sum_s dz_{s,i} [x_s, 1]
whatever the models: a sum over the n samples behind the update, each computed at its own participant's model.
So (1) every row of every observed round lies in the n-dimensional span of the honest samples [x_s, 1], whose
basis V comes from one SVD of all rows stacked (rounds multiply the rows, not the dimension); and (2) sample s is
inactive (dz_{s,i} = 0) at about half of the units of its participant, so the coordinates y = r V^T of all those
rows lie exactly on one hyperplane of R^n, with normal u_s. Finding the n hyperplanes that each hold a large share
of the rows (iteratively reweighted least squares from random starts, the sparse-null-vector search of dictionary
learning) gives M u_s ~ e_s for M = X V^T, hence every sample: [x_s, 1] ~ row s of U^{-1} V, scaled so that its
last coordinate is 1. With one round this needs n < H/2 units' worth of rows; every further round of a multi-round
protocol such as CGD's adds H rows (its steps change the coefficients dz, not the zeros' pattern much), which is
what lets it demix sums of more samples and gives the search better-conditioned hyperplanes.

Where fewer than n hyperplanes are found the missing samples are filled with the rows that are single samples
(rows proportional to one another across units and rounds, as the closed form's agreement rule) and then with
the largest remaining rows, so the attack degrades to the closed form rather than failing.
"""
from __future__ import annotations

import torch
from torch import Tensor

from gleak.attacks._relu_rows import input_layer, one_thread, span_coordinates, unit_bias
from gleak.contracts.plugin import Attack
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Observation, Reconstruction


@register_attack("subspace-demix")
class SubspaceDemix(Attack):
    """Demix a summed first-layer gradient into its samples via ReLU-zero hyperplanes, over all observed rounds.

    Parameters
    ----------
    restarts: random draws of the hyperplane search (RANSAC over units; see `_hyperplanes`).
    max_rounds: with several rounds, each of up to this many (spread over them) is demixed on its own as well as
        all together, and samples are ranked by how many of these demixings agree on them.
    group_rounds: draw a unit's rows of all rounds together (they share its zeros while its activation pattern
        persists); default false: every (round, unit) row on its own, which is robust to patterns that change.
    inlier_tol: a row lies on a hyperplane when |<y, u>| is below inlier_tol times the row's noise (estimated from
        its part outside the sample span: the protocol's fixed-point rounding and float arithmetic).
    gap: a hyperplane is accepted only if at most 2% as many rows as lie on it lie between 1 and `gap` tolerances
        off it (a sample's hyperplane is exact; a plane that fits rows only roughly is not one).
    min_share: a hyperplane must hold at least this share of the rows (ReLU zeros hold about half).
    rank_tol: singular values below rank_tol times the largest are treated as zero (the span of the samples).
    Needs the architecture (to find the first linear layer) and "batch_size": n, the number of samples behind the
    (summed) update, which the gate passes as Update.num_samples only to attacks granted it.
    Our own attack (no paper); see the module docstring for the argument.
    """

    needs = frozenset({"architecture", "batch_size"})
    conformance_params = {"restarts": 256}

    def __init__(
        self, restarts: int = 4096, group_rounds: bool = False, max_rounds: int = 8, inlier_tol: float = 30.0, gap: float = 30.0, min_share: float = 0.2,
        rank_tol: float = 1e-7,
    ):  # fmt: skip
        if restarts < 1 or max_rounds < 1:
            raise ValueError("restarts and max_rounds must be >= 1")
        if not gap > 1:
            raise ValueError(f"gap must be > 1, got {gap}")
        if not inlier_tol > 0 or not 0 < min_share < 1 or not 0 < rank_tol < 1:
            raise ValueError("inlier_tol must be > 0; min_share and rank_tol in (0, 1)")
        self.restarts, self.group_rounds, self.max_rounds = restarts, group_rounds, max_rounds
        self.inlier_tol, self.gap, self.min_share, self.rank_tol = inlier_tol, gap, min_share, rank_tol

    @classmethod
    def estimated_cost(cls, params, case) -> float:
        # Linear algebra on the first layer's rows, a few seconds; `restarts` are cheap draws, not model passes.
        return 20.0

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        k = observation.knowledge
        prefix, _ = input_layer(observation, "subspace-demix")
        d = int(torch.Size(k.input_shape).numel())
        rows, units = [], []
        for obs in (*observation.rounds, observation):
            dw, db = obs.update[f"{prefix}weight"], obs.update[f"{prefix}bias"]
            rows.append(torch.cat([dw, db.unsqueeze(1)], 1).to(torch.float64))
            units.append(torch.arange(dw.shape[0]) + (0 if self.group_rounds else len(units) * dw.shape[0]))
        n = int(observation.update.num_samples)  # on the wire: the samples behind the (summed) update
        dtype = observation.update[f"{prefix}weight"].dtype
        # Demix every round on its own and all rounds together; a sample is the more credible the more of these
        # independent demixings produce it (a spurious decomposition of one round is not repeated by another).
        groups = [(rows[i], units[i]) for i in _spread(len(rows), self.max_rounds)] if len(rows) > 1 else []
        groups.append((torch.cat(rows), torch.cat(units)))
        pool, votes, extra = [], [], {"rounds": len(rows), "demixings": len(groups)}
        for i, (r, unit) in enumerate(groups):
            samples, info = self._demix(r, unit, n, d, rng)
            if i == len(groups) - 1:
                extra.update(info)
            pool.append(samples)
            votes.append(torch.full((len(samples),), i))
        samples, support = _agreeing(torch.cat(pool), torch.cat(votes), n)
        extra["demixed"] = int(samples.shape[0])
        extra["agreement"] = float(support.float().mean()) if len(support) else 0.0
        if samples.shape[0] < n:  # fall back on the rows that are single samples, then on the largest rows
            r = torch.cat(rows)
            samples = torch.cat([samples, _single_rows(r[r.norm(dim=1) > 0], n - samples.shape[0])])
        x = samples[:n, :d].to(dtype).reshape(-1, *k.input_shape)
        return Reconstruction(x=x, extra=extra)

    def _demix(self, r: Tensor, unit: Tensor, n: int, d: int, rng: torch.Generator) -> tuple[Tensor, dict]:
        """The samples behind rows r (first-layer [dW | db] rows of one or several rounds), or none found."""
        norms = r.norm(dim=1)
        live = norms > 1e-12 * norms.max().clamp_min(1e-300)
        r, unit = r[live], unit[live]
        info: dict = {"rows": int(r.shape[0])}
        empty = torch.empty(0, d + 1, dtype=torch.float64)
        if r.shape[0] == 0:
            return empty, info
        _, s, vh = torch.linalg.svd(r, full_matrices=False)
        rank = int((s > self.rank_tol * s[0]).sum())
        dim = min(n, rank)
        info.update(rank=rank, span=dim)
        if dim == 1:
            return unit_bias(vh[:1]), info
        if not 2 <= dim <= d:
            return empty, info
        y, v, noise = span_coordinates(r, vh, dim)
        tol = self.inlier_tol * noise.clamp_min(1e-15 * float(r.norm(dim=1).max()))
        normals = self._hyperplanes(y, tol, unit, dim, rng)
        info["hyperplanes"] = len(normals)
        if len(normals) < dim:
            return empty, info
        u = torch.stack(normals, 1)
        if torch.linalg.matrix_rank(u) < dim:
            return empty, info
        return unit_bias(torch.linalg.solve(u, v)), info

    def _hyperplanes(self, y: Tensor, tol: Tensor, unit: Tensor, dim: int, rng: torch.Generator) -> list[Tensor]:
        """Normals u of hyperplanes through the origin of R^dim that each hold >= min_share of the rows of y, a row
        lying on one when |<y, u>| < tol (per row).

        Search (RANSAC over units): stack the rows of enough random units (all rounds of each) to reach rank
        dim - 1 on average; if they do, their null vector is a candidate. The rows of a unit share its zeros, so with
        several rounds few units fill a hyperplane, and a draw lies wholly on sample s's hyperplane with probability
        ~ n 2^-units. A candidate is kept if it holds enough rows and is exact (see `gap`); seeds that lie wholly on a
        hyperplane already found are skipped, which steers the search to the missing ones."""
        rows = y.shape[0]
        need = max(dim - 1, int(self.min_share * rows))
        yu = y / y.norm(dim=1, keepdim=True).clamp_min(1e-300)
        yn = y / tol.unsqueeze(1)  # residuals in units of each row's tolerance
        units, member = torch.unique(unit, return_inverse=True)
        seed_units = max(1, min(len(units), round((dim - 1) / _rank_per_unit(yu, member, len(units)))))
        found: list[tuple[int, Tensor, Tensor]] = []  # (rows on it, normal, which rows)
        batch = 256
        for _ in range(0, self.restarts, batch):
            chosen = torch.stack([torch.randperm(len(units), generator=rng)[:seed_units] for _ in range(batch)])
            seed = torch.zeros(batch, len(units), dtype=torch.bool).scatter_(1, chosen, True)[:, member]
            if found:  # draws wholly on a hyperplane already found would only find it again
                on = torch.stack([f[2] for f in found])
                seed = seed[~((seed.unsqueeze(1) & ~on.unsqueeze(0)).sum(2) == 0).any(1)]
            if len(seed) == 0:
                continue
            gram = _gram(yu, seed.T)
            with one_thread():  # batched eigh on small matrices is slow with several threads
                evals, evecs = torch.linalg.eigh(gram)
            ok = evals[:, 1] > 1e-12 * evals[:, -1]  # rank dim - 1, a unique normal (squared noise is ~1e-14)
            normals = evecs[ok][:, :, 0]
            for normal in normals:
                ratio = (yn @ normal).abs()
                inliers = ratio < 1.0
                count = int(inliers.sum())
                if count < need:
                    continue
                normal = torch.linalg.svd(y[inliers], full_matrices=True)[2][-1]  # refit on all its rows
                ratio = (yn @ normal).abs()
                inliers = ratio < 1.0
                count = int(inliers.sum())
                # A sample's hyperplane is exact: rows off it are far off (by their coefficient of that sample).
                # A plane that fits rows only roughly (samples with near-proportional coefficients) leaves many rows
                # just outside the tolerance.
                if count < need or int(((ratio >= 1.0) & (ratio < self.gap)).sum()) > 0.02 * count:
                    continue
                # ... and spanned by many rows: a plane through the rows where two samples are both inactive gets its
                # last dimension from a handful of rows only.
                _, sv, vv = torch.linalg.svd(yu[inliers], full_matrices=False)
                if int(((yu[inliers] @ vv[dim - 2]).abs() > 0.05).sum()) < max(3, 0.01 * count):
                    continue
                if all(abs(float(normal @ f[1])) < 0.999 for f in found):
                    found.append((count, normal, inliers))
        # A sample's hyperplane holds the rows where it is inactive (about half); planes that only contain the rows
        # where two samples are both inactive (and a few by chance) hold fewer: keep the fullest.
        found.sort(key=lambda f: -f[0])
        return [f[1] for f in found[:dim]]


def _rank_per_unit(yu: Tensor, member: Tensor, units: int, probe: int = 32) -> float:
    """The average numerical rank of one unit's rows over the rounds (consecutive rounds can be nearly dependent)."""
    ranks = []
    for u in range(0, units, max(1, units // probe)):
        sv = torch.linalg.svdvals(yu[member == u])
        ranks.append(int((sv**2 > 1e-12 * sv[0] ** 2).sum()) if sv.numel() else 0)
    return max(1.0, sum(ranks) / max(1, len(ranks)))



def _spread(count: int, most: int) -> list[int]:
    """Up to `most` indices spread evenly over range(count), first and last included."""
    if count <= most:
        return list(range(count))
    return sorted({round(i * (count - 1) / (most - 1)) for i in range(most)})


def _agreeing(samples: Tensor, source: Tensor, n: int, tol: float = 1e-3) -> tuple[Tensor, Tensor]:
    """Cluster samples that agree (relative distance < tol); return one per cluster, the clusters produced by the
    most distinct sources first (at most n), with their number of sources."""
    if samples.shape[0] == 0:
        return samples, torch.empty(0, dtype=torch.long)
    dist = torch.cdist(samples, samples) / samples.norm(dim=1, keepdim=True).clamp_min(1e-30)
    free = torch.ones(len(samples), dtype=torch.bool)
    clusters = []
    for i in range(len(samples)):
        if free[i]:
            members = free & (dist[i] < tol)
            clusters.append((len(torch.unique(source[members])), i))
            free &= ~members
    clusters.sort(key=lambda c: -c[0])
    keep = clusters[:n]
    return samples[[i for _, i in keep]], torch.tensor([c for c, _ in keep])


def _gram(yu: Tensor, keep: Tensor) -> Tensor:
    """Per start b, the Gram matrix of the rows it keeps: (batch, dim, dim) from rows (rows, dim), keep (rows, batch)."""
    batch = keep.shape[1]
    return torch.bmm(yu.T.unsqueeze(0) * keep.T.unsqueeze(1).to(yu.dtype), yu.expand(batch, -1, -1))


def _smallest(gram: Tensor, u: Tensor, steps: int) -> Tensor:
    """Inverse iteration towards each Gram matrix's eigenvector of smallest eigenvalue (columns of u, batched).
    (Batched eigh is needlessly slow on small matrices with several CPU threads; Cholesky solves are not.)"""
    dim = gram.shape[-1]
    eye = torch.eye(dim, dtype=gram.dtype)
    shift = 1e-12 * gram.diagonal(dim1=1, dim2=2).sum(1).clamp_min(1e-300)
    chol = torch.linalg.cholesky(gram + shift.view(-1, 1, 1) * eye)
    v = u.T.unsqueeze(2)
    for _ in range(steps):
        v = torch.cholesky_solve(v, chol)
        v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return v.squeeze(2).T



def _single_rows(r: Tensor, count: int, tol: float = 1e-6) -> Tensor:
    """Up to `count` rows that agree with other rows (single samples), largest groups first, then other rows."""
    cand = unit_bias(r)
    if cand.shape[0] == 0:
        return torch.zeros(count, r.shape[1], dtype=r.dtype)
    dist = torch.cdist(cand, cand) / cand.norm(dim=1, keepdim=True).clamp_min(1e-30)
    close = dist < tol
    free = torch.ones(cand.shape[0], dtype=torch.bool)
    groups = []
    for i in torch.argsort(close.sum(1), descending=True).tolist():
        if free[i]:
            members = free & close[i]
            groups.append((int(members.sum()), i))
            free &= ~members
    groups.sort(key=lambda g: -g[0])
    return cand[[i for _, i in groups[:count]]]
