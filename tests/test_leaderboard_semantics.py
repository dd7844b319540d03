"""The leaderboard's semantics on a hand-built results frame with known answers: verdicts per trial (missing images
make a trial at best partial), a group's verdict over even and odd seed counts, the worst case of a defense over
every case and attack, and ranks in which values equal at the precision shown (0.01) share a rank.

Verdict rule "margin" with a blind guess at MSE 0.05 (13.0 dB): a single image at PSNR p has MSE 10^(-p/10), so
p > 23.01 dB is recovered (MSE < 0.005, 10 dB under the blind guess), 16.02 < p <= 23.01 partial, else defended."""
import json
import math

import pandas as pd
import pytest

from gleak.reporting.aggregate import aggregate, apply_verdicts, attack_ranking, competition_rank, defense_ranking, median_verdict

BLIND_MSE = 0.05


def trial(defense, attack, seed, psnr, batch_size=1, mse=None, matched=None, half_mse=None, status="ok", dataset="d"):
    mse = 10 ** (-psnr / 10) if mse is None else mse
    extra = {"blind_mse": BLIND_MSE, "blind_psnr": 13.0, "blind_ssim": 0.1, "half_mse": mse if half_mse is None else half_mse}
    ok = status == "ok"
    return dict(suite="s", trial_id=f"{dataset}-{batch_size}-{defense}-{attack}-{seed}", attack=attack, attack_params="{}",
                defense=defense, defense_params="{}", model="mlp", dataset=dataset, batch_size=batch_size, seed=seed,
                status=status, mse=mse if ok else None, psnr=psnr if ok else None, ssim=0.5 if ok else None, lpips=None,
                label_acc=None, verdict=None, seconds=1.0, error=None if ok else "boom", cosine=0.5 if ok else None,
                grad_dist=0.1, matched=(batch_size if matched is None else matched) if ok else None, image=None,
                extra=json.dumps(extra if ok else {}),
                case=json.dumps({"dataset": dataset, "model": "mlp", "batch_size": batch_size}))  # fmt: skip


def frame(rows):
    return apply_verdicts(pd.DataFrame(rows), "margin")


def group(agg, defense, attack, batch_size=1):
    g = agg[(agg.defense == defense) & (agg.attack == attack) & (agg.batch_size == batch_size)]
    assert len(g) == 1
    return g.iloc[0]


def test_median_verdict_takes_the_attackers_side_of_an_even_count():
    # The verdict at least half of the trials reach or exceed.
    assert median_verdict(["recovered", "defended"]) == "recovered"
    assert median_verdict(["defended", "partial", "recovered", "defended"]) == "partial"
    assert median_verdict(["defended", "recovered", "defended"]) == "defended"  # odd: the plain median
    assert median_verdict(["recovered", "defended", "recovered"]) == "recovered"
    assert median_verdict(["partial"]) == "partial" and median_verdict([]) is None


@pytest.mark.parametrize("psnrs, verdict, recovered", [
    ((30, 10), "recovered", 1 / 2),
    ((30, 10, 10), "defended", 1 / 3),
    ((30, 20, 10, 10), "partial", 1 / 4),
    ((30, 30, 10, 10), "recovered", 2 / 4),
    ((20, 20, 30, 30, 10), "partial", 2 / 5),
])  # fmt: skip
def test_a_groups_verdict_over_even_and_odd_seed_counts(psnrs, verdict, recovered):
    agg = aggregate(frame([trial("none", "x", s, p) for s, p in enumerate(psnrs)]))
    r = group(agg, "none", "x")
    assert (r.verdict, r.recovered, r.trials) == (verdict, pytest.approx(recovered), len(psnrs))
    assert r.psnr == pytest.approx(float(pd.Series(psnrs).median()))


def test_failed_trials_count_in_no_verdict():
    agg = aggregate(frame([trial("none", "x", 0, 30), trial("none", "x", 1, 10), trial("none", "x", 2, 0, status="failed")]))
    r = group(agg, "none", "x")
    assert (r.verdict, r.recovered, r.trials, r.failed, r.psnr) == ("recovered", 0.5, 3, 1, 20.0)


def test_missing_images_make_a_trial_at_best_partial():
    # Batch of 4, three reconstructions, each exact: half the batch at MSE 1e-6, but one image never returned.
    rows = [trial("none", "x", s, 40.0, batch_size=4, mse=0.02, half_mse=1e-6, matched=3) for s in range(3)]
    rows += [trial("none", "y", s, 40.0, batch_size=4, mse=0.02, half_mse=1e-6) for s in range(3)]
    df = frame(rows)
    assert list(df.verdict) == ["partial"] * 3 + ["recovered"] * 3
    agg = aggregate(df)
    assert (group(agg, "none", "x", 4).verdict, group(agg, "none", "x", 4).recovered) == ("partial", 0.0)
    assert group(agg, "none", "y", 4).verdict == "recovered"
    # the leaderboard's row: a defense whose only leak is incomplete is at best partial
    dr = defense_ranking(aggregate(frame([trial("gamma", "x", s, 40.0, batch_size=4, mse=0.02, half_mse=1e-6, matched=3)
                                          for s in range(2)])))  # fmt: skip
    assert dr.iloc[0]["verdict"] == "partial"


