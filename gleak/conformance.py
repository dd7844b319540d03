"""`gleak check-plugin`: a conformance check for attacks and defenses (in the spirit of scikit-learn's
check_estimator). Every built-in plugin passes it in the tests.

Attacks: metadata, a supported standard case, output shapes and dtypes, determinism under a seed, no mutation of
the observation or of the model it is given, and only UnsupportedCase (never another exception) on cases it cannot
handle. Defenses: metadata, layout and dtype preserved, determinism, no mutation, finite output on an all-zero
update and on tiny tensors, and a well-formed observer view for several clients.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gleak import registry
from gleak.config import CaseConfig, TrialConfig, derive_seed, generator
from gleak.errors import PluginContractError, UnsupportedCase
from gleak.models import create_model
from gleak.plugin import Attack
from gleak.guards import extra_json
from gleak.threat import KNOWLEDGE, Observation, Reconstruction, Update
from gleak.trial import DTYPES, attacker_knowledge, client_update, draw_batches, load_case_data, observer_model

# Standard cases an attack is tried on; it must support at least one and fail cleanly on the others.
CASES = (
    CaseConfig(dataset="skimage", model="mlp", resolution=16, batch_size=1),
    CaseConfig(dataset="skimage", model="lenet", resolution=16, batch_size=1),
    CaseConfig(dataset="skimage", model="mlp", resolution=16, batch_size=2),
)


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


def _tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _meta_checks(kind: str, name: str) -> list[Check]:
    info = registry.plugin_info(kind, name)
    out = [Check("docstring summary", bool(info.summary), info.summary or "the class has no docstring")]
    required = [p.name for p in info.params.values() if p.default is inspect.Parameter.empty]
    out.append(Check("parameters have defaults", not required, ", ".join(required)))
    untyped = [p.name for p in info.params.values() if p.annotation is Any]
    out.append(Check("parameters are typed", not untyped, ", ".join(untyped)))
    return out


def _run_attack_once(attack_factory: Callable[[], Attack], case: CaseConfig, seed: int = 0):
    """One trial's chain, returning what the checks inspect."""
    cfg = TrialConfig("check", "x", {}, "none", {}, case, seed)
    dtype = DTYPES[case.dtype]
    ds = load_case_data(cfg)
    victim = draw_batches(ds, cfg, dtype)[0]
    attack = attack_factory()
    public = load_case_data(cfg, "test") if "public_data" in attack.needs else None
    knowledge = attacker_knowledge(attack, ds, victim, public)
    model = create_model(case.model, ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"), dtype=dtype)
    before_model = copy.deepcopy(model.state_dict())
    served = attack.prepare(model, knowledge, generator(seed, "attack-prepare"))
    prepare_mutated = not _tensors_equal(before_model, model.state_dict()) and served is model
    update = client_update(served, victim, cfg)
    obs = Observation(update=update, knowledge=knowledge, model=observer_model(attack, served, cfg))
    snap_update = {k: v.clone() for k, v in update.tensors.items()}
    snap_model = copy.deepcopy(obs.model.state_dict()) if obs.model is not None else None
    rec = attack.reconstruct(obs, generator(seed, "attack"))
    if not isinstance(rec, Reconstruction):
        raise PluginContractError(f"reconstruct must return a Reconstruction, got {type(rec).__name__}")
    mutated = not _tensors_equal(snap_update, update.tensors)
    return rec, victim, ds, mutated, prepare_mutated


def check_attack(name: str, params: dict[str, Any] | None = None) -> list[Check]:
    info = registry.plugin_info("attack", name)
    cls = info.obj
    fast = {**getattr(cls, "conformance_params", {}), **(params or {})}
    factory = lambda: registry.create("attack", name, **fast)  # noqa: E731
    checks = _meta_checks("attack", name)
    inst = factory()
    needs = set(getattr(inst, "needs", set()))
    unknown = needs - set(KNOWLEDGE)
    checks.append(Check("needs names known knowledge", not unknown, ", ".join(sorted(unknown))))

    supported, outcomes = None, []
    for case in CASES:
        try:
            result = _run_attack_once(factory, case)
            outcomes.append((case, None))
            if supported is None:
                supported = (case, result)
        except UnsupportedCase as exc:
            outcomes.append((case, f"UnsupportedCase: {exc}"))
        except Exception as exc:  # noqa: BLE001
            outcomes.append((case, f"{type(exc).__name__}: {exc}"))
    bad = [f"{c.model}/B={c.batch_size}: {e}" for c, e in outcomes if e and not e.startswith("UnsupportedCase")]
    checks.append(Check("unsupported cases raise UnsupportedCase only", not bad, "; ".join(bad)))
    if supported is None:
        checks.append(Check("supports a standard case", False, "; ".join(e for _, e in outcomes if e)))
        return checks
    case, (rec, victim, ds, mutated, prepare_mutated) = supported
    checks.append(Check("supports a standard case", True, f"{case.model}, batch size {case.batch_size}"))
    shape_ok, detail = True, ""
    if rec.x is None and rec.y is None:
        shape_ok, detail = False, "returned neither images nor labels"
    if rec.x is not None:
        if rec.x.dim() != 4 or tuple(rec.x.shape[1:]) != ds.input_shape or rec.x.shape[0] < 1:
            shape_ok, detail = False, f"x has shape {tuple(rec.x.shape)}, expected (n, {', '.join(map(str, ds.input_shape))})"
        elif rec.x.dtype != victim.x.dtype:
            shape_ok, detail = False, f"x dtype {rec.x.dtype} != data dtype {victim.x.dtype}"
        elif not torch.isfinite(rec.x).all():
            shape_ok, detail = False, "x has NaN or infinity"
    if rec.y is not None:
        if rec.y.dtype != torch.long or rec.y.dim() != 1 or (rec.y.numel() and (rec.y.min() < 0 or rec.y.max() >= ds.num_classes)):
            shape_ok, detail = False, f"y must be a 1-D long tensor of class indices, got {rec.y!r}"
    checks.append(Check("output shapes and dtypes", shape_ok, detail))
    rec2 = _run_attack_once(factory, case)[0]
    same = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in ((rec.x, rec2.x), (rec.y, rec2.y))
    )
    checks.append(Check("deterministic under a seed", same, "" if same else "two runs with the same seed differ"))
    checks.append(Check("does not mutate the observation", not mutated, "update tensors changed" if mutated else ""))
    try:  # what the trial stores (gleak.guards): a dict of JSON values
        extra_json(getattr(rec, "extra", None), f"attack {name!r}")
        checks.append(Check("extra is JSON", True))
    except PluginContractError as exc:
        checks.append(Check("extra is JSON", False, str(exc)))
    checks.append(
        Check("prepare does not modify the model in place", not prepare_mutated, "return a new module" if prepare_mutated else "")
    )
    return checks


