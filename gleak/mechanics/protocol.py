"""The round: the Protocol plugin kind, the one round loop (`run_rounds`), and how a client computes its update.

A Protocol owns everything between the clients and the observer: which model each client computes at
(`client_models`), what a client computes (`client_update`: FedSGD's gradient, FedAvg's local steps), what the
observer sees of a round (`observe`) and which model it holds (`observer_model`), what the server does between
rounds (`server_step`) and the training loop used for utility (`train_utility`). A Defense is the client side only:
its `client_gradient` computes every gradient a client takes and its `transform` edits what the client sends.
Built-ins live in protocols/ (installed as gleak.protocols): fedsgd (default), fedavg, secure-aggregation, cgd.

`run_rounds` is the only round loop: warm-up rounds, the observed rounds of an attack trial and utility training
all go through it, so a protocol's attack path and its training path cannot drift apart.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from gleak.contracts.errors import NonFiniteUpdate

# loss_fn, trainable and batch_gradient live with the Defense base class (its default client gradient) and are
# gleak.mechanics.protocol's public names as well: attacks, defenses and tests import them from here.
from gleak.contracts.plugin import Defense, Plugin, batch_gradient, loss_fn, trainable  # noqa: F401
from gleak.contracts.wire import ClientBatch, Update
from gleak.mechanics.accountant import PrivacyAccountant
from gleak.mechanics.defense_output import check_sent, unmodified


def _gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, defense: Defense | None, rng: torch.Generator | None):
    if defense is None:
        return batch_gradient(model, x, y)
    if rng is None:
        raise ValueError("a defense's client_gradient needs the client's generator")
    return defense.client_gradient(model, x, y, rng)


def fedsgd_update(model: nn.Module, batch: ClientBatch, defense: Defense | None = None, rng: torch.Generator | None = None) -> Update:
    """The client's gradient on its batch (the defense's `client_gradient`, plain mean-loss gradient by default)."""
    return Update(_gradient(model, batch.x, batch.y, defense, rng), "gradient", batch.size)


def check_local_steps(local_steps: int | None, local_lr: float, local_batch_size: int | None) -> None:
    """Validate FedAvg's local-training settings (ValueError naming the parameter); local_steps None: FedSGD."""
    if local_steps is not None and local_steps < 1:
        raise ValueError(f"local_steps must be >= 1, got {local_steps}")
    if not local_lr > 0:
        raise ValueError(f"local_lr must be > 0, got {local_lr}")
    if local_batch_size is not None and local_batch_size < 1:
        raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")


def fedavg_update(
    model: nn.Module, batch: ClientBatch, lr: float, local_steps: int, local_batch_size: int | None = None,
    defense: Defense | None = None, rng: torch.Generator | None = None,
) -> Update:  # fmt: skip
    """`local_steps` of plain SGD on the batch (in order, mini-batches of local_batch_size); send w_before - w_after.
    Each step's gradient comes from the defense's `client_gradient` (plain by default)."""
    local = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in trainable(local)}
    bs = local_batch_size or batch.size
    for step in range(local_steps):
        lo = (step * bs) % batch.size
        xb, yb = batch.x[lo : lo + bs], batch.y[lo : lo + bs]
        grads = _gradient(local, xb, yb, defense, rng)
        with torch.no_grad():
            for n, p in trainable(local):
                p.add_(grads[n], alpha=-lr)  # torch.optim.SGD's step without momentum, bit for bit
    delta = {n: before[n] - p.detach() for n, p in trainable(local)}
    return Update(delta, "delta", batch.size, {"lr": lr, "local_steps": local_steps, "local_batch_size": bs})


def check_finite(update: Update, who: str) -> None:
    ok, name = update.is_finite()
    if not ok:
        raise NonFiniteUpdate(f"{who}: update has NaN or infinity in parameter {name!r}")


def transmit(defenses: list[Defense], updates: list[Update], rng: torch.Generator, where: str = "") -> list[Update]:
    """Client i sends `defenses[i].transform(updates[i])` (one defense instance per client, since a defense may keep
    state across rounds). Returns what the clients sent, in client order. `where` prefixes the errors (a round)."""
    name = defenses[0].registered_name or type(defenses[0]).__name__
    sent = []
    for i, (d, u) in enumerate(zip(defenses, updates)):
        check_finite(u, f"{where}client {i}")
        s = d.transform(u, rng)
        check_sent(u, s, f"{where}defense {name!r} on client {i}")
        check_finite(s, f"{where}defense {name!r} on client {i}")
        sent.append(s)
    return sent


def server_step(model: nn.Module, sent: list[Update], lr: float) -> nn.Module:
    """The next global model (a new module): the server applies the mean of the clients' sent updates,
    w - lr * mean gradient (FedSGD) or w - mean delta (FedAvg: the delta already holds the local learning rate).
    Under secure aggregation the server learns only the sum, which is all this needs."""
    mean = Update.sum(sent).map(lambda _, t: t / len(sent))
    step = lr if mean.kind == "gradient" else 1.0
    new = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in trainable(new):
            p -= step * mean[n].to(p.dtype)
    return new


