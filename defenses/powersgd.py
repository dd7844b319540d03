"""Low-rank compression of the update: PowerSGD (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019)."""
from __future__ import annotations

import torch
from torch import Tensor

from gleak.contracts.plugin import Defense
from gleak.contracts.registry import register_defense
from gleak.contracts.wire import Update
from gleak.defenses._error_feedback import ErrorFeedback


def low_rank(m: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """One step of subspace (power) iteration (the paper's Algorithm 1): P = M Q, P orthonormalised, Q' = M^T P;
    returns (P Q'^T, Q'). M (n, k), Q (k, r). The orthonormal basis comes from a QR factorisation rather than the
    paper's Gram-Schmidt: both span the same columns, and P P^T M does not depend on which basis of them is used."""
    p = torch.linalg.qr(m @ q, mode="reduced").Q
    q_new = m.T @ p
    return p @ q_new.T, q_new


@register_defense("powersgd")
class PowerSGD(Defense):
    """Send a rank-`rank` approximation of each weight matrix of the update, found by one power-iteration step
    warm-started from the previous round's factor; vectors (biases, norm parameters) are sent as they are.

    Parameters
    ----------
    rank: the rank r of each approximation (default 2: the rank the paper's CIFAR-10 ResNet-18 runs match SGD's
        accuracy with; it reports ranks 1, 2 and 4). A tensor of shape (n, ...) is read as the matrix (n, k) of its
        rows (a convolution's kernels flattened, as the paper does); where r >= min(n, k) it is sent unchanged (the
        approximation would be exact).
    error_feedback: add what the approximation dropped to the next round's update before compressing it (the
        paper's Algorithm 2, default True). In a single observed FedSGD round nothing was dropped before.
    warm_start: start each round's power iteration from the previous round's Q (default True, the paper's);
        False draws a new Q every round.

    Q is first drawn i.i.d. standard normal from the client's generator, so a trial's result is a function of its
    seed. Deviation, named: data-parallel PowerSGD all-reduces P between the workers before orthonormalising it, so
    that every worker shares one factorisation; in federated learning each client compresses its own update (the
    server sees its P and Q, hence P Q^T), which is what this defense does.
    """

    stateful = True  # the defaults keep the residual and the factor Q across rounds

    def __init__(self, rank: int = 2, error_feedback: bool = True, warm_start: bool = True):
        if not 1 <= rank <= 4096:
            raise ValueError(f"rank must be in [1, 4096], got {rank}")
        self.rank, self.error_feedback, self.warm_start = rank, error_feedback, warm_start
        self._feedback = ErrorFeedback()
        self._q: dict[str, Tensor] = {}
        self.stateful = error_feedback or warm_start

    def reset(self) -> None:
        self._feedback.reset()
        self._q = {}

    def _one(self, name: str, a: Tensor, rng: torch.Generator) -> Tensor:
        if a.dim() < 2:
            return a.clone()
        m = a.reshape(a.shape[0], -1)
        n, k = m.shape
        if self.rank >= min(n, k):
            return a.clone()
        q = self._q.get(name) if self.warm_start else None
        if q is None or q.shape != (k, self.rank):  # a first round, or a layer the server reshaped
            q = torch.randn(k, self.rank, generator=rng, dtype=torch.float64).to(device=a.device, dtype=a.dtype)
        approx, q = low_rank(m, q)
        self._q[name] = q
        return approx.reshape(a.shape)

    def compress(self, update: Update, rng: torch.Generator) -> Update:
        return update.map(lambda name, a: self._one(name, a, rng))

    def transform(self, update: Update, rng: torch.Generator) -> Update:
        if self.error_feedback:
            return self._feedback.apply(update, lambda u: self.compress(u, rng))
        return self.compress(update, rng)
