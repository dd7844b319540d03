"""Published claims checked against a suite's own results, and the DP bound beside the attacks (issue 13).

A suite's [[claim]] tables (validated by gleak.suite) each state what a paper says about one defense against named
attacks ("DGP stops analytic attacks", "int-8 defends DLG"): `expect = "defended"` (the claim holds where the
strongest matching attack's verdict is defended) or `expect = "leaks"` (it holds where that verdict is partial or
recovered). Each claim is judged per matching defense configuration, from the aggregated groups of the leaderboard
(gleak.aggregate.aggregate): the non-adaptive side is the strongest matching attack that ignores the defense, the
adaptive side the strongest one that knows it (`defense_aware = true`); "strongest" is the defense ranking's rule
(highest median PSNR, ties to the lower median MSE). The verdict uses both sides: a claim that holds only because
the attack ignored the defense is said to fall, with the adaptive attack's numbers.

The claims travel with the folder: the run stores them in the store's meta ("claims"), and the report copies them
into suite.json (gleak.report.write_reports, from `folder_claims`) so that a clone without the store rebuilds the
same section.

DP bound: for every defense configuration whose trials report extra.epsilon (DP-SGD), the bound of gleak.dp_bound
beside the best empirical attack (its share of trials recovered).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from gleak.documents.cells import params_text

LEAKING = ("partial", "recovered")


def _matches(params_js: Any, wanted: dict[str, Any]) -> bool:
    have = json.loads(params_js) if isinstance(params_js, str) and params_js else {}
    return all(k in have and have[k] == v for k, v in wanted.items())


def _is_aware(attack_params_js: Any) -> bool:
    return bool((json.loads(attack_params_js) if isinstance(attack_params_js, str) and attack_params_js else {}).get("defense_aware"))


def _strongest(g: pd.DataFrame) -> Any:
    img = g[g["psnr"].notna()]
    if not len(img):
        return None
    return img.sort_values(["psnr", "mse_median"], ascending=[False, True], kind="stable").iloc[0]


def judge(claim: dict[str, Any], agg: pd.DataFrame) -> list[dict[str, Any]]:
    """One row per defense configuration the claim matches: the strongest non-adaptive and adaptive attack results
    (attack, median PSNR, share of trials recovered, verdict) and the claim's verdict ('holds' / 'falls' /
    'inconclusive' where the claim's attacks leak nothing even against no defense in the matching cases, 'not
    run') with its one-line reason."""
    g = agg[agg["attack"].isin(claim["attacks"])]
    for k, v in claim.get("case", {}).items():
        g = g[g[k] == v]
    baseline = _strongest(g[g["defense"] == "none"])
    g = g[(g["defense"] == claim["defense"])]
    g = g[[_matches(js, claim.get("defense_params", {})) for js in g["defense_params"]]]
    if not len(g):
        return [{"claim": claim, "defense_params": json.dumps(claim.get("defense_params", {})), "plain": None,
                 "adaptive": None, "verdict": "not run", "why": "no trial of this suite matches the claim"}]  # fmt: skip
    rows = []
    for dp, h in g.groupby("defense_params", sort=False):
        aware = h["attack_params"].map(_is_aware)
        plain, adaptive = _strongest(h[~aware]), _strongest(h[aware])
        said = _verdict(claim["expect"], plain, adaptive)
        if baseline is not None and baseline["verdict"] not in LEAKING and claim["defense"] != "none":
            # An attack that leaks nothing even undefended says nothing about a defense (in either direction).
            said = {"verdict": "inconclusive", "why": f"{baseline['attack']} does not leak even without a defense "
                    f"(undefended: {baseline['verdict']} at {baseline['psnr']:.1f} dB)"}  # fmt: skip
        rows.append({"claim": claim, "defense_params": dp, "plain": plain, "adaptive": adaptive, **said})
    return rows


def _said(r: Any) -> str:
    aware = " (knows the defense)" if _is_aware(r["attack_params"]) else ""
    rec = f", {r['recovered']:.0%} of trials recovered" if r.get("recovered") is not None else ""
    return f"{r['attack']}{aware} reaches {r['verdict']} at {r['psnr']:.1f} dB{rec}"


def _verdict(expect: str, plain: Any, adaptive: Any) -> dict[str, str]:
    """'holds' / 'falls' and why. The attack cited is the one that ignores the defense where it settles the claim
    (no knowledge needed), the defense-aware one where only it does; the other's result follows where it is
    stronger."""
    both = [r for r in (plain, adaptive) if r is not None]
    if not both:
        return {"verdict": "not run", "why": "every matching trial failed or was not applicable"}
    leaking = [r for r in both if r["verdict"] in LEAKING]
    if leaking:
        first = leaking[0]  # plain where it leaks
        why = ("only to the adaptive attack: " if first is adaptive and plain is not None and expect == "defended" else "") + _said(first)
        if first is plain and adaptive is not None and adaptive["psnr"] > plain["psnr"] + 0.01:
            why += f"; knowing the defense: {adaptive['verdict']} at {adaptive['psnr']:.1f} dB"
        return {"verdict": "falls" if expect == "defended" else "holds", "why": why}
    worst = max(both, key=lambda r: r["psnr"])
    if expect == "defended":
        return {"verdict": "holds", "why": f"every attack is defended (strongest: {worst['attack']} at {worst['psnr']:.1f} dB)"}
    blind = f", blind guess {worst['blind_psnr']:.1f} dB" if worst.get("blind_psnr") is not None else ""
    return {"verdict": "falls", "why": f"no attack leaks (strongest: {worst['attack']} at {worst['psnr']:.1f} dB{blind})"}


