"""Published claims checked against a suite's own results, and the DP bound beside the attacks.

A suite's [[claim]] tables (validated by gleak.orchestration.suite) each state what a paper says about one defense against named
attacks, at the paper's own setting: `setting` says it in words (mechanism, strength or the accuracy it costs,
model, attack and budget, batch size) and `defense_params`, `case` and `attack_params` pin it (partial matches).
`expect = "defended"` (the defense stops the attacks) or `expect = "leaks"` (the attacks still recover data).

One claim, one setting, one verdict. Only the cells at the claim's setting decide; cells of the same defense and
attacks at other settings are shown beside it ("at another setting") and never decide. An attack decides only where
it recovers the undefended case of the same setting (same data set, model, batch size and case variant, same attack
parameters): an attack that fails without a defense can neither credit nor blame one. The verdicts:

- holds: expect defended, no deciding cell's verdict is partial or recovered, and no deciding trial (over every
  deciding cell, at least 5) is recovered; or expect leaks and one leaks ("most inputs": more than half of the
  samples recovered exactly).
- falls: expect defended, and a deciding attack still leaks (partial or recovered) through the defense, or k > 0
  deciding trials are recovered ("falls for k of n victims").
- not reproduced: expect leaks, and no deciding attack leaks through the defense (the claimed leak is not shown by
  our strongest attack at the paper's setting).
- inconclusive: no attack at the setting recovers the undefended case, so no attack can judge the defense.
- not run: the suite has no trial at the claim's setting.

Both sides are judged: the strongest deciding attack that ignores the defense and the strongest that knows it
(`defense_aware = true`); a claim that holds only because the attack ignored the defense falls, with the adaptive
attack's numbers. "Strongest" is the defense ranking's rule (highest median PSNR, ties to the lower median MSE).

The claims travel with the folder: the run stores them in the store's meta ("claims"), and the report copies them
into suite.json (gleak.reporting.report.write_reports, from `folder_claims`) so that a clone without the store rebuilds the
same section; `gleak leaderboard DIR --claims SUITE` re-reads them from an edited suite file (`replace_claims`).

DP bound: for every defense configuration whose trials report extra.epsilon (DP-SGD), the bound of gleak.mechanics.dp_bound
beside the best empirical attack (its share of trials recovered).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from gleak.mechanics.metrics import leakiest_first
from gleak.reporting.claim_setting import (
    CASE_COLUMNS,
    LEAKING,
    MIN_VICTIMS,
    params_of,
    row_at_setting,
    variant_text,
    wilson,
)  # fmt: skip
from gleak.reporting.comparison_claims import RULE as COMPARISON_RULE
from gleak.reporting.comparison_claims import expects_text, judge_beats
from gleak.reporting.text_claims import is_text_claim, judge_text
from gleak.reporting.documents.cells import data, params_text

VERDICTS = ("holds", "falls", "not reproduced", "inconclusive", "not run")


def _is_aware(attack_params_js: Any) -> bool:
    return bool(params_of(attack_params_js).get("defense_aware"))


def _plain_params(attack_params_js: Any) -> str:
    """The attack's parameters without `defense_aware`: an adaptive attack's undefended twin has the same."""
    return json.dumps({k: v for k, v in params_of(attack_params_js).items() if k != "defense_aware"}, sort_keys=True)


def _case_key(js: Any) -> str:
    """A trial's case without the protocol it names: the case an undefended twin shares."""
    return json.dumps({k: v for k, v in params_of(js).items() if k not in ("protocol", "protocol_params")}, sort_keys=True)


def _strongest(g: pd.DataFrame) -> Any:
    img = g[g["psnr"].notna()]
    if not len(img):
        return None
    return img.sort_values(["psnr", "mse_median"], ascending=leakiest_first("psnr", "mse_median"), kind="stable").iloc[0]


def at_setting(claim: dict[str, Any], agg: pd.DataFrame) -> pd.Series:
    """Which aggregated cells of the claim's defense and attacks are at the claim's own setting."""
    wanted_attack = claim.get("attack_params", {})
    return pd.Series([row_at_setting(r, claim, wanted_attack) for _, r in agg.iterrows()], index=agg.index, dtype=bool)


