"""The observation gate: the one place where what an attack receives is built.

An attack's Observation is made here, and only here, from what the protocol put on the wire (its view of a round and
the model the observer holds) and what the attack's `needs` grant (gleak.contracts.wire.KNOWLEDGE). Every field is gated:
the knowledge (the defense's public description only with "knows_defense"), the model (a copy; weights only with "parameters"), the update's `num_samples` (the count behind the
update: only with "batch_size", else None) and each of the update's `meta` fields (gleak.contracts.wire.WIRE_META names the
knowledge each needs; a field it does not list never reaches an attack). Earlier rounds pass the same gate.

The active server passes here too: `refuse_unservable` turns away an attack the protocol gives no say over the
clients' models (its trial is not applicable, with the reason), and `served_models` is the one place the attack's
`prepare` and `prepare_clients` build the models the clients compute at.
"""
from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gleak.contracts.errors import PluginContractError, UnsupportedCase
from gleak.contracts.plugin import Attack
from gleak.contracts.seeds import derive_seed, generator
from gleak.contracts.tags import get_tags
from gleak.contracts.wire import WIRE_META, ClientBatch, DefenseDescription, Knowledge, Observation, Update
from gleak.mechanics.data import ImageDataset


def attacker_knowledge(
    attack: Attack, ds: ImageDataset, victim: ClientBatch, public: ImageDataset | None, setup: Any = None,
) -> Knowledge:  # fmt: skip
    """Exactly what the attack's `needs` grant it, and nothing more. `setup` (gleak.mechanics.protocol_setup.Setup): the trial's
    protocol and client defense, described to attacks that need "knows_defense" (names and parameters only)."""
    needs = get_tags(attack).needs
    described = None
    if "knows_defense" in needs and setup is not None:
        from gleak.contracts.registry import resolve_name  # the registry imports plugin modules, which import this one

        described = DefenseDescription(
            resolve_name("defense", setup.defense), copy.deepcopy(dict(setup.defense_params)), resolve_name("protocol", setup.protocol),
            copy.deepcopy(dict(setup.protocol_params)),
        )  # fmt: skip
    return Knowledge(
        input_shape=ds.input_shape,
        num_classes=ds.num_classes,
        batch_size=victim.size if "batch_size" in needs else None,
        mean=ds.mean if "data_stats" in needs else None,
        std=ds.std if "data_stats" in needs else None,
        labels=victim.y.clone() if "labels" in needs else None,
        public_x=public.normalized().to(victim.x.dtype) if public is not None else None,
        public_y=public.y if public is not None else None,
        defense=described,
    )


def observer_model(attack: Attack, model: nn.Module | None, seed: int) -> nn.Module | None:
    """The attacker's copy of the model: structure if it needs the architecture, weights only if it needs them.

    Without "parameters" every value is a guess (`guess_values`): the attacker knows the architecture and its init
    law, never the victim's values."""
    needs = get_tags(attack).needs
    if model is None or ("architecture" not in needs and "parameters" not in needs):
        return None
    mine = copy.deepcopy(model)
    if "parameters" not in needs:
        guess_values(mine, model, seed)
    return mine


def _guess_scale(t: torch.Tensor) -> float:
    """1 / sqrt(fan in): the scale of PyTorch's default init for a weight (fan in: the elements of one output row;
    of a vector or scalar, all its elements)."""
    fan_in = t[0].numel() if t.dim() >= 2 and len(t) else max(t.numel(), 1)
    return 1.0 / math.sqrt(fan_in)


def guess_values(mine: nn.Module, victim: nn.Module, seed: int) -> None:
    """Replace every value of `mine` (a copy of `victim`) by the attacker's guess, in place.

    1. Each module with a `reset_parameters` (the architecture's own init law) re-draws its parameters from torch's
       generator seeded by the trial's "attacker-guess" stream, in module order.
    2. Each floating-point parameter or buffer that still equals the victim's after that is drawn afresh from the
       "attacker-guess/rest" stream, with s = 1 / sqrt(fan in) (`_guess_scale`): a tensor no reset touched (a custom
       nn.Parameter or buffer of a module without `reset_parameters`) becomes N(0, s^2); one a reset set to the
       victim's own values (an untrained model's deterministic init: BatchNorm's ones and zeros, its running
       statistics) becomes that value plus |N(0, s^2)| (plus the absolute value, so that a variance stays positive).
    Integer buffers (BatchNorm's step counter) are counters, not data: reset where their module resets, else kept.
    So no floating value of the victim's model reaches an attack that did not declare "parameters"."""
    with torch.no_grad():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "attacker-guess"))
            for m in mine.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        rng = torch.Generator().manual_seed(derive_seed(seed, "attacker-guess/rest"))
        reset = {id(t) for m in mine.modules() if hasattr(m, "reset_parameters")
                 for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}  # fmt: skip
        theirs = dict(victim.named_parameters(remove_duplicate=True)) | dict(victim.named_buffers(remove_duplicate=True))
        named = dict(mine.named_parameters(remove_duplicate=True)) | dict(mine.named_buffers(remove_duplicate=True))
        for name, t in named.items():
            if not t.is_floating_point() or not torch.equal(t, theirs[name].to(t.device)):
                continue
            noise = torch.randn(t.shape, generator=rng, dtype=torch.float64) * _guess_scale(t)
            new = t.detach().cpu().double() + noise.abs() if id(t) in reset else noise
            t.copy_(new.to(t.dtype))


