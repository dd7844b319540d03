"""Warm-up rounds before the attacked one (case key `warmup_rounds`, first spelled `rounds`), and secure aggregation's view."""
import json

import pytest
import torch

import gleak
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.plugin import Attack, Defense
from gleak.contracts.registry import register_attack, register_defense
from gleak.contracts.wire import Reconstruction, Update
from gleak.mechanics.client_update import server_step
from gleak.orchestration.trial import execute

CALLS: list[tuple[str, int]] = []
SEEN: list = []


class Recording(Defense):
    """Counts its resets and transforms (a stand-in for a stateful defense)."""

    def __init__(self):
        self.rounds = 0

    def reset(self):
        self.rounds = 0
        CALLS.append(("reset", id(self)))

    def transform(self, update, rng):
        self.rounds += 1
        CALLS.append(("transform", self.rounds))
        return update


class Keep(Attack):
    """Keeps the observation it is given."""

    needs = frozenset({"architecture", "parameters"})

    def reconstruct(self, observation, rng):
        SEEN.append(observation)
        return Reconstruction(x=torch.zeros((1, *observation.knowledge.input_shape)))


@pytest.fixture(autouse=True, scope="module")
def _recording_plugins():
    """Registered when these tests run, not at collection, so that other tests' plugin lists do not see them."""
    if "test-recording-defense" not in gleak.list_plugins("defense"):
        register_defense("test-recording-defense")(Recording)
        register_attack("test-recording-attack")(Keep)


def test_rounds_zero_keeps_every_existing_trial_id():
    base = TrialConfig("t", "closed-form", {}, "none", {}, CaseConfig(), 0)
    assert "rounds" not in json.loads(base.to_json())["case"]
    assert TrialConfig.from_json(base.to_json()) == base
    three = TrialConfig("t", "closed-form", {}, "none", {}, CaseConfig(warmup_rounds=3), 0)
    assert three.trial_id != base.trial_id and TrialConfig.from_json(three.to_json()) == three


def test_the_old_spellings_of_the_rounds_keys_give_the_same_trials_and_runs(tmp_path):
    """`rounds` in [case] is warmup_rounds, in [utility] training_rounds (issue 12: one meaning per name): the old
    spelling expands to the same trial ids and utility config (stored under the old key, so ids never moved), and
    giving both spellings is one error naming the key."""
    from gleak.contracts.errors import InputError
    from gleak.orchestration.suite import load_suite
    from gleak.orchestration.utility import utility_id

    body = """[suite]\nname = "t"\nseeds = 1\n[case]\ndataset = "skimage"\nresolution = 8\n{case}\n[[attack]]\nname = "closed-form"
[[defense]]\nname = "none"\n[utility]\ndataset = "skimage"\nresolution = 8\nclients = 2\nbatch_size = 4\n{utility}\n"""
    suites = {}
    for tag, case, utility in (("old", "rounds = 2", "rounds = 3"), ("new", "warmup_rounds = 2", "training_rounds = 3")):
        (tmp_path / f"{tag}.toml").write_text(body.format(case=case, utility=utility))
        suites[tag] = load_suite(tmp_path / f"{tag}.toml")
    old, new = suites["old"], suites["new"]
    assert [t.trial_id for t in old.trials] == [t.trial_id for t in new.trials]
    assert new.trials[0].case.warmup_rounds == 2 and new.utility.training_rounds == 3
    assert json.loads(new.trials[0].to_json())["case"]["rounds"] == 2  # stored under its first name
    assert utility_id(old.utility, "none", {}) == utility_id(new.utility, "none", {})
    assert new.utility.to_dict()["rounds"] == 3 and type(new.utility).from_dict(new.utility.to_dict()) == new.utility
    (tmp_path / "both.toml").write_text(body.format(case="rounds = 2\nwarmup_rounds = 2", utility="training_rounds = 3"))
    with pytest.raises(InputError, match=r"\[case\] key 'rounds': is the old name of warmup_rounds"):
        load_suite(tmp_path / "both.toml")


