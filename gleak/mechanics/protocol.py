"""The Protocol plugin kind: the round between clients and observer.

A Protocol owns everything between the clients and the observer: which model each client computes at
(`client_models`), what a client computes (`client_update`: FedSGD's gradient, FedAvg's local steps), what the
observer sees of a round (`observe`) and which model it holds (`observer_model`), what the server does between
rounds (`server_step`) and the training loop used for utility (`train_utility`). A Defense is the client side only:
its `client_gradient` computes every gradient a client takes and its `transform` edits what the client sends.
Built-ins live in protocols/ (installed as gleak.protocols): fedsgd (default), fedavg, secure-aggregation, cgd.

The round loop is gleak.mechanics.rounds (`run_rounds`, and `federated_training` for utility); what a client computes
and the server's step are gleak.mechanics.client_update; which protocol a trial runs is
gleak.mechanics.protocol_setup.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from gleak.contracts.plugin import Defense, Plugin
from gleak.contracts.wire import ClientBatch, Update
from gleak.mechanics.client_update import fedsgd_update, server_step, shift_each
from gleak.mechanics.rounds import federated_training


class Protocol(Plugin):
    """The round between clients and observer (base class: FedSGD at one shared model, the server seeing each
    client's update).

    shared_model: True when every client computes at the model the server sends (so an active attack's prepared
        model reaches the client). Protocols with private per-client models (CGD) set False, and an active attack
        through them is refused rather than silently disarmed.
    per_client_models: True when the server may send each client a model of its own (an active attack's
        `prepare_clients`, model inconsistency); False where it cannot, `models_held` then saying why in one line
        (CGD: each participant draws and steps its own confined model). An attack that needs it is refused there.
    observed_rounds(): how many rounds of an attack trial the observer sees (the last is attacked, the earlier
        ones reach the attack as Observation.rounds).
    observes_sum: True where the observer sees only a sum over clients (secure aggregation, CGD), never one client's
        own update: what it exposes is the sum, so no per-client knowledge (the victim's labels) is granted through it.
    observed_clients(clients): how many clients' samples the observed update carries, the victim's first: the
        reconstruction is paired one-to-one with all of them, and an attack may return at most that many samples.
    forged_step(models, displacement): the clients' models after one round whose aggregate the adversary forged
        (an attack declaring "forged_aggregate"); UnsupportedCase where the protocol has no such round.
    A protocol instance serves one run (one trial, or one utility run); `reset` starts a new one. Randomness comes
    only from the generators passed in.
    """

    plugin_kind: ClassVar[str] = "protocol"
    shared_model: ClassVar[bool] = True
    per_client_models: ClassVar[bool] = True
    models_held: ClassVar[str] = ""
    observes_sum: ClassVar[bool] = False

    def observed_rounds(self) -> int:
        return 1

    def observed_clients(self, clients: int) -> int:
        """The leading clients whose samples the observed update carries: all of them in a sum, else the victim."""
        return clients if self.observes_sum else 1

    def reset(self) -> None:
        """Forget the state of a previous run (called before `client_models`)."""

    def client_models(self, model: nn.Module, clients: int, rng: torch.Generator) -> list[nn.Module]:
        """The model each client computes at (the victim first), given the model the server built. Default: the
        shared model for all."""
        return [model] * clients

    def client_update(self, model: nn.Module, batch: ClientBatch, defense: Defense, rng: torch.Generator) -> Update:
        """What one client computes at `model` on its batch; every gradient through `defense.client_gradient`.
        Default: FedSGD, the gradient of the mean loss."""
        return fedsgd_update(model, batch, defense, rng)

    def observe(self, sent: list[Update], rng: torch.Generator) -> Update:
        """What the observer sees of one round, given what each client sent (the victim first). Default: the
        victim's own update (a server that sees every client's update)."""
        return sent[0]

    def observer_model(self, model: nn.Module, client_models: list[nn.Module]) -> nn.Module:
        """The model the observer holds (its best knowledge of the parameters the victim's update was computed
        at), given the model the server sent and the clients' models. Default: the shared model."""
        return model

    def server_step(self, models: list[nn.Module], sent: list[Update], lr: float, rng: torch.Generator) -> list[nn.Module]:
        """The clients' models for the next round (new modules; `models` untouched). Default: the server applies
        the mean of what was sent at step `lr` (gleak.mechanics.client_update.server_step) and every client gets the result."""
        new = server_step(models[0], sent, lr)
        return [new] * len(models)

    def forged_step(self, models: list[nn.Module], displacement: dict[str, torch.Tensor]) -> list[nn.Module]:
        """The clients' models after a round whose aggregate the adversary forged so that every model moves by
        `displacement` (new modules; `models` untouched). Default: the server steps the one model it sends with the
        forged aggregate, so every client gets the shared model moved by it (what an active server could send
        anyway)."""
        return shift_each(models, displacement)

    def utility_lr(self, config: Any) -> float:
        """The server step of a utility run (a gleak.contracts.config.UtilityConfig). Default: its server_lr."""
        return config.server_step

    def train_utility(
        self, config: Any, train: Any, test: Any, rng: torch.Generator,
        defense: tuple[str, dict[str, Any]] = ("none", {}), on_round: Callable[[], None] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Train under this protocol with `defense` (name, params) on every client, given a UtilityConfig and the
        train/test ImageDatasets; return at least {"accuracy": float}. Default: federated training through
        `run_rounds` (`federated_training`)."""
        return federated_training(config, self, defense, train, test, on_round)
