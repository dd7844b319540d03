"""Protocols as their own plugin kind: the registry, the legacy defense spelling, trial ids, the one round loop,
the observation gate, CGD's rounds (per participant and vectorised), and refusals."""
import csv
import dataclasses
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import gleak
from gleak.contracts import registry
from gleak.contracts.config import CaseConfig, TrialConfig, UtilityConfig
from gleak.contracts.plugin import Attack
from gleak.contracts.wire import Reconstruction
from gleak.mechanics.data import ImageDataset
from gleak.mechanics.protocol_setup import trial_setup
from gleak.orchestration.trial import execute, run_trial

ROOT = Path(__file__).resolve().parent.parent


# ---- trial ids ------------------------------------------------------------------------------------------------
def _published_ids(path: Path) -> list[str] | None:
    import gleak.orchestration.suite as S

    s = S.load_suite(path)
    out = ROOT / "results" / s.name / "results.csv"
    if not out.exists():
        return None
    if any(t.identity().get("vocabulary_sha256") == "" for t in s.trials[:1]):
        return "corpus missing"  # a text suite's ids hold its vocabulary's hash, which needs the corpus installed
    return sorted(t.trial_id for t in s.trials), sorted(r["trial_id"] for r in csv.DictReader(out.open()))


def test_every_shipped_suite_keeps_the_trial_ids_of_its_published_results(monkeypatch):
    # A data check: the published results.csv of each shipped suite holds the ids its trials had when they were
    # run; the suite loaded by today's code must give exactly those ids (the data sets need not be here: their
    # checks are skipped). A folder not yet regenerated after a change that gave its trials new ids says so in its
    # STALE.md (why, and the command that regenerates it): it is listed, never silently passed.
    import gleak.orchestration.suite as S

    monkeypatch.setattr(S, "_check_data", lambda *a, **k: None)
    monkeypatch.setattr(S, "_utility", lambda *a, **k: None)
    checked, stale = 0, []
    for path in sorted((ROOT / "suites").glob("*.toml")):
        pair = _published_ids(path)
        if pair is None:
            continue
        if pair == "corpus missing":  # an optional extra not installed here (fortunes): its suite is not compared
            stale.append(f"{path.stem} (text corpus not installed)")
            continue
        note = ROOT / "results" / path.stem / "STALE.md"
        if note.exists():
            assert f"gleak run suites/{path.name}" in note.read_text(), f"{note}: say how to regenerate the folder"
            stale.append(path.stem)
            continue
        ours, published = pair
        assert ours == published, f"{path.name}: {len(set(ours) - set(published))} trial ids changed"
        checked += 1
    assert checked >= 3 and checked + len(stale) >= 6, (checked, stale)


def test_the_default_protocol_stays_out_of_the_identity_and_a_named_one_enters_it():
    base = TrialConfig("t", "closed-form", {}, "none", {}, CaseConfig(), 0)
    assert "protocol" not in base.identity()["case"]
    assert TrialConfig.from_json(base.to_json()) == base
    cgd = dataclasses.replace(base, case=CaseConfig(protocol="cgd"))
    assert cgd.trial_id != base.trial_id and TrialConfig.from_json(cgd.to_json()) == cgd


# ---- the registry -----------------------------------------------------------------------------------------------
def test_list_protocols_and_the_legacy_defense_spelling(capsys):
    from gleak.cli import main

    assert main(["list", "protocols"]) == 0
    listed = capsys.readouterr().out
    assert all(n in listed for n in ("fedsgd", "fedavg", "secure-aggregation", "cgd"))
    assert set(gleak.list_plugins("protocol")) >= {"fedsgd", "fedavg", "secure-aggregation", "cgd"}
    # [[defense]] name = "cgd": the cgd protocol with the "none" transform, ranked as a defense.
    s = trial_setup(CaseConfig(clients=4), "cgd", {"delta": 0.01})
    assert (s.protocol, s.protocol_params["delta"], s.defense) == ("cgd", 0.01, "none")
    assert trial_setup(CaseConfig(), "topk", {"ratio": 0.9}) == trial_setup(CaseConfig(), "topk", {"ratio": 0.9})
    s = trial_setup(CaseConfig(protocol="secure-aggregation"), "topk", {"ratio": 0.9})
    assert (s.protocol, s.defense) == ("secure-aggregation", "topk")
    # The defense spelling of secure aggregation had no parameters: the protocol's new ones stay out of its trial ids.
    assert registry.check_params("defense", "secure-aggregation", {}) == {}
    s = trial_setup(CaseConfig(update="fedavg", local_steps=3, local_lr=0.05), "none", {})
    assert (s.protocol, s.protocol_params["local_steps"], s.protocol_params["local_lr"]) == ("fedavg", 3, 0.05)


