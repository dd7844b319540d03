"""The conformance checks of a model plugin: built for a case, its forward pass, names and a short trial."""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch

from gleak.contracts import registry
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.errors import PluginContractError
from gleak.mechanics.models import create_model
from gleak.orchestration.conformance.common import CASES, CHECK_NAMES, Check, _meta_checks, _run, _state, _tensors_equal
from gleak.orchestration.trial import load_case_data

# The case a model is built for: the standard attack case's data (16 px RGB photographs, 10 classes).
MODEL_CASE = CASES[0]


def check_model(name: str, params: dict[str, Any] | None = None) -> list[Check]:
    """A model plugin: built for a case's input shape and classes, it maps a batch to (batch, classes) finite
    logits, names its parameters as a state dict can be saved and loaded (`model_state = "file:PATH"`), builds the
    same weights under the same seed, and a short trial (inverting gradients, a few iterations) runs on it."""
    params = dict(params or {})
    checks = _meta_checks("model", name)
    case = replace(MODEL_CASE, model=name, model_params=params)
    ds = load_case_data(TrialConfig("check", "none", {}, "none", {}, case, 0))

    def build(seed: int) -> torch.nn.Module:
        return create_model(name, ds.input_shape, ds.num_classes, seed=seed, **params)

    try:
        model = build(0)
        if not isinstance(model, torch.nn.Module):
            raise PluginContractError(f"returned {type(model).__name__}, not a torch.nn.Module")
    except Exception as exc:  # noqa: BLE001 - the check reports what went wrong, the rest cannot run
        checks.append(Check("builds for a case", False, f"{type(exc).__name__}: {exc}"))
        return checks + [Check(n, False, "the model did not build") for n in CHECK_NAMES["model"][5:]]
    checks.append(Check("builds for a case", True, f"input {tuple(ds.input_shape)}, {ds.num_classes} classes"))
    built = _state(model)  # before the forward pass moves BatchNorm's running statistics
    checks.append(_run("forward shape", lambda: _forward_problem(model, ds)))
    checks.append(_run("parameter names", lambda: _names_problem(model, build(1))))
    checks.append(_run("deterministic under a seed", lambda: "" if _tensors_equal(built, _state(build(0)))
                       else "two builds under seed 0 have different weights (draw them from torch's seeded generator)"))
    checks.append(_run("a trial runs on it", lambda: _trial_problem(case)))
    return checks


def _forward_problem(model: torch.nn.Module, ds: Any) -> str:
    x = ds.normalized(torch.arange(2)).to(torch.float32)
    out = model(x)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, ds.num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"a batch of 2 gave {shape}, expected (2, {ds.num_classes}) logits"
    if not torch.isfinite(out).all():
        return "the logits have NaN or infinity"
    if not any(p.requires_grad for p in model.parameters()):
        return "no trainable parameter: there is no gradient to attack"
    return ""


def _names_problem(model: torch.nn.Module, other: torch.nn.Module) -> str:
    """Every parameter is in the state dict under its name, and another seed's build has the same names and shapes
    (a checkpoint saved from one build loads into another: model_state = "file:PATH")."""
    state = model.state_dict()
    missing = [n for n, _ in model.named_parameters() if n not in state]
    if missing:
        return f"parameters missing from the state dict: {', '.join(missing[:3])}"
    layout = {k: tuple(v.shape) for k, v in state.items()}
    other_layout = {k: tuple(v.shape) for k, v in other.state_dict().items()}
    if layout != other_layout:
        diff = sorted(set(layout.items()) ^ set(other_layout.items()))
        return f"the layout depends on the seed: {diff[0][0]!r} differs between builds"
    try:
        copy.deepcopy(other).load_state_dict(state)
    except Exception as exc:  # noqa: BLE001
        return f"its own state dict does not load back: {type(exc).__name__}: {exc}"
    return ""


def _trial_problem(case: CaseConfig) -> str:
    from gleak.orchestration.trial import run_trial

    cfg = TrialConfig("check", "inverting-gradients", registry.check_params("attack", "inverting-gradients",
                      {"iterations": 2, "tv": 1e-4}), "none", {}, case, 0)  # fmt: skip
    row = run_trial(cfg)
    return "" if row["status"] == "ok" else f"the trial {row['status']}: {row.get('error')}"
