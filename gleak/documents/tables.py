"""The tables written beside the leaderboard: results.csv (one row per trial), leaderboard.csv (the defense ranking),
leaderboard_by_case.csv (every aggregated group) and leaderboard.tex (the defense ranking in LaTeX)."""
from __future__ import annotations

import json

import pandas as pd

from gleak.aggregate import varying_keys
from gleak.documents.cells import params_text
from gleak.store import CSV_COLUMNS

TEX_COLUMNS = ["rank", "defense", "defense_params", "worst_attack", "psnr", "ssim", "verdict", "label_acc", "accuracy", "epsilon"]


def results_csv(df: pd.DataFrame) -> str:
    return df[CSV_COLUMNS].to_csv(index=False)


def ranking_csv(dr: pd.DataFrame) -> str:
    return dr.to_csv(index=False)


def by_case_csv(agg: pd.DataFrame) -> str:
    detail = agg.assign(extra=agg["extra"].map(lambda d: json.dumps(d, sort_keys=True)))
    return detail.to_csv(index=False)


def ranking_tex(dr: pd.DataFrame, df: pd.DataFrame, set_params: dict | None = None) -> str:
    """The defense ranking's main columns, parameters as in the Markdown table (those that differ from the defaults
    or that the suite varies or sets)."""
    vd = varying_keys(df, "defense", set_params)
    tex_frame = dr.assign(defense_params=[params_text(js, "defense", d, vd.get(d)) for d, js in zip(dr["defense"], dr["defense_params"])])
    return tex_frame[[c for c in TEX_COLUMNS if c in dr]].to_latex(index=False, float_format="%.3f", na_rep="", escape=True)
