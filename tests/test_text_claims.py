"""Published claims about text attacks (gleak.reporting.text_claims) and the token-set baseline in the text
leaderboard, judged on synthetic trial rows whose scores are set by hand (no attack runs)."""
import json

import pandas as pd
import pytest

from gleak.contracts.errors import InputError
from gleak.orchestration.suite import load_suite
from gleak.reporting.claims import claim_blocks
from gleak.reporting.documents.text import text_blocks
from gleak.reporting.comparison_claims import judge_beats
from gleak.reporting.text_claims import judge_text


def _trial(attack, seed, r1, r2, rl, verdict, defense="none", batch=1, params=None, dparams=None):
    extra = {"modality": "text", "rouge1": r1, "rouge2": r2, "rougeL": rl, "token_acc": rl, "token_set_f1": 1.0,
             "blind_rouge1": 0.3, "verdict": verdict, "text_truth": "a b", "text_reconstruction": "a b"}
    return {"suite": "t", "trial_id": f"{attack}{seed}{defense}{batch}{json.dumps(params)}", "attack": attack,
            "attack_params": json.dumps(params or {}, sort_keys=True), "defense": defense,
            "defense_params": json.dumps(dparams or {}), "dataset": "fortunes", "model": "text-classifier",
            "batch_size": batch, "seed": seed, "status": "ok", "verdict": verdict, "psnr": None,
            "case": json.dumps({"seq_len": 16}), "extra": json.dumps(extra)}  # fmt: skip


BEATS = {"source": "s", "claim": "LAMP: 5x more bigrams", "defense": "none", "defense_params": {}, "attacks": ["lamp"],
         "attack_params": {}, "case": {"batch_size": 1}, "expect": "beats", "than": "tag", "than_params": {},
         "metric": "rouge2", "factor": 5.0}  # fmt: skip


def _pairs(lamp_r2, tag_r2):
    rows = []
    for s, (a, b) in enumerate(zip(lamp_r2, tag_r2)):
        rows += [_trial("lamp", s, 0.9, a, 0.9, "recovered"), _trial("tag", s, 0.9, b, 0.9, "recovered")]
    return pd.DataFrame(rows)


def test_a_beats_claim_holds_only_at_the_claimed_factor_on_the_same_victims():
    held = judge_beats(BEATS, _pairs([0.5, 0.6, 0.5], [0.1, 0.1, 0.1]))  # 5.33x
    assert held["verdict"] == "holds" and "5.33x" in held["why"] and "3 of 3" in held["why"], held
    fell = judge_beats(BEATS, _pairs([0.3, 0.3, 0.3], [0.1, 0.1, 0.1]))  # 3x: better, but not the claimed 5x
    assert fell["verdict"] == "falls" and "3.00x" in fell["why"], fell
    reverse = judge_beats(BEATS, _pairs([0.1, 0.1, 0.1], [0.5, 0.5, 0.5]))
    assert reverse["verdict"] == "falls" and "0.20x" in reverse["why"], reverse
    # Victims only one attack saw are not compared: a TAG row of another seed changes nothing.
    extra = pd.concat([_pairs([0.5, 0.6, 0.5], [0.1, 0.1, 0.1]), pd.DataFrame([_trial("tag", 9, 0.9, 0.9, 0.9, "recovered")])])
    assert judge_beats(BEATS, extra)["why"] == held["why"]
    assert judge_beats({**BEATS, "case": {"batch_size": 4}}, _pairs([0.5], [0.1]))["verdict"] == "not run"


def test_a_text_claim_that_a_defense_stops_an_attack_never_holds_with_a_recovered_victim():
    claim = {"source": "s", "claim": "noise stops TAG", "defense": "noise", "defense_params": {}, "attacks": ["tag"],
             "attack_params": {}, "case": {}, "expect": "defended"}  # fmt: skip
    undefended = [_trial("tag", s, 1.0, 1.0, 1.0, "recovered") for s in range(6)]
    stopped = [_trial("tag", s, 0.1, 0.0, 0.1, "defended", defense="noise") for s in range(6)]
    held = judge_text(claim, pd.DataFrame(undefended + stopped))
    assert held["verdict"] == "holds" and "0 of 6" in held["why"], held
    one = stopped[:5] + [_trial("tag", 5, 0.9, 0.9, 0.9, "recovered", defense="noise")]  # the median is still defended
    fell = judge_text(claim, pd.DataFrame(undefended + one))
    assert fell["verdict"] == "falls" and "1 of 6" in fell["why"], fell
    few = judge_text(claim, pd.DataFrame(undefended[:3] + stopped[:3]))
    assert few["verdict"] == "inconclusive", few
    weak = [_trial("tag", s, 0.2, 0.0, 0.2, "defended") for s in range(6)]  # TAG fails undefended: it cannot judge
    assert judge_text(claim, pd.DataFrame(weak + stopped))["verdict"] == "inconclusive"


