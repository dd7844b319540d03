"""The leaderboard's text sections: trials whose case is text (gleak.mechanics.modality) are scored by ROUGE and token
accuracy (gleak.mechanics.text.metrics), not PSNR, so they get tables of their own: the defenses ranked by their worst case
over the text attacks, each case's rows, and each attack's reconstruction printed beside its truth."""
from __future__ import annotations

import json
from typing import Any

import pandas as pd

from gleak.contracts.vocabulary import DEFAULT_SEQ_LEN
from gleak.mechanics.verdicts import PARTIAL_MARGIN, PARTIAL_ROUGE_1, RECOVERED_ROUGE_L
from gleak.reporting.aggregate import as_float, median_verdict
from gleak.reporting.documents.cells import accuracy_change, attack_label, fmt, params_text

METRICS = ("rouge1", "rouge2", "rougeL", "token_acc", "bleu", "token_set_f1", "blind_rouge1")
HEADS = dict(zip(METRICS, ("ROUGE-1", "ROUGE-2", "ROUGE-L", "token acc", "BLEU", "token-set F1", "blind ROUGE-1")))
BASELINE = "token-set"  # the read-out every text attack must beat: the embedding gradient's rows, no optimisation
HEADS["baseline_rouge1"] = "token-set ROUGE-1"


def text_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The ok trials of text cases, with their text metrics (from the row's extra) as columns."""
    extras = [json.loads(js) if isinstance(js, str) and js else {} for js in df.get("extra", [None] * len(df))]
    keep = pd.Series([e.get("modality") == "text" for e in extras], index=df.index, dtype=bool)
    if len(df):
        keep &= df["status"] == "ok"
    out = df[keep].copy()
    kept = [e for e, k in zip(extras, keep) if k]
    for m in (*METRICS, "text_truth", "text_reconstruction", "seq_len"):
        out[m] = [e.get(m) for e in kept]
    out["seq_len"] = [_case(js).get("seq_len") or DEFAULT_SEQ_LEN for js in out.get("case", [None] * len(out))]
    return out


def _case(js: Any) -> dict:
    try:
        return json.loads(js) if isinstance(js, str) and js else {}
    except ValueError:
        return {}


def _groups(t: pd.DataFrame) -> pd.DataFrame:
    keys = ["dataset", "model", "batch_size", "seq_len", "defense", "defense_params", "attack", "attack_params"]
    rows = []
    for key, g in t.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, key))
        row["trials"] = len(g)
        for m in METRICS:
            vals = pd.to_numeric(g[m], errors="coerce").dropna()
            row[m] = float(vals.mean()) if len(vals) else None
            row[f"{m}_std"] = float(vals.std()) if len(vals) > 1 else None
        row["verdict"] = median_verdict(g["verdict"].dropna())
        rows.append(row)
    return pd.DataFrame(rows)


def _with_token_set(agg: pd.DataFrame) -> pd.DataFrame:
    """Each row with the token-set read-out's mean ROUGE-1 (and std) at the same case and defense: the baseline a
    text attack must beat beside the blind guess (None where the suite did not run the read-out)."""
    keys = ["dataset", "model", "batch_size", "seq_len", "defense", "defense_params"]
    base = {tuple(r[k] for k in keys): (r["rouge1"], r["rouge1_std"]) for r in agg[agg["attack"] == BASELINE].to_dict("records")}
    got = [base.get(tuple(r[k] for k in keys), (None, None)) for r in agg.to_dict("records")]
    return agg.assign(baseline_rouge1=[g[0] for g in got], baseline_rouge1_std=[g[1] for g in got])


def _attack_with_threat_model(r: dict, va: dict | None) -> str:
    """The attack (with its telling parameters unless va is None) and the threat model it needs in brackets, as
    the image tables name a worst attack (gleak.reporting.documents.cells.worst_attack_text)."""
    from gleak.contracts.threat_model import of_attack

    tm = of_attack(r["attack"], r["attack_params"])
    label = r["attack"] if va is None else attack_label(r["attack"], r["attack_params"], va)
    return f"{label} [{tm}]" if tm else label


def _ms(r: dict, m: str) -> str:
    s = r.get(f"{m}_std")
    return fmt(r[m], "3") + (f" ± {fmt(s, '3')}" if s is not None and s == s else "")


def only_text(df: pd.DataFrame) -> bool:
    """True where every finished trial is a text trial: the image tables (PSNR, SSIM, ...) would be empty."""
    ok = df[df["status"] == "ok"] if "status" in df.columns else df
    return len(ok) > 0 and len(text_rows(df)) == len(ok)


