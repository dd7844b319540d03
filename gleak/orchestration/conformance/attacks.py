"""The conformance checks of an attack: its cases, output, determinism, and models shaped only by its hooks."""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Callable

import torch

from gleak.contracts import registry
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.errors import PluginContractError, UnsupportedCase
from gleak.contracts.plugin import Attack
from gleak.contracts.seeds import derive_seed, generator
from gleak.contracts.tags import get_tags
from gleak.contracts.wire import KNOWLEDGE, Reconstruction
from gleak.mechanics.defense_output import extra_json
from gleak.mechanics.gate import attacker_knowledge, forged_models, observation
from gleak.mechanics.label_query import query_model, read_counts
from gleak.mechanics.models import create_model
from gleak.mechanics.protocol_setup import Setup, trial_setup
from gleak.mechanics.rounds import run_rounds
from gleak.orchestration.conformance.common import CASES, TEXT_CASES, Check, _meta_checks, _state, _tensors_equal
from gleak.orchestration.trial import DTYPES, client_update, draw_batches, load_case_data, observed_schedule


def attack_cases(cls: type) -> tuple[CaseConfig, ...]:
    """The standard cases, and for an attack that only applies behind a protocol's wire (its class names one as
    `conformance_protocol = (name, params)`) the first MLP case run through that protocol with two clients."""
    if get_tags(cls).modality == "text":
        return TEXT_CASES
    extra = getattr(cls, "conformance_protocol", None)
    if extra is None:
        return CASES
    name, params = extra
    return (*CASES, replace(CASES[0], clients=2, protocol=name, protocol_params=dict(params)))


def _observed_through_protocol(attack: Attack, cfg: TrialConfig, ds: Any, model: Any, public: Any):
    """A case with a protocol: its observed rounds (gleak.mechanics.rounds.run_rounds), every round through the gate."""
    dtype = DTYPES[cfg.case.dtype]
    batches = draw_batches(ds, cfg, dtype)
    setup = trial_setup(cfg.case, "none", {})
    protocol = registry.create("protocol", setup.protocol, **setup.protocol_params)
    defenses = [registry.create("defense", "none") for _ in batches]
    knowledge = attacker_knowledge(attack, ds, batches[0], public, setup)
    protocol.reset()
    models = protocol.client_models(model, len(batches), generator(cfg.seed, "client-models"))
    if "forged_aggregate" in get_tags(attack).needs:  # the forged round, as a trial makes it
        models = forged_models(attack, protocol, models, knowledge, cfg.seed)
    _, seen = run_rounds(protocol, defenses, models, protocol.observed_rounds(), observed_schedule(batches, cfg),
                         cfg.case.warmup_lr, step_last=False)  # fmt: skip
    history = tuple(observation(w.view, w.held, attack, knowledge, cfg.seed) for w in seen[:-1])
    return batches[0], observation(seen[-1].view, seen[-1].held, attack, knowledge, cfg.seed, history)


