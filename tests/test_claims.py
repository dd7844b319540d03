"""Published claims ([[claim]] tables) judged at their settings, and the DP bound in the leaderboard."""
import json
import re
import shutil

import pandas as pd
import pytest

from gleak.contracts.errors import InputError
from gleak.orchestration.suite import load_suite
from gleak.reporting.claims import elsewhere_text, judge, undefended_twin, wilson

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
    ('defense = "dgp"', 'defense = "fedavgg+none"', "defense"), ('defense = "dgp"', 'defense = "fedavg+nonee"', "defense"),
])  # fmt: skip
def test_unknown_plugins_and_missing_keys_are_named(tmp_path, old, new, key):
    with pytest.raises(InputError, match=rf"\[claim #1\] key '{key}'"):
        _suite(tmp_path, HEAD + CLAIM.replace(old, new))


def test_claims_parse_with_resolved_names(tmp_path):
    s = _suite(tmp_path, HEAD + CLAIM + CLAIM.replace('defense = "dgp"', 'defense = "noise"\ndefense_params = { mode = "dp" }'))
    assert [c["defense"] for c in s.claims] == ["dgp", "noise"] and s.claims[1]["defense_params"] == {"mode": "dp"}
    assert len(s.trials) == 6  # claims add no trials


def test_a_claim_about_a_protocol_names_it_as_the_leaderboard_does(tmp_path):
    # FedAvg's local training protects (or not) as PROTOCOL+DEFENSE, the name protocol_pairs gives its trials
    s = _suite(tmp_path, HEAD + CLAIM.replace('defense = "dgp"', 'defense = "fedavg+none"'))
    assert s.claims[0]["defense"] == "fedavg+none"


def _row(attack, aware, psnr, verdict, dp='{"k1": 0.05}', recovered=None, defense="dgp", batch=1, trials=5):
    return {"dataset": "skimage", "model": "mlp", "batch_size": batch, "variant": "", "defense": defense,
            "defense_params": dp, "attack": attack, "attack_params": json.dumps({"defense_aware": True} if aware else {}),
            "psnr": psnr, "mse_median": 10 ** (-psnr / 10), "verdict": verdict, "recovered": recovered,
            "blind_psnr": 12.0, "trials": trials, "failed": 0, "not_applicable": 0}  # fmt: skip


def _none(attack, psnr, verdict, batch=1, aware=False):
    return _row(attack, aware, psnr, verdict, dp="{}", defense="none", batch=batch, recovered=1.0 if verdict == "recovered" else 0.0)


CLAIM_D = {"source": "s", "claim": "c", "setting": "k1 5%", "defense": "dgp", "defense_params": {}, "attacks": ["closed-form"],
           "case": {}, "expect": "defended"}  # fmt: skip


def test_a_claim_is_judged_only_at_its_own_setting_and_shows_the_others():
    agg = pd.DataFrame([_none("closed-form", 120.0, "recovered"), _row("closed-form", False, 11.0, "defended", recovered=0.0),
                        _row("closed-form", False, 40.0, "recovered", dp='{"k1": 0.01}', recovered=1.0)])  # fmt: skip
    pinned = {**CLAIM_D, "defense_params": {"k1": 0.05}}
    j = judge(pinned, agg)
    assert j["verdict"] == "holds" and j["plain"]["psnr"] == 11.0, j["why"]
    assert "k1=0.01" in elsewhere_text(j) and "40.0 dB" in elsewhere_text(j)  # shown, not deciding
    assert judge(CLAIM_D, agg)["verdict"] == "falls"  # a claim pinned to no strength is judged at every one
    assert judge({**pinned, "defense_params": {"k1": 0.2}}, agg)["verdict"] == "not run"
    assert judge({**pinned, "case": {"batch_size": 4}}, agg)["verdict"] == "not run"
    assert judge({**pinned, "attack_params": {"defense_aware": True}}, agg)["verdict"] == "not run"