def _probe_update(dtype: torch.dtype, seed: int) -> Update:
    g = torch.Generator().manual_seed(seed)
    return Update(
        {
            "a.weight": torch.randn(32, 20, generator=g, dtype=dtype),
            "a.bias": torch.randn(32, generator=g, dtype=dtype),
            "b.weight": torch.randn(10, 32, generator=g, dtype=dtype) * 1e-3,
            "b.bias": torch.randn(1, generator=g, dtype=dtype),
        },
        "gradient",
        4,
    )


def _client_gradient_problems(factory: Callable[[], Any], dtype: torch.dtype) -> list[str]:
    """The client_gradient hook on a small MLP: one finite tensor per trainable parameter, deterministic under the
    client's generator, and the model untouched."""
    from gleak.protocol import trainable

    model = create_model("mlp", (1, 4, 4), 3, seed=0, dtype=dtype, hidden=[6])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 1, 4, 4, generator=g, dtype=dtype), torch.tensor([0, 1, 2, 1, 0])
    snap = copy.deepcopy(model.state_dict())
    try:
        g1 = factory().client_gradient(model, x, y, torch.Generator().manual_seed(6))
        g2 = factory().client_gradient(model, x, y, torch.Generator().manual_seed(6))
    except Exception as exc:  # noqa: BLE001
        return [f"{dtype}: {type(exc).__name__}: {exc}"]
    params = dict(trainable(model))
    out = []
    if not isinstance(g1, dict) or list(g1) != list(params):
        return [f"{dtype}: must return a dict with one tensor per trainable parameter, in model order"]
    if any(g1[n].shape != p.shape or g1[n].dtype != dtype or not torch.isfinite(g1[n]).all() for n, p in params.items()):
        out.append(f"{dtype}: a gradient has the wrong shape or dtype, or is not finite")
    if not _tensors_equal(g1, g2):
        out.append(f"{dtype}: two calls with the same generator differ")
    if not _tensors_equal(snap, model.state_dict()):
        out.append(f"{dtype}: the model was modified")
    return out


