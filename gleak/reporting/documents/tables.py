"""The tables written beside the leaderboard: results.csv (one row per trial), leaderboard.csv (the defense ranking),
leaderboard_by_case.csv (every aggregated group) and leaderboard.tex (the defense ranking in LaTeX)."""
from __future__ import annotations

import json
import re
from typing import Any

import pandas as pd

from gleak.orchestration.store import CSV_COLUMNS
from gleak.reporting.aggregate import varying_keys
from gleak.reporting.documents.cells import params_text

TEX_COLUMNS = ["rank", "defense", "defense_params", "worst_attack", "psnr", "ssim", "verdict", "label_acc", "accuracy", "epsilon"]
TEX_HEADS = {"rank": "Rank", "defense": "Defense", "defense_params": "Parameters", "worst_attack": "Worst attack",
             "psnr": "PSNR (dB)", "ssim": "SSIM", "verdict": "Verdict", "label_acc": "Label accuracy",
             "accuracy": "Test accuracy", "epsilon": "Epsilon"}  # fmt: skip
_TEX_ESCAPES = str.maketrans({c: "\\" + c for c in "&%$#_{}"} | {"~": "-", "^": "-", "\\": "/"})


# A text cell that a spreadsheet would take for a formula (OWASP's CSV injection: = + - @, a tab or a carriage
# return first) is written with a quote before it, as spreadsheets expect; a cell that already starts with quotes
# before such a character gets one more, so that reading back (unquoted_cell) removes exactly one and every text
# round-trips. Numbers are not text: -1.5 and -inf are written as they are, also when they arrive as strings.
_FORMULA = re.compile(r"^'*[=+\-@\t\r]")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def quoted_cell(value: Any) -> Any:
    """A text cell as a spreadsheet reads it as text (see above); anything else unchanged."""
    if isinstance(value, str) and _FORMULA.match(value) and not _is_number(value):
        return "'" + value
    return value


def unquoted_cell(value: Any) -> Any:
    """The text quoted_cell was given (a cell of a CSV gleak wrote, read back)."""
    if isinstance(value, str) and value.startswith("'") and _FORMULA.match(value[1:]) and not _is_number(value[1:]):
        return value[1:]
    return value


def _text_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if pd.api.types.is_object_dtype(frame[c]) or pd.api.types.is_string_dtype(frame[c])]


def spreadsheet_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with its text cells quoted (quoted_cell): what every CSV gleak writes holds."""
    text = _text_columns(frame)
    return frame.assign(**{c: frame[c].map(quoted_cell) for c in text}) if text else frame


def unquoted(frame: pd.DataFrame) -> pd.DataFrame:
    """A CSV's frame as it was before spreadsheet_safe (its text columns unquoted)."""
    text = _text_columns(frame)
    return frame.assign(**{c: frame[c].map(unquoted_cell) for c in text}) if text else frame


def csv_text(frame: pd.DataFrame) -> str:
    return spreadsheet_safe(frame).to_csv(index=False)


def results_csv(df: pd.DataFrame) -> str:
    return csv_text(df[CSV_COLUMNS])


def ranking_csv(dr: pd.DataFrame) -> str:
    return csv_text(dr)


def by_case_csv(agg: pd.DataFrame) -> str:
    detail = agg.assign(extra=agg["extra"].map(lambda d: json.dumps(d, sort_keys=True)))
    return csv_text(detail)


def ranking_tex(dr: pd.DataFrame, df: pd.DataFrame, set_params: dict | None = None) -> str:
    """The defense ranking's main columns, parameters as in the Markdown table (those that differ from the defaults
    or that the suite varies or sets)."""
    vd = varying_keys(df, "defense", set_params)
    tex_frame = dr.assign(defense_params=[params_text(js, "defense", d, vd.get(d)) for d, js in zip(dr["defense"], dr["defense_params"])])
    cols = [c for c in TEX_COLUMNS if c in dr]
    tabular = tex_frame[cols].rename(columns=TEX_HEADS).to_latex(index=False, float_format="%.3f", na_rep="", escape=True)
    suite = str(df["suite"].dropna().iloc[0]) if "suite" in df and df["suite"].notna().any() else "gleak"
    name = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in suite)
    shown = suite.translate(_TEX_ESCAPES)
    caption = (f"Defenses of the suite {shown} ranked by their worst case over attacks: the median PSNR of the "
               "strongest attack (lower is more private), its SSIM and verdict"
               + (", with the test accuracy of federated training under the defense" if "accuracy" in cols else "")
               + (" and its epsilon" if "epsilon" in cols else "") + ".")  # fmt: skip
    return ("% The defense ranking of a gleak leaderboard; needs \\usepackage{booktabs}.\n"
            "\\begin{table}[t]\n\\centering\n\\small\n"
            f"\\caption{{{caption}}}\n\\label{{tab:gleak-{name}-defenses}}\n{tabular}\\end{{table}}\n")
