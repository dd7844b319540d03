"""Code tests of the forged aggregate (attacks/forged_trap.py, Protocol.forged_step, gleak.mechanics.gate.forged_models):
an aggregator that returns a sum of its choosing moves every participant's model, even where it sends none (CGD);
the capability lies outside every honest-but-curious threat model and is granted only by name."""
import copy
import json

import pytest
import torch

from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.registry import create
from gleak.mechanics.models import create_model
from gleak.orchestration import trial as trial_module
from gleak.orchestration.trial import run_trial

SEEDS = (0, 1, 2, 3, 4)
CGD = {"partition": "16x1", "colluders": 0}


def _cfg(attack: str, seed: int, defense: str = "cgd", params: dict | None = None, clients: int = 16, **attack_params) -> TrialConfig:
    # 16x16 crops: a quarter of the first layer, so CGD's 18 model draws and 16-party secure sums take a quarter of
    # the time; the trap does not depend on the image size.
    case = CaseConfig(dataset="skimage", model="mlp", batch_size=1, clients=clients, resolution=16)
    return TrialConfig("t", attack, attack_params, defense, CGD if params is None else params, case, seed)


def _exact(rows: list[dict]) -> int:
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    return sum(r["psnr"] > 40 for r in rows)


def test_a_forged_aggregate_plants_a_trap_in_every_confined_model_and_recovers_victims_through_cgd():
    # CGD with 16 participants and no colluders, where the passive attacks on the honest sum stay at the blind level
    # (results/malicious-server): the forged round moves every confined model onto the trap and most victims come
    # back exactly, each row paired among all 16 observed samples.
    forged = [run_trial(_cfg("forged-trap", s)) for s in SEEDS]
    assert _exact(forged) >= 3, [r["psnr"] for r in forged]
    assert all(json.loads(r["extra"])["observed_samples"] == 16 for r in forged)


def test_without_the_forged_round_the_trap_is_never_planted(monkeypatch):
    # The same attack with the forged round skipped (the models left as CGD drew them): the trap is not there.
    monkeypatch.setattr(trial_module, "forged_models", lambda attack, protocol, models, knowledge, seed: models)
    rows = [run_trial(_cfg("forged-trap", s)) for s in SEEDS]
    assert _exact(rows) == 0, [r["psnr"] for r in rows]


def test_cgd_moves_every_participant_and_the_adversarys_proxies_by_the_forged_displacement():
    proto = create("protocol", "cgd", partition="4x1", colluders=2)  # only the models: no trial
    model = create_model("mlp", (3, 8, 8), 10, seed=0, dtype=torch.float64)
    models = proto.client_models(model, 4, torch.Generator().manual_seed(0))
    before = [copy.deepcopy(m) for m in models]
    extra = [copy.deepcopy(m) for m in proto._extra]
    name = next(n for n, _ in model.named_parameters())
    move = {name: torch.full_like(dict(model.named_parameters())[name], 0.25)}
    k = proto._k
    out = proto.forged_step(models, move)
    for new, old, orig in zip(out, before, models):
        p_new, p_old = dict(new.named_parameters()), dict(old.named_parameters())
        assert torch.allclose(p_new[name] - p_old[name], move[name])
        assert all(torch.equal(p_new[n], p_old[n]) for n in p_new if n != name)
        assert torch.equal(dict(orig.named_parameters())[name], p_old[name])  # the old modules untouched
    for new, old in zip(proto._extra, extra):
        assert torch.allclose(dict(new.named_parameters())[name] - dict(old.named_parameters())[name], move[name])
    assert proto._k == k + 1
    held = proto.observer_model(model, out)
    assert held is out[-1]  # a colluder's model, moved like every other


def test_a_forged_aggregate_is_refused_where_nothing_is_aggregated_or_the_threat_model_does_not_grant_it(tmp_path):
    local = run_trial(_cfg("forged-trap", 0, "local-training", {"partition": "4x1"}, clients=4))
    assert local["status"] == "not-applicable" and "nothing" in local["error"], local["error"]
    split = run_trial(_cfg("forged-trap", 0, "cgd", {"partition": "4x2", "split_features": True, "colluders": 0}, clients=4))
    assert split["status"] == "not-applicable", split["error"]
    import dataclasses

    named = dataclasses.replace(_cfg("forged-trap", 0, params={"partition": "4x1", "colluders": 0}, clients=4), threat_model="F")
    row = run_trial(named)
    assert row["status"] == "not-applicable" and "forges" in row["error"], row["error"]
    assert run_trial(dataclasses.replace(named, threat_model="C+forges"))["status"] == "ok"


@pytest.mark.parametrize("bad", ["not a dict", "wrong shape", "nan"])
def test_a_forge_that_breaks_its_contract_fails_the_trial_named(monkeypatch, bad):
    from attacks.forged_trap import ForgedTrap

    def forge(self, held, knowledge, rng):
        name, p = next((n, p) for n, p in held.named_parameters())
        if bad == "not a dict":
            return [p]
        if bad == "wrong shape":
            return {name: torch.zeros(3)}
        return {name: torch.full_like(p, float("nan"))}

    monkeypatch.setattr(ForgedTrap, "forge", forge)
    row = run_trial(_cfg("forged-trap", 0, params={"partition": "4x1", "colluders": 0}, clients=4))
    assert row["status"] == "failed" and "forge" in row["error"], row["error"]