def text_blocks(df: pd.DataFrame, vd: dict | None = None, va: dict | None = None,
                utility: pd.DataFrame | None = None) -> list[tuple]:  # fmt: skip
    """The text sections as leaderboard blocks; none where the suite has no text trial. vd, va: the parameters to
    name for each defense and attack (gleak.reporting.aggregate.varying_keys); utility: the suite's utility.csv, whose accuracy
    and epsilon stand beside each defense's worst case."""
    t = text_rows(df)
    if not len(t):
        return []
    vd, va = vd or {}, va or {}

    def d_params(r: dict) -> str:
        return params_text(r["defense_params"], "defense", r["defense"], vd.get(r["defense"]))

    agg = _with_token_set(_groups(t))
    # A metric no trial has (BLEU in results scored before gleak computed it) is left out rather than shown empty.
    shown_metrics = [m for m in (*METRICS, "baseline_rouge1") if agg[m].notna().any()]
    heads = [HEADS[m] for m in shown_metrics]
    doc: list[tuple] = [("h2", "Text: defenses ranked by their worst case over the text attacks")]
    doc.append(("p",
        "Text trials are scored on the token strings of each victim sequence (reconstructed rows paired with the "
        "sequences by optimal assignment): ROUGE-1, ROUGE-2 and ROUGE-L F-measures (Lin, ACL Workshop 2004; the "
        "rouge-score package), token accuracy (the share of positions holding the true token)"
        + (", corpus BLEU over the paired sequences (Papineni et al., ACL 2002, as sacreBLEU computes it)"
           if "bleu" in shown_metrics else "")
        + " and the token-set F1 "
        "(the batch's set of tokens, in any order). The blind guess is the sequence of the training split's most "
        "frequent tokens"
        + ("; the token-set read-out (the tokens whose embedding-gradient row is non-zero, ranked by its norm, no "
           "optimisation) is the baseline every text attack must beat: an attack whose ROUGE-1 is not above the "
           "token set's has learnt nothing beyond the bag of words the gradient hands over"
           if "baseline_rouge1" in shown_metrics else "")
        + ". Beside each attack, in brackets, the threat model it needs (Carletti et al., USENIX Security 2025). "
        "Verdict: recovered where ROUGE-L >= "
        f"{RECOVERED_ROUGE_L:g} (the text in its order); partial where ROUGE-1 >= {PARTIAL_ROUGE_1:g} and at least "
        f"{PARTIAL_MARGIN:g} above the blind guess's ROUGE-1 (the words); else defended. Means ± std over seeds. A "
        "defense's worst case is the attack with the highest mean ROUGE-1 against it in any case"
        + ("; beside it the test accuracy of the suite's utility run under the defense, its change from the "
           "undefended run and epsilon where the defense has one." if utility is not None else ".")))  # fmt: skip
    accuracy = _accuracy_by_defense(utility)
    worst = []
    for (d, dp), g in agg.groupby(["defense", "defense_params"], sort=False, dropna=False):
        w = g.sort_values("rouge1", ascending=False, na_position="last").iloc[0].to_dict()
        worst.append(w)
    worst.sort(key=lambda r: (r["rouge1"] if r["rouge1"] is not None else 0.0))
    rank_rows, prev, rank = [], None, 0
    for i, r in enumerate(worst, 1):
        val = round(r["rouge1"] or 0.0, 2)
        rank = rank if val == prev else i
        prev = val
        row = [str(rank), r["defense"], d_params(r), _attack_with_threat_model(r, va),
               f"B={r['batch_size']} L={r['seq_len']}", *[_ms(r, m) for m in shown_metrics], r["verdict"] or ""]  # fmt: skip
        if accuracy is not None:
            row += accuracy.get((r["defense"], r["defense_params"]), ["", "", ""])
        rank_rows.append(row)
    head = ["rank", "defense", "params", "worst attack [threat model]", "its case", *heads, "verdict"]
    if accuracy is not None:
        head += ["accuracy", "change (points)", "epsilon"]
    doc.append(("table", head, rank_rows))

    doc.append(("h2", "Text: results by case"))
    for key, g in agg.groupby(["dataset", "model", "batch_size", "seq_len"], sort=False):
        doc.append(("h3", f"dataset={key[0]} model={key[1]} batch size={key[2]} sequence length={key[3]}"))
        rows = [[r["defense"], d_params(r), _attack_with_threat_model(r, None),
                 params_text(r["attack_params"], "attack", r["attack"], va.get(r["attack"])),
                 str(r["trials"]), *[_ms(r, m) for m in shown_metrics], r["verdict"] or ""] for r in g.to_dict("records")]  # fmt: skip
        doc.append(("table", ["defense", "params", "attack", "attack params", "trials", *heads, "verdict"], rows))

    doc.append(("h2", "Text: reconstructions beside their truth"))
    doc.append(("p", "Undefended, the first sequence of each attack's trial of the lowest seed in each case."))
    shown = []
    none = t[t["defense"] == "none"].sort_values("seed")
    for _, g in none.groupby(["dataset", "model", "batch_size", "seq_len", "attack", "attack_params"], sort=False):
        r = g.iloc[0]
        shown.append([attack_label(r["attack"], r["attack_params"], va), f"B={r['batch_size']} L={r['seq_len']}", str(r["text_truth"] or ""),
                      str(r["text_reconstruction"] or ""), fmt(r["rouge1"], "3")])  # fmt: skip
    if shown:
        doc.append(("table", ["attack", "case", "truth", "reconstruction", "ROUGE-1"], shown))
    return doc


def _accuracy_by_defense(utility: pd.DataFrame | None) -> dict[tuple, list[str]] | None:
    """(defense, defense_params) -> [accuracy, change from the undefended run in points, epsilon] as text."""
    if utility is None or not len(utility):
        return None
    out = {}
    for u in utility.to_dict("records"):
        acc = as_float(u.get("accuracy"))
        failed = u.get("status") not in (None, "ok") and acc is None
        out[(u["defense"], u["defense_params"])] = [fmt(acc, "pct") if not failed else "failed", accuracy_change(u),
                                                     fmt(as_float(u.get("epsilon")), "2")]  # fmt: skip
    return out


def worst_rouge_per_config(df: pd.DataFrame) -> dict[tuple, tuple[float | None, float | None]]:
    """(defense, defense_params, attack, attack_params) -> (mean ROUGE-1, its std over seeds) of the attack's most
    leaky text case against that defense configuration: the text analogue of the worst-case PSNR."""
    t = text_rows(df)
    if not len(t):
        return {}
    out: dict[tuple, tuple[float | None, float | None]] = {}
    for r in _groups(t).to_dict("records"):
        key = (r["defense"], r["defense_params"], r["attack"], r["attack_params"])
        if r["rouge1"] is not None and (key not in out or r["rouge1"] > (out[key][0] or -1.0)):
            out[key] = (r["rouge1"], r["rouge1_std"])
    return out
