"""The privacy filters NVIDIA FLARE ships for a client's update (nvflare.app_common.filters, read at NVFlare 2.8):
ExcludeVars, PercentilePrivacy (after Shokri and Shmatikov, "Privacy-Preserving Deep Learning", CCS 2015) and
SVTPrivacy (the sparse vector technique; Lyu, Su, Li, "Understanding the Sparse Vector Technique for Differential
Privacy", VLDB 2017).

FLARE applies them to the weight difference a client returns (or its weights). gleak applies them to the update
as the client sends it: FedAvg's weight difference, or FedSGD's gradient (the difference of one step at learning
rate 1, up to its sign, which none of the three filters reads). Deviations from FLARE, named in each class:
excluded variables are sent as zeros rather than left out (gleak's wire keeps the model's layout, and the server
does not move them either way); FLARE divides by the round's local step count before filtering and multiplies
after (NUM_STEPS_CURRENT_ROUND), which a gleak defense is not told, so the update is filtered as it is (a FedSGD
update is one step); the random draws come from the trial's generator, not numpy's global one, so that a trial is
a function of its seed.
"""
from __future__ import annotations

import math
import re
import numpy as np
import torch
from torch import Tensor

from gleak.contracts.plugin import Defense
from gleak.contracts.registry import register_defense
from gleak.contracts.wire import Update
from gleak.defenses.noise import sample_noise

MAX_PASSES = 100_000  # SVT's selection passes; each accepts every remaining entry with a positive probability


@register_defense("exclude-vars")
class ExcludeVars(Defense):
    """Send zeros for the parameters named, the rest of the update as it is (FLARE's ExcludeVars).

    Parameters
    ----------
    exclude: the parameters kept back: a list of exact names, or one regular expression searched in each name (as
        FLARE's `exclude_vars` takes a list or a string; unanchored: "0\\." matches "layers.0.weight"). Default
        "" (or []): nothing is excluded, FLARE's default. A pattern or name that matches no parameter of the update fails
        the trial, naming the update's parameters (FLARE only logs a warning: a filter that silently does nothing
        would make a leaderboard row mean nothing).

    Deviation, named: FLARE removes the excluded variables from what it sends; gleak sends them as zeros (the
    server does not update them either way, and every attack and protocol reads the model's layout).
    """

    def __init__(self, exclude: str | list[str] = ""):
        if isinstance(exclude, str):
            try:
                re.compile(exclude)
            except re.error as exc:
                raise ValueError(f"exclude is not a regular expression: {exc}") from None
        elif not isinstance(exclude, (list, tuple)) or not all(isinstance(n, str) for n in exclude):
            raise ValueError(f"exclude must be a list of parameter names or one regular expression, got {exclude!r}")
        self.exclude = exclude if isinstance(exclude, str) else list(exclude)

    def excluded(self, names: list[str]) -> list[str]:
        if isinstance(self.exclude, str):
            pattern = re.compile(self.exclude)
            return [n for n in names if pattern.search(n)]
        return [n for n in names if n in self.exclude]

    def transform(self, update: Update, rng: torch.Generator) -> Update:
        if not self.exclude:
            return update.map(lambda _, a: a.clone())
        out = set(self.excluded(update.names()))
        missing = [n for n in self.exclude if n not in update.names()] if isinstance(self.exclude, list) else []
        if not out or missing:
            raise ValueError(f"exclude-vars: {self.exclude!r} matches {'no' if not out else 'not every'} parameter of the "
                             f"update (its parameters: {', '.join(update.names())})")  # fmt: skip
        return update.map(lambda n, a: torch.zeros_like(a) if n in out else a.clone())


@register_defense("percentile")
class Percentile(Defense):
    """Send only the update's largest entries, each clipped to [-gamma, gamma] (FLARE's PercentilePrivacy).

    After Shokri and Shmatikov (CCS 2015): an entry is kept where its magnitude is at or above a percentile of all
    the update's magnitudes.

    Parameters
    ----------
    percentile: the percentile (0-100) of |update| over every entry of every tensor together (numpy's linear
        interpolation) below which an entry is zeroed (strictly below: an entry at the cut-off is kept). Default 10,
        FLARE's.
    gamma: the clipping bound of the entries kept. Default 0.01, FLARE's (set for weight differences; a FedSGD
        gradient is the difference of one step at learning rate 1).

    FLARE's docstring says entries under gamma become zero; its code (and this defense) uses gamma only to clip.
    Scalars (0-d tensors) are sent as they are, as FLARE does.
    """

    def __init__(self, percentile: float = 10.0, gamma: float = 0.01):
        if not 0 <= percentile <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {percentile}")
        if not 0 < gamma < math.inf:
            raise ValueError(f"gamma must be positive and finite, got {gamma}")
        self.percentile, self.gamma = percentile, gamma

    def transform(self, update: Update, rng: torch.Generator) -> Update:
        flat = update.flat()
        if not flat.numel():
            return update.map(lambda _, a: a.clone())
        cutoff = float(np.percentile(flat.detach().abs().double().cpu().numpy(), self.percentile))

        def one(_: str, a: Tensor) -> Tensor:
            if a.dim() == 0:
                return a.clone()
            return torch.where(a.abs() < cutoff, torch.zeros_like(a), a).clamp(-self.gamma, self.gamma)

        return update.map(one)


