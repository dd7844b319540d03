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

import copy
import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from gleak import registry
from gleak.config import CaseConfig, TrialConfig, derive_seed, generator
from gleak.errors import PluginContractError, UnsupportedCase
from gleak.models import create_model
from gleak.gate import attacker_knowledge, observation
from gleak.plugin import Attack, Defense, Plugin, transforms_inputs
from gleak.protocol import Setup, run_rounds, trial_setup
from gleak.guards import extra_json
from gleak.threat import KNOWLEDGE, ClientBatch, Reconstruction, Update
from gleak.trial import DTYPES, client_update, draw_batches, load_case_data, observed_schedule

CHECK_NAMES = {
    "attack": ["own docstring", "docstring summary", "parameters have defaults", "parameters are typed",
               "needs names known knowledge", "unsupported cases raise UnsupportedCase only", "supports a standard case",
               "output shapes and dtypes", "deterministic under a seed", "does not mutate the observation",
               "extra is JSON", "prepare does not modify the model in place", "models change only through the hooks"],
    "defense": ["own docstring", "docstring summary", "parameters have defaults", "parameters are typed",
                "layout and dtype preserved", "deterministic under a seed", "does not mutate its input",
                "finite on zero and tiny updates", "client gradient well formed", "no round hooks",
                "declares the inputs it trains on"],
    "protocol": ["own docstring", "docstring summary", "parameters have defaults", "parameters are typed",
                 "client models", "client update well formed", "observer view well formed", "observer model",
                 "server step moves the models", "rounds run deterministically", "trains for utility"],
    "model": ["own docstring", "docstring summary", "parameters have defaults", "parameters are typed",
              "builds for a case", "forward shape", "parameter names", "deterministic under a seed",
              "a trial runs on it"],
}  # fmt: skip
# Methods of a Protocol that a Defense no longer has: defining one on a defense is a mistake the trial would ignore.
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
    return out


def attack_cases(cls: type) -> tuple[CaseConfig, ...]:
    """The standard cases, and for an attack that only applies behind a protocol's wire (its class names one as
    `conformance_protocol = (name, params)`) the first MLP case run through that protocol with two clients."""
    if getattr(cls, "modality", "image") == "text":
        return TEXT_CASES
    extra = getattr(cls, "conformance_protocol", None)
    if extra is None:
        return CASES
    name, params = extra
    return (*CASES, replace(CASES[0], clients=2, protocol=name, protocol_params=dict(params)))


def _observed_through_protocol(attack: Attack, cfg: TrialConfig, ds: Any, model: Any, public: Any):
    """A case with a protocol: its observed rounds (gleak.protocol.run_rounds), every round through the gate."""
    dtype = DTYPES[cfg.case.dtype]
    batches = draw_batches(ds, cfg, dtype)
    setup = trial_setup(cfg.case, "none", {})
    protocol = registry.create("protocol", setup.protocol, **setup.protocol_params)
    defenses = [registry.create("defense", "none") for _ in batches]
    knowledge = attacker_knowledge(attack, ds, batches[0], public, setup)
    protocol.reset()
    models = protocol.client_models(model, len(batches), generator(cfg.seed, "client-models"))
    _, seen = run_rounds(protocol, defenses, models, protocol.observed_rounds(), observed_schedule(batches, cfg),
                         cfg.case.warmup_lr, step_last=False)  # fmt: skip
    history = tuple(observation(w.view, w.held, attack, knowledge, cfg) for w in seen[:-1])
    return batches[0], observation(seen[-1].view, seen[-1].held, attack, knowledge, cfg, history)


