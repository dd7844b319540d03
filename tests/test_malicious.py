"""The active server: per-client models where the protocol lets the server choose them, and the three attacks
built on it (model inconsistency, Fishing, trap weights), through secure aggregation and CGD."""
import json
import statistics
import textwrap
from dataclasses import replace

import pytest
import torch
from gleak.attacks.fishing import target_class

import gleak
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.plugin import batch_gradient
from gleak.contracts.seeds import derive_seed, generator
from gleak.contracts.wire import Knowledge
from gleak.mechanics.models import create_model
from gleak.orchestration.conformance import check_plugin
from gleak.orchestration.trial import attacker_knowledge, draw_batches, execute, load_case_data, run_trial

SEEDS = (0, 1, 2, 3, 4)


def _case(clients: int, batch: int, protocol: str = "secure-aggregation", **kw) -> CaseConfig:
    return CaseConfig(dataset="skimage", model="mlp", batch_size=batch, clients=clients, protocol=protocol, **kw)


def _trial(attack: str, params: dict, case: CaseConfig, seed: int, defense: str = "none", dparams=None) -> dict:
    return run_trial(TrialConfig("t", attack, params, defense, dparams or {}, case, seed))


def _extra(row: dict) -> dict:
    return json.loads(row["extra"]) if row.get("extra") else {}


# ---- model inconsistency ------------------------------------------------------------------------------------------
def test_model_inconsistency_through_secure_aggregation_of_16_recovers_the_target_exactly():
    rows = [_trial("model-inconsistency", {}, _case(16, 1), s) for s in SEEDS]
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    assert statistics.median(r["psnr"] for r in rows) >= 40, [r["psnr"] for r in rows]
    # the inner closed form is told the target's one sample, not the sum's 16: one image (its largest row), even
    # where noise keeps the rows from agreeing (told 16, it would name 16 candidates for the scorer to pick from)
    noisy = TrialConfig("t", "model-inconsistency", {}, "noise", {"sigma": 1e-3}, _case(16, 1), 0)
    assert execute(noisy)["_arrays"][2].shape[0] == 1
    # the same sum without the inconsistent models: the closed form reads a mixture of 16 samples
    plain = [_trial("closed-form", {}, _case(16, 1), s)["psnr"] for s in SEEDS[:3]]
    assert statistics.median(plain) < 30, plain


def test_the_dead_model_sends_nothing_but_its_label_counts():
    ds = load_case_data(TrialConfig("t", "x", {}, "none", {}, _case(2, 1), 0))
    model = create_model("mlp", ds.input_shape, ds.num_classes, seed=0)
    attack = gleak.create("attack", "model-inconsistency")
    k = Knowledge(input_shape=ds.input_shape, num_classes=ds.num_classes, batch_size=1)
    target, dead, dead2 = attack.prepare_clients(attack.prepare(model, k, generator(0, "p")), 3, k, generator(0, "c"))
    assert dead is dead2 and dead is not target
    g = batch_gradient(dead, ds.normalized(torch.arange(4)), ds.y[:4])
    last = list(g)[-1]
    assert all(not t.any() for n, t in g.items() if n != last) and g[last].any()
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), model.parameters()))


# ---- Fishing ------------------------------------------------------------------------------------------------------
def test_fishing_through_a_secure_sum_fishes_a_class_of_the_sum_and_finds_the_victim_only_in_its_class():
    # No label reaches Fishing through the sum: its first query reads the sum's label counts (gleak.mechanics.
    # label_query), it fishes the rarest class there and singles out one sample of the 32, the victim's only where
    # that class is the victim's.
    hits = 0
    for s in SEEDS:
        cfg = TrialConfig("t", "fishing", {}, "none", {}, _case(32, 1), s)
        labels = torch.cat([b.y for b in draw_batches(load_case_data(cfg), cfg, torch.float32)])
        row = run_trial(cfg)
        e = _extra(row)
        assert row["status"] == "ok" and e["observed_share_psnr40"] * 32 >= 1, (row["error"], e)
        counts = torch.bincount(labels, minlength=10)
        assert counts[e["target_class"]] == counts[counts > 0].min()  # the rarest class of the sum, from the query
        assert (row["psnr"] >= 40) == (e["target_class"] == int(labels[0])), (s, row["psnr"], e["target_class"], int(labels[0]))
        hits += row["psnr"] >= 40
    assert hits < len(SEEDS)  # the victim is not singled out by construction


def test_the_label_query_reads_the_label_counts_of_a_sum_exactly():
    from gleak.contracts.wire import Update
    from gleak.mechanics.client_update import fedsgd_update
    from gleak.mechanics.label_query import query_model, read_counts

    cfg = TrialConfig("t", "x", {}, "none", {}, _case(8, 3), 0)
    ds = load_case_data(cfg)
    batches = draw_batches(ds, cfg, torch.float32)
    query = query_model(create_model("mlp", ds.input_shape, 10, seed=0), 10)
    total = Update.sum([fedsgd_update(query, b) for b in batches])
    want = torch.bincount(torch.cat([b.y for b in batches]), minlength=10)
    assert torch.equal(read_counts(total, query, 10, 3), want)
    assert not torch.equal(read_counts(fedsgd_update(query, batches[0]), query, 10, 3), want)  # one client: its own


