"""Published claims about text attacks, judged on the text trials (ROUGE, not PSNR), with the image claims' rules.

gleak.reporting.claims judges a claim on the aggregated image cells; a claim whose trials at its setting are text
trials (gleak.reporting.documents.text.text_rows) is judged here, trial by trial, with the same verdicts:

- expect "leaks" / "defended": a cell is one (attack, attack parameters, case) at the claim's defense; its verdict is
  the median of its trials' text verdicts (gleak.mechanics.verdicts.text_verdict). Against a defense, an attack
  decides only where its undefended twin (same attack, parameters and case, no defense) is recovered, as for
  images; a claim about the undefended case (defense "none") is about the attack itself, so every cell decides.
  "no input" holds only where none of n >= 5 deciding trials is recovered.
A claim that one attack beats another (expect "beats") is judged in gleak.reporting.comparison_claims.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from gleak.reporting.aggregate import median_verdict
from gleak.reporting.claim_setting import LEAKING, MIN_VICTIMS, rows_at_setting, variant_text, wilson
from gleak.reporting.documents.text import BASELINE, text_rows

CELL_KEYS = ("dataset", "model", "batch_size", "seq_len", "attack", "attack_params")


def is_text_claim(claim: dict[str, Any], df: pd.DataFrame | None) -> bool:
    """True where the claim's setting's trials are text trials (a claim comparing attacks is judged apart:
    gleak.reporting.comparison_claims)."""
    return df is not None and len(rows_at_setting(text_rows(df), claim, claim["attacks"], claim.get("attack_params", {}))) > 0


def _cell_text(g: pd.DataFrame, t: pd.DataFrame | None = None) -> str:
    """One cell's verdict and scores, with the token-set read-out's ROUGE-1 on the same victims where t (all the
    text trials) holds it: the baseline a text attack must beat."""
    r = g.iloc[0]
    base = ""
    if t is not None:
        b = t[(t["attack"] == BASELINE) & t["seed"].isin(g["seed"])]
        for k in ("dataset", "model", "batch_size", "seq_len", "defense", "defense_params"):
            b = b[b[k] == r[k]]
        base = f", token-set read-out ROUGE-1 {pd.to_numeric(b['rouge1']).mean():.2f}" if len(b) else ""
    rec = int((g["verdict"] == "recovered").sum())
    lo, hi = wilson(rec, len(g)) or (0.0, 1.0)
    return (f"{r['attack']}{variant_text(r['attack'], r['attack_params'])} B={int(r['batch_size'])} L={r['seq_len']}: {median_verdict(g['verdict'].dropna())}, "
            f"ROUGE-1 {pd.to_numeric(g['rouge1']).mean():.2f}, ROUGE-2 {pd.to_numeric(g['rouge2']).mean():.2f}, "
            f"{rec}/{len(g)} recovered [95% {lo:.0%}, {hi:.0%}]{base}")  # fmt: skip


def judge_text(claim: dict[str, Any], df: pd.DataFrame) -> dict[str, Any]:
    """The claim's verdict (gleak.reporting.claims.VERDICTS), why, and its evidence (text)."""
    t = text_rows(df)
    here = rows_at_setting(t, claim, claim["attacks"], claim.get("attack_params", {}))
    if not len(here):
        return {"verdict": "not run", "why": "no trial of this suite is at the claim's setting", "evidence": "-", "twin": "-"}
    cells = [g for _, g in here.groupby(list(CELL_KEYS), sort=False, dropna=False)]
    twins: list[pd.DataFrame | None] = []
    for g in cells:
        r = g.iloc[0]
        tw = t[(t["defense"] == "none") & (t["attack"] == r["attack"]) & (t["attack_params"] == r["attack_params"])
               & (t["dataset"] == r["dataset"]) & (t["model"] == r["model"]) & (t["batch_size"] == r["batch_size"])
               & (t["seq_len"] == r["seq_len"])]  # fmt: skip
        twins.append(tw if len(tw) else None)
    if claim["defense"] == "none":  # a claim about the attack itself: every cell decides
        deciding = cells
    else:
        deciding = [g for g, tw in zip(cells, twins) if tw is not None and median_verdict(tw["verdict"].dropna()) == "recovered"]
    twin_text = "; ".join(_cell_text(tw, t) for tw in twins if tw is not None) or "-"
    if not deciding:
        return {"verdict": "inconclusive", "why": "no attack here recovers the undefended case, so none can judge the defense",
                "evidence": "; ".join(_cell_text(g, t) for g in cells), "twin": twin_text}  # fmt: skip
    strongest = max(deciding, key=lambda g: float(pd.to_numeric(g["rouge1"]).mean()))
    leaking = [g for g in deciding if median_verdict(g["verdict"].dropna()) in LEAKING]
    k = sum(int((g["verdict"] == "recovered").sum()) for g in deciding)
    n = sum(len(g) for g in deciding)
    lo, hi = wilson(k, n) or (0.0, 1.0)
    evidence = "; ".join(_cell_text(g, t) for g in deciding)
    if claim["expect"] == "defended":
        if leaking:
            verdict, why = "falls", f"{_cell_text(max(leaking, key=lambda g: float(pd.to_numeric(g['rouge1']).mean())), t)} leaks"
        elif k:
            verdict, why = "falls", f"falls for {k} of {n} victims [95% {lo:.0%}, {hi:.0%}]"
        elif n < MIN_VICTIMS:
            verdict, why = "inconclusive", f"0 of {n} deciding trials recovered: at least {MIN_VICTIMS} are needed"
        else:
            verdict, why = "holds", f"0 of {n} deciding trials recovered [95% {lo:.0%}, {hi:.0%}]; strongest {_cell_text(strongest, t)}"
        return {"verdict": verdict, "why": why, "evidence": evidence, "twin": twin_text}
    if not leaking:
        return {"verdict": "not reproduced", "why": f"no deciding attack leaks; strongest {_cell_text(strongest, t)}",
                "evidence": evidence, "twin": twin_text}  # fmt: skip
    best = max(leaking, key=lambda g: float(pd.to_numeric(g["rouge1"]).mean()))
    if claim.get("quantifier") == "most inputs":
        share = float((best["verdict"] == "recovered").mean())
        if share <= 0.5:
            return {"verdict": "not reproduced", "why": f"most inputs: {share:.0%} of the victims recovered (more than "
                    f"half needed); {_cell_text(best, t)}", "evidence": evidence, "twin": twin_text}  # fmt: skip
    return {"verdict": "holds", "why": f"{_cell_text(best, t)} leaks", "evidence": evidence, "twin": twin_text}
