"""Code tests of the threat model: what an attack may receive is the intersection of what it declares, what the
suite's threat model grants and what the protocol exposes (gleak.mechanics.gate.grant); one output allowance for
every attack (one row per observed sample), scored one-to-one against every observed client's samples."""
import dataclasses
import json

import pytest
import torch

import gleak
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.errors import InputError
from gleak.contracts.plugin import Attack
from gleak.contracts.registry import register_attack
from gleak.contracts.threat_model import capabilities_of, missing, parse, required
from gleak.contracts.wire import Reconstruction
from gleak.orchestration.suite import load_suite
from gleak.orchestration.trial import run_trial

SEEDS = (0, 1, 2)


def _case(clients: int, protocol: str = "fedsgd") -> CaseConfig:
    return CaseConfig(dataset="skimage", model="mlp", batch_size=1, clients=clients, protocol=protocol)


def test_the_letters_nest_and_an_attack_gets_the_smallest_that_grants_what_it_declares():
    assert parse("a").capabilities == {"updates"} and parse("C") != parse("B")
    assert parse("B").capabilities < parse("C").capabilities < parse("D").capabilities < parse("G").capabilities
    assert str(required({"architecture", "parameters"})) == "B"
    assert str(required({"architecture", "batch_size"})) == "C"
    assert str(required({"architecture", "batch_size", "labels"})) == "C+labels"
    assert str(required({"batch_size", "public_data"}, active=True)) == "G"
    assert str(required({"per_client_models", "batch_size"})) == "F"
    assert missing({"architecture", "labels"}, False, parse("C")) == ["labels"]
    assert "manipulates" in capabilities_of(set(), active=True)
    for bad in ("Z", "B+oracle", ""):
        with pytest.raises(ValueError):
            parse(bad)


@pytest.mark.parametrize("protocol", ["secure-aggregation", "cgd"])
def test_no_label_reaches_an_attack_through_a_sum(protocol):
    # iDLG-style gradient matching told the labels: granted where the server sees the victim's update, never through
    # a sum, whatever the suite's threat model.
    for seed in SEEDS:
        row = run_trial(TrialConfig("t", "dlg", {"labels": "given", "iterations": 2}, "none", {}, _case(4, protocol), seed))
        assert row["status"] == "not-applicable" and "labels" in row["error"], row["error"]
    plain = run_trial(TrialConfig("t", "dlg", {"labels": "given", "iterations": 2}, "none", {}, _case(4), 0))
    assert plain["status"] == "ok", plain["error"]


def test_a_suite_threat_model_refuses_what_it_does_not_grant_and_names_it(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "s"\nthreat_model = "C"\n[case]\ndataset = "skimage"\nmodel = "mlp"\n'
                     '[[attack]]\nname = "closed-form"\n[[attack]]\nname = "dlg"\nlabels = "given"\niterations = 2\n'
                     '[[attack]]\nname = "imprint"\n[[defense]]\nname = "none"\n')  # fmt: skip
    trials = {t.attack: t for t in load_suite(suite).trials}
    assert all(t.threat_model == "C" for t in trials.values())
    assert run_trial(trials["closed-form"])["status"] == "ok"
    for name, what in (("dlg", "labels"), ("imprint", "manipulates")):
        row = run_trial(trials[name])
        assert row["status"] == "not-applicable" and "threat model C" in row["error"] and what in row["error"], row["error"]
    # the threat model is part of the trial's id; a suite naming none keeps the earlier ids
    assert trials["closed-form"].trial_id != dataclasses.replace(trials["closed-form"], threat_model=None).trial_id
    suite.write_text(suite.read_text().replace('threat_model = "C"', 'threat_model = "Q"'))
    with pytest.raises(InputError, match=r"\[suite\] key 'threat_model'.*letter A-H"):
        load_suite(suite)


@register_attack("test-greedy-rows")
class GreedyRows(Attack):
    """Returns one row more than the samples behind what it observed."""

    needs = frozenset({"architecture", "batch_size"})

    def reconstruct(self, observation, rng):
        n = int(observation.update.num_samples) + 1
        return Reconstruction(x=torch.zeros(n, *observation.knowledge.input_shape))


