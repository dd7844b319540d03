"""Secure aggregation (Bonawitz et al., CCS 2017, "Practical Secure Aggregation for Privacy-Preserving Machine
Learning"), modelled by what it lets the observer see."""
from __future__ import annotations

import torch
from torch import nn

from gleak.contracts.plugin import Defense
from gleak.contracts.registry import register_protocol
from gleak.contracts.wire import ClientBatch, Update
from gleak.mechanics.client_update import check_local_steps, fedavg_update, fedsgd_update
from gleak.mechanics.protocol import Protocol


# Its defense spelling had no parameters: FedAvg's settings stay out of those trials' ids.
@register_protocol("secure-aggregation", as_defense=True, defense_params=())
class SecureAggregation(Protocol):
    """The observer sees only the sum of all clients' updates at the shared parameters (Bonawitz et al. 2017).

    Clients compute FedSGD gradients at the shared model and send them (after their defense's transform); the server
    (or an eavesdropper) learns their sum and nothing else, with the number of samples behind it (gated: only an
    attack granted "batch_size" reads it). No cryptography runs here: for the benchmark only the view matters, and a
    correct secure-aggregation protocol reveals exactly the sum, so the sum is computed in the clear. Set the number
    of clients with the case key `clients` (the victim is client 0; the others draw their own batches). With one
    client the sum is the victim's own update. The server steps with the mean, which the sum gives.
    Seed 000 Theorem 2: with a shared global model the sum is still the gradient of the union of the clients'
    batches, so attacks that handle large batches (imprint with enough bins) still recover samples through it.
    local_steps: None (default): clients send FedSGD gradients; a number: FedAvg's local steps at local_lr on
        mini-batches of local_batch_size (None: the whole batch), and the sum is of their deltas (a legacy case with
        `update = "fedavg"`, or a [utility] run with algorithm = "fedavg", sets them).
    Also accepted as a defense (`[[defense]] name = "secure-aggregation"`), its historical spelling.
    """

    observes_sum = True

    def __init__(self, local_steps: int | None = None, local_lr: float = 0.1, local_batch_size: int | None = None):
        check_local_steps(local_steps, local_lr, local_batch_size)
        self.local_steps, self.local_lr, self.local_batch_size = local_steps, local_lr, local_batch_size

    def client_update(self, model: nn.Module, batch: ClientBatch, defense: Defense, rng: torch.Generator) -> Update:
        if self.local_steps is None:
            return fedsgd_update(model, batch, defense, rng)
        return fedavg_update(model, batch, self.local_lr, self.local_steps, self.local_batch_size, defense, rng)

    def utility_lr(self, config) -> float:
        return config.server_step if self.local_steps is None else 1.0

    def observe(self, sent: list[Update], rng: torch.Generator) -> Update:
        return Update.sum(sent)