def undefended_twin(r: Any, agg: pd.DataFrame) -> Any:
    """The same attack (same parameters, `defense_aware` aside) against no defense at the same case: the like to
    compare a defended cell with. The exact parameters where they were run, else the plain twin's."""
    same_case = agg[(agg["defense"] == "none") & (agg["attack"] == r["attack"])]
    # The same case; a protocol named in [case] is the defense, so it and its parameters may differ (the variant
    # label names non-default protocol parameters, so it is compared only where the case itself is not stored).
    for k in (*CASE_COLUMNS, *(() if "case" in agg.columns else ("variant",))):
        if k in agg.columns:
            same_case = same_case[same_case[k] == r[k]]
    if "case" in agg.columns:
        same_case = same_case[same_case["case"].map(_case_key) == _case_key(r.get("case"))]
    exact = same_case[same_case["attack_params"] == r["attack_params"]]
    if len(exact):
        return _strongest(exact)
    return _strongest(same_case[same_case["attack_params"].map(_plain_params) == _plain_params(r["attack_params"])])


def recovered_count(r: Any) -> tuple[int, int] | None:
    """(trials recovered, trials judged) of an aggregated cell."""
    if r is None or r.get("recovered") is None or (isinstance(r.get("recovered"), float) and math.isnan(r["recovered"])):
        return None
    n = int(r.get("trials", 0) or 0) - int(r.get("failed", 0) or 0) - int(r.get("not_applicable", 0) or 0)
    return (int(round(float(r["recovered"]) * n)), n) if n > 0 else None


def evidence_text(r: Any) -> str:
    """'attack [variant] (knows the defense): verdict at P dB, k/n recovered [lo, hi]' of one aggregated cell."""
    if r is None:
        return "-"
    aware = variant_text(r["attack"], r["attack_params"]) + (" (knows the defense)" if _is_aware(r["attack_params"]) else "")
    kn = recovered_count(r)
    rate = ""
    if kn is not None:
        lo, hi = wilson(*kn)
        rate = f", {kn[0]}/{kn[1]} recovered [95% {lo:.0%}, {hi:.0%}]"
    return f"{r['attack']}{aware}: {r['verdict']} at {r['psnr']:.1f} dB{rate}"


def judge(claim: dict[str, Any], agg: pd.DataFrame) -> dict[str, Any]:
    """The claim's one verdict (VERDICTS) and why, from the cells at its setting whose attack recovers the
    undefended case; with the deciding cells (plain and adaptive), their undefended twins and the cells of the same
    defense and attacks at other settings."""
    cand = agg[(agg["defense"] == claim["defense"]) & agg["attack"].isin(claim["attacks"])]
    here_mask = at_setting(claim, cand) if len(cand) else pd.Series([], dtype=bool)
    here, there = cand[here_mask], cand[~here_mask]
    out: dict[str, Any] = {"claim": claim, "plain": None, "adaptive": None, "twin": {}, "elsewhere": there, "here": here}
    if not len(here):
        return {**out, "verdict": "not run", "why": "no trial of this suite is at the claim's setting"}
    na = here[[int(r.get("not_applicable", 0) or 0) >= int(r.get("trials", 0) or 0) > 0 for _, r in here.iterrows()]]
    if len(na):  # an attack the protocol or the model forbids: part of the evidence, never a leak
        names = ", ".join(sorted(set(na["attack"])))
        out["not_applicable"] = f"; not applicable at this setting (the protocol or model forbids what they need): {names}"
    twins = {i: undefended_twin(r, agg) for i, r in here.iterrows()}
    # A claim that data leaks is also decided by an attack that recovers the victim at the claim's own setting: that
    # recovery is the claim's evidence whatever the attack does elsewhere (FedLeak through FedAvg, say, where its
    # FedSGD twin is only partial).
    fit = here[[(twins[i] is not None and twins[i]["verdict"] == "recovered")
                or (claim["expect"] == "leaks" and here.at[i, "verdict"] == "recovered") for i in here.index]]  # fmt: skip
    out["twin"] = twins
    if not len(fit):
        best = _strongest(pd.DataFrame([t for t in twins.values() if t is not None])) if any(t is not None for t in twins.values()) else None
        why = (f"{best['attack']} does not recover the undefended case at this setting (no defense: {best['verdict']} at "
               f"{best['psnr']:.1f} dB): no attack here can judge the defense") if best is not None else \
              "no undefended trial at this setting: no attack here is shown to work"  # fmt: skip
        return {**out, "verdict": "inconclusive", "why": why + out.get("not_applicable", "")}
    aware = fit["attack_params"].map(_is_aware)
    out["plain"], out["adaptive"] = _strongest(fit[~aware]), _strongest(fit[aware])
    said = _verdict(claim["expect"], out["plain"], out["adaptive"], twins, fit)
    said = _quantified(claim, said, fit, out["plain"], out["adaptive"])
    return {**out, **said, "why": said["why"] + out.get("not_applicable", "")}


