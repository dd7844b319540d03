"""Published claims ([[claim]] tables) and the DP bound in the leaderboard (issue 13)."""
import json
import re
import shutil

import pandas as pd
import pytest

from gleak.claims import judge
from gleak.errors import InputError
from gleak.suite import load_suite

HEAD = """
[suite]
name = "c"
seeds = 1
save_images = false
[case]
dataset = "skimage"
model = "mlp"
[[attack]]
name = "closed-form"
defense_aware = [false, true]
[[defense]]
name = "none"
[[defense]]
name = "dgp"
[[defense]]
name = "noise"
mode = "dp"
noise_multiplier = 1.0
"""
CLAIM = """
[[claim]]
source = "seed 001"
claim = "DGP stops analytic attacks"
defense = "dgp"
attacks = ["closed-form"]
expect = "defended"
"""


def _suite(tmp_path, text):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return load_suite(p)


@pytest.mark.parametrize("line, key", [
    ('expect = "maybe"', "expect"), ('colour = "red"', "colour"), ('defense_params = { k9 = 1 }', "defense_params.k9"),
    ('case = { seeds = 3 }', "case.seeds"), ('case = { batch_size = "4" }', "case.batch_size"),
])  # fmt: skip
def test_a_bad_claim_key_is_one_line_naming_it(tmp_path, line, key):
    text = HEAD + CLAIM.replace('expect = "defended"', line if line.startswith("expect") else 'expect = "defended"\n' + line)
    with pytest.raises(InputError) as exc:
        _suite(tmp_path, text)
    msg = str(exc.value)
    assert "\n" not in msg and "[claim #1]" in msg and f"key {key!r}" in msg and "s.toml" in msg, msg


@pytest.mark.parametrize("old, new, key", [
    ('defense = "dgp"', 'defense = "dgpp"', "defense"), ('["closed-form"]', '["closed-frm"]', "attacks"),
    ('["closed-form"]', '[]', "attacks"), ('source = "seed 001"\n', "", "source"),
])  # fmt: skip
def test_unknown_plugins_and_missing_keys_are_named(tmp_path, old, new, key):
    with pytest.raises(InputError, match=rf"\[claim #1\] key '{key}'"):
        _suite(tmp_path, HEAD + CLAIM.replace(old, new))


def test_claims_parse_with_resolved_names(tmp_path):
    s = _suite(tmp_path, HEAD + CLAIM + CLAIM.replace('defense = "dgp"', 'defense = "noise"\ndefense_params = { mode = "dp" }'))
    assert [c["defense"] for c in s.claims] == ["dgp", "noise"] and s.claims[1]["defense_params"] == {"mode": "dp"}
    assert len(s.trials) == 6  # claims add no trials


def _row(attack, aware, psnr, verdict, dp='{"k1": 0.05}', recovered=None):
    return {"dataset": "skimage", "model": "mlp", "batch_size": 1, "variant": "", "defense": "dgp", "defense_params": dp,
            "attack": attack, "attack_params": json.dumps({"defense_aware": True} if aware else {}), "psnr": psnr,
            "mse_median": 10 ** (-psnr / 10), "verdict": verdict, "recovered": recovered, "blind_psnr": 12.0}  # fmt: skip


