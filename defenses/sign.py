"""Gradient sign compression: signSGD (Bernstein, Wang, Azizzadenesheli, Anandkumar, "signSGD: Compressed Optimisation
for Non-Convex Problems", ICML 2018), with the scaled sign and error feedback of Karimireddy, Rebjock, Stich, Jaggi,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019."""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gleak.contracts.plugin import Defense, check_choice
from gleak.contracts.registry import register_defense
from gleak.contracts.wire import Update
from gleak.defenses._error_feedback import ErrorFeedback

SCALES = ("none", "mean")


def sign_of(a: Tensor, scale: str) -> Tensor:
    """sign(a) (zero where a is zero), times mean|a| over the tensor where `scale` is "mean"."""
    s = torch.sign(a)
    return s if scale == "none" else s * a.abs().mean()


@register_defense("sign")
class Sign(Defense):
    """Send the sign of every entry of the update: one bit per coordinate.

    Parameters
    ----------
    scale: "none" (default): the signs themselves, +1 / -1 (0 where the gradient is exactly zero), as signSGD sends
        them (Bernstein et al. 2018); the step size is then the server's learning rate alone, so a [utility] run
        needs a server_lr of the order of the gradient's entries (signSGD's own rates are 1e-4 to 1e-3). "mean":
        the scaled sign of Karimireddy et al. (2019), sign(g) * ||g||_1 / d per tensor, whose step has the
        gradient's own size; the attacker sees the same sign pattern and one number more per tensor.
    error_feedback: add what the compression dropped to the next round's update before taking its sign (EF-signSGD,
        Karimireddy et al. 2019, Algorithm 1). Default False (signSGD has none); matters only with warm-up rounds.

    Deviation, named: signSGD with majority vote (Bernstein et al., Algorithm 3) has the server send back the sign of
    the sum of the workers' signs; gleak's server steps by the sum it aggregates (the protocol's), so only the
    client side (what a client sends, what an observer of one client sees) is signSGD's. Wu, Chen, Guo, Weinberger
    (UAI 2023, "Learning To Invert") report that a learned inversion model breaks gradient sign, where optimisation
    attacks matching the gradient's values fail.
    """

    def __init__(self, scale: Literal["none", "mean"] = "none", error_feedback: bool = False):
        check_choice("scale", scale, SCALES)
        self.scale, self.error_feedback = scale, error_feedback
        self._feedback = ErrorFeedback()
        self.stateful = error_feedback

    def reset(self) -> None:
        self._feedback.reset()

    def compress(self, update: Update) -> Update:
        return update.map(lambda _, a: sign_of(a, self.scale))

    def transform(self, update: Update, rng: torch.Generator) -> Update:
        return self._feedback.apply(update, self.compress) if self.error_feedback else self.compress(update)