def worst_case_frame():
    rows = []
    for s in range(2):
        # alpha: its worst case is attack x in the second case (batch 4), not its first case's worst (y, 18 dB)
        rows += [trial("alpha", "x", s, 15.0), trial("alpha", "y", s, 18.0),
                 trial("alpha", "x", s, 26.0, batch_size=4), trial("alpha", "y", s, 12.0, batch_size=4)]
        # beta: its worst case is in the first case (y, 22 dB); a second data set's case under it
        rows += [trial("beta", "y", s, 22.0), trial("beta", "x", s, 14.0, batch_size=4),
                 trial("beta", "x", s, 11.0, dataset="e")]
        # gamma's worst case is in the last case of all (data set e)
        rows += [trial("gamma", "x", s, 9.0), trial("gamma", "x", s, 30.0 + s, dataset="e")]
    return frame(rows)


def test_the_worst_case_is_over_every_case_and_attack():
    dr = defense_ranking(aggregate(worst_case_frame())).set_index("defense")
    assert (dr.loc["alpha", "worst_attack"], dr.loc["alpha", "psnr"], dr.loc["alpha", "verdict"]) == ("x", 26.0, "recovered")
    assert "B=4" in dr.loc["alpha", "worst_case"]
    assert (dr.loc["beta", "worst_attack"], dr.loc["beta", "psnr"], dr.loc["beta", "verdict"]) == ("y", 22.0, "partial")
    assert (dr.loc["gamma", "psnr"], dr.loc["gamma", "worst_case"].split("/")[0]) == (30.5, "e")
    assert list(dr.index) == ["beta", "alpha", "gamma"] and list(dr["rank"]) == [1, 2, 3]


def test_a_worst_case_tie_goes_to_the_lower_median_mse():
    rows = [trial("alpha", "x", 0, 20.0, batch_size=4, mse=0.01), trial("alpha", "y", 0, 20.0, batch_size=4, mse=0.002)]
    dr = defense_ranking(aggregate(frame(rows)))
    assert (dr.iloc[0]["worst_attack"], dr.iloc[0]["mse_median"]) == ("y", 0.002)


def test_values_equal_to_the_precision_shown_share_a_rank():
    assert competition_rank([20.001, 20.004, 25.0, None, 19.0], ascending=True) == [2, 2, 4, 5, 1]
    assert competition_rank([20.001, 20.004, 25.0, 20.02], ascending=False) == [3, 3, 1, 2]
    assert competition_rank([1.0, 1.0, 1.0], ascending=True) == [1, 1, 1]
    assert competition_rank([float("nan"), 2.0], ascending=False) == [2, 1]


def test_the_defense_ranking_ties_within_the_precision_shown():
    rows = [trial(d, "x", 0, p) for d, p in (("a", 20.001), ("b", 20.004), ("c", 25.0), ("d", 14.0), ("e", 19.996))]
    dr = defense_ranking(aggregate(frame(rows)))
    assert list(dr.defense) == ["d", "e", "a", "b", "c"]
    assert list(dr["rank"]) == [1, 2, 2, 2, 5]  # 19.996, 20.001 and 20.004 all show as 20.00


def test_the_attack_ranking_ranks_undefended_median_psnr_highest_first_with_ties():
    rows = [trial("none", a, s, p + s) for a, p in (("x", 30.0), ("y", 30.003), ("z", 20.0)) for s in range(2)]
    rows += [trial("alpha", "z", s, 40.0) for s in range(2)]  # a defended trial never counts as undefended
    df = frame(rows)
    ar = attack_ranking(aggregate(df), df).set_index("attack")
    assert ar.loc["z", "psnr_undefended"] == 20.5 and ar.loc["z", "rank"] == 3
    assert ar.loc["x", "rank"] == ar.loc["y", "rank"] == 1
    assert ar.loc["z", "defenses_recovered"] == "1/2"  # z recovers through alpha (40 dB), not undefended (20.5)
    assert math.isclose(ar.loc["y", "psnr_undefended"], 30.503)


def test_the_diagnostics_column_is_said_in_words_most_telling_first():
    from gleak.reporting.documents.cells import extras_text

    said = extras_text({"row_kept": 0.5, "half_mse": 0.0123, "share_psnr40": 0.75, "bins_usable": 3.0,
                        "blind_mse": 0.1, "model_train_loss": 0.2})  # fmt: skip
    assert said == ("75% of the batch exact (PSNR > 40 dB); half the batch at MSE <= 0.0123; "
                    "50% of the read row's entries left by the defense; bins usable 3")  # fmt: skip
    assert "=" not in said.replace("<=", "") and "_" not in said