@register_defense("svt")
class SVT(Defense):
    """Send a noisy few of the update's entries, chosen by the sparse vector technique (FLARE's SVTPrivacy).

    As rewritten in NVFlare 2.8. Over all entries (scalars excepted, sent as they are): c = ceil(fraction * n) entries are to be released. A
    threshold tau + Laplace(gamma / eps_threshold) is drawn once; passes over the entries not yet accepted accept
    each whose |clip(entry, gamma)| + Laplace(2 gamma c / eps_query) reaches it, until at least c are accepted; c of
    the accepted are drawn (with replacement by default, as FLARE) and each released as clip(entry, gamma) +
    Laplace(2 gamma c / eps_release), not clipped again.

    Parameters
    ----------
    fraction: the share of entries released (default 0.1).
    selection_epsilon: FLARE's `epsilon` (renamed: a gleak defense's `epsilon` is the method that reports its DP
        guarantee), the budget of the selection, split as eps_threshold = selection_epsilon / (1 + (2c)^(2/3)) and
        eps_query = selection_epsilon - eps_threshold (Lyu et al.'s optimal split, FLARE's default; default 0.1).
    noise_var: the release budget per released entry, eps_release = c * noise_var (FLARE's name; not a variance;
        default 0.1).
    gamma: the clipping bound (default 1e-5); tau: the threshold's offset (default 1e-6).
    replace: draw the released entries with replacement (default True, FLARE's; fewer than c distinct ones then).

    The guarantee FLARE accounts is for the selected values, per round; gleak reports no epsilon for it (its
    accountant composes none). Deviation, named: FLARE splits the draw of the c released entries by variable and
    chunk (binomial or hypergeometric counts, then uniform within each); a uniform draw over all accepted entries,
    used here, has the same distribution.
    """

    def __init__(self, fraction: float = 0.1, selection_epsilon: float = 0.1, noise_var: float = 0.1,
                 gamma: float = 1e-5, tau: float = 1e-6, replace: bool = True):  # fmt: skip
        for name, v in (("selection_epsilon", selection_epsilon), ("noise_var", noise_var), ("gamma", gamma)):
            if not 0 < v < math.inf:
                raise ValueError(f"{name} must be positive and finite, got {v}")
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if not 0 <= tau < math.inf:
            raise ValueError(f"tau must be non-negative and finite, got {tau}")
        self.fraction, self.selection_epsilon, self.noise_var = fraction, selection_epsilon, noise_var
        self.gamma, self.tau, self.replace = gamma, tau, replace

    def budgets(self, c: int) -> tuple[float, float, float]:
        """(eps_threshold, eps_query, eps_release) for c released entries."""
        eps_threshold = self.selection_epsilon / (1 + (2 * c) ** (2 / 3))
        return eps_threshold, self.selection_epsilon - eps_threshold, c * self.noise_var

    def transform(self, update: Update, rng: torch.Generator) -> Update:
        vectors = [n for n in update.names() if update[n].dim() > 0]
        if not vectors:
            return update.map(lambda _, a: a.clone())
        w = torch.cat([update[n].detach().reshape(-1).double().cpu() for n in vectors])
        n = w.numel()
        c = min(math.ceil(n * self.fraction), n)
        eps_t, eps_q, eps_r = self.budgets(c)
        clipped = w.clamp(-self.gamma, self.gamma)
        q = clipped.abs()

        def lap(n: int, scale: float) -> Tensor:  # the noise defense's Laplace sampler, drawn from the client's rng
            return sample_noise(torch.Size([n]), scale, "laplace", rng, torch.float64)

        threshold = self.tau + float(lap(1, self.gamma / eps_t)[0])
        accepted = torch.zeros(n, dtype=torch.bool)
        for _ in range(MAX_PASSES):
            if int(accepted.sum()) >= c:
                break
            cand = (~accepted).nonzero().flatten()
            hit = q[cand] + lap(len(cand), 2 * self.gamma * c / eps_q) >= threshold
            accepted[cand[hit]] = True
        else:
            raise RuntimeError(f"svt: fewer than {c} entries accepted after {MAX_PASSES} passes")
        pool = accepted.nonzero().flatten()
        if self.replace:
            pick = pool[torch.randint(len(pool), (c,), generator=rng)]
        else:
            pick = pool[torch.randperm(len(pool), generator=rng)[:c]]
        out = torch.zeros_like(w)
        out[pick] = clipped[pick] + lap(len(pick), 2 * self.gamma * c / eps_r)
        pieces = dict(zip(vectors, out.split([update[v].numel() for v in vectors])))
        return update.map(lambda name, a: pieces[name].reshape(a.shape).to(a) if name in pieces else a.clone())
