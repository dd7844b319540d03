"""Dual Gradient Pruning (seed 001, "Revisiting Gradient Pruning: A Dual Realization for Defending against Gradient
Attacks", Algorithms 1 and 2)."""
from __future__ import annotations

import torch
from torch import Tensor

from gleak.defenses._error_feedback import ErrorFeedback
from gleak.plugin import Defense
from gleak.registry import register_defense
from gleak.threat import Update


def dgp_counts(n: int, k1: float, k2: float) -> tuple[int, int]:
    """How many entries of an n-entry layer DGP drops from the top and from the bottom: round(k1 n), round(k2 n)
    (Python's round, half to even, as Top-k here); the bottom count is capped so that the two never exceed n."""
    top = int(round(k1 * n))
    return top, min(int(round(k2 * n)), n - top)


def dgp_keep_mask(a: Tensor, k1: float, k2: float) -> Tensor:
    """True where DGP keeps an entry of `a`: sort |a| descending (stable, so ties go by position), drop the first
    round(k1 n) and the last round(k2 n). Exactly that many are dropped, whatever the values (ties, all zeros)."""
    n = a.numel()
    top, bottom = dgp_counts(n, k1, k2)
    order = torch.sort(a.detach().abs().reshape(-1), descending=True, stable=True).indices
    keep = torch.zeros(n, dtype=torch.bool, device=a.device)
    keep[order[top : n - bottom]] = True
    return keep.view_as(a)


@register_defense("dgp")
class DGP(Defense):
    """Dual gradient pruning: per layer, drop the largest k1 and the smallest k2 fractions of |grad| (seed 001).

    Algorithm 1 (per layer, every parameter tensor is a layer): sort |g| in descending order, remove the top-k1 set
    T_k1 and the bottom-k2 set B_k2, send the rest. Removing the largest entries pushes the sent gradient far from the
    true one (seed 001 Fig. 1: reconstruction error grows with ||g - g~|| / ||g||, which Top-k keeps small by
    construction); removing the smallest gives a high pruning ratio, which breaks the gradient structure an active
    attacker relies on (Robbing the Fed's imprint bins).
    Algorithm 2 (error feedback, Karimireddy et al. 2019): p_t = g_t + e_t, send DGP(p_t), e_{t+1} = p_t - DGP(p_t);
    the residual is kept per client across rounds (reset between trials). It only differs from plain DGP in cases
    with warm-up rounds (case key `rounds`).

    Parameters
    ----------
    k1: fraction of each layer's entries dropped from the top (largest |g|). Default 0.05 (seed 001).
    k2: fraction dropped from the bottom (smallest |g|). Default 0.75 (seed 001), so 80% of every layer is pruned.
        p = k1 / k2 is the paper's privacy/accuracy knob.
    error_feedback: Algorithm 2 (default True, as the paper). False is plain Algorithm 1 in every round.
    Counts: exactly round(k1 n) + round(k2 n) entries of an n-entry layer are dropped, ties broken by position; where
    the two rounded counts would exceed n the bottom count is capped (only possible with k1 + k2 close to 1).
    """

    stateful = True

    def __init__(self, k1: float = 0.05, k2: float = 0.75, error_feedback: bool = True):
        if not (0.0 <= k1 <= 1.0 and 0.0 <= k2 <= 1.0):
            raise ValueError(f"k1 and k2 must be in [0, 1], got k1={k1}, k2={k2}")
        if k1 + k2 > 1.0:
            raise ValueError(f"k1 + k2 must be <= 1 (the fraction pruned), got {k1 + k2}")
        self.k1, self.k2, self.error_feedback = k1, k2, error_feedback
        self._feedback = ErrorFeedback()

    def reset(self) -> None:
        self._feedback.reset()

    def prune(self, update: Update) -> Update:
        return update.map(lambda _, a: a * dgp_keep_mask(a, self.k1, self.k2))

    def transform(self, update: Update, rng: torch.Generator) -> Update:
        return self._feedback.apply(update, self.prune) if self.error_feedback else self.prune(update)