def gate_update(update: Update, needs: frozenset[str] | set[str]) -> Update:
    """The update as the attack may see it: tensors and kind always, the sample count and each meta field only
    where `needs` grant what it reveals."""
    meta = {k: v for k, v in update.meta.items() if k in WIRE_META and (not WIRE_META[k] or WIRE_META[k] in needs)}
    count = update.num_samples if "batch_size" in needs else None
    return replace(update, tensors=dict(update.tensors), num_samples=count, meta=meta)


def observation(
    view: Update, held: nn.Module | None, attack: Attack, knowledge: Knowledge, seed: int,
    rounds: tuple[Observation, ...] = (),
) -> Observation:  # fmt: skip
    """What the attack receives of one round: the gated view, the gated model and its knowledge (built by
    `attacker_knowledge`), with the earlier rounds' observations (each made here too)."""
    return Observation(gate_update(view, get_tags(attack).needs), knowledge, observer_model(attack, held, seed), rounds)


def grant(attack: Attack, protocol: Any, attack_name: str, protocol_name: str, threat_model: str | None) -> str:
    """What the attack may receive, decided in one place: the intersection of what it declares (`needs`, `active`),
    what the trial's threat model grants (gleak.contracts.threat_model; None: whatever the attack declares) and
    what the protocol exposes (a sum over clients exposes no client's labels; the server's say over the clients'
    models: `refuse_unservable`). UnsupportedCase (not applicable, this its reason) where the attack needs more.
    Returns the threat model the trial runs under, as its row names it."""
    from gleak.contracts.threat_model import CAPABILITIES, missing, of_tags, parse

    refuse_unservable(attack, protocol, attack_name, protocol_name)
    tags = get_tags(attack)
    if "labels" in tags.needs and get_tags(protocol).observes_sum:
        raise UnsupportedCase(f"attack {attack_name!r} needs the victim's labels, which protocol {protocol_name!r} does "
                              "not expose: its observer sees only a sum over clients")  # fmt: skip
    if threat_model is None:
        return of_tags(tags)
    model = parse(threat_model)
    lacking = missing(tags.needs, tags.active, model)
    if lacking:
        said = "; ".join(f"{c} ({CAPABILITIES[c]})" for c in lacking)
        raise UnsupportedCase(f"attack {attack_name!r} needs what threat model {model} does not grant: {said}")
    return str(model)


def refuse_unservable(attack: Attack, protocol: Any, attack_name: str, protocol_name: str) -> None:
    """UnsupportedCase (the trial is not applicable, this its reason) where the attack needs what the protocol does
    not let the server do: send each client its own model ("per_client_models", Protocol.per_client_models), or
    send the clients any model it prepared (an active attack, Protocol.shared_model)."""
    tags, server = get_tags(attack), get_tags(protocol)
    if "per_client_models" in tags.needs and not server.per_client_models:
        held = f": {server.models_held}" if server.models_held else ""
        raise UnsupportedCase(f"attack {attack_name!r} sends each client its own model, which protocol "
                              f"{protocol_name!r} does not let the server choose{held}")  # fmt: skip
    if tags.active and not server.shared_model:
        raise UnsupportedCase(f"active attack {attack_name!r} through protocol {protocol_name!r}: its clients never "
                              "compute at the model the server prepares")  # fmt: skip


def forged_models(attack: Attack, protocol: Any, models: list[nn.Module], knowledge: Knowledge, seed: int) -> list[nn.Module]:
    """The clients' models after one round whose aggregate the adversary forged (an attack declaring
    "forged_aggregate"): `attack.forge` sees the model the observer holds, as the gate lets it, and names how every
    model should move; the protocol moves them (Protocol.forged_step). PluginContractError where the displacement is
    not a finite tensor of a trainable parameter's shape."""
    held = observer_model(attack, protocol.observer_model(models[0], models), seed)
    move = attack.forge(held, knowledge, generator(seed, "attack-forge"))
    shapes = {n: p.shape for n, p in (held if held is not None else models[0]).named_parameters() if p.requires_grad}
    if not isinstance(move, dict):
        raise PluginContractError(f"forge must return a dict of tensors by parameter name, got {type(move).__name__}")
    for name, t in move.items():
        if name not in shapes or not isinstance(t, torch.Tensor) or t.shape != shapes[name]:
            raise PluginContractError(f"forge returned {name!r}, not a tensor of a trainable parameter's shape")
        if not torch.isfinite(t).all():
            raise PluginContractError(f"forge returned a non-finite displacement of {name!r}")
    return protocol.forged_step(models, move)


def served_models(attack: Attack, model: nn.Module, clients: int, knowledge: Knowledge, seed: int) -> list[nn.Module]:
    """The model each client computes at (the victim first) when the server sends them: `prepare` on the server's
    model, then `prepare_clients` (from a generator of its own, so that `prepare` draws the same model whether or
    not an attack defines `prepare_clients`). PluginContractError where the clients get different models without the attack
    declaring "per_client_models" (it would be granted a capability its threat model does not name)."""
    prepared = attack.prepare(model, knowledge, generator(seed, "attack-prepare"))
    if type(attack).prepare_clients is Attack.prepare_clients:
        return [prepared] * clients
    models = attack.prepare_clients(prepared, clients, knowledge, generator(seed, "attack-clients"))
    if not isinstance(models, list) or len(models) != clients or not all(isinstance(m, nn.Module) for m in models):
        raise PluginContractError(f"prepare_clients must return a list of {clients} modules, one per client")
    if len({id(m) for m in models}) > 1 and "per_client_models" not in get_tags(attack).needs:
        raise PluginContractError('prepare_clients sent clients different models: declare "per_client_models" in needs')
    return models