def test_a_renamed_plugin_keeps_its_old_name_with_a_warning_and_its_trial_ids():
    @registry.register_attack("test-old-name")
    class Before(Attack):
        """A stand-in for an attack before its rename."""

    old = TrialConfig("t", "test-old-name", {}, "none", {}, CaseConfig(), 0).trial_id
    registry._REGISTRIES["attack"]._plugins.pop("test-old-name")

    @registry.register_attack("test-new-name", aliases=("test-old-name",))
    class After(Attack):
        """The same attack under its new name."""

    with pytest.warns(DeprecationWarning, match="test-old-name.*test-new-name"):
        assert registry.plugin_info("attack", "test-old-name").obj is After
    with pytest.warns(DeprecationWarning):
        assert isinstance(gleak.create("attack", "test-old-name"), After)
    assert TrialConfig("t", "test-new-name", {}, "none", {}, CaseConfig(), 0).trial_id == old
    assert TrialConfig("t", "test-old-name", {}, "none", {}, CaseConfig(), 0).trial_id == old
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.plugin_info("attack", "test-new-name")  # the new name warns nothing


def test_case_protocol_errors_name_the_key(tmp_path):
    from gleak.contracts.errors import InputError
    from gleak.orchestration.suite import load_suite

    def suite(case: str, defense: str = 'name = "none"') -> Path:
        f = tmp_path / "s.toml"
        f.write_text(f'[case]\nmodel = "mlp"\nresolution = 8\n{case}\n[[attack]]\nname = "closed-form"\n[[defense]]\n{defense}\n')
        return f

    for case, defense, msg in (
        ('protocol = "cdg"', 'name = "none"', "[case] key 'protocol': unknown protocol 'cdg'; did you mean 'cgd'"),
        ('protocol = "cgd"\nprotocol_params = { delta = -1.0 }', 'name = "none"', "[case] key 'protocol_params'"),
        ('protocol = "cgd"\nprotocol_params = { delt = 0.1 }', 'name = "none"', "key 'protocol_params.delt'"),
        ('protocol = "cgd"', 'name = "cgd"', "[defense] key 'name': defense 'cgd' is the protocol 'cgd'"),
    ):  # fmt: skip
        with pytest.raises(InputError, match=msg.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            load_suite(suite(case, defense))
    ok = load_suite(suite('clients = 4\nprotocol = "cgd"\nprotocol_params = { delta = 0.01 }', 'name = "noise"\nsigma = 0.01'))
    (t,) = ok.trials
    assert t.case.protocol_params["delta"] == 0.01 and t.defense == "noise"


# ---- the gate ---------------------------------------------------------------------------------------------------
class _Peek(Attack):
    """Keeps what it is given."""

    needs = frozenset({"architecture", "parameters"})
    got: list = []

    def reconstruct(self, observation, rng):
        type(self).got.append(observation)
        return Reconstruction(x=torch.zeros((1, *observation.knowledge.input_shape)))


def _everything_but_values(obj, depth=0):
    """Every attribute of what an attack receives, tensors by shape and dtype (their values depend on the data)."""
    if depth > 6:
        return "..."
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), str(obj.dtype))
    if isinstance(obj, torch.nn.Module):
        return ("module", type(obj).__name__, [(n, tuple(p.shape)) for n, p in obj.state_dict().items()])
    if dataclasses.is_dataclass(obj):
        return {f.name: _everything_but_values(getattr(obj, f.name), depth + 1) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _everything_but_values(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_everything_but_values(v, depth + 1) for v in obj]
    return obj


@pytest.mark.parametrize("protocol", ["fedsgd", "fedavg", "secure-aggregation"])
def test_an_attack_not_granted_the_batch_size_cannot_read_it_anywhere(protocol):
    if "test-peek" not in gleak.list_plugins("attack"):
        registry.register_attack("test-peek")(_Peek)
    params = {"local_steps": 2} if protocol == "fedavg" else {}

    def seen(batch, needs):
        _Peek.got.clear()
        _Peek.needs = needs
        case = CaseConfig(dataset="skimage", model="mlp", resolution=8, batch_size=batch, clients=2, warmup_rounds=1,
                          protocol=protocol, protocol_params=params)  # fmt: skip
        execute(TrialConfig("t", "test-peek", {}, "none", {}, case, 0))
        return _everything_but_values(_Peek.got[-1])

    try:
        blind = frozenset({"architecture", "parameters"})
        assert seen(2, blind) == seen(3, blind)  # no attribute differs with the batch size: none carries it
        told = blind | {"batch_size"}
        assert seen(2, told) != seen(3, told)  # the control: granted, it is there
    finally:
        _Peek.needs = frozenset({"architecture", "parameters"})


def test_the_defense_is_described_only_to_an_attack_that_knows_it():
    if "test-peek" not in gleak.list_plugins("attack"):
        registry.register_attack("test-peek")(_Peek)
    case = CaseConfig(dataset="skimage", model="mlp", resolution=8, batch_size=1)

    def described(needs, defense="topk", params=None):
        _Peek.got.clear()
        _Peek.needs = needs
        params = registry.check_params("defense", defense, {"ratio": 0.3} if params is None else params)
        execute(TrialConfig("t", "test-peek", {}, defense, params, case, 0))
        return _Peek.got[-1].knowledge.defense

    try:
        assert described(frozenset({"architecture", "parameters"})) is None
        told = described(frozenset({"architecture", "parameters", "knows_defense"}))
        assert told.defense == "topk" and told.param("ratio") == 0.3 and told.protocol == "fedsgd"
        # DGP's error-feedback residual is client state, never part of the description
        dgp = described(frozenset({"knows_defense"}), "dgp", {})
        assert dgp.defense == "dgp" and all(not isinstance(v, torch.Tensor) for v in dgp.defense_params.values())
    finally:
        _Peek.needs = frozenset({"architecture", "parameters"})


# ---- the round loop, CGD ----------------------------------------------------------------------------------------
def _image_ds(n, seed):
    proto = torch.rand(4, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 4
    x = (proto[y] + 0.3 * torch.rand(n, 1, 6, 6, generator=g)).clamp(0, 1)
    return ImageDataset("toy", x, y, tuple("abcd"), torch.tensor([0.5]), torch.tensor([0.3]))


def _rounds_and_engine(partition: str, secure_sum: str):
    """The same CGD utility run twice, on a toy set: through run_rounds (train_per_participant's models) and by the
    vectorised engine stepped as the plugin steps it. Returns (the rounds' models, the engine, the partition)."""
    from gleak.protocols.cgd_training import ConfinedMLP, Partition, init_deltas, make_layout, step_size
    from gleak.protocols.cgd_utility import subset, train_per_participant

    from gleak.contracts.seeds import derive_seed

    train_ds = _image_ds(30, 0)
    cfg = UtilityConfig(dataset="toy", model="mlp", model_params={"hidden": [5]}, training_rounds=4, server_lr=0.5, seed=3)
    cgd = gleak.create("protocol", "cgd", partition=partition, delta=0.1, delta_high=0.3, secure_sum=secure_sum)
    ours = train_per_participant(cgd, cfg, train_ds, train_ds, dtype=torch.float64, models_only=True)
    seed = derive_seed(cfg.seed, "cgd")
    x, y = subset(train_ds, None, cfg.seed, "pixels")
    part = Partition.parse(partition)
    net = ConfinedMLP(make_layout(x.double(), y, part), [36, 5, 4], init_deltas(part.m, 0.1, 0.3, seed), seed,
                      secure_sum=secure_sum, dtype=torch.float64)  # fmt: skip
    for k in range(1, cfg.training_rounds + 1):
        net.step(step_size(k, cfg.server_step))
    return ours, net, part


def _same_model(module: torch.nn.Module, theirs: list[torch.Tensor], tol: float, where: int) -> None:
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    for r, lin in enumerate(linears):
        assert torch.allclose(lin.weight.T, theirs[2 * r], atol=tol, rtol=0), (where, r)
        assert torch.allclose(lin.bias, theirs[2 * r + 1], atol=tol, rtol=0), (where, r)


@pytest.mark.parametrize("secure_sum", ["float", "protocol"])
def test_cgd_per_participant_rounds_equal_the_vectorised_engine(secure_sum):
    ours, net, _ = _rounds_and_engine("3x1", secure_sum)
    moved = 0.0
    for l, model in enumerate(ours):
        theirs = net.participant_params(l)
        _same_model(model, theirs, 1e-9, l)
        moved = max(moved, float((net._init(l)[0] - theirs[0]).abs().max()))
    assert moved > 1e-3  # the rounds stepped the models (a loop that never steps would also "agree")


@pytest.mark.parametrize("secure_sum,tol", [("float", 1e-9), ("protocol", 1e-4)])
def test_cgd_vertical_block_rounds_equal_the_vectorised_engines_vfl_reading(secure_sum, tol):
    """Sample blocks as clients of run_rounds (protocols/cgd_vertical.py) train the engine's vfl models: every
    participant's model (its block's first layer on all features, its own upper layers). The fixed-point wire
    rounds the block's bias in one partial rather than per participant (a named deviation): 2^-17 per entry."""
    ours, net, part = _rounds_and_engine("3x4", secure_sum)
    moved = 0.0
    for i, block in enumerate(ours):
        for j, member in enumerate(block.members):
            l = j * part.rows + i
            theirs = net.model_params(l)
            _same_model(member, theirs, tol, l)
            moved = max(moved, float((net._init(l)[2] - theirs[2]).abs().max()))
    assert moved > 1e-3  # the rounds stepped the models


def test_cgd_rounds_step_the_models_and_warm_up_rounds_are_cgd_rounds():
    if "test-peek" not in gleak.list_plugins("attack"):
        registry.register_attack("test-peek")(_Peek)
    _Peek.got.clear()
    case = CaseConfig(dataset="skimage", model="mlp", resolution=8, batch_size=2, clients=4, warmup_rounds=2)
    execute(TrialConfig("t", "test-peek", {}, "cgd", {"iterations": 2}, case, 0))
    obs = _Peek.got[-1]
    seen = [*obs.rounds, obs]
    assert len(seen) == 4 and all(o.update.meta["protocol"] == "cgd" for o in seen)  # warm-up through CGD too
    firsts = [o.model.state_dict()["1.weight"] for o in seen]
    assert all(not torch.equal(a, b) for a, b in zip(firsts, firsts[1:]))  # every round moved the proxy model


def test_an_active_attack_through_cgd_is_refused_in_one_line():
    case = CaseConfig(dataset="skimage", model="mlp", resolution=8, batch_size=2, clients=4)
    row = run_trial(TrialConfig("t", "imprint", {}, "cgd", {}, case, 0))
    assert row["status"] == "not-applicable" and row["error"].startswith("UnsupportedCase: active attack 'imprint'")
    assert "\n" not in row["error"]
    ok = run_trial(TrialConfig("t", "imprint", {}, "secure-aggregation", {}, case, 0))  # a shared model: it works
    assert ok["status"] == "ok"


def test_defenses_compose_with_protocols():
    case = CaseConfig(dataset="skimage", model="mlp", resolution=8, batch_size=2, clients=4, protocol="cgd")
    dp = {"mode": "dp", "noise_multiplier": 1.0, "clip": 1.0}
    row = run_trial(TrialConfig("t", "closed-form", {"rows": "agreement"}, "noise", dp, case, 0))
    assert row["status"] == "ok", row["error"]
    assert '"epsilon"' in row["extra"]  # the victim's accountant, stepped by the noisy step it took
    plain = run_trial(TrialConfig("t", "closed-form", {"rows": "agreement"}, "none", {}, case, 0))
    assert row["grad_dist"] > plain["grad_dist"] + 0.5  # the noise is inside CGD's (honest) sum
    sa = dataclasses.replace(case, protocol="secure-aggregation")
    topk = run_trial(TrialConfig("t", "closed-form", {}, "topk", {"ratio": 0.9}, sa, 0))
    assert topk["status"] == "ok" and topk["grad_dist"] > 0


# ---- conformance of protocols -------------------------------------------------------------------------------------
def test_a_protocol_with_a_broken_hook_fails_check_plugin(tmp_path):
    from gleak.orchestration.conformance import check_plugin

    f = tmp_path / "bad_protocol.py"
    f.write_text(textwrap.dedent('''
        import torch
        from gleak import register_protocol
        from gleak.mechanics.protocol import Protocol

        @register_protocol("test-stuck-protocol")
        class Stuck(Protocol):
            """Never moves the models, and its view ignores the generator."""
            def server_step(self, models, sent, lr, rng):
                return models
            def observe(self, sent, rng):
                return sent[0].map(lambda _, t: t + torch.randn(t.shape))

        @register_protocol("test-undocumented-protocol")
        class Undocumented(Protocol):
            pass
    '''))
    registry.load_plugin_file(f)
    failed = {c.name for c in check_plugin("protocol", "test-stuck-protocol") if not c.passed}
    assert failed == {"server step moves the models", "observer view well formed", "rounds run deterministically"}
    failed = {c.name for c in check_plugin("protocol", "test-undocumented-protocol") if not c.passed}
    assert failed == {"own docstring"}


def test_server_lr_is_the_new_name_of_the_fedsgd_warm_up_step_with_the_same_trial_id():
    from gleak.contracts.config_checks import check_case_values

    old = TrialConfig("t", "closed-form", {}, "dgp", {}, CaseConfig(warmup_rounds=3, local_lr=0.01), 0)
    new = TrialConfig("t", "closed-form", {}, "dgp", {}, CaseConfig(warmup_rounds=3, server_lr=0.01), 0)
    assert new.trial_id == old.trial_id and new.case.warmup_lr == old.case.warmup_lr == 0.01
    other = TrialConfig("t", "closed-form", {}, "dgp", {}, CaseConfig(warmup_rounds=3, server_lr=0.02), 0)
    assert other.trial_id != old.trial_id
    assert [k for k, _ in check_case_values(CaseConfig(server_lr=0.1, update="fedavg"))] == ["server_lr"]
    assert [k for k, _ in check_case_values(CaseConfig(server_lr=0.1, local_lr=0.5))] == ["local_lr"]
    case = dataclasses.replace(new.case, dataset="skimage", model="mlp", resolution=8)
    a = execute(dataclasses.replace(new, case=case))
    b = execute(dataclasses.replace(old, case=dataclasses.replace(case, server_lr=None, local_lr=0.01)))
    assert a["mse"] == b["mse"]  # the same computation


def test_a_protocol_named_by_the_case_trains_with_its_defense_in_utility_runs():
    from gleak.contracts.registry import check_params
    from gleak.orchestration.utility import defense_configs, label, run_utility, utility_id

    tiny = UtilityConfig(dataset="skimage", model="mlp", model_params={"hidden": [16]}, clients=2, training_rounds=3, batch_size=8)
    case = CaseConfig(protocol="cgd", protocol_params=check_params("protocol", "cgd", {"partition": "2x1"}))
    trials = [TrialConfig("t", "closed-form", {}, "noise", {"sigma": 0.1}, c, 0) for c in (case, CaseConfig())]
    pair, plain = defense_configs(trials)
    assert pair[2][0] == "cgd" and len(plain) == 2 and label("noise", pair[2]) == "cgd+noise"
    assert utility_id(tiny, "noise", {"sigma": 0.1}) == utility_id(tiny, "noise", {"sigma": 0.1}, None) != \
        utility_id(tiny, *pair)  # fmt: skip
    dp = {"mode": "dp", "noise_multiplier": 1.0, "clip": 1.0}
    row = run_utility(tiny, "noise", dp, protocol=pair[2])
    assert row["status"] == "ok", row["error"]
    assert '"path": "per-participant"' in row["extra"] and 0 <= row["accuracy"] <= 1
    assert row["epsilon"] > 0  # the participants' accountants, stepped once per round
    sa = run_utility(tiny, "topk", {"ratio": 0.5}, protocol=("secure-aggregation", {}))
    assert sa["status"] == "ok", sa["error"]


def test_the_leaderboard_ranks_a_protocol_and_its_defense_as_one_defense():
    import json

    import pandas as pd

    from gleak.reporting.aggregate import protocol_pairs

    df = pd.DataFrame({"defense": ["noise", "noise", "cgd"],
                       "case": [json.dumps(CaseConfig(protocol="cgd").to_dict()), json.dumps(CaseConfig().to_dict()),
                                json.dumps(CaseConfig().to_dict())]})  # fmt: skip
    assert protocol_pairs(df)["defense"].tolist() == ["cgd+noise", "noise", "cgd"]


def test_a_clients_forward_leaves_the_servers_and_the_observers_batchnorm_statistics_alone():
    # A client computes on its own copy: its train-mode forward moves BatchNorm's running statistics there only.
    # Were it the shared module, the observer's copy would hold a share of the victim batch's statistics (which
    # GradInversion's BN prior reads) and the next client would compute at a model the server never sent.
    from gleak.contracts.wire import ClientBatch
    from gleak.mechanics.rounds import Schedule, run_rounds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.LazyLinear(5))  # fmt: skip
    model(torch.rand(2, 3, 8, 8))  # materialise the lazy layer
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    batches = [ClientBatch(torch.rand(4, 3, 8, 8, generator=g) * 5, torch.randint(0, 5, (4,), generator=g),
                           torch.zeros(3), torch.ones(3)) for _ in range(2)]  # fmt: skip
    protocol = gleak.create("protocol", "fedsgd")
    defenses = [gleak.create("defense", "none") for _ in batches]
    schedule = Schedule(lambda r: batches, lambda r: [torch.Generator().manual_seed(i) for i in range(2)],
                        lambda r: torch.Generator().manual_seed(9))  # fmt: skip
    _, seen = run_rounds(protocol, defenses, [model, model], 1, schedule, 0.1, step_last=False)
    for k, v in before.items():
        assert torch.equal(seen[0].held.state_dict()[k], v), k
        assert torch.equal(model.state_dict()[k], v), k
