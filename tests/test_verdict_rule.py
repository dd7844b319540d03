"""One verdict per trial (gleak.mechanics.verdicts.trial_verdict): the trial judges by its suite's rule and stores the rule with
the verdict, `gleak rescore` keeps it, the leaderboard reads it; the published verdicts follow that one function."""
import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from gleak.mechanics import metrics, verdicts
from gleak.mechanics.verdicts import trial_verdict, verdict

ROOT = Path(__file__).resolve().parents[1]


def test_an_exact_blind_guess_cannot_be_beaten():
    # The images all equal the mean image: no attack gains over the blind guess (this raised a math domain error).
    assert verdict(0.01, blind_mse=0.0) == "defended"
    assert verdict(0.0, blind_mse=0.0) == "defended"
    assert verdict(0.0, blind_mse=0.05) == "recovered"
    assert verdict(0.0, blind_mse=0.0, rule="seed002") == "recovered"  # the bands alone


def test_trial_verdict_reads_the_half_batch_mse_the_blind_guess_and_completeness():
    # margin: the MSE half the batch reaches; seed002: the batch mean
    assert trial_verdict(0.5, 0.001, 0.05, 4, 4, "margin") == "recovered"
    assert trial_verdict(0.5, 0.001, 0.05, 4, 4, "seed002") == "defended"
    assert trial_verdict(0.001, 0.001, 0.05, 3, 4, "margin") == "partial"  # an image without a reconstruction
    assert trial_verdict(0.001, 0.001, 0.05, 3, 4, "seed002") == "partial"
    assert trial_verdict(0.015, 0.015, 0.05, 1, 1, "margin") == "partial"  # 5.2 dB over the blind guess
    assert trial_verdict(0.015, 0.015, 0.05, 1, 1, "seed002") == "recovered"
    assert trial_verdict(None, None, 0.05, 0, 1, "margin") is None
    assert verdict(0.05, blind_mse=1.0) == "partial"  # 13 dB over the blind guess, but not under MSE 0.03
    assert verdict(0.029, blind_mse=1.0) == "recovered"
    assert [verdict(m, rule="seed002") for m in (0.029, 0.031, 0.15, 0.199, 0.2)] == \
        ["recovered", "partial", "partial", "partial", "defended"]  # the bands of DLG Fig. 6  # fmt: skip


def _cfg():
    from gleak.api import trial_config

    # Noise at sigma 0.1 leaves the closed form an MSE just above the blind guess's: seed002 says partial, margin defended.
    return trial_config("closed-form", {"name": "noise", "sigma": 0.1}, dataset="skimage", model="mlp",
                        model_params={"hidden": [32]}, resolution=16, batch_size=1)  # fmt: skip


def test_a_trial_judges_by_its_suites_rule_and_stores_it():
    from gleak.orchestration.trial import run_trial

    rows = {rule: run_trial(dataclasses.replace(_cfg(), verdict=rule)) for rule in verdicts.VERDICT_RULES}
    assert rows["margin"]["trial_id"] == rows["seed002"]["trial_id"]  # the rule judges, it computes nothing
    assert (rows["margin"]["verdict"], rows["seed002"]["verdict"]) == ("defended", "partial")
    for rule, row in rows.items():
        e = json.loads(row["extra"])
        assert e["verdict_rule"] == rule
        assert row["verdict"] == trial_verdict(row["mse"], e["half_mse"], e["blind_mse"], row["matched"], 1, rule)


def test_a_suite_gives_its_rule_to_every_trial_and_keeps_their_ids(tmp_path):
    from gleak.orchestration.suite import load_suite

    text = (ROOT / "suites" / "closed-form-sweep.toml").read_text()
    s = load_suite(ROOT / "suites" / "closed-form-sweep.toml")
    assert s.verdict == "seed002" and {t.verdict for t in s.trials} == {"seed002"}
    other = tmp_path / "closed-form-sweep.toml"
    other.write_text(text.replace('verdict = "seed002"', 'verdict = "margin"'))
    m = load_suite(other)
    assert {t.verdict for t in m.trials} == {"margin"}
    assert [t.trial_id for t in m.trials] == [t.trial_id for t in s.trials]
    from gleak.contracts.config import TrialConfig

    t = s.trials[0]
    assert TrialConfig.from_json(t.to_json()) == t  # what a worker receives keeps the rule


def _blob(mse_rec: float = 0.015, mse_blind: float = 0.05):
    """One 8x8 grey image at 0.5, a reconstruction off by sqrt(mse_rec) and a blind guess off by sqrt(mse_blind)."""
    from gleak.orchestration.reconstructions import pack

    truth = torch.full((1, 1, 8, 8), 0.5)
    return pack(truth, torch.tensor([3]), truth + mse_rec**0.5, None, truth + mse_blind**0.5)


