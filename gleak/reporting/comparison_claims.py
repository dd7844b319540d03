"""Published claims that one attack beats another (expect "beats"), judged victim by victim on the stored trials.

The claim's attack's mean `metric` over the setting's victims is set against the `than` attack's mean on the same
victims (same case, defense and seed; a victim only one of them attacked is left out). The claim holds where the
ratio is at least `factor` (text claims such as "5x more bigrams") or the difference at least `margin`, in the
metric's own units (image claims such as "3 dB above inverting gradients"); it falls otherwise, with both means, the
ratio or the difference, and on how many victims the claim's attack scored higher. Where the claim names several
attacks or its attack ran with several parameter sets, the best of them speaks for the claim.
Text metrics (ROUGE, BLEU, ...) are read from the text trials (gleak.reporting.documents.text.text_rows), image
metrics (PSNR, SSIM, ...) from the image trials' own columns.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from gleak.mechanics.text.metrics import COMPARED as TEXT_METRICS
from gleak.reporting.claim_setting import param_defaults, params_of, rows_at_setting, variant_text
from gleak.reporting.documents.text import text_rows

# One victim: the same case, defense (and its parameters) and seed. seq_len tells text cases apart where an older
# store holds the case inline.
PAIR_KEYS = ("case", "dataset", "model", "batch_size", "seq_len", "defense", "defense_params", "seed")
UNITS = {"psnr": " dB", "rpsnr": " dB"}
RULE = ("A claim that one attack beats another holds where its mean score over the setting's victims is at least "
        "the claimed factor times the other's, or the claimed margin above it, on the same victims (same case, "
        "defense and seed).")  # fmt: skip


def expects_text(claim: dict[str, Any]) -> str:
    """What a beats claim expects, in words: "beats tag on rouge2 by at least 5x", "... on psnr by at least 3 dB"."""
    if "margin" in claim:
        by = f"{claim['margin']:g}{UNITS.get(claim['metric'], '')}"
    else:
        by = f"{claim.get('factor', 1.0):g}x"
    return f"beats {claim['than']} on {claim['metric']} by at least {by}"


def _image_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The ok trials that are not text trials (text_rows decides which are), seq_len empty."""
    if not len(df):
        return df.assign(seq_len=0)
    out = df[(df["status"] == "ok") & ~df.index.isin(text_rows(df).index)].copy()
    out["seq_len"] = 0
    return out


def _than_rows(t: pd.DataFrame, claim: dict[str, Any]) -> pd.DataFrame:
    """The `than` attack's trials at the claim's setting whose parameters, defaults filled in, equal `than_params`
    where it names them (so `defense_aware = false` picks the plain attack, whose stored parameters omit it)."""
    rows = rows_at_setting(t, claim, [claim["than"]], {})
    wanted = claim.get("than_params", {})
    if not wanted or not len(rows):
        return rows
    base = param_defaults(claim["than"])
    keep = [all({**base, **params_of(js)}.get(k) == v for k, v in wanted.items()) for js in rows["attack_params"]]
    return rows[pd.Series(keep, index=rows.index, dtype=bool)]


def judge_beats(claim: dict[str, Any], df: pd.DataFrame) -> dict[str, Any]:
    """The claim's verdict (holds, falls or not run), why, and its evidence. Where `than_params` leaves several
    variants of the other attack, the claim is judged against the strongest of them (the hardest comparison)."""
    metric = claim["metric"]
    t = text_rows(df) if metric in TEXT_METRICS else _image_rows(df)
    keys = [k for k in PAIR_KEYS if k in t.columns]
    by_margin = "margin" in claim
    judged: list[tuple[float, str, str, float, float, int, int]] = []  # per `than` variant: our best against it
    for tap, theirs in _than_rows(t, claim).groupby("attack_params", sort=False):
        than = claim["than"] + variant_text(claim["than"], tap) + (" (defense-aware)" if params_of(tap).get("defense_aware") else "")
        best: tuple[float, str, str, float, float, int, int] | None = None
        for attack in claim["attacks"]:
            ours = rows_at_setting(t, claim, [attack], claim.get("attack_params", {}))
            for ap, g in ours.groupby("attack_params", sort=False):
                paired = g.merge(theirs, on=keys, suffixes=("", "_than"))
                if not len(paired):
                    continue
                a, b = pd.to_numeric(paired[metric]), pd.to_numeric(paired[f"{metric}_than"])
                ma, mb = float(a.mean()), float(b.mean())
                if by_margin:
                    score = ma - mb
                else:
                    score = ma / mb if mb > 0 else (float("inf") if ma > 0 else 1.0)
                if best is None or score > best[0]:
                    best = (score, attack + variant_text(attack, ap), than, ma, mb, int((a > b).sum()), len(paired))
        if best is not None:
            judged.append(best)
    if not judged:
        return {"verdict": "not run", "why": f"no victim at the claim's setting was attacked by both the claim's attack and {claim['than']}",
                "evidence": "-", "twin": "-"}  # fmt: skip
    score, label, than, ma, mb, wins, n = min(judged, key=lambda j: j[0])
    unit = UNITS.get(metric, "")
    if by_margin:
        compared, claimed, holds = f"{score:+.2f}{unit}", f"claimed at least +{claim['margin']:g}{unit}", score >= claim["margin"]
    else:
        factor = float(claim.get("factor", 1.0))
        compared, claimed, holds = f"{score:.2f}x", f"claimed at least {factor:g}x", score >= factor
    said = (f"{label} {metric} {ma:.3f} against {than} {mb:.3f} on the same {n} victims: {compared} ({claimed}); "
            f"higher on {wins} of {n}")  # fmt: skip
    return {"verdict": "holds" if holds else "falls", "why": said, "evidence": said, "twin": "-"}
