"""The one round loop (`run_rounds`) and its use for utility: warm-up rounds, the observed rounds of an attack trial
and utility training (`federated_training`) all go through it, so a protocol's attack path and its training path
cannot drift apart.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from gleak.contracts.plugin import Defense
from gleak.contracts.wire import ClientBatch, Update
from gleak.mechanics.client_update import client_defense, transmit
from gleak.mechanics.defense_output import unmodified

# The loop is handed a gleak.mechanics.protocol.Protocol and only calls its methods: typed Any here, since the
# Protocol's default utility training (`federated_training`) lives in this module and the protocol imports it.
AnyProtocol = Any


@dataclass
class Round:
    """One round: the models the clients computed at, their updates before and after their defenses' transforms
    (`sent`: what crossed the wire), the observer's view (None when the loop does not observe) and the model the
    observer holds (ungated: gleak.mechanics.gate decides what an attack may see of it)."""

    at: list[nn.Module]
    updates: list[Update]
    sent: list[Update]
    view: Update | None
    held: nn.Module | None


@dataclass
class Schedule:
    """Where round r of a run gets its inputs: the clients' batches, the clients' generators and the generator of
    the round's wire (the defenses' transforms, the protocol's view and server step)."""

    batches: Callable[[int], list[ClientBatch]]
    client_rngs: Callable[[int], list[torch.Generator]]
    wire_rng: Callable[[int], torch.Generator]


def _client_copy(model: nn.Module) -> nn.Module:
    """The model a client computes at. A client gets the server's model and computes on its own copy: a train-mode
    forward moves BatchNorm's running statistics, and those are the client's own (FedSGD sends gradients only), so
    they must not reach the server's model, the next client or the observer (whose copy would otherwise hold a
    share of the victim batch's statistics, which GradInversion's BN prior reads). Models without buffers are
    used as they are (parameters are never modified in place by a client)."""
    return copy.deepcopy(model) if any(True for _ in model.buffers()) else model


def run_rounds(
    protocol: AnyProtocol, defenses: list[Defense], models: list[nn.Module], rounds: int, schedule: Schedule, lr: float,
    *, observe: bool = True, step_last: bool = True, on_round: Callable[[int, list[nn.Module]], None] | None = None,
) -> tuple[list[nn.Module], list[Round]]:  # fmt: skip
    """The round loop. Each round r: client i computes `protocol.client_update` at models[i] on its batch, sends
    `defenses[i].transform` of it, the observer sees `protocol.observe` of what was sent (when `observe`), and the
    server steps the models (`protocol.server_step`; after the last round only with `step_last`).
    Returns the clients' models after the loop and what each round put on the wire (no rounds without `observe`). `on_round(r, models)` is
    called after each round's step (utility curves, progress)."""
    seen = []
    for r in range(rounds):
        batches, crngs, wire = schedule.batches(r), schedule.client_rngs(r), schedule.wire_rng(r)
        updates = [protocol.client_update(_client_copy(m), b, d, g) for m, b, d, g in zip(models, batches, defenses, crngs)]
        # A defense that edits its input in place would make the plain update look defended: caught here.
        sent = unmodified(transmit, defenses, updates, wire, f"round {r + 1}: " if rounds > 1 else "")
        view = held = None
        if observe:
            view = protocol.observe(sent, wire)
            held = protocol.observer_model(models[0], models)
        if observe:  # a utility run observes nothing: keeping its rounds would hold every model and update it made
            seen.append(Round(list(models), updates, sent, view, held))
        if r < rounds - 1 or step_last:
            models = protocol.server_step(models, sent, lr, wire)
        if on_round is not None:
            on_round(r, models)
    return models, seen


# Utility training: the default `Protocol.train_utility`.
CURVE_POINTS = 10  # test accuracy is also recorded at this many evenly spaced rounds (the learning curve in `extra`)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 4096) -> float:
    was = model.training
    model.eval()
    right = sum(int((model(x[i : i + chunk]).argmax(1) == y[i : i + chunk]).sum()) for i in range(0, len(y), chunk))
    model.train(was)
    return right / int((y != -100).sum())  # a classifier's labels; a language model's positions with a next token


def federated_training(
    cfg: Any, protocol: AnyProtocol, defense: tuple[str, dict[str, Any]], train: Any, test: Any,
    on_round: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Train under `protocol` with `defense` (name, params) on every client's update for cfg.training_rounds rounds through
    run_rounds; {"accuracy", "curve"}. The loop of a utility run (gleak.orchestration.utility), described there."""
    from gleak.contracts.seeds import derive_seed, generator
    from gleak.mechanics import device as devices
    from gleak.mechanics.data import client_shards
    from gleak.mechanics.models import create_model

    dtype = torch.float32
    model = create_model(cfg.model, train.input_shape, train.num_classes, seed=derive_seed(cfg.seed, "utility-model"),
                         dtype=dtype, **cfg.model_params)  # fmt: skip
    defenses: list[Defense] = [client_defense(defense[0], defense[1], train.mean, train.std, train.num_classes)
                               for _ in range(cfg.clients)]  # fmt: skip
    model = devices.to_device(defenses[0].wrap_model(model, generator(cfg.seed, "utility-defense-model")))  # PRECODE's
    # The data travels to the run's device once (gleak.mechanics.device.use; loaded on the CPU); the clients' index draws stay
    # on the CPU, which indexes either device's tensors.
    x, y = devices.to_device(train.model_input(None, dtype)), devices.to_device(train.y)  # token ids stay ids
    xt, yt = devices.to_device(test.model_input(None, dtype)), devices.to_device(test.y)
    parts = client_shards(train.y, cfg.clients, generator(cfg.seed, "utility-shards"), cfg.dirichlet_alpha, cfg.batch_size * cfg.local_steps)
    data_rng = generator(cfg.seed, "utility-data")  # the same stream for every defense: paired comparison
    defense_rng = generator(cfg.seed, "utility-defense")
    client_rngs = [generator(cfg.seed, f"utility-client/{i}") for i in range(cfg.clients)]
    per_round = cfg.batch_size * (cfg.local_steps if cfg.algorithm == "fedavg" else 1)
    marks = {math.ceil(cfg.training_rounds * k / CURVE_POINTS) for k in range(1, CURVE_POINTS + 1)}
    curve: list[list[float]] = []

    def batches(r: int) -> list[ClientBatch]:
        out = []
        for part in parts:
            idx = part[torch.randperm(len(part), generator=data_rng)[:per_round]]
            out.append(ClientBatch(x[idx], y[idx], train.mean, train.std))
        return out

    def after(r: int, models: list[torch.nn.Module]) -> None:
        if r + 1 in marks:
            curve.append([r + 1, accuracy(models[0], xt, yt)])
        if on_round is not None:
            on_round()

    protocol.reset()
    models = protocol.client_models(model, cfg.clients, generator(cfg.seed, "utility-client-models"))
    schedule = Schedule(batches, lambda r: client_rngs, lambda r: defense_rng)
    run_rounds(protocol, defenses, models, cfg.training_rounds, schedule, protocol.utility_lr(cfg), observe=False, on_round=after)
    return {"accuracy": curve[-1][1], "curve": curve}