def _quantified(claim: dict[str, Any], said: dict[str, str], fit: pd.DataFrame, plain: Any, adaptive: Any) -> dict[str, str]:
    """The claim's quantifier over the deciding trials, after the cells' verdicts: "no input" (expect defended)
    holds only where none of n >= MIN_VICTIMS deciding trials, over every deciding cell, is recovered; k > 0 falls
    "for k of n victims". "most inputs" (expect leaks) holds only where the strongest leaking cell recovers more
    than half of its batches' samples exactly (extra.share_psnr40, else its share of trials recovered)."""
    quantifier = claim.get("quantifier", "no input" if claim["expect"] == "defended" else "some input")
    if quantifier == "no input" and said["verdict"] == "holds":
        counts = [(r, recovered_count(r)) for _, r in fit.iterrows()]
        k = sum(kn[0] for _, kn in counts if kn is not None)
        n = sum(kn[1] for _, kn in counts if kn is not None)
        lo, hi = wilson(k, n) or (0.0, 1.0)
        if k:
            worst = max((r for r, kn in counts if kn is not None and kn[0]), key=lambda r: recovered_count(r)[0])
            return {"verdict": "falls", "why": f"falls for {k} of {n} victims [95% {lo:.0%}, {hi:.0%}]: {evidence_text(worst)}"}
        if n < MIN_VICTIMS:
            return {"verdict": "inconclusive", "why": f"0 of {n} deciding trials recovered: at least {MIN_VICTIMS} are "
                                                      f"needed to say that no input is recovered; {said['why']}"}  # fmt: skip
        return {"verdict": "holds", "why": f"0 of {n} deciding trials recovered [95% {lo:.0%}, {hi:.0%}]; {said['why']}"}
    if quantifier == "most inputs" and said["verdict"] == "holds":
        leaking = [r for r in (plain, adaptive) if r is not None and r["verdict"] in LEAKING]
        share = max((_recovered_share(r) for r in leaking), default=0.0)
        if share <= 0.5:
            return {"verdict": "not reproduced", "why": f"most inputs: the strongest deciding attack recovers {share:.0%} "
                                                        f"of the samples exactly (more than half needed); {said['why']}"}  # fmt: skip
        return {"verdict": "holds", "why": f"{share:.0%} of the samples recovered exactly; {said['why']}"}
    return said


def _recovered_share(r: Any) -> float:
    """A cell's mean share of its batches' samples recovered exactly (extra.share_psnr40), else its share of
    trials recovered."""
    extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
    if extra.get("share_psnr40") is not None:
        return float(extra["share_psnr40"])
    return float(r.get("recovered") or 0.0)


def _twin_of(r: Any, twins: dict, fit: pd.DataFrame) -> Any:
    for i, f in fit.iterrows():
        if f["attack_params"] == r["attack_params"] and f["defense_params"] == r["defense_params"] and f["psnr"] == r["psnr"]:
            return twins[i]
    return None