def test_fishing_with_the_victims_class_named_recovers_it_through_the_sum():
    rows = []
    for s in SEEDS:
        cfg = TrialConfig("t", "fishing", {}, "none", {}, _case(32, 1), s)
        victim = draw_batches(load_case_data(cfg), cfg, torch.float32)[0]
        rows.append(_trial("fishing", {"target_class": int(victim.y[0])}, _case(32, 1), s))
    assert sum(r["psnr"] >= 40 for r in rows) >= 3, [r["psnr"] for r in rows]


def test_class_fishing_on_a_large_batch_reads_samples_of_its_class_exactly():
    # class fishing on a large batch, at its most frequent class: samples of it read exactly, never a mixture
    for s in (0, 1, 2):
        cfg = TrialConfig("t", "x", {}, "none", {}, _case(1, 32, "fedsgd"), s)
        labels = draw_batches(load_case_data(cfg), cfg, torch.float32)[0].y
        common = int(torch.bincount(labels).argmax())
        e = _extra(_trial("fishing", {"mode": "class", "target_class": common}, _case(1, 32, "fedsgd"), s))
        assert int((labels == common).sum()) >= 3
        assert e["share_psnr40"] * 32 >= 1 and e["samples_single"] == round(e["share_psnr40"] * 32), e


def test_fishing_leaves_the_other_classes_no_gradient_but_the_classifier_bias():
    case = _case(1, 16, "fedsgd")
    cfg = TrialConfig("t", "fishing", {}, "none", {}, case, 0)
    ds = load_case_data(cfg)
    victim = draw_batches(ds, cfg, torch.float32)[0]
    for mode in ("class", "feature"):
        attack = gleak.create("attack", "fishing", mode=mode)
        k = attacker_knowledge(attack, ds, victim, load_case_data(cfg, "test"))
        k = replace(k, label_counts=torch.bincount(victim.y, minlength=10))  # what the query round reads
        fished = attack.prepare(create_model("mlp", ds.input_shape, 10, seed=derive_seed(0, "model")), k, generator(0, "p"))
        t = target_class(None, k)
        others = victim.y != t
        g = batch_gradient(fished, victim.x[others], victim.y[others])
        assert not g["1.weight"].any() and not g["1.bias"].any(), mode  # nothing before the classifier
        mine = batch_gradient(fished, victim.x[~others], victim.y[~others])
        assert mine["1.weight"].any(), mode


# ---- trap weights -------------------------------------------------------------------------------------------------
def test_trap_rows_fire_for_few_images_and_single_samples_are_read_exactly():
    from gleak.attacks.trap_weights import trap_rows

    pixels = load_case_data(TrialConfig("t", "x", {}, "none", {}, _case(1, 1), 0)).x.flatten(1).double()
    rate = lambda sf: float((pixels @ trap_rows(64, pixels.shape[1], 0.5, sf, torch.Generator().manual_seed(0)).T > 0).double().mean())  # noqa: E731
    assert rate(0.95) < 0.1 and rate(1.0) > 0.4, (rate(0.95), rate(1.0))
    shares = [_extra(_trial("trap-weights", {}, _case(1, 8, "fedsgd"), s))["share_psnr40"] for s in SEEDS]
    assert statistics.mean(shares) >= 0.5, shares
    # through secure aggregation: 16 clients of 4, the target's samples among 64
    agg = [_extra(_trial("trap-weights", {}, _case(16, 4), s))["share_psnr40"] for s in SEEDS]
    assert statistics.mean(agg) >= 0.3, agg


def test_a_mixture_that_would_fire_a_dead_trap_row_is_not_named():
    from gleak.attacks.trap_weights import consistent_rows

    x1, x2 = torch.tensor([1.0, 0, 0], dtype=torch.float64), torch.tensor([0, 1.0, 0], dtype=torch.float64)
    mix = 2 * x1 - x2  # two rows that both samples activate with errors of opposite sign: db = 2 - 1
    dw = torch.stack([mix, mix, x1, x2, torch.zeros(3, dtype=torch.float64)])
    db = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    w = torch.eye(3, dtype=torch.float64)[[0, 0, 0, 1, 0]]  # row 4: fired by the mixture only (w x - 1.5 > 0)
    b = torch.tensor([0.0, 0.0, 0.0, 0.0, -1.5], dtype=torch.float64)
    x, extra = consistent_rows(dw, db, w, b, 2)
    assert {tuple(r.tolist()) for r in x} == {tuple(x1.tolist()), tuple(x2.tolist())} and extra["consistent"] == 2