def _run_attack_once(attack_factory: Callable[[], Attack], case: CaseConfig, seed: int = 0):
    """One trial's chain, returning what the checks inspect."""
    cfg = TrialConfig("check", "x", {}, "none", {}, case, seed)
    dtype = DTYPES[case.dtype]
    ds = load_case_data(cfg)
    victim = draw_batches(ds, cfg, dtype)[0]
    attack = attack_factory()
    if case.protocol != "fedsgd":
        public = load_case_data(cfg, "test") if "public_data" in get_tags(attack).needs else None
        model = create_model(case.model, ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"), dtype=dtype)
        victim, obs = _observed_through_protocol(attack, cfg, ds, model, public)
        snap_update = {k: v.clone() for k, v in obs.update.tensors.items()}
        rec = attack.reconstruct(obs, generator(seed, "attack"))
        if not isinstance(rec, Reconstruction):
            raise PluginContractError(f"reconstruct must return a Reconstruction, got {type(rec).__name__}")
        return rec, victim, ds, not _tensors_equal(snap_update, obs.update.tensors), False
    public = load_case_data(cfg, "test") if "public_data" in get_tags(attack).needs else None
    knowledge = attacker_knowledge(attack, ds, victim, public, Setup("fedsgd", {}, "none", {}))
    model = create_model(case.model, ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"), dtype=dtype)
    if "label_counts" in get_tags(attack).needs:  # the server's query round, as a trial makes it (gleak.orchestration.trial)
        query = query_model(model, ds.num_classes)
        counts = read_counts(client_update(query, victim, cfg, tag="/query"), query, ds.num_classes, victim.size)
        knowledge = replace(knowledge, label_counts=counts)
    if "forged_aggregate" in get_tags(attack).needs:  # the forged round, as a trial makes it
        model = forged_models(attack, registry.create("protocol", "fedsgd"), [model], knowledge, cfg.seed)[0]
    before_model = copy.deepcopy(model.state_dict())
    served = attack.prepare(model, knowledge, generator(seed, "attack-prepare"))
    prepare_mutated = not _tensors_equal(before_model, model.state_dict()) and served is model
    update = client_update(served, victim, cfg)
    obs = observation(update, served, attack, knowledge, cfg.seed)  # the trial's own gate
    update = obs.update
    snap_update = {k: v.clone() for k, v in update.tensors.items()}
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
    fast = {**get_tags(cls).fast_params, **(params or {})}
    factory = lambda: registry.create("attack", name, **fast)  # noqa: E731
    checks = _meta_checks("attack", name)
    inst = factory()
    needs = set(get_tags(inst).needs)
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
    try:  # what the trial stores (gleak.mechanics.defense_output): a dict of JSON values
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


def model_hook_problem(attack_factory: Callable[[], Attack], case: CaseConfig, clients: int = 3, seed: int = 0) -> str:
    """What an attack did to a model outside `prepare` and `prepare_clients` ('' where nothing): the case (one the
    attack supports) runs through secure aggregation with `clients` clients (or the protocol the case names),
    the hooks build the clients' models, one round runs and the attack reconstructs; the model handed to the hooks
    and every model they returned must then be exactly as the hooks left them, and different models per client
    need "per_client_models" in `needs`."""
    from gleak.mechanics.gate import refuse_unservable

    if case.protocol == "fedsgd":
        case = replace(case, clients=clients, protocol="secure-aggregation")
    cfg = TrialConfig("check", "x", {}, "none", {}, case, seed)
    ds, attack = load_case_data(cfg), attack_factory()
    batches = draw_batches(ds, cfg, DTYPES[case.dtype])
    setup = trial_setup(case, "none", {})
    protocol = registry.create("protocol", setup.protocol, **setup.protocol_params)
    refuse_unservable(attack, protocol, "the attack", setup.protocol)
    public = load_case_data(cfg, "test") if "public_data" in get_tags(attack).needs else None
    knowledge = attacker_knowledge(attack, ds, batches[0], public, setup)
    model = create_model(case.model, ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"), dtype=DTYPES[case.dtype])
    protocol.reset()
    models = protocol.client_models(model, len(batches), generator(seed, "client-models"))
    handed = [(models[0], _state(models[0]))]
    if get_tags(protocol).shared_model:
        prepared = attack.prepare(models[0], knowledge, generator(seed, "attack-prepare"))
        if not _tensors_equal(handed[0][1], _state(models[0])):
            return "prepare modified the model it was handed (return a new module)"
        handed.append((prepared, _state(prepared)))
        models = attack.prepare_clients(prepared, len(batches), knowledge, generator(seed, "attack-clients"))
        if not _tensors_equal(handed[1][1], _state(prepared)):
            return "prepare_clients modified the prepared model in place (return new modules)"
        if len({id(m) for m in models}) > 1 and "per_client_models" not in get_tags(attack).needs:
            return 'prepare_clients sends clients different models without "per_client_models" in needs'
    served = handed + [(m, _state(m)) for m in models]
    _, seen = run_rounds(protocol, [registry.create("defense", "none") for _ in batches], models, protocol.observed_rounds(),
                         observed_schedule(batches, cfg), case.warmup_lr, step_last=False)  # fmt: skip
    history = tuple(observation(w.view, w.held, attack, knowledge, cfg.seed) for w in seen[:-1])
    attack.reconstruct(observation(seen[-1].view, seen[-1].held, attack, knowledge, cfg.seed, history), generator(seed, "attack"))
    if any(not _tensors_equal(state, _state(m)) for m, state in served):
        return ("a model the clients computed at changed after the hooks returned (in reconstruct, or through a "
                "reference kept from them): only prepare and prepare_clients may shape the models")  # fmt: skip
    return ""