def test_an_attack_that_fails_undefended_makes_a_claim_inconclusive_never_falls_or_holds():
    weak = pd.DataFrame([_none("closed-form", 14.0, "partial"), _row("closed-form", False, 13.5, "partial", recovered=0.0)])
    for expect in ("defended", "leaks"):
        j = judge({**CLAIM_D, "expect": expect}, weak)
        assert j["verdict"] == "inconclusive" and "does not recover the undefended case" in j["why"], j
    no_twin = weak[weak["defense"] != "none"]
    assert judge(CLAIM_D, no_twin)["verdict"] == "inconclusive"


def test_a_victim_recovered_at_the_claim_s_setting_decides_a_leak_claim_without_a_recovered_twin():
    # The attack recovers the victim through the defense (3 of 5) but its undefended twin only partly: a claim that
    # data leaks holds on that recovery; a claim that the defense stops the attack stays undecided by it.
    odd = pd.DataFrame([_none("closed-form", 22.0, "partial"), _row("closed-form", False, 25.0, "recovered", recovered=0.6)])
    leak = judge({**CLAIM_D, "expect": "leaks"}, odd)
    assert leak["verdict"] == "holds" and "recovered at 25.0 dB" in leak["why"] and "partial at 22.0 dB" in leak["why"], leak
    assert judge(CLAIM_D, odd)["verdict"] == "inconclusive"
    no_twin = odd[odd["defense"] != "none"]
    assert judge({**CLAIM_D, "expect": "leaks"}, no_twin)["verdict"] == "holds"
    partly = odd.assign(verdict=["partial", "partial"])  # a partial leak there is no such evidence
    assert judge({**CLAIM_D, "expect": "leaks"}, partly)["verdict"] == "inconclusive"


def test_the_undefended_twin_is_the_same_case_and_the_same_attack_parameters():
    # Undefended: recovered at batch 1, defended at batch 4; the claim at batch 4 compares like with like.
    agg = pd.DataFrame([_none("closed-form", 120.0, "recovered", batch=1), _none("closed-form", 11.0, "defended", batch=4),
                        _row("closed-form", False, 14.0, "partial", batch=4, recovered=0.0)])  # fmt: skip
    assert judge({**CLAIM_D, "case": {"batch_size": 4}}, agg)["verdict"] == "inconclusive"
    agg = pd.concat([agg, pd.DataFrame([_none("closed-form", 60.0, "recovered", batch=4, aware=True)])])
    j = judge({**CLAIM_D, "case": {"batch_size": 4}}, agg)  # the aware twin is another attack configuration
    assert j["verdict"] == "inconclusive", j
    assert undefended_twin(agg.iloc[2], agg)["psnr"] == 11.0


def test_the_adaptive_side_decides_and_a_leak_claim_can_be_not_reproduced():
    agg = pd.DataFrame([_none("closed-form", 120.0, "recovered"), _row("closed-form", False, 12.0, "defended", recovered=0.0),
                        _row("closed-form", True, 36.0, "recovered", recovered=1.0), _row("rgap", False, 50.0, "recovered")])  # fmt: skip
    j = judge(CLAIM_D, agg)
    assert j["verdict"] == "falls" and "only to the attack that knows the defense" in j["why"] and "36.0 dB" in j["why"]
    assert "no defense, same case: recovered at 120.0 dB" in j["why"]  # like with like
    assert j["plain"]["psnr"] == 12.0 and j["adaptive"]["psnr"] == 36.0  # rgap is not among the claim's attacks
    plain = agg[~agg["attack_params"].str.contains("true")]
    assert judge(CLAIM_D, plain)["verdict"] == "holds"
    assert judge({**CLAIM_D, "expect": "leaks"}, agg)["verdict"] == "holds"
    assert judge({**CLAIM_D, "expect": "leaks"}, plain)["verdict"] == "not reproduced"
    assert "5/5 recovered [95% 57%, 100%]" in judge(CLAIM_D, agg)["why"]