def check_defense(name: str, params: dict[str, Any] | None = None) -> list[Check]:
    info = registry.plugin_info("defense", name)
    fast = {**getattr(info.obj, "conformance_params", {}), **(params or {})}
    factory = lambda: registry.create("defense", name, **fast)  # noqa: E731
    checks = _meta_checks("defense", name)
    problems = {"layout and dtype preserved": [], "deterministic under a seed": [], "does not mutate its input": [],
                "finite on zero and tiny updates": [], "observer view well formed": [],
                "client gradient well formed": []}  # fmt: skip
    for dtype in (torch.float32, torch.float64):
        u = _probe_update(dtype, 0)
        snap = {k: v.clone() for k, v in u.tensors.items()}
        d1, d2 = factory(), factory()
        d1.reset()
        d2.reset()
        out1 = d1.transform(u, torch.Generator().manual_seed(1)).clone()
        out2 = d2.transform(_probe_update(dtype, 0), torch.Generator().manual_seed(1))
        if out1.names() != u.names() or any(out1[k].shape != u[k].shape or out1[k].dtype != dtype for k in u.names()):
            problems["layout and dtype preserved"].append(f"{dtype}: layout or dtype changed")
        if not _tensors_equal(out1.tensors, out2.tensors):
            problems["deterministic under a seed"].append(f"{dtype}: two runs differ")
        if not _tensors_equal(snap, u.tensors):
            problems["does not mutate its input"].append(f"{dtype}: input tensors changed")
        zero = u.map(lambda _, t: torch.zeros_like(t))
        tiny = Update({"w": torch.tensor([0.5], dtype=dtype)}, "gradient", 1)
        for label, probe in (("all-zero", zero), ("one-element", tiny)):
            d = factory()
            d.reset()
            try:
                out = d.transform(probe, torch.Generator().manual_seed(2))
                if not out.is_finite()[0]:
                    problems["finite on zero and tiny updates"].append(f"{label}: NaN or infinity")
            except Exception as exc:  # noqa: BLE001
                problems["finite on zero and tiny updates"].append(f"{label}: {type(exc).__name__}: {exc}")
        clients = [_probe_update(dtype, s) for s in range(3)]
        ds_ = [factory() for _ in clients]
        sent = [d.transform(c, torch.Generator().manual_seed(3)) for d, c in zip(ds_, clients)]
        view = ds_[0].observe(sent, torch.Generator().manual_seed(4))
        if not isinstance(view, Update) or view.names() != clients[0].names():
            problems["observer view well formed"].append(f"{dtype}: observe() must return an Update of the same layout")
        problems["client gradient well formed"] += _client_gradient_problems(factory, dtype)
    checks += [Check(k, not v, "; ".join(v)) for k, v in problems.items()]
    return checks


def check_plugin(kind: str, name: str, params: dict[str, Any] | None = None) -> list[Check]:
    if kind == "attack":
        return check_attack(name, params)
    if kind == "defense":
        return check_defense(name, params)
    raise ValueError(f"check-plugin checks attacks and defenses, not {kind!r}")