def _verdict(expect: str, plain: Any, adaptive: Any, twins: dict, fit: pd.DataFrame) -> dict[str, str]:
    """The verdict from the strongest deciding cells; the sentence compares each with its undefended twin."""
    both = [r for r in (plain, adaptive) if r is not None]
    leaking = [r for r in both if r["verdict"] in LEAKING]

    def said(r: Any) -> str:
        t = _twin_of(r, twins, fit)
        return evidence_text(r) + (f" (no defense, same case: {t['verdict']} at {t['psnr']:.1f} dB)" if t is not None else "")

    if leaking:
        first = leaking[0]  # the attack that ignores the defense where it leaks: it needs no knowledge
        only = first is adaptive and plain is not None and expect == "defended"
        why = ("only to the attack that knows the defense: " if only else "") + said(first)
        return {"verdict": "falls" if expect == "defended" else "holds", "why": why}
    worst = max(both, key=lambda r: r["psnr"])
    if expect == "defended":
        return {"verdict": "holds", "why": "every deciding attack is defended; strongest " + said(worst)}
    return {"verdict": "not reproduced", "why": "no deciding attack leaks through the defense; strongest " + said(worst)}


def _varying(rows: pd.DataFrame, col: str) -> list[str]:
    ps = [params_of(js) for js in rows[col]]
    keys = sorted(set().union(*ps)) if ps else []
    return [k for k in keys if len({json.dumps(p.get(k), sort_keys=True) for p in ps}) > 1]


def _cell_setting(r: Any, dkeys: list[str], akeys: list[str]) -> str:
    dp, ap = params_of(r["defense_params"]), params_of(r["attack_params"])
    parts = [f"{k}={dp.get(k)}" for k in dkeys] + [f"{k}={ap.get(k)}" for k in akeys if k != "defense_aware"]
    parts += [f"{r['model']}, batch {int(r['batch_size'])}"]
    return ", ".join(parts)


def elsewhere_text(j: dict[str, Any], limit: int = 4) -> str:
    """The cells of the claim's defense and attacks at other settings, strongest first: shown, never deciding."""
    there = j["elsewhere"]
    if not len(there):
        return ""
    both = pd.concat([j["here"], there])
    dkeys, akeys = _varying(both, "defense_params"), _varying(both, "attack_params")
    rows = there[there["psnr"].notna()].sort_values("psnr", ascending=leakiest_first("psnr")[0], kind="stable")
    out = [f"{_cell_setting(r, dkeys, akeys)}: {r['attack']}{' (aware)' if _is_aware(r['attack_params']) else ''} "
           f"{r['verdict']} at {r['psnr']:.1f} dB" for _, r in rows.head(limit).iterrows()]  # fmt: skip
    more = len(rows) - limit
    return "; ".join(out) + (f"; and {more} more" if more > 0 else "")


def best_image(r: Any, df: pd.DataFrame | None) -> str | None:
    """The stored reconstruction (images/NAME) of the cell's best trial by PSNR, where the run saved images."""
    if r is None or df is None or "image" not in df.columns:
        return None
    g = df[(df["attack"] == r["attack"]) & (df["attack_params"] == r["attack_params"]) & (df["defense"] == r["defense"])
           & (df["defense_params"] == r["defense_params"]) & (df["status"] == "ok")]  # fmt: skip
    for k in CASE_COLUMNS:
        g = g[g[k] == r[k]]
    if "case" in r and "case" in g.columns and isinstance(r.get("case"), str):
        g = g[g["case"] == r["case"]]
    g = g[g["image"].map(lambda v: isinstance(v, str) and bool(v)) & g["psnr"].notna()]
    if not len(g):
        return None
    return "images/" + str(g.sort_values("psnr", ascending=leakiest_first("psnr")[0], kind="stable").iloc[0]["image"])


RULES = ("One verdict per claim, judged only on the cells at the claim's own setting (its `setting`; cells of the same "
         "defense and attacks at other settings are listed, never deciding). An attack decides only where it recovers "
         "the undefended case of the same setting (same data set, model, batch size and attack parameters): an attack "
         "that fails without a defense can neither credit nor blame one; a claim that data leaks is also decided by an "
         "attack that recovers the victim at the claim's own setting (that recovery needs no twin). holds: expects defended, no deciding "
         "attack's verdict is partial or recovered and none of n >= 5 deciding trials is recovered, or expects leaks "
         "and one leaks (\"most inputs\": more than half of the samples recovered exactly); falls: expects defended "
         "and a deciding attack still leaks, or k of n deciding trials are recovered; not reproduced: expects leaks and no deciding attack leaks; inconclusive: no "
         "attack at the setting recovers the undefended case; not run: no trial at the setting. Each side is the "
         "deciding attack with the highest median PSNR; the attack that knows the defense is the same attack with "
         "defense_aware = true (the defense's name and parameters, never its randomness). Recovered: the trials whose "
         "verdict is recovered, with the 95% Wilson interval.")
