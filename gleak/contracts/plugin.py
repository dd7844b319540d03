"""Base classes of the attack and defense plugin kinds (the third kind, Protocol, is in gleak.mechanics.protocol), and the
client's loss and gradient that a Defense computes by default (`loss_fn`, `batch_gradient`; gleak.mechanics.protocol uses the
same functions for every client update).

Parameters are stored as given (scikit-learn style) and validated in ``__init__`` by the plugin itself, so that
a suite is checked completely before any trial runs. All randomness comes from the generator passed in.
"""
from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from gleak.contracts.wire import Knowledge, Observation, Reconstruction, Update


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy averaged over the batch: the loss every attack here assumes the client minimises."""
    return F.cross_entropy(logits, y)


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def batch_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient of the mean loss over (x, y), one tensor per trainable parameter (model untouched)."""
    params = trainable(model)
    loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, [p for _, p in params])
    return {n: g.detach() for (n, _), g in zip(params, grads)}


def check_choice(name: str, value: Any, choices: Any) -> None:
    """Raise ValueError("NAME must be 'a', 'b' or 'c', got VALUE") unless `value` is one of `choices`. The registry
    checks Literal parameters before construction; this keeps a plugin built directly (Plugin(...)) as strict."""
    choices = tuple(choices)
    if value not in choices:
        names = [repr(c) for c in choices]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise ValueError(f"{name} must be {listed}, got {value!r}")


