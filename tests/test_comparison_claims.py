"""Claims that one attack beats another on an image metric by a margin (gleak.reporting.comparison_claims), judged
on synthetic trial rows whose PSNRs are set by hand (no attack runs); a data check on results/learned's."""
import json
from pathlib import Path

import pandas as pd
import pytest

from gleak.reporting.claims import claim_blocks
from gleak.reporting.comparison_claims import judge_beats

CASE = json.dumps({"batch_size": 1, "dataset": "fashion-mnist", "resolution": 14})
BEATS = {"source": "s", "claim": "learned beats inverting gradients by 3 dB under sign", "defense": "sign",
         "defense_params": {}, "attacks": ["learning-to-invert"], "attack_params": {"adaptive": True},
         "case": {"batch_size": 1}, "expect": "beats", "than": "inverting-gradients", "than_params": {},
         "metric": "psnr", "margin": 3.0}  # fmt: skip


def _trial(attack, seed, psnr, defense="sign", params=None, case=CASE):
    return {"suite": "l", "trial_id": f"{attack}{seed}{defense}{json.dumps(params)}", "attack": attack,
            "attack_params": json.dumps(params or {}, sort_keys=True), "defense": defense, "defense_params": "{}",
            "dataset": "fashion-mnist", "model": "mlp", "batch_size": 1, "seed": seed, "status": "ok",
            "verdict": "partial", "psnr": psnr, "ssim": psnr / 40, "case": case, "extra": "{}"}  # fmt: skip


def _pairs(ours, theirs, **kw):
    rows = []
    for s, (a, b) in enumerate(zip(ours, theirs)):
        rows += [_trial("learning-to-invert", s, a, params={"adaptive": True}, **kw), _trial("inverting-gradients", s, b, **kw)]
    return pd.DataFrame(rows)


def test_an_image_beats_claim_holds_only_at_the_claimed_margin_on_the_same_victims():
    held = judge_beats(BEATS, _pairs([20, 19, 20.5], [16, 16.5, 16]))  # +3.67 dB
    assert held["verdict"] == "holds" and "+3.67 dB" in held["why"] and "3 of 3" in held["why"], held
    short = judge_beats(BEATS, _pairs([18, 18, 18], [16, 16, 16]))  # better by 2 dB: not the claimed 3
    assert short["verdict"] == "falls" and "+2.00 dB" in short["why"], short
    worse = judge_beats(BEATS, _pairs([12, 12, 12], [16, 16, 16]))
    assert worse["verdict"] == "falls" and "-4.00 dB" in worse["why"] and "higher on 0 of 3" in worse["why"], worse
    # A victim only one attack saw is not compared; another case is another victim.
    extra = pd.concat([_pairs([20, 19, 20.5], [16, 16.5, 16]), pd.DataFrame([_trial("inverting-gradients", 9, 40.0)]),
                       pd.DataFrame([_trial("inverting-gradients", 0, 40.0, case=CASE.replace("14", "28"))])])
    assert judge_beats(BEATS, extra)["why"] == held["why"]
    # Another defense's trials do not judge a claim about sign.
    assert judge_beats(BEATS, _pairs([20], [16], defense="topk"))["verdict"] == "not run"
    # The non-adaptive learned attack is not the claim's attack.
    plain = pd.DataFrame([_trial("learning-to-invert", 0, 30, params={"adaptive": False}), _trial("inverting-gradients", 0, 16)])
    assert judge_beats(BEATS, plain)["verdict"] == "not run"


def test_against_several_variants_of_the_other_attack_the_claim_meets_the_strongest():
    aware = [_trial("inverting-gradients", s, 21.0, params={"defense_aware": True, "mask_from": 0.5}) for s in range(3)]
    both = pd.concat([_pairs([20, 19, 20.5], [16, 16.5, 16]), pd.DataFrame(aware)])
    judged = judge_beats(BEATS, both)  # the defense-aware variant is 21 dB: the learned attack is 1.17 dB below it
    assert judged["verdict"] == "falls" and "(defense-aware)" in judged["why"] and "-1.17 dB" in judged["why"], judged
    plain = judge_beats({**BEATS, "than_params": {"defense_aware": False}}, both)  # its stored params omit the default
    assert plain["verdict"] == "holds" and "+3.67 dB" in plain["why"], plain


def test_a_factor_claim_on_an_image_metric_compares_ratios():
    claim = {k: v for k, v in BEATS.items() if k != "margin"} | {"metric": "ssim", "factor": 1.2}
    assert judge_beats(claim, _pairs([20, 20], [16, 16]))["verdict"] == "holds"  # 1.25x
    assert judge_beats(claim, _pairs([18, 18], [16, 16]))["verdict"] == "falls"  # 1.125x


def test_the_claims_section_states_the_margin_in_decibels_and_the_rule():
    blocks = claim_blocks([BEATS], pd.DataFrame(), _pairs([20, 19, 20.5], [16, 16.5, 16]))
    row = [c.strip("\ue000\ue001") for c in blocks[2][2][0]]
    assert row[3] == "beats inverting-gradients on psnr by at least 3 dB", row
    assert row[4].startswith("holds: learning-to-invert psnr 19.833 against inverting-gradients 16.167"), row
    assert "claimed margin above it" in blocks[1][1]


def test_data_results_learned_judges_wu_et_al_s_comparative_headline():
    text = (Path(__file__).resolve().parents[1] / "results" / "learned" / "leaderboard.md").read_text()
    rows = [line for line in text.splitlines() if "beats inverting-gradients on psnr by at least 3 dB" in line]
    assert len(rows) == 4, rows  # sign and Top-k 99%, at batch 1 and 4
    assert all("| holds: " in r or "| falls: " in r for r in rows), rows
