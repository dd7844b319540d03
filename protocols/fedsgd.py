"""Federated SGD (McMahan et al., AISTATS 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data", the FedSGD baseline), the default protocol."""
from __future__ import annotations

from gleak.contracts.registry import register_protocol
from gleak.mechanics.protocol import Protocol


@register_protocol("fedsgd")
class FedSGD(Protocol):
    """Federated SGD (McMahan et al. 2017): every client sends its gradient at the shared model; the server sees each.

    Each round every client computes the gradient of its mean cross-entropy loss on its batch at the model the server
    sent, and the server applies w -= lr * mean of what was sent (lr: the case's server step in warm-up rounds, the
    [utility] lr in training). The observer is the server: it sees the victim's own update and holds the model.
    No parameters; this is the protocol every case runs unless it names another.
    """
