"""Secure aggregation (Bonawitz et al., CCS 2017, "Practical Secure Aggregation for Privacy-Preserving Machine
Learning"), modelled by what it lets the observer see."""
from __future__ import annotations

import torch

from gleak.plugin import Defense
from gleak.registry import register_defense
from gleak.threat import Update


@register_defense("secure-aggregation")
class SecureAggregation(Defense):
    """The observer sees only the sum of all clients' updates at the shared parameters (Bonawitz et al. 2017).

    A protocol defense: clients send their updates unchanged, and the server (or an eavesdropper) learns their sum
    and nothing else. No cryptography runs here: for the benchmark only the view matters, and a correct
    secure-aggregation protocol reveals exactly the sum, so the sum is computed in the clear. Set the number of
    clients with the case key `clients` (the victim is client 0; the others draw their own batches). With one client
    the sum is the victim's own update.
    Seed 000 Theorem 2: with a shared global model the sum is still the gradient of the union of the clients'
    batches, so attacks that handle large batches (imprint with enough bins) still recover samples through it.
    """

    def observe(self, updates: list[Update], rng: torch.Generator) -> Update:
        return Update.sum(updates)