def test_a_claim_falls_to_the_adaptive_attack_and_holds_without_it():
    claim = {"source": "s", "claim": "c", "defense": "dgp", "defense_params": {}, "attacks": ["closed-form"], "case": {}, "expect": "defended"}
    agg = pd.DataFrame([_row("closed-form", False, 12.0, "defended", recovered=0.0), _row("closed-form", True, 36.0, "recovered", recovered=1.0),
                        _row("rgap", False, 50.0, "recovered")])  # fmt: skip
    (r,) = judge(claim, agg)
    assert r["verdict"] == "falls" and "only to the adaptive attack" in r["why"] and "36.0 dB" in r["why"]
    assert r["plain"]["psnr"] == 12.0 and r["adaptive"]["psnr"] == 36.0  # rgap is not among the claim's attacks
    (r,) = judge(claim, agg[~agg["attack_params"].str.contains("true")])
    assert r["verdict"] == "holds"
    (r,) = judge({**claim, "expect": "leaks"}, agg)
    assert r["verdict"] == "holds"
    (r,) = judge({**claim, "expect": "leaks"}, agg[~agg["attack_params"].str.contains("true")])
    assert r["verdict"] == "falls"
    (r,) = judge({**claim, "defense_params": {"k1": 0.1}}, agg)
    assert r["verdict"] == "not run"
    two = pd.concat([agg, pd.DataFrame([_row("closed-form", False, 9.0, "defended", dp='{"k1": 0.1}')])])
    assert [x["verdict"] for x in judge(claim, two)] == ["falls", "holds"]  # one row per matching configuration
    weak = pd.concat([agg, pd.DataFrame([{**_row("closed-form", False, 11.0, "defended"), "defense": "none", "defense_params": "{}"}])])
    (r,) = judge({**claim, "expect": "leaks"}, weak[~weak["attack_params"].str.contains("true")])
    assert r["verdict"] == "inconclusive" and "even without a defense" in r["why"]  # an attack that never works
    strong = pd.concat([agg, pd.DataFrame([{**_row("closed-form", False, 50.0, "recovered"), "defense": "none", "defense_params": "{}"}])])
    (r,) = judge({**claim, "expect": "leaks"}, strong[~strong["attack_params"].str.contains("true")])
    assert r["verdict"] == "falls"


def test_the_leaderboard_judges_the_claims_and_a_clone_rebuilds_them(tmp_path):
    """End to end: run a small suite, the leaderboard has the claims (DGP's falls to the defense-aware closed form,
    with its numbers) and the DP bound; the defense ranking's worst case for DGP is the adaptive attack's; deleting
    the store and rebuilding from the committed files gives the same section."""
    import gleak
    from gleak.report import write_reports

    s = _suite(tmp_path, HEAD + CLAIM)
    out = tmp_path / "out"
    gleak.run(s, out, progress=False)
    md = (out / "leaderboard.md").read_text()
    section = md[md.index("## Published claims"):md.index("## Results by case")]
    assert "| DGP stops analytic attacks |" in section and "falls: only to the adaptive attack" in section
    assert "## Differential privacy: the bound beside the attacks" in section
    lb = pd.read_csv(out / "leaderboard.csv")
    by_case = pd.read_csv(out / "leaderboard_by_case.csv")
    dgp = by_case[by_case["defense"] == "dgp"]
    assert lb.loc[lb["defense"] == "dgp", "psnr"].iloc[0] == dgp["psnr"].max()
    assert dgp.loc[dgp["psnr"].idxmax(), "attack_params"].find('"defense_aware": true') >= 0
    assert json.loads(lb.loc[lb["defense"] == "dgp", "worst_attack_params"].iloc[0])["defense_aware"] is True
    ranking = md[md.index("## Defenses, ranked"):md.index("## Attacks, ranked")]
    assert re.search(r"\|\s*closed-form defense_aware=True\s*\|", ranking)  # the table names the adaptive variant
    assert json.loads((out / "suite.json").read_text())["claims"][0]["claim"] == "DGP stops analytic attacks"
    for f in out.glob("results.sqlite*"):
        f.unlink()
    shutil.rmtree(out / "images", ignore_errors=True)
    write_reports(out)
    md2 = (out / "leaderboard.md").read_text()
    assert md2[md2.index("## Published claims"):md2.index("## Results by case")] == section


def test_kappa_bounds_every_guess():
    """Kappa's upper bound is never below what any fixed guess attains (the images, their pairwise midpoints, the
    mean), and not below the attained value, on the embedded images (the bound's docstring examples run in
    test_doctests.py)."""
    import torch

    import gleak.dp_bound as dpb
    from gleak.data import load_dataset

    x = load_dataset("skimage", "train").x[:60].double()
    upper, attained = dpb.baseline_kappa(x), dpb.attained_kappa(x)
    r = dpb.recovered_radius(x)
    guesses = [x, (x.unsqueeze(0) + x.unsqueeze(1)).flatten(0, 1) / 2, x.mean(0, keepdim=True)]
    best = 0.0
    for g in guesses:
        rmse = torch.cdist(g.flatten(1), x.flatten(1)) / x[0].numel() ** 0.5
        best = max(best, float((rmse <= r.unsqueeze(0)).double().sum(1).max()) / len(x))
    assert attained <= best <= upper, (attained, best, upper)
    assert dpb.reconstruction_bound(0.5, 1e-5, upper) > upper  # e^eps > 1: the guarantee allows more than kappa
