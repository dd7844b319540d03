"""The verdict of a trial: recovered, partial or defended, from what its row stores.

- Verdict, rule "margin" (default): recovered needs the MSE band of the closed-form notes (MSE < 0.03) AND a margin of at least
  RECOVERED_MARGIN_DB over the blind guess AND a reconstruction for every image of the batch; partial needs
  MSE < 0.2 and at least PARTIAL_MARGIN_DB over the blind guess; else defended. Rule "seed002": the MSE bands
  alone (DLG Fig. 6 as used in the closed-form notes), kept so that suites reproducing the closed-form notes are judged by their rule.
- One verdict per trial: `trial_verdict`. The trial computes it under its suite's rule and stores the rule beside it
  (extra verdict_rule); `gleak rescore` and the leaderboard call the same function, so a stored verdict reads the
  same before and after a rescore.

>>> verdict(0.01), verdict(0.1), verdict(0.5)
('recovered', 'partial', 'defended')
>>> verdict(0.01, blind_mse=0.05), verdict(0.001, blind_mse=0.05), verdict(0.001, blind_mse=0.05, rule="seed002")
('partial', 'recovered', 'recovered')
>>> verdict(0.01, blind_mse=0.0), verdict(0.0, blind_mse=0.0), verdict(0.0, blind_mse=0.05)
('defended', 'defended', 'recovered')
"""
from __future__ import annotations

import math
from typing import Any

# Verdict bands of DLG Fig. 6 as used in the closed-form notes: MSE below 0.03 recovered, below 0.2 partial, else defended.
RECOVERED_MSE = 0.03
PARTIAL_MSE = 0.2
# "margin" verdicts: recovered needs at least 10 dB (a tenth of the MSE) over the blind guess, partial 3 dB (half).
RECOVERED_MARGIN_DB = 10.0
PARTIAL_MARGIN_DB = 3.0
VERDICT_RULES = ("margin", "seed002")
# Text trials (gleak.mechanics.text.metrics): recovered where ROUGE-L reaches RECOVERED_ROUGE_L (the text in its order),
# partial where ROUGE-1 reaches PARTIAL_ROUGE_1 and PARTIAL_MARGIN above the blind guess's (the words); their rule:
RECOVERED_ROUGE_L = 0.8
PARTIAL_ROUGE_1 = 0.5
PARTIAL_MARGIN = 0.2
TEXT_VERDICT_RULE = "text"  # the verdict rule a text trial stores (extra verdict_rule): these bands
VERDICT_ORDER = {"defended": 0, "partial": 1, "recovered": 2}


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _gain_db(m: float, blind: float) -> float:
    """How far (dB) the attack's MSE `m` is under the blind guess's `blind`: 10 log10(blind / m). An exact recovery
    (m = 0) beats any blind guess that is not exact itself (+inf); a blind guess that is exact (the images all equal
    the mean image) cannot be beaten (-inf for m > 0, 0 dB for m = 0: no gain over it)."""
    if m > 0 and blind > 0:
        return 10 * math.log10(blind / m)
    if m == 0:
        return math.inf if blind > 0 else 0.0
    return -math.inf


def verdict(mse_value: float | None, blind_mse: float | None = None, rule: str = "margin", complete: bool = True) -> str | None:
    """The verdict band of one MSE (see the module docstring). `blind_mse`: the blind guess's MSE on the same batch
    (None: unknown, the bands alone decide); `complete`: every image of the batch had a reconstruction. A trial's
    verdict is `trial_verdict`, which picks the MSE this reads."""
    if rule not in VERDICT_RULES:
        raise ValueError(f"verdict rule must be one of {', '.join(VERDICT_RULES)}, got {rule!r}")
    if _missing(mse_value):
        return None
    m = float(mse_value)
    if rule == "seed002" or _missing(blind_mse):
        band = "recovered" if m < RECOVERED_MSE else "partial" if m < PARTIAL_MSE else "defended"
    else:
        gain = _gain_db(m, float(blind_mse))
        if m < RECOVERED_MSE and gain >= RECOVERED_MARGIN_DB:
            band = "recovered"
        elif m < PARTIAL_MSE and gain >= PARTIAL_MARGIN_DB:
            band = "partial"
        else:
            band = "defended"
    if band == "recovered" and not complete:  # an image the attack did not return was not recovered
        band = "partial"
    return band


def trial_verdict(mse_value: float | None, half_mse: float | None, blind_mse: float | None, matched: Any,
                  batch_size: Any, rule: str = "margin") -> str | None:  # fmt: skip
    """A trial's verdict under `rule`, from what its row stores: the batch-mean MSE, the MSE at least half of the
    batch reaches (extra.half_mse), the blind guess's MSE (extra.blind_mse), the images paired with one of the
    attack's reconstructions (matched) and the batch size. The one verdict of a trial: the trial (`score`),
    `gleak rescore` and the leaderboard (for a row stored under another rule) all call it. Unknown matched or
    batch size: taken as complete (rows stored before `matched` existed)."""
    if _missing(mse_value):
        return None
    complete = _missing(matched) or _missing(batch_size) or float(matched) >= float(batch_size)
    return verdict(verdict_mse(mse_value, half_mse, rule), blind_mse, rule, complete)


def verdict_rule_text(rule: str) -> str:
    """The rule in words, for the leaderboard."""
    if rule == "seed002":
        return (f"Verdict rule 'seed002' (DLG Fig. 6 bands as used in the closed-form notes): MSE < {RECOVERED_MSE} recovered, "
                f"< {PARTIAL_MSE} partial, else defended; a trial missing a reconstruction is at best partial.")  # fmt: skip
    return (f"Verdict rule 'margin', on the MSE that at least half of the batch's images reach (each image scored "
            f"alone, after the optimal pairing): recovered needs it below {RECOVERED_MSE} and at least "
            f"{RECOVERED_MARGIN_DB:g} dB under the blind guess's MSE (the data set's mean image, scored on the same "
            f"batch), and a reconstruction for every image of the batch; partial needs it below {PARTIAL_MSE} and "
            f"{PARTIAL_MARGIN_DB:g} dB under the blind guess; else defended.")  # fmt: skip


def verdict_mse(mean_mse: float | None, half_mse: float | None, rule: str) -> float | None:
    """The MSE a trial's verdict reads: under "margin" the MSE at least half of the batch's images reach (an image is
    a person's data: half the batch recovered exactly is a leak); under "seed002" the batch mean, as the closed-form notes do."""
    return half_mse if rule == "margin" and not _missing(half_mse) else mean_mse


def text_verdict(rouge1: float, rouge_l: float, blind_rouge1: float) -> str:
    """A text trial's verdict from its ROUGE-1, ROUGE-L and the blind guess's ROUGE-1 (the bands above)."""
    if rouge_l >= RECOVERED_ROUGE_L:
        return "recovered"
    if rouge1 >= PARTIAL_ROUGE_1 and rouge1 >= blind_rouge1 + PARTIAL_MARGIN:
        return "partial"
    return "defended"