def _run_attack_once(attack_factory: Callable[[], Attack], case: CaseConfig, seed: int = 0):
    """One trial's chain, returning what the checks inspect."""
    cfg = TrialConfig("check", "x", {}, "none", {}, case, seed)
    dtype = DTYPES[case.dtype]
    ds = load_case_data(cfg)
    victim = draw_batches(ds, cfg, dtype)[0]
    attack = attack_factory()
    if case.protocol != "fedsgd":
        public = load_case_data(cfg, "test") if "public_data" in attack.needs else None
        model = create_model(case.model, ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"), dtype=dtype)
        victim, obs = _observed_through_protocol(attack, cfg, ds, model, public)
        snap_update = {k: v.clone() for k, v in obs.update.tensors.items()}
        rec = attack.reconstruct(obs, generator(seed, "attack"))
        if not isinstance(rec, Reconstruction):
            raise PluginContractError(f"reconstruct must return a Reconstruction, got {type(rec).__name__}")
        return rec, victim, ds, not _tensors_equal(snap_update, obs.update.tensors), False
    public = load_case_data(cfg, "test") if "public_data" in attack.needs else None
    knowledge = attacker_knowledge(attack, ds, victim, public, Setup("fedsgd", {}, "none", {}))
    model = create_model(case.model, ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"), dtype=dtype)
    before_model = copy.deepcopy(model.state_dict())
    served = attack.prepare(model, knowledge, generator(seed, "attack-prepare"))
    prepare_mutated = not _tensors_equal(before_model, model.state_dict()) and served is model
    update = client_update(served, victim, cfg)
    obs = observation(update, served, attack, knowledge, cfg)  # the trial's own gate
    update = obs.update
    snap_update = {k: v.clone() for k, v in update.tensors.items()}
    snap_model = copy.deepcopy(obs.model.state_dict()) if obs.model is not None else None
    rec = attack.reconstruct(obs, generator(seed, "attack"))
    if not isinstance(rec, Reconstruction):
        raise PluginContractError(f"reconstruct must return a Reconstruction, got {type(rec).__name__}")
    mutated = not _tensors_equal(snap_update, update.tensors)
    return rec, victim, ds, mutated, prepare_mutated


def _output_check(rec: Any, victim: Any, ds: Any) -> Check:
    """The reconstruction's shapes and dtypes: images (n, *input shape) of the data's dtype (a text case's: scores
    (n, L, V) over the vocabulary, in the model's float dtype), finite; labels a 1-D long tensor of class indices."""
    shape_ok, detail = True, ""
    want = victim.x.dtype if victim.x.dtype.is_floating_point else torch.get_default_dtype()
    if rec.x is None and rec.y is None:
        shape_ok, detail = False, "returned neither images nor labels"
    if rec.x is not None:
        if rec.x.dim() != 1 + len(ds.input_shape) or tuple(rec.x.shape[1:]) != ds.input_shape or rec.x.shape[0] < 1:
            shape_ok, detail = False, f"x has shape {tuple(rec.x.shape)}, expected (n, {', '.join(map(str, ds.input_shape))})"
        elif rec.x.dtype != want:
            shape_ok, detail = False, f"x dtype {rec.x.dtype} != data dtype {want}"
        elif not torch.isfinite(rec.x).all():
            shape_ok, detail = False, "x has NaN or infinity"
    if rec.y is not None:
        if rec.y.dtype != torch.long or rec.y.dim() != 1 or (rec.y.numel() and (rec.y.min() < 0 or rec.y.max() >= ds.num_classes)):
            shape_ok, detail = False, f"y must be a 1-D long tensor of class indices, got {rec.y!r}"
    return Check("output shapes and dtypes", shape_ok, detail)


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
    for case in attack_cases(cls):
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
    through = f", through {case.protocol} {case.protocol_params}" if case.protocol != "fedsgd" else ""
    checks.append(Check("supports a standard case", True, f"{case.model}, batch size {case.batch_size}{through}"))
    checks.append(_output_check(rec, victim, ds))
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
    checks.append(_hooks_check(factory, case))
    return checks


def _hooks_check(factory: Callable[[], Attack], case: CaseConfig) -> Check:
    name = "models change only through the hooks"
    try:
        problem = model_hook_problem(factory, case)
    except UnsupportedCase as exc:  # a case the attack refuses through the protocol: nothing to check there
        return Check(name, True, f"not exercised: {exc}")
    except Exception as exc:  # noqa: BLE001 - a broken hook is what this finds
        problem = f"{type(exc).__name__}: {exc}"
    return Check(name, not problem, problem)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def model_hook_problem(attack_factory: Callable[[], Attack], case: CaseConfig, clients: int = 3, seed: int = 0) -> str:
    """What an attack did to a model outside `prepare` and `prepare_clients` ('' where nothing): the case (one the
    attack supports) runs through secure aggregation with `clients` clients (or the protocol the case names),
    the hooks build the clients' models, one round runs and the attack reconstructs; the model handed to the hooks
    and every model they returned must then be exactly as the hooks left them, and different models per client
    need "per_client_models" in `needs`."""
    from gleak.gate import refuse_unservable

    if case.protocol == "fedsgd":
        case = replace(case, clients=clients, protocol="secure-aggregation")
    cfg = TrialConfig("check", "x", {}, "none", {}, case, seed)
    ds, attack = load_case_data(cfg), attack_factory()
    batches = draw_batches(ds, cfg, DTYPES[case.dtype])
    setup = trial_setup(case, "none", {})
    protocol = registry.create("protocol", setup.protocol, **setup.protocol_params)
    refuse_unservable(attack, protocol, "the attack", setup.protocol)
    public = load_case_data(cfg, "test") if "public_data" in attack.needs else None
    knowledge = attacker_knowledge(attack, ds, batches[0], public, setup)
    model = create_model(case.model, ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"), dtype=DTYPES[case.dtype])
    protocol.reset()
    models = protocol.client_models(model, len(batches), generator(seed, "client-models"))
    handed = [(models[0], _state(models[0]))]
    if protocol.shared_model:
        prepared = attack.prepare(models[0], knowledge, generator(seed, "attack-prepare"))
        if not _tensors_equal(handed[0][1], _state(models[0])):
            return "prepare modified the model it was handed (return a new module)"
        handed.append((prepared, _state(prepared)))
        models = attack.prepare_clients(prepared, len(batches), knowledge, generator(seed, "attack-clients"))
        if not _tensors_equal(handed[1][1], _state(prepared)):
            return "prepare_clients modified the prepared model in place (return new modules)"
        if len({id(m) for m in models}) > 1 and "per_client_models" not in attack.needs:
            return 'prepare_clients sends clients different models without "per_client_models" in needs'
    served = handed + [(m, _state(m)) for m in models]
    _, seen = run_rounds(protocol, [registry.create("defense", "none") for _ in batches], models, protocol.observed_rounds(),
                         observed_schedule(batches, cfg), case.warmup_lr, step_last=False)  # fmt: skip
    history = tuple(observation(w.view, w.held, attack, knowledge, cfg) for w in seen[:-1])
    attack.reconstruct(observation(seen[-1].view, seen[-1].held, attack, knowledge, cfg, history), generator(seed, "attack"))
    if any(not _tensors_equal(state, _state(m)) for m, state in served):
        return ("a model the clients computed at changed after the hooks returned (in reconstruct, or through a "
                "reference kept from them): only prepare and prepare_clients may shape the models")  # fmt: skip
    return ""


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


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The values under torch.func's wrappers (DP-SGD computes per-example gradients under vmap), detached."""
    try:
        from torch._C import _functorch as ft

        while ft.is_functorch_wrapped_tensor(t):
            t = ft.get_unwrapped(t)
    except (ImportError, AttributeError):  # another torch: the tensor as it is
        pass
    return t.detach().clone()


def _missing_rows(rows: torch.Tensor, allowed: torch.Tensor) -> int:
    """How many of `rows` (n, d) are not exactly one of `allowed`'s rows (m, d)."""
    if not len(rows):
        return 0
    if not len(allowed):
        return len(rows)
    same = (rows.unsqueeze(1) == allowed.unsqueeze(0)).all(-1)
    return int((~same.any(1)).sum())


def _declared_inputs_problems(factory: Callable[[], Any]) -> list[str]:
    """The inputs the model sees inside client_gradient (a forward pre-hook on the probe model) against what the
    defense declares: without a `gradient_batch` override, only rows of the client's batch; with one, exactly the
    rows of the batch it kept (Defense.training_batch), which has the client's shapes and is deterministic."""
    model = create_model("mlp", (1, 4, 4), 3, seed=0, dtype=torch.float64, hidden=[6])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 1, 4, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    seen: list[torch.Tensor] = []
    handle = model.register_forward_pre_hook(lambda _, inp: seen.append(_unwrapped(inp[0])))
    d = factory()
    d.reset()
    kept: list = []
    d.kept_batches = kept
    try:
        d.client_gradient(model, x, y, torch.Generator().manual_seed(6))
    except Exception as exc:  # noqa: BLE001
        return [f"client_gradient raised {type(exc).__name__}: {exc}"]
    finally:
        handle.remove()
        d.kept_batches = None
    width = x[0].numel()
    rows = torch.cat([t.reshape(-1, width) for t in seen]) if seen else x.new_zeros(0, width)
    if not transforms_inputs(d):
        n = _missing_rows(rows, x.reshape(-1, width))
        return [f"the model saw {n} input rows that are not the client's: a defense that trains on transformed inputs "
                "must declare it (override Defense.gradient_batch, train through Defense.training_batch)"] if n else []  # fmt: skip
    if not kept:
        return ["gradient_batch is overridden but client_gradient kept no batch (call Defense.training_batch)"]
    sent = torch.cat([xb.reshape(-1, width) for _, xb, _ in kept])
    problems = []
    if any(xb.shape != x.shape or xb.dtype != x.dtype or yb.shape != y.shape for _, xb, yb in kept):
        problems.append("gradient_batch must return x's shape and dtype and y's shape")
    if _missing_rows(rows, sent) or _missing_rows(sent, rows):
        problems.append("the model did not train on exactly the batch gradient_batch returned and training_batch kept")
    again = factory().gradient_batch(x, y, torch.Generator().manual_seed(6))
    if not torch.equal(again[0], kept[0][1]):
        problems.append("gradient_batch: two calls with the same generator differ")
    return problems


def check_defense(name: str, params: dict[str, Any] | None = None) -> list[Check]:
    info = registry.plugin_info("defense", name)
    fast = {**getattr(info.obj, "conformance_params", {}), **(params or {})}
    factory = lambda: registry.create("defense", name, **fast)  # noqa: E731
    checks = _meta_checks("defense", name)
    problems = {"layout and dtype preserved": [], "deterministic under a seed": [], "does not mutate its input": [],
                "finite on zero and tiny updates": [], "client gradient well formed": []}  # fmt: skip
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
        problems["client gradient well formed"] += _client_gradient_problems(factory, dtype)
    checks += [Check(k, not v, "; ".join(v)) for k, v in problems.items()]
    hooks = [h for h in ROUND_HOOKS if isinstance(info.obj, type) and hasattr(info.obj, h) and not hasattr(Defense, h)]
    checks.append(Check("no round hooks", not hooks, f"{', '.join(hooks)}: a Protocol's methods, never called on a "
                        "defense (register a protocol with register_protocol)" if hooks else ""))  # fmt: skip
    declared = _declared_inputs_problems(factory)
    checks.append(Check("declares the inputs it trains on", not declared, "; ".join(declared)))
    return checks


# ---- models -----------------------------------------------------------------------------------------------------
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
    from gleak.trial import run_trial

    cfg = TrialConfig("check", "inverting-gradients", registry.check_params("attack", "inverting-gradients",
                      {"iterations": 2, "tv": 1e-4}), "none", {}, case, 0)  # fmt: skip
    row = run_trial(cfg)
    return "" if row["status"] == "ok" else f"the trial {row['status']}: {row.get('error')}"


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


# ---- protocols --------------------------------------------------------------------------------------------------
def _probe_setup(dtype: torch.dtype = torch.float32):
    """A small MLP and three clients' batches (the victim first)."""
    model = create_model("mlp", (1, 4, 4), 3, seed=0, dtype=dtype, hidden=[6])
    g = torch.Generator().manual_seed(0)
    zero, one = torch.zeros(1), torch.ones(1)
    batches = [ClientBatch(torch.randn(2, 1, 4, 4, generator=g, dtype=dtype), torch.tensor([i % 3, (i + 1) % 3]), zero, one)
               for i in range(3)]  # fmt: skip
    return model, batches


def _layout(module: Any) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in module.named_parameters()] if isinstance(module, torch.nn.Module) else []


def _run(check: str, fn: Callable[[], str]) -> Check:
    """A check whose body returns a problem ('' when none); an exception is a failure naming it."""
    try:
        problem = fn()
    except Exception as exc:  # noqa: BLE001 - a broken hook is what this finds
        problem = f"{type(exc).__name__}: {exc}"
    return Check(check, not problem, problem)


class _ProtocolProbe:
    """The checks of one protocol, on a small probe model and three clients' batches: each method returns '' or
    what is wrong."""

    def __init__(self, name: str, fast: dict[str, Any]):
        self.name, self.fast = name, fast
        self.model, self.batches = _probe_setup()
        self.layout = _layout(self.model)

    def factory(self) -> Any:
        return registry.create("protocol", self.name, **self.fast)

    @staticmethod
    def none() -> Defense:
        return registry.create("defense", "none")

    @staticmethod
    def rng(s: int) -> torch.Generator:
        return torch.Generator().manual_seed(s)

    def start(self) -> tuple[Any, list[torch.nn.Module]]:
        from gleak.protocol import Protocol

        p = self.factory()
        if not isinstance(p, Protocol):
            raise TypeError(f"a protocol must be a gleak.protocol.Protocol, got {type(p).__name__}")
        p.reset()
        return p, p.client_models(self.model, len(self.batches), self.rng(1))

    def sent_updates(self, p: Any, ms: list[torch.nn.Module]) -> list[Update]:
        return [p.client_update(m, b, self.none(), self.rng(10 + i)) for i, (m, b) in enumerate(zip(ms, self.batches))]

    def models_ok(self) -> str:
        snap = copy.deepcopy(self.model.state_dict())
        p, ms = self.start()
        if len(ms) != len(self.batches) or any(_layout(m) != self.layout for m in ms):
            return "client_models must return one module per client with the model's parameter layout"
        if not _tensors_equal(snap, self.model.state_dict()):
            return "client_models modified the server's model"
        again = self.start()[1]
        if any(not _tensors_equal(a.state_dict(), b.state_dict()) for a, b in zip(ms, again)):
            return "two calls with the same generator differ"
        return ""

    def update_ok(self) -> str:
        p, ms = self.start()
        u = self.sent_updates(p, ms)[0]
        names = [n for n, q in ms[0].named_parameters() if q.requires_grad]
        if not isinstance(u, Update) or u.names() != names:
            return "client_update must return an Update with one tensor per trainable parameter, in model order"
        if any(u[n].shape != q.shape or u[n].dtype != q.dtype for n, q in ms[0].named_parameters()) or not u.is_finite()[0]:
            return "a tensor has the wrong shape or dtype, or is not finite"
        if u.num_samples != self.batches[0].size:
            return f"num_samples must be the client's batch size ({self.batches[0].size}), got {u.num_samples}"
        return ""

    def view_ok(self) -> str:
        p, ms = self.start()
        sent = self.sent_updates(p, ms)
        snap = [dict((k, v.clone()) for k, v in u.tensors.items()) for u in sent]
        view = p.observe(sent, self.rng(4))
        if not isinstance(view, Update) or view.names() != sent[0].names() or not view.is_finite()[0]:
            return "observe must return a finite Update of the clients' layout"
        if any(not _tensors_equal(a, u.tensors) for a, u in zip(snap, sent)):
            return "observe modified what the clients sent"
        p2, ms2 = self.start()
        if not _tensors_equal(view.tensors, p2.observe(self.sent_updates(p2, ms2), self.rng(4)).tensors):
            return "two views with the same generator differ"
        return ""

    def held_ok(self) -> str:
        p, ms = self.start()
        p.observe(self.sent_updates(p, ms), self.rng(4))
        held = p.observer_model(ms[0], ms)
        return "" if _layout(held) == self.layout else "observer_model must return a module with the model's layout"

    def step_ok(self) -> str:
        p, ms = self.start()
        sent = self.sent_updates(p, ms)
        p.observe(sent, self.rng(4))
        snaps = [copy.deepcopy(m.state_dict()) for m in ms]
        new = p.server_step(ms, sent, 0.1, self.rng(5))
        if len(new) != len(ms) or any(_layout(m) != self.layout for m in new):
            return "server_step must return one module per client with the model's layout"
        if any(not _tensors_equal(s, m.state_dict()) for s, m in zip(snaps, ms)):
            return "server_step modified the models it was given (return new modules)"
        if all(_tensors_equal(s, m.state_dict()) for s, m in zip(snaps, new)):
            return "server_step left every model where it was (no client's model moved)"
        return ""

    def rounds_ok(self) -> str:
        from gleak.protocol import Schedule

        rng, batches = self.rng, self.batches
        views = []
        for _ in range(2):
            p, ms = self.start()
            sched = Schedule(lambda r: batches, lambda r: [rng(20 + i + 10 * r) for i in range(3)], lambda r: rng(30 + r))
            out, seen = run_rounds(p, [self.none() for _ in batches], ms, 2, sched, 0.1)
            if len(seen) != 2 or any(w.view is None for w in seen) or len(out) != len(batches):
                return "run_rounds did not return two observed rounds and one model per client"
            views.append(torch.cat([w.view.flat() for w in seen]))
        if not torch.equal(*views):
            return "two runs with the same seeds differ"
        if p.observed_rounds() < 1:
            return f"observed_rounds must be >= 1, got {p.observed_rounds()}"
        return ""

    def trains_ok(self) -> str:
        from gleak.config import UtilityConfig
        from gleak.utility import load_utility_data

        cfg = UtilityConfig(dataset="skimage", model="mlp", model_params={"hidden": [8]}, resolution=8, clients=3,
                            training_rounds=2, batch_size=2, server_lr=0.1)  # fmt: skip
        train, test = load_utility_data(cfg)
        out = self.factory().train_utility(cfg, train, test, self.rng(6))
        acc = out.get("accuracy") if isinstance(out, dict) else None
        if not isinstance(acc, float) or not 0 <= acc <= 1:
            return f"train_utility must return {{'accuracy': float in [0, 1], ...}}, got {out!r}"[:200]
        return ""


def check_protocol(name: str, params: dict[str, Any] | None = None) -> list[Check]:
    info = registry.plugin_info("protocol", name)
    fast = {**getattr(info.obj, "conformance_params", {}), **(params or {})}
    checks = _meta_checks("protocol", name)
    probe = _ProtocolProbe(name, fast)
    for check, fn in (("client models", probe.models_ok), ("client update well formed", probe.update_ok),
                      ("observer view well formed", probe.view_ok), ("observer model", probe.held_ok),
                      ("server step moves the models", probe.step_ok), ("rounds run deterministically", probe.rounds_ok),
                      ("trains for utility", probe.trains_ok)):  # fmt: skip
        checks.append(_run(check, fn))
    return checks
