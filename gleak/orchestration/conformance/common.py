"""What every kind's checks share: the check names per kind, the standard cases, a check's result, and the
checks of a plugin's metadata (docstring, parameters)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gleak.contracts import registry
from gleak.contracts.config import CaseConfig
from gleak.contracts.plugin import Plugin

CHECK_NAMES = {
    "attack": ["own docstring", "docstring summary", "parameters have defaults", "parameters are typed",
               "parameters shadow no method", "needs names known knowledge",
               "unsupported cases raise UnsupportedCase only", "supports a standard case", "output shapes and dtypes",
               "deterministic under a seed", "does not mutate the observation", "extra is JSON",
               "prepare does not modify the model in place", "models change only through the hooks"],
    "defense": ["own docstring", "docstring summary", "parameters have defaults", "parameters are typed",
                "parameters shadow no method", "layout and dtype preserved", "deterministic under a seed",
                "does not mutate its input", "finite on zero and tiny updates", "client gradient well formed",
                "no round hooks", "declares the inputs it trains on"],
    "protocol": ["own docstring", "docstring summary", "parameters have defaults", "parameters are typed",
                 "parameters shadow no method", "client models", "client update well formed",
                 "observer view well formed", "observer model", "server step moves the models",
                 "rounds run deterministically", "trains for utility"],
    "model": ["own docstring", "docstring summary", "parameters have defaults", "parameters are typed",
              "parameters shadow no method", "builds for a case", "forward shape", "parameter names",
              "deterministic under a seed", "a trial runs on it"],
}  # fmt: skip
# Methods of a Protocol, not of a Defense: defining one on a defense is a mistake the trial would ignore.
ROUND_HOOKS = ("observe", "client_models", "observed_rounds", "next_models", "observer_model", "train_utility", "server_step")

# Standard cases an attack is tried on; it must support at least one and fail cleanly on the others.
CASES = (
    CaseConfig(dataset="skimage", model="mlp", resolution=16, batch_size=1),
    CaseConfig(dataset="skimage", model="lenet", resolution=16, batch_size=1),
    CaseConfig(dataset="skimage", model="mlp", resolution=16, batch_size=2),
)
# The standard cases of a text attack (its class sets `modality = "text"`): the text classifier on short sequences.
TEXT_CASES = (
    CaseConfig(dataset="fortunes", model="text-classifier", seq_len=8, batch_size=1),
    CaseConfig(dataset="fortunes", model="text-classifier", seq_len=8, batch_size=2),
)


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


def _tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _own_doc(obj: Any) -> Check:
    """The plugin's own docstring: a class that has none inherits its base's, which describes no paper."""
    own = obj.__doc__ if not inspect.isclass(obj) or "__doc__" in vars(obj) else None
    bases = {c.__doc__ for c in getattr(obj, "__mro__", ())[1:] if issubclass(c, Plugin) or c is Plugin}
    ok = bool(own and own.strip()) and own not in bases
    return Check("own docstring", ok, "" if ok else "the class has no docstring of its own (only its base class's)")


def _meta_checks(kind: str, name: str) -> list[Check]:
    info = registry.plugin_info(kind, name)
    out = [_own_doc(info.obj), Check("docstring summary", bool(info.summary), info.summary or "the class has no docstring")]
    reserved = registry._registry(kind).reserved  # a model's input_shape and num_classes come from the case
    params = [p for p in info.params.values() if p.name not in reserved]
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    out.append(Check("parameters have defaults", not required, ", ".join(required)))
    untyped = [p.name for p in params if p.annotation is Any]
    out.append(Check("parameters are typed", not untyped, ", ".join(untyped)))
    # A parameter is stored as an attribute of its name (get_params reads it back): one named like a method the
    # trial calls (a defense's `epsilon`) replaces that method with a number on every instance.
    shadowed = [f"{p.name} (a method of {c.__name__})" for p in params for c in inspect.getmro(info.obj)[1:]
                if p.name in vars(c) and callable(vars(c)[p.name])] if inspect.isclass(info.obj) else []  # fmt: skip
    out.append(Check("parameters shadow no method", not shadowed, ", ".join(dict.fromkeys(shadowed))))
    return out


def _run(check: str, fn: Callable[[], str]) -> Check:
    """A check whose body returns a problem ('' when none); an exception is a failure naming it."""
    try:
        problem = fn()
    except Exception as exc:  # noqa: BLE001 - a broken hook is what this finds
        problem = f"{type(exc).__name__}: {exc}"
    return Check(check, not problem, problem)