def test_a_text_leak_claim_about_the_undefended_attack_and_its_most_inputs_quantifier():
    claim = {"source": "s", "claim": "LAMP leaks at batch 4", "defense": "none", "defense_params": {}, "attacks": ["lamp"],
             "attack_params": {}, "case": {"batch_size": 4}, "expect": "leaks"}  # fmt: skip
    partial = [_trial("lamp", s, 0.6, 0.2, 0.5, "partial", batch=4) for s in range(5)]
    assert judge_text(claim, pd.DataFrame(partial))["verdict"] == "holds"
    blind = [_trial("lamp", s, 0.3, 0.0, 0.2, "defended", batch=4) for s in range(5)]
    assert judge_text(claim, pd.DataFrame(blind))["verdict"] == "not reproduced"
    most = {**claim, "quantifier": "most inputs"}
    assert judge_text(most, pd.DataFrame(partial))["verdict"] == "not reproduced"  # words, not the text: 0 of 5
    three = [_trial("lamp", s, 0.9, 0.8, 0.9, "recovered", batch=4) for s in range(3)] + partial[3:]
    assert judge_text(most, pd.DataFrame(three))["verdict"] == "holds"


def test_the_claims_section_judges_a_text_claim_on_its_trials():
    blocks = claim_blocks([BEATS], pd.DataFrame(), _pairs([0.5, 0.6, 0.5], [0.1, 0.1, 0.1]))
    row = [c.strip("\ue000\ue001") for c in blocks[2][2][0]]  # data cells are marked for escaping
    assert row[3] == "beats tag on rouge2 by at least 5x" and row[4].startswith("holds: lamp rouge2 0.533"), row


def test_the_text_leaderboard_shows_the_token_set_baseline_beside_each_attack():
    rows = [_trial("token-set", s, 0.5 + 0.1 * s, 0.0, 0.3, "partial") for s in range(3)]
    rows += [_trial("tag", s, 0.9, 0.5, 0.8, "recovered") for s in range(3)]
    rows += [_trial("tag", s, 0.2, 0.0, 0.1, "defended", defense="dgp") for s in range(3)]  # no token set run there
    doc = text_blocks(pd.DataFrame(rows))
    tables = [b for b in doc if b[0] == "table"]
    head, body = tables[1][1], tables[1][2]
    col = head.index("token-set ROUGE-1")
    by = {(r[0], r[2].split(" [")[0]): r[col] for r in body}  # the attack, without its threat model in brackets
    assert all(r[2].endswith(" [C]") for r in body), body  # both attacks need threat model C
    assert by[("none", "tag")].startswith("0.600") and by[("none", "token-set")].startswith("0.600")
    assert by[("dgp", "tag")] in ("", "-"), by  # not run at that defense: empty, never another defense's
    assert any("baseline every text attack must beat" in b[1] for b in doc if b[0] == "p")


HEAD = """
[suite]
name = "c"
seeds = 1
[case]
dataset = "fortunes"
model = "text-classifier"
[[attack]]
name = "lamp"
[[attack]]
name = "tag"
[[defense]]
name = "none"
"""
CLAIM = """
[[claim]]
source = "s"
claim = "LAMP beats TAG"
defense = "none"
attacks = ["lamp"]
than = "tag"
metric = "rouge2"
factor = 5
expect = "beats"
"""


@pytest.mark.parametrize("old, new, key", [
    ('than = "tag"\n', "", "than"), ('than = "tag"', 'than = "tagg"', "than"), ('metric = "rouge2"', 'metric = "mse"', "metric"),
    ("factor = 5", "factor = -1", "factor"), ("factor = 5", 'factor = "5"', "factor"),
    ("factor = 5", "factor = 5\nmargin = 3", "margin"), ("factor = 5", "margin = -1", "margin"), ("factor = 5", "margin = true", "margin"),
    ('expect = "beats"', 'expect = "leaks"', "than"), ('than = "tag"', 'than = "tag"\nthan_params = { nope = 1 }', "than_params.nope"),
])  # fmt: skip
def test_a_bad_comparison_claim_is_one_line_naming_its_key(tmp_path, old, new, key):
    p = tmp_path / "s.toml"
    p.write_text(HEAD + CLAIM.replace(old, new))
    with pytest.raises(InputError) as exc:
        load_suite(p)
    msg = str(exc.value)
    assert "\n" not in msg and "[claim #1]" in msg and f"key {key!r}" in msg and "s.toml" in msg, msg