def shifted(model: nn.Module, displacement: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of `model` with each named trainable parameter moved by `displacement[name]` (absent names stay)."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in trainable(new):
            if n in displacement:
                p += displacement[n].to(p.dtype).to(p.device)
    return new


def shift_each(models: list[nn.Module], displacement: dict[str, torch.Tensor]) -> list[nn.Module]:
    """`shifted` of each model, a model shared by several clients moved once (and still shared)."""
    moved: dict[int, nn.Module] = {}
    for m in models:
        if id(m) not in moved:
            moved[id(m)] = shifted(m, displacement)
    return [moved[id(m)] for m in models]


# ---- the Protocol plugin kind ---------------------------------------------------------------------------------
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
        the mean of what was sent at step `lr` (gleak.mechanics.protocol.server_step) and every client gets the result."""
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
    protocol: Protocol, defenses: list[Defense], models: list[nn.Module], rounds: int, schedule: Schedule, lr: float,
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


# ---- utility training: the default `train_utility` -----------------------------------------------------------
CURVE_POINTS = 10  # test accuracy is also recorded at this many evenly spaced rounds (the learning curve in `extra`)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 4096) -> float:
    was = model.training
    model.eval()
    right = sum(int((model(x[i : i + chunk]).argmax(1) == y[i : i + chunk]).sum()) for i in range(0, len(y), chunk))
    model.train(was)
    return right / int((y != -100).sum())  # a classifier's labels; a language model's positions with a next token


def federated_training(
    cfg: Any, protocol: Protocol, defense: tuple[str, dict[str, Any]], train: Any, test: Any,
    on_round: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Train under `protocol` with `defense` (name, params) on every client's update for cfg.training_rounds rounds through
    run_rounds; {"accuracy", "curve"}. The loop of a utility run (gleak.orchestration.utility), described there."""
    from gleak.contracts.config import derive_seed, generator
    from gleak.contracts.registry import create
    from gleak.mechanics import device as devices
    from gleak.mechanics.data import client_shards
    from gleak.mechanics.models import create_model

    dtype = torch.float32
    model = create_model(cfg.model, train.input_shape, train.num_classes, seed=derive_seed(cfg.seed, "utility-model"),
                         dtype=dtype, **cfg.model_params)  # fmt: skip
    defenses: list[Defense] = [create("defense", defense[0], **defense[1]) for _ in range(cfg.clients)]
    for d in defenses:
        d.reset()
        d.bind_accountant(PrivacyAccountant())  # this client's own, stepped by its noisy steps
        d.bind_data(train.mean, train.std)
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


# ---- which protocol a trial runs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """The round protocol of a trial and the client defense composed with it (names and full parameters)."""

    protocol: str
    protocol_params: dict[str, Any]
    defense: str
    defense_params: dict[str, Any]


def trial_setup(case: Any, defense: str, defense_params: dict[str, Any]) -> Setup:
    """The protocol and client defense of a trial (a gleak.contracts.config.CaseConfig and its [[defense]] entry).

    In order: a protocol named as a defense ([[defense]] name = "cgd", the historical spelling) runs that protocol
    with the "none" transform; else the case's `protocol` with its `protocol_params`; else the legacy case key
    `update = "fedavg"` (with local_steps, local_lr) selects fedavg; else fedsgd. The trial's id is unaffected:
    it hashes the suite's spelling."""
    from gleak.contracts import registry
    from gleak.contracts.errors import InputError, UnsupportedCase

    info = registry.plugin_info("defense", defense)
    legacy_fedavg = {"local_steps": case.local_steps, "local_lr": case.local_lr}
    if info.protocol is not None:
        if case.protocol != "fedsgd" or case.protocol_params:
            raise InputError(f"defense {defense!r} is the protocol {info.protocol!r}: do not also set the case's protocol")
        params = dict(defense_params)
        if case.update == "fedavg":  # the legacy client computation, where the protocol has one
            if "local_steps" not in registry.plugin_info("protocol", info.protocol).params:
                raise UnsupportedCase(f"protocol {info.protocol!r}: participants send gradients (case update = 'fedsgd')")
            params.update(legacy_fedavg)
        return Setup(info.protocol, registry.check_params("protocol", info.protocol, params), "none", {})
    if case.protocol != "fedsgd" or case.protocol_params:
        params = registry.check_params("protocol", case.protocol, dict(case.protocol_params))
        return Setup(registry.resolve_name("protocol", case.protocol), params, defense, defense_params)
    if case.update == "fedavg":
        return Setup("fedavg", registry.check_params("protocol", "fedavg", legacy_fedavg), defense, defense_params)
    return Setup("fedsgd", {}, defense, defense_params)