def test_not_applicable_attacks_are_named_and_a_protocol_in_the_case_keeps_its_twin():
    sa = {**_row("closed-form", False, 12.0, "defended", dp="{}", defense="sa", recovered=0.0),
          "case": json.dumps({"batch_size": 1, "protocol": "secure-aggregation"})}  # fmt: skip
    na = {**_row("fishing", False, float("nan"), None, dp="{}", defense="sa", trials=3), "not_applicable": 3, "case": sa["case"]}
    base = {**_none("closed-form", 120.0, "recovered"), "case": json.dumps({"batch_size": 1, "protocol": "fedsgd"})}
    claim = {**CLAIM_D, "defense": "sa", "attacks": ["closed-form", "fishing"]}
    j = judge(claim, pd.DataFrame([base, sa, na]).assign(psnr=lambda d: d["psnr"].where(d["psnr"].notna(), None)))
    assert j["verdict"] == "holds" and "not applicable at this setting" in j["why"] and "fishing" in j["why"], j["why"]


def test_a_defended_claim_never_holds_with_a_recovered_victim_and_needs_five():
    # The cell's majority verdict is defended, but 1 of 5 victims is recovered: the claim falls, saying so.
    one = pd.DataFrame([_none("closed-form", 120.0, "recovered"), _row("closed-form", False, 11.0, "defended", recovered=0.2)])
    j = judge(CLAIM_D, one)
    assert j["verdict"] == "falls" and "falls for 1 of 5 victims" in j["why"], j["why"]
    # recovered victims count over every deciding cell, not only the strongest
    two = pd.DataFrame([_none("closed-form", 120.0, "recovered"), _none("rgap", 120.0, "recovered"),
                        _row("closed-form", False, 15.0, "defended", recovered=0.0),
                        _row("rgap", False, 11.0, "defended", recovered=0.4)])  # fmt: skip
    j = judge({**CLAIM_D, "attacks": ["closed-form", "rgap"]}, two)
    assert j["verdict"] == "falls" and "2 of 10 victims" in j["why"], j["why"]
    # none recovered of 3: too few to say "no input"
    few = pd.DataFrame([_none("closed-form", 120.0, "recovered"), _row("closed-form", False, 11.0, "defended", recovered=0.0, trials=3)])
    assert judge(CLAIM_D, few)["verdict"] == "inconclusive"
    assert judge(CLAIM_D, one.assign(recovered=[1.0, 0.0]))["verdict"] == "holds"


def test_most_inputs_needs_more_than_half_of_the_samples_recovered():
    leak = {**CLAIM_D, "expect": "leaks", "quantifier": "most inputs"}
    cell = _row("imprint", False, 20.0, "partial", recovered=0.0)
    base = _none("imprint", 120.0, "recovered")
    few = pd.DataFrame([base, {**cell, "extra": {"share_psnr40": 0.3}}])
    j = judge({**leak, "attacks": ["imprint"]}, few)
    assert j["verdict"] == "not reproduced" and "30%" in j["why"], j["why"]
    many = pd.DataFrame([base, {**cell, "extra": {"share_psnr40": 0.7}}])
    assert judge({**leak, "attacks": ["imprint"]}, many)["verdict"] == "holds"
    assert judge({**leak, "attacks": ["imprint"], "quantifier": "some input"}, few)["verdict"] == "holds"


def test_wilson_interval():
    lo, hi = wilson(3, 3)
    assert abs(lo - 0.4385) < 1e-3 and hi == 1.0
    lo, hi = wilson(0, 5)
    assert lo == 0.0 and abs(hi - 0.4345) < 1e-3
    lo, hi = wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-3 and abs(hi - 0.7634) < 1e-3 and wilson(1, 0) is None


def test_shipped_claims_name_their_setting_and_one_claim_has_one_setting_everywhere():
    """A data check over the shipped suites: every claim states its paper's setting in words, and a claim made in
    several suites is pinned to the same setting in each (so it cannot get two verdicts)."""
    import tomllib
    from pathlib import Path

    from gleak.contracts.errors import Where
    from gleak.orchestration.suite_claims import parse_claims

    seen = {}
    for path in sorted((Path(__file__).resolve().parent.parent / "suites").glob("*.toml")):
        # the claim tables alone: a suite whose data set is an optional extra (Fashion-MNIST) is read without it
        for c in parse_claims(tomllib.loads(path.read_text()).get("claim", []), Where(path)):
            assert c["setting"], f"{path.name}: claim {c['claim']!r} names no setting"
            pin = (c["defense"], tuple(c["attacks"]), c["expect"], json.dumps([c["defense_params"], c["case"], c["attack_params"]], sort_keys=True))
            prev = seen.setdefault(c["claim"], (path.name, pin))
            assert prev[1] == pin, f"{c['claim']!r}: {prev[0]} and {path.name} judge it at different settings"