TEXT_RULES = ("Text claims are judged the same way on the text verdicts (ROUGE; a claim about the undefended case is "
              "about the attack, so every attack decides).")  # fmt: skip


def _expects(claim: dict[str, Any]) -> str:
    return expects_text(claim) if claim["expect"] == "beats" else claim["expect"]


def claim_blocks(claims: list[dict[str, Any]], agg: pd.DataFrame, df: pd.DataFrame | None = None) -> list[tuple]:
    """The 'Published claims' section (report blocks), or nothing where the suite states no claim."""
    if not claims:
        return []
    rows, counts, any_text, any_beats = [], {v: 0 for v in VERDICTS}, False, False
    for claim in claims:
        beats = claim["expect"] == "beats"
        if beats or is_text_claim(claim, df):
            any_beats |= beats
            any_text |= not beats
            jt = judge_beats(claim, df if df is not None else pd.DataFrame()) if beats else judge_text(claim, df)
            counts[jt["verdict"]] += 1
            rows.append([data(claim["source"]), data(claim["claim"]), data(claim.get("setting") or "not stated"),
                         data(_expects(claim)), f"{jt['verdict']}: {jt['why']}", data(jt["evidence"]), "-",
                         data(jt["twin"]), "-", "-"])  # fmt: skip
            continue
        j = judge(claim, agg)
        counts[j["verdict"]] += 1
        deciding = j["plain"] if j["plain"] is not None else j["adaptive"]
        twin = _twin_of(deciding, j["twin"], j["here"]) if deciding is not None else None
        twin_text = evidence_text(twin) if twin is not None else "-"
        rows.append([data(claim["source"]), data(claim["claim"]), data(claim.get("setting") or "not stated"), data(_expects(claim)),
                     f"{j['verdict']}: {j['why']}", evidence_text(j["plain"]), evidence_text(j["adaptive"]), twin_text,
                     best_image(deciding, df) or "-", elsewhere_text(j) or "-"])  # fmt: skip
    header = ["source", "claim", "setting (the paper's)", "expects", "claim verdict", "evidence: attack ignoring the defense",
              "evidence: attack knowing the defense", "same attack, no defense, same case", "best trial", "at another setting"]  # fmt: skip
    tally = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    intro = (f"Each claim from its source, judged on this suite's own trials at the claim's own setting: {tally}. {RULES}"
             + (f" {TEXT_RULES}" if any_text else "") + (f" {COMPARISON_RULE}" if any_beats else ""))
    return [("h2", "Published claims"), ("p", intro), ("table", header, rows)]


