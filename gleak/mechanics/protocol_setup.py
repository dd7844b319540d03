"""Which protocol a trial runs, and with which client defense: the spellings a suite may use for it, read once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
