"""Threat models as data: the capabilities an adversary may have, the named threat models built from them, and
what each attack's declaration (`needs`, `active`) asks of them.

The vocabulary follows Carletti, Foggia, Mazzocca, Parrella and Vento, "SoK: Gradient Inversion Attacks in
Federated Learning" (USENIX Security 2025): an adversary observes model updates and may have basic knowledge (the
architecture and weights of the model the server sent, with the input preprocessing), training details (batch
size, local steps, learning rate; here also the defense's public parameters, Kerckhoffs), surrogate data, knowledge
of the clients' data distribution (batch-norm statistics), and may actively manipulate the model the clients
receive or select (inject) clients. Their threat models A-H are nested sets of these. Two capabilities lie outside
every letter and are granted only where a suite names them: knowing the victim's labels (an oracle the SoK counts
as part of an attack, not of the adversary) and forging the aggregate a protocol returns to its participants.

A threat model is written as its letter, optionally with extras: "B", "F+labels". `required(needs, active)` is the
smallest threat model an attack's declaration fits; the gate (gleak.mechanics.gate.grant) compares it with the
suite's threat model and with what the protocol exposes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gleak.contracts.tags import Tags

CAPABILITIES = {
    "updates": "observes the model updates on the wire",
    "model": "knows the architecture and the weights of the model the clients compute at, and the input preprocessing",
    "training": "knows training details: batch size, local steps, learning rate, the defense's public parameters",
    "surrogate": "has surrogate data from the clients' distribution",
    "distribution": "knows statistics of the clients' data distribution (batch-norm statistics)",
    "manipulates": "modifies the model sent to the clients (one model for all, or one per client)",
    "injects": "injects clients of its own (client selection)",
    "labels": "knows the victim's true labels",
    "forges": "forges the aggregate that the protocol returns to its participants",
}

# Each letter's capabilities (Carletti et al. 2025, Table 2) and name.
_LETTERS = {
    "A": ("eavesdropper", ("updates",)),
    "B": ("informed eavesdropper", ("updates", "model")),
    "C": ("parameter-aware eavesdropper", ("updates", "model", "training")),
    "D": ("data-enhanced eavesdropper", ("updates", "model", "training", "surrogate")),
    "E": ("statistical-informed eavesdropper", ("updates", "model", "training", "surrogate", "distribution")),
    "F": ("active manipulator", ("updates", "model", "training", "manipulates")),
    "G": ("data-enhanced manipulator", ("updates", "model", "training", "surrogate", "manipulates")),
    "H": ("active client manipulator", ("updates", "model", "training", "surrogate", "manipulates", "injects")),
}
EXTRAS = ("labels", "forges")  # in no letter: named explicitly ("B+labels")

# What each knowledge an attack may declare in `needs` (gleak.contracts.wire.KNOWLEDGE) asks of the adversary.
# "label_counts" is read from a query round at a model the server prepared: it needs the active capability.
NEED_CAPABILITY = {
    "architecture": "model", "parameters": "model", "data_stats": "model",
    "batch_size": "training", "knows_defense": "training",
    "public_data": "surrogate", "labels": "labels",
    "per_client_models": "manipulates", "label_counts": "manipulates", "forged_aggregate": "forges",
}  # fmt: skip


@dataclass(frozen=True)
class ThreatModel:
    """A letter of Carletti et al. with optional extra capabilities (EXTRAS)."""

    letter: str
    extras: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return _LETTERS[self.letter][0]

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset(_LETTERS[self.letter][1]) | frozenset(self.extras)

    def __str__(self) -> str:
        return "+".join((self.letter, *self.extras))

    def describe(self) -> str:
        """'F+labels (active manipulator, and knows the victim's true labels)'."""
        more = "".join(f", and {CAPABILITIES[e].split(':')[0]}" for e in self.extras)
        return f"{self} ({self.name}{more})"

    def grants(self, capability: str) -> bool:
        return capability in self.capabilities


def parse(text: str) -> ThreatModel:
    """'G' or 'B+labels' -> ThreatModel; ValueError naming the letters and extras otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"threat_model must be a letter A-H with optional extras ({', '.join(EXTRAS)}), got {text!r}")
    letter, *extras = [p.strip() for p in text.strip().split("+")]
    if letter.upper() not in _LETTERS:
        raise ValueError(f"threat_model must start with a letter A-H (Carletti et al. 2025), got {letter!r}")
    bad = [e for e in extras if e not in EXTRAS]
    if bad:
        raise ValueError(f"threat_model extra {bad[0]!r} is not one of {', '.join(EXTRAS)}")
    return ThreatModel(letter.upper(), tuple(e for e in EXTRAS if e in extras))


def capabilities_of(needs: frozenset[str] | set[str], active: bool = False) -> frozenset[str]:
    """What an attack's declaration asks of the adversary: observing updates, one capability per need, and the
    active capability where it prepares the clients' model."""
    caps = {"updates", *(NEED_CAPABILITY[n] for n in needs if n in NEED_CAPABILITY)}
    if active:
        caps.add("manipulates")
    return frozenset(caps)


def required(needs: frozenset[str] | set[str], active: bool = False) -> ThreatModel:
    """The smallest threat model that grants what an attack declares: the first letter (in order of its size, then
    A-H) whose capabilities cover it, with the extras it needs."""
    caps = capabilities_of(needs, active)
    extras = tuple(e for e in EXTRAS if e in caps)
    base = caps - set(extras)
    letter = min((lt for lt, (_, c) in _LETTERS.items() if base <= set(c)), key=lambda lt: (len(_LETTERS[lt][1]), lt))
    return ThreatModel(letter, extras)


def missing(needs: frozenset[str] | set[str], active: bool, model: ThreatModel) -> list[str]:
    """The capabilities an attack's declaration asks for that `model` does not grant (in CAPABILITIES order)."""
    caps = capabilities_of(needs, active)
    return [c for c in CAPABILITIES if c in caps and not model.grants(c)]


def letters() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every letter's (name, capabilities), for documents."""
    return dict(_LETTERS)


def of_tags(tags: Tags) -> str:
    """The smallest threat model that grants what an attack's declaration (gleak.contracts.tags.Tags) asks for."""
    return str(required(tags.needs, tags.active))


@lru_cache(maxsize=1024)
def of_attack(attack: str, params_json: str | None) -> str:
    """The threat model an attack configuration runs under where the suite names none: the smallest that grants
    what it declares (its parameters may add needs: labels = "given"). '' where it cannot be built."""
    from gleak.contracts.registry import create  # the registry imports plugin modules
    from gleak.contracts.tags import get_tags

    try:
        inst = create("attack", attack, **(json.loads(params_json) if params_json else {}))
    except Exception:  # noqa: BLE001 - an attack this gleak no longer builds: its rows name no threat model
        return ""
    return of_tags(get_tags(inst))


def of_row(attack: str, params_json: str | None, config_json: str | None = None) -> str:
    """A stored trial's threat model: the suite's where its config names one, else the attack's own (`of_attack`)."""
    named = json.loads(config_json).get("threat_model") if isinstance(config_json, str) and config_json else None
    return named or of_attack(attack, params_json if isinstance(params_json, str) else None)