def test_closed_form_agreement_names_what_it_finds_when_fewer_rows_differ_than_samples():
    """Rows of fewer distinct inputs than the update's count (here one image four times): the closed form's
    agreement rule names the groups it has instead of ending in an error."""
    from gleak.contracts.wire import ClientBatch, Observation
    from gleak.mechanics.client_update import fedsgd_update

    ds = load_case_data(TrialConfig("t", "x", {}, "none", {}, _case(1, 1), 0))
    for seed in (0, 1):
        model = create_model("mlp", ds.input_shape, ds.num_classes, seed=seed)
        same = ds.normalized(torch.tensor([seed] * 4))
        update = fedsgd_update(model, ClientBatch(same, ds.y[[seed] * 4], ds.mean, ds.std))
        k = Knowledge(input_shape=ds.input_shape, num_classes=ds.num_classes, batch_size=4)
        rec = gleak.create("attack", "closed-form", rows="agreement").reconstruct(Observation(update, k, model), generator(0, "a"))
        assert len(rec.x) == 1 and torch.allclose(rec.x[0], same[0], atol=1e-4)


# ---- the protocol decides ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("attack, reason", [
    ("model-inconsistency", "does not let the server choose: each participant draws and steps its own confined model"),
    ("fishing", "its clients never compute at the model the server prepares"),
    ("trap-weights", "its clients never compute at the model the server prepares"),
    ("imprint", "its clients never compute at the model the server prepares"),
])  # fmt: skip
def test_through_cgd_every_active_attack_is_not_applicable_with_its_reason(attack, reason):
    for s in (0, 1):
        r = _trial(attack, {}, _case(16, 1, "cgd", protocol_params={"colluders": 0}), s)
        assert r["status"] == "not-applicable" and reason in r["error"], r["error"]


def test_an_attack_sending_different_models_must_declare_it(tmp_path):
    from gleak.contracts.registry import load_plugin_file

    f = tmp_path / "undeclared.py"
    f.write_text(textwrap.dedent('''
        import copy
        from gleak import register_attack
        from gleak.attacks.closed_form import ClosedForm

        @register_attack("test-undeclared-inconsistency")
        class Undeclared(ClosedForm):
            """Sends the other clients a copy of the model without declaring per_client_models."""
            active = True
            def prepare_clients(self, prepared, clients, knowledge, rng):
                return [prepared] + [copy.deepcopy(prepared) for _ in range(clients - 1)]
    '''))
    load_plugin_file(f)
    r = _trial("test-undeclared-inconsistency", {}, _case(4, 1), 0)
    assert r["status"] == "failed" and "per_client_models" in r["error"], r["error"]
    failed = {c.name: c.detail for c in check_plugin("attack", "test-undeclared-inconsistency") if not c.passed}
    assert "per_client_models" in failed.get("models change only through the hooks", ""), failed


@pytest.mark.parametrize("where", ["reconstruct", "prepare"])
def test_an_attack_editing_the_model_outside_its_hooks_fails_check_plugin(tmp_path, where):
    from gleak.contracts.registry import load_plugin_file

    edit = {"reconstruct": ("def prepare(self, model, knowledge, rng):\n                self._sent = model\n"
                            "                return model\n"
                            "            def reconstruct(self, observation, rng):\n"
                            "                with torch.no_grad():\n"
                            "                    next(self._sent.parameters()).mul_(2)\n"
                            "                return super().reconstruct(observation, rng)\n"),
            "prepare": ("def prepare(self, model, knowledge, rng):\n                with torch.no_grad():\n"
                        "                    next(model.parameters()).zero_()\n"
                        "                return copy.deepcopy(model)\n")}[where]  # fmt: skip
    f = tmp_path / f"edits_{where}.py"
    f.write_text(textwrap.dedent(f'''
        import copy
        import torch
        from gleak import register_attack
        from gleak.attacks.closed_form import ClosedForm

        @register_attack("test-edits-in-{where}")
        class Edits(ClosedForm):
            """Edits the model outside prepare / prepare_clients."""
            active = True
            {edit}
    '''))
    load_plugin_file(f)
    failed = {c.name for c in check_plugin("attack", f"test-edits-in-{where}") if not c.passed}
    assert "models change only through the hooks" in failed, failed


def test_the_default_hook_leaves_imprint_trials_bit_identical(monkeypatch):
    """An attack without prepare_clients: one prepared model for every client, from the same generator."""
    import gleak.orchestration.trial as T

    cases = [(_case(1, 4, "fedsgd"), "none", {}), (_case(4, 2), "topk", {"ratio": 0.9})]
    # a random measurement: the prepare step draws from its generator, which must stay the one it had
    trials = [TrialConfig("t", "imprint", {"bins": 16, "measurement": "random"}, d, dp, c, s) for c, d, dp in cases for s in (0, 1)]
    now = [execute(cfg) for cfg in trials]
    before = lambda attack, model, clients, knowledge, seed: [  # noqa: E731
        attack.prepare(model, knowledge, generator(seed, "attack-prepare"))] * clients
    monkeypatch.setattr(T, "served_models", before)
    for cfg, a in zip(trials, now):
        b = execute(cfg)
        assert (a["mse"], a["psnr"], a["extra"]) == (b["mse"], b["psnr"], b["extra"]), cfg
        assert torch.equal(a["_arrays"][2], b["_arrays"][2])
