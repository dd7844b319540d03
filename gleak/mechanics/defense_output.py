"""Run-time checks of what plugins hand back, at the trial's seam between the defense and the wire.

Validation at load time cannot see what a plugin does when it runs. Two contract breaches would otherwise be
recorded as results: a defense that modifies the update it is given in place (the plain update the trial compares
against is then the defended one: grad_dist 0.0 instead of the true distance), and an `extra` that is not JSON
(it cannot be stored). Each is this trial's failure, with the reason (PluginContractError), never a crash or a
wrong number. `gleak check-plugin` uses the same functions, so a plugin fails there first.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence, TypeVar

import torch

from gleak.contracts.errors import PluginContractError

T = TypeVar("T")


def _snapshot(updates: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in u.tensors.items()} for u in updates]


def _changed(before: dict[str, torch.Tensor], after: Any) -> str | None:
    if list(before) != list(after.tensors):
        return "its tensors were replaced"
    for k, v in before.items():
        if not torch.equal(v, after.tensors[k]):
            return f"tensor {k!r} changed"
    return None


def unmodified(send: Callable[..., T], defenses: Sequence[Any], updates: Sequence[Any], *args: Any) -> T:
    """send(defenses, updates, *args) (gleak.mechanics.protocol.send_round / transmit), then check that no client's update was
    modified in place by its defense; PluginContractError names the defense and the tensor."""
    before = _snapshot(updates)
    out = send(defenses, updates, *args)
    for i, (b, u) in enumerate(zip(before, updates)):
        what = _changed(b, u)
        if what:
            name = getattr(defenses[i] if i < len(defenses) else defenses[0], "registered_name", "") or type(defenses[0]).__name__
            raise PluginContractError(
                f"defense {name!r} modified client {i}'s update in place ({what}); transform must return a new Update"
            )
    return out


def check_sent(given: Any, sent: Any, who: str) -> None:
    """What a defense's transform returned for the update `given`: an Update of the same tensors (names and shapes)
    with floating-point values. PluginContractError naming `who` (the defense and client) and what was wrong, so
    that a malformed update is the defense's failure, not a later plugin's (an attack handed int64 tensors)."""
    from gleak.contracts.wire import Update

    if not isinstance(sent, Update):
        raise PluginContractError(f"{who}: transform must return an Update, got {type(sent).__name__}")
    if set(sent.tensors) != set(given.tensors):
        lost, new = sorted(set(given.tensors) - set(sent.tensors)), sorted(set(sent.tensors) - set(given.tensors))
        said = "; ".join(s for s in (f"dropped {lost}" if lost else "", f"added {new}" if new else "") if s)
        raise PluginContractError(f"{who}: transform returned other tensors than it was given ({said})")
    for name, t in sent.tensors.items():
        if not isinstance(t, torch.Tensor):
            raise PluginContractError(f"{who}: transform returned {type(t).__name__} for {name!r}, not a tensor")
        if t.shape != given.tensors[name].shape:
            raise PluginContractError(f"{who}: transform changed the shape of {name!r} from "
                                      f"{tuple(given.tensors[name].shape)} to {tuple(t.shape)}")  # fmt: skip
        if not t.is_floating_point():
            raise PluginContractError(f"{who}: transform returned {name!r} as {t.dtype}, not floating point")


def extra_json(extra: Any, who: str = "the attack") -> str:
    """`extra` as the JSON text the store holds; PluginContractError when it is not a JSON object of plain values."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise PluginContractError(f"{who}'s extra must be a dict, got {type(extra).__name__}")
    try:
        return json.dumps(extra, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise PluginContractError(f"{who}'s extra is not JSON: {exc}") from None