def dp_bound_blocks(df: pd.DataFrame, agg: pd.DataFrame) -> list[tuple]:
    """'DP bound' section: per defense configuration with an epsilon, the Balle-Cherubin-Hayes bound on the share
    of examples any attack recovers, beside the best attack's share of trials recovered."""
    from gleak.mechanics.data import load_dataset
    from gleak.mechanics.dp_bound import attained_kappa, baseline_kappa, reconstruction_bound
    eps_of = {}
    for (d, dp), g in df.groupby(["defense", "defense_params"], sort=False):
        e = [json.loads(x).get("epsilon") for x in g["extra"].dropna() if isinstance(x, str)]
        e = [v for v in e if isinstance(v, (int, float))]
        if e:
            eps_of[(d, dp)] = max(e)  # the weakest guarantee any of its trials had
    if not eps_of:
        return []
    kappas: dict[str, tuple[float, float] | None] = {}
    rows = []
    for (d, dp), eps in eps_of.items():
        g = agg[(agg["defense"] == d) & (agg["defense_params"] == dp)]
        best = _strongest(g)
        delta = json.loads(dp).get("delta", 1e-5)
        ds_name = str(best["dataset"]) if best is not None else None
        if ds_name not in kappas:
            try:
                x = load_dataset(ds_name, "train").x
                kappas[ds_name] = (baseline_kappa(x), attained_kappa(x))
            except Exception:  # noqa: BLE001 - a data set not on this machine: the bound is left empty, not guessed
                kappas[ds_name] = None
        k = kappas[ds_name]
        bound = reconstruction_bound(eps, delta, k[0]) if k else None
        rows.append([data(d), data(params_text(dp, "defense", d)), f"{eps:.3g}", f"{delta:g}",
                     f"{k[0]:.3f} ({k[1]:.3f} attained)" if k else "unavailable", f"{bound:.3g}" if bound is not None else "",
                     data(best["attack"]) if best is not None else "", f"{best['psnr']:.2f}" if best is not None else "",
                     f"{best['recovered']:.0%}" if best is not None and best.get("recovered") is not None else ""])  # fmt: skip
    intro = ("No attack can beat a differential-privacy guarantee: Balle, Cherubin & Hayes (IEEE S&P 2022, "
             "Theorem 2) bound the probability that any attack reconstructs an example of an (epsilon, delta)-DP "
             "mechanism by e^epsilon kappa + delta, kappa the best blind guess's chance. Here the event is gleak's "
             "'recovered' verdict for one example and the prior is uniform over the training split's images; kappa "
             "is bounded from above over every fixed guess (gleak.mechanics.dp_bound; beside it what the best of the images "
             "themselves attains). Epsilon: the largest any trial of the configuration reports (its accountant). "
             "Beside the bound: the best attack's share of trials recovered (every image of the batch).")  # fmt: skip
    header = ["defense", "params", "epsilon", "delta", "kappa", "bound on recovery", "best attack", "PSNR", "recovered"]
    return [("h2", "Differential privacy: the bound beside the attacks"), ("p", intro), ("table", header, rows)]


def folder_claims(folder: Path) -> list[dict[str, Any]]:
    """The claims of the folder's suite: from its store's meta, else from suite.json (a clone without the store)."""
    from gleak.orchestration.store import Store

    if Store.exists(folder):
        store = Store.open_existing(folder)
        try:
            return list(store.get_meta("claims", []) or [])
        finally:
            store.close()
    meta = folder / "suite.json"
    return list(json.loads(meta.read_text()).get("claims", []) or []) if meta.is_file() else []


def with_case(agg: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """The aggregated cells with their trials' whole case (JSON; one per cell: the cells split the cases that
    differ), so that a claim can name any case key."""
    if "case" in agg.columns or "case" not in df.columns or not len(agg):
        return agg
    from gleak.reporting.aggregate import case_variants

    keys = [*CASE_COLUMNS, "variant", "defense", "defense_params", "attack", "attack_params"]
    trials = df.assign(variant=case_variants(df))
    first = trials.dropna(subset=["case"]).groupby(keys, sort=False, dropna=False)["case"].first()
    return agg.assign(case=[first.get(tuple(r[k] for k in keys)) for _, r in agg.iterrows()])


def replace_claims(folder: str | Path, claims: list[dict[str, Any]]) -> None:
    """Store a suite file's (validated) claims with the folder's trials, in its store and its suite.json, so that
    the next report judges them: claims are read, never run, so editing them needs no trial rerun."""
    from gleak.orchestration.store import Store

    folder = Path(folder)
    if Store.exists(folder):
        store = Store.open_existing(folder)
        try:
            store.set_meta("claims", claims)
        finally:
            store.close()
    meta = folder / "suite.json"
    if meta.is_file():
        from gleak.mechanics.atomic_files import atomic_write_bytes

        doc = json.loads(meta.read_text())
        doc["claims"] = claims
        atomic_write_bytes(meta, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


def with_claims(doc: list[tuple], folder: str | Path, df: pd.DataFrame, agg: pd.DataFrame) -> list[tuple]:
    """The leaderboard blocks with the 'Published claims' and DP-bound sections inserted before 'Results by case'
    (at the end where there is none)."""
    claims = folder_claims(Path(folder))
    extra = (claim_blocks(claims, with_case(agg, df), df) if claims else []) + dp_bound_blocks(df, agg)
    if not extra:
        return doc
    at = next((i for i, b in enumerate(doc) if b[:2] == ("h2", "Results by case")), len(doc))
    return doc[:at] + extra + doc[at:]