@pytest.mark.parametrize("protocol, clients", [("fedsgd", 16), ("secure-aggregation", 4), ("cgd", 4)])
def test_an_attack_returning_more_rows_than_observed_samples_fails(protocol, clients):
    # Through fedsgd the server attacks the victim's own update: 1 sample, whatever the number of clients.
    row = run_trial(TrialConfig("t", "test-greedy-rows", {}, "none", {}, _case(clients, protocol), 0))
    assert row["status"] == "failed" and "more than the" in row["error"], row


def test_rows_are_paired_one_to_one_with_every_observed_sample():
    # The imprint through a sum of 16 returns up to 16 rows (the same allowance as every attack), scored one-to-one:
    # the victim's score from the row paired with it, and the share of all 16 recovered beside it.
    for seed in SEEDS:
        row = run_trial(TrialConfig("t", "imprint", {}, "none", {}, _case(16, "secure-aggregation"), seed))
        e = json.loads(row["extra"])
        assert row["status"] == "ok" and 0 < e["observed_share_psnr40"] <= 1 and e["observed_samples"] == 16, row
        assert row["matched"] <= 1
    fed = run_trial(TrialConfig("t", "imprint", {}, "none", {}, _case(16), 0))
    assert "observed_share_psnr40" not in json.loads(fed["extra"])  # the victim's own update: nothing to share


def test_every_row_of_a_report_names_its_threat_model(tmp_path):
    out = tmp_path / "out"
    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "s"\nsave_images = false\n[case]\ndataset = "skimage"\nmodel = "mlp"\n'
                     '[[attack]]\nname = "closed-form"\n[[attack]]\nname = "idlg"\n[[defense]]\nname = "none"\n')  # fmt: skip
    gleak.run(str(suite), out=str(out), workers=1, progress=False)
    import pandas as pd

    df = pd.read_csv(out / "results.csv")
    assert dict(zip(df["attack"], df["threat_model"])) == {"closed-form": "C", "idlg": "C"}
    assert "C (parameter-aware eavesdropper)" in (out / "leaderboard.md").read_text()


def test_the_victim_gets_only_the_rows_paired_with_its_own_samples():
    from gleak.mechanics.metrics import victim_share

    a, b = torch.zeros(1, 1, 4, 4), torch.ones(1, 1, 4, 4)
    rows, share = victim_share([a, b], torch.cat([b + 0.01, a + 0.01]))
    assert rows.tolist() == [1] and share == 1.0  # 40 dB: 0.01 off is exact enough; each row pairs once, both found
    rows, share = victim_share([a, b], b + 0.3)  # one row, closer to the other client's sample: not the victim's
    assert rows.tolist() == [] and share == 0.0


def test_a_store_row_computed_under_the_earlier_scoring_rule_is_recomputed_not_renamed(tmp_path):
    import sqlite3

    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "s"\nsave_images = false\n[case]\ndataset = "skimage"\nmodel = "mlp"\nclients = 2\n'
                     'protocol = "secure-aggregation"\n[[attack]]\nname = "closed-form"\n[[defense]]\nname = "none"\n')  # fmt: skip
    out = tmp_path / "out"
    gleak.run(str(suite), out=str(out), workers=1, progress=False)
    db = sqlite3.connect(out / "results.sqlite")
    tid, config = db.execute("SELECT trial_id, config FROM trials").fetchone()
    old = json.loads(config)
    del old["observed"]  # as a row stored before the rule: another id, a config without the key
    db.execute("UPDATE trials SET trial_id = 'aaaaaaaaaaaaaaaa', config = ?, psnr = 1.0", (json.dumps(old),))
    db.execute("UPDATE membership SET trial_id = 'aaaaaaaaaaaaaaaa'")
    db.commit()
    db.close()
    gleak.run(str(suite), out=str(out), workers=1, progress=False)
    db = sqlite3.connect(out / "results.sqlite")
    psnr = db.execute("SELECT psnr FROM trials WHERE trial_id = ?", (tid,)).fetchone()
    assert psnr is not None and psnr[0] != 1.0  # recomputed under its id, the old result not carried over
