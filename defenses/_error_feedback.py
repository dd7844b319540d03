"""Error feedback (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"; Xue et al. (AAAI 2024) Algorithm 2): a client keeps
what its compressor dropped and adds it to the next update.

    p_t = g_t + e_t,    send C(p_t),    e_{t+1} = p_t - C(p_t)

so that, over any number of rounds, sum_t C(p_t) + e_T = sum_t g_t (nothing is lost, only delayed). Shared by the
pruning defenses (topk, dgp); not a plugin itself (the leading underscore keeps it out of discovery).
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor

from gleak.contracts.wire import Update


class ErrorFeedback:
    """The residual of one client, kept per parameter name across rounds.

    A parameter the client has not sent before starts from a zero residual (an active server may change the model's
    layout between rounds); the residuals of parameters absent from an update are kept untouched.
    """

    def __init__(self) -> None:
        self.residual: dict[str, Tensor] = {}

    def reset(self) -> None:
        self.residual = {}

    def apply(self, update: Update, compress: Callable[[Update], Update]) -> Update:
        """Send `compress(update + residual)` and keep what it dropped. `update` is not modified."""
        corrected = update.map(lambda k, g: g + self.residual[k] if k in self.residual else g.clone())
        sent = compress(corrected)
        for k in corrected.names():
            self.residual[k] = corrected[k] - sent[k]
        return sent