def test_the_leaderboard_judges_the_claims_and_a_clone_rebuilds_them(tmp_path):
    """End to end: run a small suite, the leaderboard has the claims (DGP's falls to the defense-aware closed form,
    with its numbers) and the DP bound; the defense ranking's worst case for DGP is the adaptive attack's; deleting
    the store and rebuilding from the committed files gives the same section."""
    import gleak
    from gleak.reporting.report import write_reports

    s = _suite(tmp_path, HEAD + CLAIM)
    out = tmp_path / "out"
    gleak.run(s, out, progress=False)
    md = (out / "leaderboard.md").read_text()
    section = md[md.index("## Published claims"):md.index("## Results by case")]
    assert "| DGP stops analytic attacks |" in section and "falls: only to the attack that knows the defense" in section
    assert "## Differential privacy: the bound beside the attacks" in section
    lb = pd.read_csv(out / "leaderboard.csv")
    by_case = pd.read_csv(out / "leaderboard_by_case.csv")
    dgp = by_case[by_case["defense"] == "dgp"]
    assert lb.loc[lb["defense"] == "dgp", "psnr"].iloc[0] == dgp["psnr"].max()
    assert dgp.loc[dgp["psnr"].idxmax(), "attack_params"].find('"defense_aware": true') >= 0
    assert json.loads(lb.loc[lb["defense"] == "dgp", "worst_attack_params"].iloc[0])["defense_aware"] is True
    ranking = md[md.index("## Defenses, ranked"):md.index("## Attacks, ranked")]
    assert re.search(r"\|\s*closed-form defense_aware=True \[C\]\s*\|", ranking)  # the table names the adaptive variant and its threat model
    assert json.loads((out / "suite.json").read_text())["claims"][0]["claim"] == "DGP stops analytic attacks"
    for f in out.glob("results.sqlite*"):
        f.unlink()
    shutil.rmtree(out / "images", ignore_errors=True)
    write_reports(out)
    md2 = (out / "leaderboard.md").read_text()
    assert md2[md2.index("## Published claims"):md2.index("## Results by case")] == section


def test_leaderboard_claims_rejudges_edited_claims_without_rerunning(tmp_path, capsys):
    """`gleak leaderboard DIR --claims SUITE`: the edited claims are judged on the stored trials (no trial runs);
    a suite file of another suite is one line, exit 2, and changes nothing."""
    import gleak
    from gleak.cli import main

    p = tmp_path / "s.toml"
    p.write_text(HEAD + CLAIM)
    out = tmp_path / "out"
    gleak.run(load_suite(p), out, progress=False)
    before = (out / "leaderboard.md").read_text()
    assert "falls: only to the attack that knows the defense" in before
    p.write_text(HEAD + CLAIM.replace('expect = "defended"', 'expect = "leaks"\nsetting = "edited"'))
    assert main(["leaderboard", str(out), "--claims", str(p)]) == 0
    after = (out / "leaderboard.md").read_text()
    assert re.search(r"\|\s*edited\s*\|", after) and "holds: closed-form" in after and "falls: only" not in after
    assert json.loads((out / "suite.json").read_text())["claims"][0]["setting"] == "edited"
    other = tmp_path / "o.toml"
    other.write_text(HEAD.replace('name = "c"', 'name = "other"') + CLAIM)
    capsys.readouterr()
    assert main(["leaderboard", str(out), "--claims", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'other'" in err and "'c'" in err, err
    assert (out / "leaderboard.md").read_text() == after


def test_kappa_bounds_every_guess():
    """Kappa's upper bound is never below what any fixed guess attains (the images, their pairwise midpoints, the
    mean), and not below the attained value, on the embedded images (the bound's docstring examples run in
    test_doctests.py)."""
    import torch

    import gleak.mechanics.dp_bound as dpb
    from gleak.mechanics.data import load_dataset

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