class Plugin:
    """Shared behaviour: `get_params`, a readable repr, and the registered name."""

    registered_name: ClassVar[str] = ""
    plugin_kind: ClassVar[str] = ""  # "attack", "defense" or "protocol": set by each kind's base class
    # Parameters that keep `gleak check-plugin` fast (for example fewer iterations); merged over the defaults.
    conformance_params: ClassVar[dict[str, Any]] = {}

    @classmethod
    def estimated_cost(cls, params: dict[str, Any], case: Any) -> float:
        """This plugin's work in one trial, in units of one forward-backward pass of the case's model on the
        client's batch (a gleak.contracts.config.CaseConfig). Only used to start long trials first and for the time-left
        estimate, so a rough figure is fine. Default: 1 x `iterations` x `restarts` where the plugin has them
        (an optimisation attack's cost); override when the work scales differently."""
        cost = 1.0
        for key in ("iterations", "restarts"):
            v = params.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                cost *= v
        return cost

    def get_params(self) -> dict[str, Any]:
        sig = inspect.signature(type(self).__init__)
        return {
            name: getattr(self, name)
            for name, p in sig.parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and hasattr(self, name)
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"


class Attack(Plugin):
    """An observer that reconstructs private data from what crosses the wire.

    needs: the knowledge the attack requires (keys of gleak.contracts.wire.KNOWLEDGE). The observation it receives holds
    exactly these and nothing more.
    active: True when the attack modifies the model before the client computes its update (`prepare`).
    """

    plugin_kind: ClassVar[str] = "attack"
    needs: ClassVar[frozenset[str]] = frozenset({"architecture", "parameters"})
    active: ClassVar[bool] = False

    def prepare(self, model: nn.Module, knowledge: Knowledge, rng: torch.Generator) -> nn.Module:
        """Active attacks return the model the server sends to the client (a new module). Passive: unchanged."""
        return model

    def prepare_clients(
        self, prepared: nn.Module, clients: int, knowledge: Knowledge, rng: torch.Generator
    ) -> list[nn.Module]:  # fmt: skip
        """The model each client computes at, the victim (client 0) first, given the model `prepare` returned. With
        `prepare`, the only place an attack may shape the clients' models: neither may edit a module it was handed,
        and nothing later may edit what they returned (`gleak check-plugin` checks both). An attack that sends
        clients different models declares "per_client_models" in `needs`; the trial refuses it where the protocol
        does not let the server choose each client's model (gleak.mechanics.gate). Default: `prepared` for every client."""
        return [prepared] * clients

    def forge(self, held: nn.Module | None, knowledge: Knowledge, rng: torch.Generator) -> dict[str, torch.Tensor]:
        """An attack that declares "forged_aggregate" returns here how every participant's model should move in one
        forged round before the observed ones (name -> tensor, trainable parameters only; absent names stay): the
        aggregator returns the sum that makes each participant's own step move it so (Protocol.forged_step).
        `held`: the observer's model as the gate lets it see it. Never edit `held` in place."""
        raise NotImplementedError(f"{type(self).__name__} declares no forged aggregate")

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        raise NotImplementedError


class DefenseAware:
    """The `defense_aware` option of an attack (one name on every attack that has it): when set, the
    instance needs "knows_defense" and reads observation.knowledge.defense. Added after the attacks' first release,
    so a False value stays out of trial ids (`identity_params`) and earlier ids stay valid."""

    defense_aware: bool = False
    # Options that only the defense-aware attack reads: stored (and in trial ids) only where defense_aware is True.
    aware_options: ClassVar[tuple[str, ...]] = ()

    def use_defense_knowledge(self, defense_aware: bool) -> None:
        """Store the option (validated) and, when set, add "knows_defense" to this instance's needs."""
        if not isinstance(defense_aware, bool):
            raise ValueError(f"defense_aware must be true or false, got {defense_aware!r}")
        self.defense_aware = defense_aware
        if defense_aware:
            self.needs = self.needs | {"knows_defense"}  # type: ignore[attr-defined]

    @classmethod
    def identity_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The stored parameters: defense_aware and the `aware_options` only where defense_aware is True."""
        if params.get("defense_aware"):
            return dict(params)
        return {k: v for k, v in params.items() if k != "defense_aware" and k not in cls.aware_options}


class Defense(Plugin):
    """The client side: how a client computes its gradients and what it does to its update before sending it.

    client_gradient: how the client computes each gradient inside its own computation (the FedSGD update, and every
        local step of FedAvg or a CGD participant), before `transform`. The default is the plain gradient of the mean
        loss; DP-SGD overrides it to clip per example and add noise, and steps its accountant there.
    gradient_batch: the batch that enters the gradient; a defense that transforms the client's inputs (ATS)
        overrides it, which declares the transform (the trial scores against what was sent).
    transform: applied by each client to its own update before sending (quantize, noise, prune). It may keep state
        across rounds (error feedback); `reset` clears it. Must not modify its input.
    privacy_spent / epsilon: the (epsilon, delta)-DP guarantee of what this client has done so far (its accountant,
        stepped with the noisy steps actually taken), or of a given horizon; None where the defense defines none.
    What the observer sees, which model each client computes at and what the server does are the round's, not the
    client's: see gleak.mechanics.protocol.Protocol.
    """

    plugin_kind: ClassVar[str] = "defense"
    stateful: ClassVar[bool] = False

    def reset(self) -> None:
        """Forget state kept across rounds (called once per client before its first round)."""

    def transform(self, update: Update, rng: torch.Generator) -> Update:
        return update

    def bind_data(self, mean: torch.Tensor | list[float], std: torch.Tensor | list[float]) -> None:
        """The normalisation of the client's own data (pixels = x * std + mean per channel), given by the runner to
        every client's defense before its first round: a client knows how it normalises its data (ATS transforms
        pixels). Default: ignored."""

    def bind_classes(self, num_classes: int) -> None:
        """The number of classes of the client's task, given by the runner beside `bind_data`: a defense that trains
        on soft labels (MixUp's mixed one-hot labels) needs their width. Default: ignored."""

    def wrap_model(self, model: nn.Module, rng: torch.Generator) -> nn.Module:
        """The model every client trains (and the observer holds), built from the case's model; a defense that
        extends the architecture (PRECODE's bottleneck) returns a new module. Default: unchanged."""
        return model

    # What a transforming defense's trials are scored against: "sent", the batch that entered the gradient (ATS: its
    # authors score the transformed image), or "private", the client's own batch (MixUp, InstaHide: an encoding
    # recovered is not yet an image recovered); the other is scored beside it, in the row's extra.
    scored_against: ClassVar[str] = "sent"

    # Set to a list by the trial for the client it attacks: `training_batch` then keeps (given x, x', y') there.
    kept_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def gradient_batch(self, x: torch.Tensor, y: torch.Tensor, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch the client's gradient is computed on, given the client's own batch (x, y): what enters the
        gradient, so what was sent. A defense that trains on transformed inputs (ATS's augmentation) overrides this
        hook, and the override is its declaration (`transforms_inputs`): a trial then scores the reconstruction
        against the returned batch and the client's untransformed batch (`scored_against` says which is primary).
        The returned x has x's shape and dtype; y has y's shape, or is soft labels (B, classes) in x's floating
        dtype, rows summing to 1 (MixUp); randomness from `rng`. Default: (x, y) unchanged, nothing drawn.
        Call it through `training_batch` (the default `client_gradient` does): `gleak check-plugin` fails a
        defense whose model sees other inputs than the batch it kept, or other inputs than (x, y) undeclared."""
        return x, y

    def training_batch(self, x: torch.Tensor, y: torch.Tensor, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`gradient_batch(x, y, rng)`, kept in `kept_batches` as (x, x', y') when the trial keeps them."""
        xb, yb = self.gradient_batch(x, y, rng)
        if self.kept_batches is not None:
            self.kept_batches.append((x.detach(), xb.detach(), yb.detach()))
        return xb, yb

    def client_gradient(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, rng: torch.Generator) -> dict[str, torch.Tensor]:
        """The client's gradient of its loss on (x, y) at the model's parameters, one tensor per trainable parameter
        (by name): by default the plain gradient of the mean loss on `training_batch(x, y, rng)`. Must not modify
        the model; randomness from `rng` (the client's own generator)."""
        return batch_gradient(model, *self.training_batch(x, y, rng))

    def epsilon(self, *, delta: float, sample_rate: float, steps: int) -> float | None:
        """The (epsilon, delta)-DP guarantee of `steps` steps at `sample_rate`, where one is defined, else None."""
        return None

    # The client's accountant (gleak.mechanics.accountant.PrivacyAccountant), given by the trial before the first round
    # (`bind_accountant`): a defense that draws calibrated noise steps it there; the count is the accountant's.
    privacy_accountant: Any = None

    def bind_accountant(self, accountant: Any) -> None:
        """The client's own privacy accountant, for its noisy steps (opacus' shape: stepped where the noise is
        drawn). Called by the runner once per client and run, after `reset`."""
        self.privacy_accountant = accountant

    def privacy_spent(self) -> float | None:
        """Epsilon of the steps its accountant counted (at the defense's own delta), else None."""
        return None


def transforms_inputs(defense: Any) -> bool:
    """Whether a defense (instance or class) declares that its client trains on a transformed batch: it overrides
    `Defense.gradient_batch`. Such a defense's trials are scored against the batch that entered the gradient."""
    cls = defense if isinstance(defense, type) else type(defense)
    return issubclass(cls, Defense) and cls.gradient_batch is not Defense.gradient_batch


def soft_labels(y: torch.Tensor, n: int) -> bool:
    """Whether `y` is soft labels for n examples, as a transforming defense may return them (MixUp): a floating
    (n, classes) tensor."""
    return y.is_floating_point() and y.dim() == 2 and len(y) == n


def hard_labels(y: torch.Tensor) -> torch.Tensor:
    """Class indices: soft labels (n, classes) by their largest entry (a mixture's dominant label), others as they are."""
    return y.argmax(-1) if y.is_floating_point() and y.dim() == 2 else y
