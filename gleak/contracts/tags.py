"""One declaration per plugin, read in one place: what it needs, what it is and how it is checked quickly (in the
spirit of scikit-learn's estimator tags).

A plugin declares itself with class attributes of its base class (`needs`, `active`, `modality`, `stateful`,
`conformance_params`; a protocol's `shared_model`, `per_client_models`, `models_held`, `observes_sum`; a defense's
`gradient_batch` override, which declares that it trains on transformed inputs). Nothing in gleak reads those
attributes directly: the gate, the threat model, the trial, conformance and `gleak show` ask `get_tags`, which
returns them as one frozen `Tags`. An instance's tags can differ from its class's where a parameter changes what the
plugin needs (a defense-aware attack adds "knows_defense"), so ask the instance where there is one.

>>> from gleak.contracts.plugin import Attack
>>> class Peek(Attack):
...     needs = frozenset({"architecture", "parameters", "labels"})
>>> tags = get_tags(Peek)
>>> tags.kind, sorted(tags.needs), tags.active
('attack', ['architecture', 'labels', 'parameters'], False)
>>> from gleak.contracts.threat_model import of_tags
>>> of_tags(tags)  # the smallest threat model that grants it
'B+labels'
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

MODALITIES = ("image", "text")
# What `gleak check-plugin` runs a plugin with where it declares no `conformance_params`: an optimisation's loop
# parameters cut to a few steps (a 40-line attack at its default 300 iterations took minutes per check).
QUICK = {"iterations": 2, "restarts": 1, "max_iter": 5, "steps": 2, "epochs": 1}


@dataclass(frozen=True)
class Tags:
    """What one plugin (class or instance) declares.

    kind: attack, defense, protocol or model.
    needs: (attack) the knowledge and capabilities it requires (gleak.contracts.wire.KNOWLEDGE, threat-model extras);
        the observation it receives holds exactly these.
    active: (attack) it modifies the model before the client computes (`Attack.prepare`).
    modality: (attack) the cases it reconstructs, "image" or "text"; conformance runs it on those.
    stateful: (defense) it keeps state across rounds (error feedback), cleared by `reset`.
    transforms_inputs: (defense) its client trains on a transformed batch (`Defense.gradient_batch` overridden):
        its trials are scored against what entered the gradient and the client's own batch.
    scored_against: (defense) which of the two is the trial's truth: "sent" (ATS) or "private" (MixUp, InstaHide).
    shared_model, per_client_models, models_held, observes_sum: (protocol) what the server may do to the clients'
        models and what the observer sees (gleak.mechanics.protocol.Protocol).
    fast_params: parameters merged over the defaults so that `gleak check-plugin` runs quickly: the plugin's
        `conformance_params`, else its loop parameters cut to QUICK (`quick_params`).
    """

    kind: str
    needs: frozenset[str] = frozenset()
    active: bool = False
    modality: str = "image"
    stateful: bool = False
    transforms_inputs: bool = False
    scored_against: str = "sent"
    shared_model: bool = True
    per_client_models: bool = True
    models_held: str = ""
    observes_sum: bool = False
    fast_params: Mapping[str, Any] = field(default_factory=dict)


def get_tags(plugin: Any) -> Tags:
    """The declaration of `plugin` (a plugin class or instance) as one Tags."""
    from gleak.contracts.plugin import transforms_inputs

    cls = plugin if isinstance(plugin, type) else type(plugin)
    kind = getattr(cls, "plugin_kind", "") or "model"  # each kind's base class names it; a model is a torch module
    modality = getattr(plugin, "modality", "image")
    return Tags(
        kind=kind,
        needs=frozenset(getattr(plugin, "needs", frozenset())),  # an attack's (other kinds declare none)
        active=bool(getattr(plugin, "active", False)),
        modality=modality if modality in MODALITIES else "image",
        stateful=bool(getattr(plugin, "stateful", False)),
        transforms_inputs=transforms_inputs(cls),
        scored_against=str(getattr(cls, "scored_against", "sent")),
        shared_model=bool(getattr(plugin, "shared_model", True)),
        per_client_models=bool(getattr(plugin, "per_client_models", True)),
        models_held=str(getattr(plugin, "models_held", "") or ""),
        observes_sum=bool(getattr(plugin, "observes_sum", False)),
        fast_params=dict(getattr(plugin, "conformance_params", {}) or {}) or quick_params(cls),
    )


def quick_params(cls: type) -> dict[str, Any]:
    """The loop parameters of a plugin's __init__ (QUICK's names, whole-number defaults above QUICK's) cut to QUICK."""
    import inspect

    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: QUICK[p.name] for p in params if p.name in QUICK and isinstance(p.default, int)
            and not isinstance(p.default, bool) and p.default > QUICK[p.name]}  # fmt: skip
