"""Federated averaging (McMahan et al., AISTATS 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data")."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gleak.contracts.plugin import Defense
from gleak.contracts.registry import register_protocol
from gleak.contracts.wire import ClientBatch, Update
from gleak.mechanics.client_update import check_local_steps, fedavg_update
from gleak.mechanics.protocol import Protocol


@register_protocol("fedavg")
class FedAvg(Protocol):
    """Federated averaging (McMahan et al. 2017): each client takes local SGD steps and sends w_before - w_after.

    local_steps: SGD steps per round on the client's batch, in order, on mini-batches of local_batch_size (None: the
        whole batch each step).
    local_lr: the clients' local step size.
    shuffle: each client draws a fresh random order of its batch every epoch (from its own generator; the attacker
        never learns it), as Dimitrov et al.'s FedAvg clients do (TMLR 2022, attacks/fedavg_leakage.py). Default
        False (in order); left out of trial ids while False (`identity_params`), so earlier ids stay valid.
    The server applies the mean of the sent deltas (server step 1, as FedAvg's weighted average with equal
    shards). The wire carries lr, local_steps and local_batch_size in the update's meta; the observation gate
    passes lr and local_steps (public protocol settings) and local_batch_size only to attacks granted "batch_size".
    A case's legacy keys `update = "fedavg"`, `local_steps`, `local_lr` select this protocol.
    """

    conformance_params = {"local_steps": 2}

    def __init__(self, local_steps: int = 1, local_lr: float = 0.1, local_batch_size: int | None = None, shuffle: bool = False):
        check_local_steps(local_steps, local_lr, local_batch_size)
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be true or false, got {shuffle!r}")
        self.local_steps, self.local_lr, self.local_batch_size = local_steps, local_lr, local_batch_size
        self.shuffle = shuffle

    @classmethod
    def identity_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The stored parameters: `shuffle` only where it is True (added after the first release)."""
        return {k: v for k, v in params.items() if k != "shuffle" or v}

    def client_update(self, model: nn.Module, batch: ClientBatch, defense: Defense, rng: torch.Generator) -> Update:
        return fedavg_update(model, batch, self.local_lr, self.local_steps, self.local_batch_size, defense, rng,
                             self.shuffle)  # fmt: skip

    def utility_lr(self, config: Any) -> float:
        return 1.0  # the server applies the mean delta as it is (the delta holds the local step size)