def test_rescore_keeps_the_rule_stored_with_the_row():
    from gleak.orchestration.reconstructions import rescore_rows

    kept = rescore_rows([("a", _blob(), json.dumps({"verdict_rule": "seed002"}))], ["verdict"], rule="margin")
    (_, cols, extra), = kept
    assert cols["verdict"] == "recovered" and extra["verdict_rule"] == "seed002"
    (_, cols, extra), = rescore_rows([("a", _blob(), "{}")], ["verdict"], rule="margin")  # stored before the rule
    assert cols["verdict"] == "partial" and extra["verdict_rule"] == "margin"
    # the same verdict the trial's own scoring gives under that rule
    s = metrics.score(torch.full((1, 1, 8, 8), 0.5), torch.tensor([3]), torch.full((1, 1, 8, 8), 0.5 + 0.015**0.5),
                      None, blind=torch.full((1, 1, 8, 8), 0.5 + 0.05**0.5), rule="seed002")  # fmt: skip
    assert s["verdict"] == "recovered"


def _row(**kw):
    base = dict(status="ok", mse=0.015, matched=1, batch_size=1, verdict="recovered",
                extra=json.dumps({"blind_mse": 0.05, "half_mse": 0.015, "verdict_rule": "seed002"}))  # fmt: skip
    return {**base, **kw}


def test_the_report_reads_a_verdict_stored_under_its_rule_and_judges_others_by_the_same_function():
    from gleak.reporting.aggregate import apply_verdicts

    df = pd.DataFrame([_row(), _row(verdict="defended"), _row(extra=json.dumps({"blind_mse": 0.05, "half_mse": 0.015}))])
    # row 1: stored by the trial under seed002 (its full arrays): read as stored, even where the numbers say otherwise
    assert list(apply_verdicts(df, "seed002")["verdict"]) == ["recovered", "defended", "recovered"]
    assert list(apply_verdicts(df, "margin")["verdict"]) == ["partial", "partial", "partial"]


@pytest.mark.parametrize("folder", sorted(p.name for p in (ROOT / "results").glob("*/results.csv") for p in [p.parent]))
def test_every_published_verdict_is_the_one_verdict_function_of_its_row(folder):
    """Each committed row's verdict is trial_verdict of its stored numbers under its suite's rule, and the committed
    leaderboard.csv (rank, worst attack, PSNR, verdict) rebuilds from results.csv as published."""
    from gleak.mechanics.text.metrics import text_verdict
    from gleak.reporting import report
    from gleak.reporting.aggregate import aggregate, defense_ranking

    d = ROOT / "results" / folder
    data = report._load_committed(d)
    df, rule = data["df"], data["rule"]
    raw = pd.read_csv(d / "results.csv", dtype={"verdict": str, "extra": str})
    for r, published in zip(df.itertuples(), raw["verdict"]):
        e = json.loads(r.extra) if isinstance(r.extra, str) and r.extra else {}
        if r.status != "ok":
            mine = None
        elif e.get("verdict_rule") == "text":  # a text trial: its ROUGE bands (gleak.mechanics.text.metrics)
            mine = text_verdict(e["rouge1"], e["rougeL"], e["blind_rouge1"])
        else:
            mine = trial_verdict(r.mse, e.get("half_mse"), e.get("blind_mse"), r.matched, r.batch_size, rule)
        assert (mine or "") == (published if isinstance(published, str) else ""), (folder, r.trial_id)
    dr = defense_ranking(aggregate(df), data["utility"]).reset_index(drop=True)
    lb = pd.read_csv(d / "leaderboard.csv")
    assert len(dr) == len(lb)
    image_cols = "worst_attack" in lb.columns  # a text suite's ranking has no image scores to rank by
    assert image_cols or df[df.status == "ok"].extra.str.contains('"verdict_rule": "text"').all()
    for c in ("rank", "defense", "defense_params", "worst_attack", "verdict", "recovered")[: None if image_cols else 3]:
        assert [str(x) if not pd.isna(x) else "" for x in dr[c]] == [str(x) if not pd.isna(x) else "" for x in lb[c]], c
    for c in ("psnr", "mse_median", "psnr_mean", "psnr_std", "psnr_lo", "psnr_hi", "ssim", "blind_psnr") if image_cols else ():
        assert pd.to_numeric(dr[c]).round(9).equals(pd.to_numeric(lb[c]).round(9)), c
