"""`gleak check-plugin`: a conformance check for attacks, defenses and protocols (in the spirit of scikit-learn's
check_estimator). Every built-in plugin passes it in the tests, one pytest id per (plugin, check), as scikit-learn's
parametrize_with_checks does: the names of each kind's checks are listed in CHECK_NAMES.

Every kind: its own docstring (not only its base class's), parameters with defaults and types.
Attacks: a supported standard case, output shapes and dtypes, determinism under a seed, no mutation of the
observation or of the model it is given, and only UnsupportedCase (never another exception) on cases it cannot
handle; models shaped only by `prepare` and `prepare_clients` (`model_hook_problem`: through secure aggregation
with three clients, the model handed to them and every model they return unchanged after the round and the
reconstruction, and different models per client only with "per_client_models" in `needs`). Defenses: layout and dtype preserved, determinism, no mutation, finite output on an all-zero update and on
tiny tensors, a well-formed client gradient, and no round hooks (those are a Protocol's: a defense that defines
`observe` would be silently ignored). Protocols: every method on a small MLP with three clients: the clients'
models (ownership: the server's model untouched), a client's update, the observer's view and model, the server's
step (new models that moved, the old ones untouched), two rounds of run_rounds (deterministic under a seed) and a
utility run. Models: built for a case, (batch, classes) finite logits, parameters named in a state dict whose layout
does not depend on the seed, the same weights under the same seed, and a short trial on it.
"""
from __future__ import annotations

from typing import Any

from gleak.contracts import registry
from gleak.orchestration.conformance.attacks import attack_cases, check_attack, model_hook_problem
from gleak.orchestration.conformance.common import CASES, CHECK_NAMES, TEXT_CASES, Check
from gleak.orchestration.conformance.defenses import check_defense
from gleak.orchestration.conformance.models import check_model
from gleak.orchestration.conformance.protocols import check_protocol

__all__ = ["CASES", "CHECK_NAMES", "TEXT_CASES", "Check", "attack_cases", "check_attack", "check_defense", "check_model",
           "check_plugin", "check_protocol", "model_hook_problem"]


def check_plugin(kind: str, name: str, params: dict[str, Any] | None = None) -> list[Check]:
    """Every check of plugin `name` of `kind`. A defense that is a protocol's historical spelling (cgd) is checked
    as the protocol it is."""
    if kind == "attack":
        return check_attack(name, params)
    if kind == "defense":
        info = registry.plugin_info("defense", name)
        return check_protocol(info.protocol, params) if info.protocol else check_defense(name, params)
    if kind == "protocol":
        return check_protocol(name, params)
    if kind == "model":
        return check_model(name, params)
    raise ValueError(f"check-plugin checks attacks, defenses, protocols and models, not {kind!r}")