def _cell(r: Any) -> list[str]:
    if r is None:
        return ["-", "", "", ""]
    rec = "" if r.get("recovered") is None else f"{r['recovered']:.0%}"
    return [r["attack"], f"{r['psnr']:.2f}", rec, str(r["verdict"])]


def claim_blocks(claims: list[dict[str, Any]], agg: pd.DataFrame) -> list[tuple]:
    """The 'Published claims' section (report blocks), or nothing where the suite states no claim."""
    if not claims:
        return []
    rows, held, fell, unsure = [], 0, 0, 0
    for claim in claims:
        for r in judge(claim, agg):
            held += r["verdict"] == "holds"
            fell += r["verdict"] == "falls"
            unsure += r["verdict"] == "inconclusive"
            rows.append([claim["source"], claim["claim"], claim["defense"], params_text(r["defense_params"], "defense", claim["defense"]),
                         ", ".join(claim["attacks"]), claim["expect"], *_cell(r["plain"]), *_cell(r["adaptive"]),
                         f"{r['verdict']}: {r['why']}"])  # fmt: skip
    header = ["source", "claim", "defense", "params", "attacks", "expects", "attack (ignores the defense)", "PSNR",
              "recovered", "verdict", "attack (knows the defense)", "PSNR", "recovered", "verdict", "claim verdict"]  # fmt: skip
    intro = (f"Each claim from its source, judged on this suite's own trials: {held} hold, {fell} fall, {unsure} "
             "inconclusive. 'expects defended' holds where no matching attack's verdict is partial or recovered; "
             "'expects leaks' holds where the strongest matching attack's is; inconclusive where the claim's attacks "
             "leak nothing even without a defense in the matching cases (an attack must work before a defense is "
             "credited or blamed). Each side: the matching attack with the highest median PSNR "
             "over the matching cases; the attack that knows the defense is the same attack with defense_aware = "
             "true (threat model 'knows defense': the defense's name and parameters, never its randomness).")  # fmt: skip
    return [("h2", "Published claims"), ("p", intro), ("table", header, rows)]


def dp_bound_blocks(df: pd.DataFrame, agg: pd.DataFrame) -> list[tuple]:
    """'DP bound' section: per defense configuration with an epsilon, the Balle-Cherubin-Hayes bound on the share
    of examples any attack recovers, beside the best attack's share of trials recovered."""
    from gleak.data import load_dataset
    from gleak.dp_bound import attained_kappa, baseline_kappa, reconstruction_bound
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
        rows.append([d, params_text(dp, "defense", d), f"{eps:.3g}", f"{delta:g}",
                     f"{k[0]:.3f} ({k[1]:.3f} attained)" if k else "unavailable", f"{bound:.3g}" if bound is not None else "",
                     str(best["attack"]) if best is not None else "", f"{best['psnr']:.2f}" if best is not None else "",
                     f"{best['recovered']:.0%}" if best is not None and best.get("recovered") is not None else ""])  # fmt: skip
    intro = ("No attack can beat a differential-privacy guarantee: Balle, Cherubin & Hayes (IEEE S&P 2022, "
             "Theorem 2) bound the probability that any attack reconstructs an example of an (epsilon, delta)-DP "
             "mechanism by e^epsilon kappa + delta, kappa the best blind guess's chance. Here the event is gleak's "
             "'recovered' verdict for one example and the prior is uniform over the training split's images; kappa "
             "is bounded from above over every fixed guess (gleak.dp_bound; beside it what the best of the images "
             "themselves attains). Epsilon: the largest any trial of the configuration reports (its accountant). "
             "Beside the bound: the best attack's share of trials recovered (every image of the batch).")  # fmt: skip
    header = ["defense", "params", "epsilon", "delta", "kappa", "bound on recovery", "best attack", "PSNR", "recovered"]
    return [("h2", "Differential privacy: the bound beside the attacks"), ("p", intro), ("table", header, rows)]


def folder_claims(folder: Path) -> list[dict[str, Any]]:
    """The claims of the folder's suite: from its store's meta, else from suite.json (a clone without the store)."""
    from gleak.store import Store

    if Store.exists(folder):
        store = Store.open_existing(folder)
        try:
            return list(store.get_meta("claims", []) or [])
        finally:
            store.close()
    meta = folder / "suite.json"
    return list(json.loads(meta.read_text()).get("claims", []) or []) if meta.is_file() else []


def with_claims(doc: list[tuple], folder: str | Path, df: pd.DataFrame, agg: pd.DataFrame) -> list[tuple]:
    """The leaderboard blocks with the 'Published claims' and DP-bound sections inserted before 'Results by case'
    (at the end where there is none)."""
    claims = folder_claims(Path(folder))
    extra = claim_blocks(claims, agg) + dp_bound_blocks(df, agg)
    if not extra:
        return doc
    at = next((i for i, b in enumerate(doc) if b[:2] == ("h2", "Results by case")), len(doc))
    return doc[:at] + extra + doc[at:]