def test_the_utility_step_sizes_have_one_name_each_and_reach_the_step_they_name(tmp_path):
    """[utility] `lr` meant FedSGD's server step and FedAvg's local step (issue 12): now server_lr and client_lr.
    The old spelling gives the same run (same utility id); the wrong name for the algorithm, or both spellings, is
    one error naming the key; each name changes the training it names."""
    import dataclasses

    from gleak.contracts.config import UtilityConfig
    from gleak.contracts.errors import InputError
    from gleak.orchestration.suite import load_suite
    from gleak.orchestration.utility import run_utility, utility_id

    body = """[suite]\nname = "t"\nseeds = 1\n[case]\ndataset = "skimage"\nresolution = 8\n[[attack]]\nname = "closed-form"
[[defense]]\nname = "none"\n[utility]\ndataset = "skimage"\nresolution = 8\nclients = 2\nbatch_size = 4\n{utility}\n"""

    def load(tag, utility):
        (tmp_path / f"{tag}.toml").write_text(body.format(utility=utility))
        return load_suite(tmp_path / f"{tag}.toml").utility

    for algorithm, name in (("fedsgd", "server_lr"), ("fedavg", "client_lr")):
        old, new = load("old", f'algorithm = "{algorithm}"\nlr = 0.3'), load("new", f'algorithm = "{algorithm}"\n{name} = 0.3')
        assert old == new and getattr(new, name) == 0.3
        assert utility_id(old, "none", {}) == utility_id(new, "none", {}) and new.to_dict()["lr"] == 0.3
        assert UtilityConfig.from_dict(new.to_dict()) == new
    for utility, key in (('algorithm = "fedavg"\nserver_lr = 0.3', "server_lr"), ("client_lr = 0.3", "client_lr"),
                         ("lr = 0.3\nserver_lr = 0.3", "lr")):  # fmt: skip
        with pytest.raises(InputError, match=rf"\[utility\] key '{key}'"):
            load("bad", utility)
    tiny = UtilityConfig(dataset="skimage", model="mlp", model_params={"hidden": [8]}, resolution=8, clients=2,
                         training_rounds=3, batch_size=4)  # fmt: skip
    fedavg = dataclasses.replace(tiny, algorithm="fedavg", local_steps=2, server_lr=None)
    for cfg, name in ((tiny, "server_lr"), (fedavg, "client_lr")):
        rows = [run_utility(dataclasses.replace(cfg, **{name: lr}), "none", {}) for lr in (1e-4, 0.5)]
        curves = {json.dumps(json.loads(r["extra"])["curve"]) for r in rows}  # test accuracy after each round
        assert len(curves) == 2, f"{name} changes nothing in a {cfg.algorithm} run"


def test_each_client_keeps_one_defense_through_every_round_and_the_model_moves():
    CALLS.clear()
    SEEN.clear()
    case = CaseConfig(dataset="skimage", model="mlp", resolution=8, batch_size=2, clients=3, warmup_rounds=4)
    execute(TrialConfig("t", "test-recording-attack", {}, "test-recording-defense", {}, case, 0))
    assert sum(c == "reset" for c, _ in CALLS) == 3  # once per client, before its first round
    assert sorted(r for c, r in CALLS if c == "transform") == sorted([1, 2, 3, 4, 5] * 3)
    obs = SEEN[-1]
    assert len(obs.rounds) == 4
    models = [o.model for o in obs.rounds] + [obs.model]
    firsts = [m.state_dict()["1.weight"] for m in models]
    assert all(not torch.equal(a, b) for a, b in zip(firsts, firsts[1:]))  # each round moved the global model


def test_server_step_applies_the_mean_of_what_was_sent():
    model = torch.nn.Linear(3, 2)
    g = torch.Generator().manual_seed(0)
    sent = [Update({"weight": torch.randn(2, 3, generator=g), "bias": torch.randn(2, generator=g)}) for _ in range(4)]
    new = server_step(model, sent, lr=0.5)
    mean_w = torch.stack([u["weight"] for u in sent]).mean(0)
    assert torch.allclose(new.weight, model.weight - 0.5 * mean_w) and new is not model
    deltas = [Update(u.tensors, "delta") for u in sent]
    assert torch.allclose(server_step(model, deltas, lr=0.5).weight, model.weight - mean_w)


def test_error_feedback_reaches_the_attacked_round():
    from gleak.mechanics.client_update import fedsgd_update
    from gleak.orchestration.trial import draw_batches, load_case_data

    case = CaseConfig(dataset="skimage", model="mlp", resolution=8, batch_size=1, warmup_rounds=3, local_lr=0.01)
    for ef in (True, False):
        SEEN.clear()
        cfg = TrialConfig("t", "test-recording-attack", {}, "dgp", {"error_feedback": ef}, case, 0)
        execute(cfg)
        obs = SEEN[-1]
        victim = draw_batches(load_case_data(cfg), cfg, torch.float32)[0]
        fresh = gleak.create("defense", "dgp", error_feedback=False).prune(fedsgd_update(obs.model, victim))
        same = all(torch.equal(obs.update[k], fresh[k]) for k in fresh.names())
        assert same != ef  # with error feedback the residual of the three earlier rounds is on the wire


def test_secure_aggregation_shows_only_the_sum():
    d = gleak.create("protocol", "secure-aggregation")
    g = torch.Generator().manual_seed(0)
    ups = [Update({"w": torch.randn(5, generator=g)}, num_samples=2) for _ in range(3)]
    view = d.observe(ups, g)
    assert torch.allclose(view["w"], sum(u["w"] for u in ups)) and view.num_samples == 6
    case = CaseConfig(dataset="skimage", model="mlp", batch_size=1, clients=4)
    alone = execute(TrialConfig("t", "closed-form", {}, "none", {}, case, 0))
    summed = execute(TrialConfig("t", "closed-form", {"rows": "largest"}, "secure-aggregation", {}, case, 0))
    assert alone["psnr"] > 100 and summed["psnr"] < 30  # one row: the victim's own is mixed with three others'
    # The closed form inverts the sum as the 4 samples behind it (Update.num_samples), the victim's among them.
    demixed = execute(TrialConfig("t", "closed-form", {}, "secure-aggregation", {}, case, 0))
    assert demixed["extra"]["rows_used"] == 4 and demixed["verdict"] == "recovered"
