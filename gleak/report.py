"""Leaderboards from the store: results.csv, leaderboard.md / .csv / .tex.

Aggregation over the trials of one (case, defense, attack) group: mean PSNR, SSIM, LPIPS, cosine and label accuracy,
median MSE, the verdict of the median MSE, and the share of trials recovered. A defense is only as strong as the
best attack against it: defenses are ranked by their worst case (the highest mean PSNR any attack reaches in any
case); attacks are ranked by their mean PSNR against the undefended baseline.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gleak.errors import InputError
from gleak.figures import atomic_write_bytes
from gleak.registry import plugin_info
from gleak.metrics import LPIPS_HOWTO, PARTIAL_MSE, RECOVERED_MSE, verdict
from gleak.store import CSV_COLUMNS, Store

CASE_KEYS = ["dataset", "model", "batch_size"]


def varying_keys(df: pd.DataFrame, kind: str) -> dict[str, set[str]]:
    """For each plugin name, the parameters whose value differs between the suite's configurations of it."""
    out: dict[str, set[str]] = {}
    for name, g in df.groupby(kind):
        dicts = [json.loads(s) for s in g[f"{kind}_params"].dropna().unique()]
        keys = set().union(*dicts) if dicts else set()
        out[name] = {k for k in keys if len({json.dumps(d.get(k), sort_keys=True) for d in dicts}) > 1}
    return out


def _params_text(js: str, kind: str | None = None, name: str | None = None, show: set[str] | None = None) -> str:
    """Parameters as 'k=v, ...': with kind and name, those that differ from the plugin's defaults plus `show`
    (the ones the suite varies), so that a sweep's rows all name their value."""
    d = json.loads(js) if isinstance(js, str) and js else {}
    if kind and name:
        try:
            defaults = plugin_info(kind, name).defaults()
            d = {k: v for k, v in d.items() if k in (show or ()) or k not in defaults or defaults[k] != v}
        except InputError:  # a plugin that is not loaded now: show everything
            pass
    return ", ".join(f"{k}={v}" for k, v in d.items()) if d else "-"


def _s(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)


def results_frame(store: Store) -> pd.DataFrame:
    df = store.frame()
    for c in CSV_COLUMNS:
        if c not in df.columns:
            df[c] = None
    return df


def _numeric_extras(series: pd.Series) -> dict[str, float]:
    vals: dict[str, list[float]] = {}
    for s in series.dropna():
        for k, v in json.loads(s).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                vals.setdefault(k, []).append(float(v))
    return {k: float(np.mean(v)) for k, v in vals.items()}


def case_variants(df: pd.DataFrame) -> pd.Series:
    """Per trial, the case settings that differ between trials of one dataset/model/batch size (for example
    model_state=trained), as 'k=v, ...', so that such trials are not averaged together; '' where none differ."""
    out = pd.Series("", index=df.index, dtype=object)
    if "case" not in df.columns:
        return out
    for _, g in df.groupby(CASE_KEYS, sort=False, dropna=False):
        cases = {i: json.loads(s) if isinstance(s, str) and s else {} for i, s in g["case"].items()}
        keys = sorted(set().union(*cases.values()) - set(CASE_KEYS))
        varying = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in cases.values()}) > 1]
        for i, c in cases.items():
            out[i] = ", ".join(f"{k}={c.get(k)}" for k in varying)
    return out


def aggregate(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (case, defense, defense params, attack, attack params) over the trials that finished."""
    keys = CASE_KEYS + ["variant", "defense", "defense_params", "attack", "attack_params"]
    df = df.assign(variant=case_variants(df))
    rows = []
    for key, g in df.groupby(keys, sort=False, dropna=False):
        ok = g[g.status == "ok"]
        row = dict(zip(keys, key))
        row["trials"] = len(g)
        row["failed"] = int((g.status != "ok").sum())
        has_img = ok["mse"].notna().any()
        mse = ok["mse"].dropna()
        row["psnr"] = float(ok["psnr"].dropna().mean()) if has_img else None
        row["psnr_std"] = float(ok["psnr"].dropna().std(ddof=0)) if has_img else None
        row["mse_median"] = float(mse.median()) if has_img else None
        row["ssim"] = float(ok["ssim"].dropna().mean()) if has_img else None
        row["lpips"] = float(ok["lpips"].dropna().mean()) if ok["lpips"].notna().any() else None
        row["cosine"] = float(ok["cosine"].dropna().mean()) if has_img else None
        row["label_acc"] = float(ok["label_acc"].dropna().mean()) if ok["label_acc"].notna().any() else None
        row["labels_exact"] = f"{int((ok['label_acc'] == 1.0).sum())}/{len(ok)}" if ok["label_acc"].notna().any() else None
        row["recovered"] = float((mse < RECOVERED_MSE).mean()) if has_img else None
        row["verdict"] = verdict(row["mse_median"]) if has_img else None
        row["grad_dist"] = float(ok["grad_dist"].dropna().mean()) if ok["grad_dist"].notna().any() else None
        row["extra"] = _numeric_extras(ok["extra"])
        row["seconds"] = float(g["seconds"].mean())
        rows.append(row)
    return pd.DataFrame(rows)


def _fmt(v: Any, kind: str = "g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if kind == "e":
        return f"{v:.3e}"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "2":
        return f"{v:.2f}"
    if kind == "3":
        return f"{v:.3f}"
    return str(v)


def defense_ranking(agg: pd.DataFrame, utility: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each defense config's worst case over attacks and cases (image attacks by PSNR; label attacks beside)."""
    rows = []
    for (d, dp), g in agg.groupby(["defense", "defense_params"], sort=False):
        img = g[g["psnr"].notna()]
        row: dict[str, Any] = {"defense": d, "defense_params": dp}
        if len(img):
            worst = img.loc[img["psnr"].idxmax()]
            row.update(
                worst_attack=worst["attack"], worst_case=_case_text(worst), psnr=worst["psnr"], mse_median=worst["mse_median"],
                ssim=worst["ssim"], lpips=worst["lpips"], verdict=worst["verdict"], recovered=worst["recovered"],
            )  # fmt: skip
        lab = g[g["label_acc"].notna()]
        row["label_acc"] = float(lab["label_acc"].max()) if len(lab) else None
        row["grad_dist"] = float(g["grad_dist"].dropna().mean()) if g["grad_dist"].notna().any() else None
        if utility is not None and len(utility):
            u = utility[(utility["defense"] == d) & (utility["defense_params"] == dp)]
            if len(u):
                row["accuracy"] = float(u["accuracy"].iloc[0])
                row["epsilon"] = u["epsilon"].iloc[0]
        rows.append(row)
    out = pd.DataFrame(rows)
    if "psnr" in out:
        # Lowest worst-case PSNR first; ties (exact recoveries give inf) broken by the larger median MSE.
        out = out.sort_values(["psnr", "mse_median"], ascending=[True, False], na_position="last", kind="stable")
        out = out.reset_index(drop=True)
    out.insert(0, "rank", range(1, len(out) + 1))
    return out


def attack_ranking(agg: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (a, ap), g in agg.groupby(["attack", "attack_params"], sort=False):
        base = g[g["defense"] == "none"]
        img = g[g["psnr"].notna()]
        rows.append(
            {
                "attack": a,
                "attack_params": ap,
                "psnr_undefended": float(base["psnr"].dropna().mean()) if base["psnr"].notna().any() else None,
                "best_psnr": float(img["psnr"].max()) if len(img) else None,
                "defenses_recovered": f"{int((img['verdict'] == 'recovered').sum())}/{len(img)}" if len(img) else None,
                "label_acc_undefended": float(base["label_acc"].dropna().mean()) if base["label_acc"].notna().any() else None,
            }
        )
    out = pd.DataFrame(rows)
    out = out.sort_values(["psnr_undefended", "label_acc_undefended"], ascending=False, na_position="last", kind="stable")
    out = out.reset_index(drop=True)
    out.insert(0, "rank", range(1, len(out) + 1))
    return out


def _case_text(r: Any) -> str:
    variant = f" ({r['variant']})" if r.get("variant") else ""
    return f"{r['dataset']}/{r['model']}/B={r['batch_size']}{variant}"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _extras_text(d: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3g}" for k, v in sorted(d.items()) if not k.startswith("_"))


def leaderboard_markdown(
    suite: str, description: str, df: pd.DataFrame, agg: pd.DataFrame, dr: pd.DataFrame, ar: pd.DataFrame,
    utility: pd.DataFrame | None = None, notes: list[str] | None = None,
) -> str:  # fmt: skip
    ok, failed = int((df.status == "ok").sum()), int((df.status != "ok").sum())
    vd, va = varying_keys(df, "defense"), varying_keys(df, "attack")
    out = [f"# Leaderboard: {suite}", ""]
    if description:
        out += [description.strip(), ""]
    out += [
        f"{len(df)} trials: {ok} ok, {failed} failed. Written by `gleak run`; regenerate with `gleak leaderboard DIR`.",
        f"Verdict of the median MSE (DLG Fig. 6 bands, seed 002): MSE < {RECOVERED_MSE} recovered, < {PARTIAL_MSE} "
        "partial, else defended. PSNR, SSIM, LPIPS, cosine: means over trials after optimal matching; "
        "'recovered' is the share of trials below the recovered band.",
        "",
    ]
    show_util = "accuracy" in dr.columns
    h = ["rank", "defense", "params", "worst attack", "worst case", "PSNR", "MSE (median)", "SSIM", "LPIPS", "verdict",
         "recovered", "label acc", "grad dist"]  # fmt: skip
    if show_util:
        h += ["accuracy", "epsilon"]
    rows = []
    for _, r in dr.iterrows():
        row = [str(r["rank"]), r["defense"], _params_text(r["defense_params"], "defense", r["defense"], vd.get(r["defense"])),
               _s(r.get("worst_attack")), _s(r.get("worst_case")), _fmt(r.get("psnr"), "2"), _fmt(r.get("mse_median"), "e"),
               _fmt(r.get("ssim"), "3"), _fmt(r.get("lpips"), "3"), _s(r.get("verdict")),
               _fmt(r.get("recovered"), "pct"), _fmt(r.get("label_acc"), "3"), _fmt(r.get("grad_dist"), "3")]  # fmt: skip
        if show_util:
            row += [_fmt(r.get("accuracy"), "pct"), _fmt(r.get("epsilon"), "2")]
        rows.append(row)
    out += ["## Defenses, ranked by their worst case over attacks", "", _md_table(h, rows), ""]

    rows = [[str(r["rank"]), r["attack"], _params_text(r["attack_params"], "attack", r["attack"], va.get(r["attack"])),
             _fmt(r["psnr_undefended"], "2"), _fmt(r["best_psnr"], "2"), _s(r["defenses_recovered"]),
             _fmt(r["label_acc_undefended"], "3")]
            for _, r in ar.iterrows()]  # fmt: skip
    h = ["rank", "attack", "params", "PSNR undefended", "best PSNR", "configs recovered", "label acc undefended"]
    out += ["## Attacks, ranked by their results against the undefended baseline", "", _md_table(h, rows), ""]

    out += ["## Results by case", ""]
    for case_key, g in agg.groupby(CASE_KEYS + ["variant"], sort=False):
        variant = f" {case_key[3]}" if case_key[3] else ""
        out += [f"### dataset={case_key[0]} model={case_key[1]} batch size={case_key[2]}{variant}", ""]
        h = ["defense", "params", "attack", "attack params", "trials", "PSNR", "MSE (median)", "SSIM", "LPIPS",
             "cosine", "label acc", "labels exact", "recovered", "verdict", "grad dist", "diagnostics"]  # fmt: skip
        rows = [[r["defense"], _params_text(r["defense_params"], "defense", r["defense"], vd.get(r["defense"])), r["attack"],
                 _params_text(r["attack_params"], "attack", r["attack"], va.get(r["attack"])),
                 f"{r['trials'] - r['failed']}/{r['trials']}", _fmt(r["psnr"], "2"), _fmt(r["mse_median"], "e"),
                 _fmt(r["ssim"], "3"), _fmt(r["lpips"], "3"), _fmt(r["cosine"], "3"), _fmt(r["label_acc"], "3"),
                 _s(r["labels_exact"]), _fmt(r["recovered"], "pct"), _s(r["verdict"]),
                 _fmt(r["grad_dist"], "3"), _extras_text(r["extra"])] for _, r in g.iterrows()]  # fmt: skip
        out += [_md_table(h, rows), ""]
    if failed:
        out += ["## Failed trials", ""]
        errs = df[df.status != "ok"].groupby(["attack", "defense", "error"], dropna=False).size().reset_index(name="n")
        out += [_md_table(["attack", "defense", "error", "trials"],
                          [[r["attack"], r["defense"], str(r["error"]), str(r["n"])] for _, r in errs.iterrows()]), ""]  # fmt: skip
    footnotes = list(notes or [])
    if df["mse"].notna().any() and not df["lpips"].notna().any():
        footnotes.append(f"LPIPS is unavailable on the machine that ran this suite, so its column is empty. {LPIPS_HOWTO}.")
    if footnotes:
        out += ["## Notes", ""] + [f"- {n}" for n in footnotes] + [""]
    return "\n".join(out)


def _write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_reports(folder: str | Path, suite: str | None = None, description: str | None = None) -> dict[str, Path]:
    """Regenerate results.csv and the leaderboard files of an output folder from its store."""
    folder = Path(folder)
    store = Store.open_existing(folder)
    try:
        df = results_frame(store)
        suite = suite or store.get_meta("suite", folder.name)
        description = description if description is not None else store.get_meta("description", "")
    finally:
        store.close()
    paths = {}
    csv = df[CSV_COLUMNS].to_csv(index=False)
    _write_text(folder / "results.csv", csv)
    paths["results.csv"] = folder / "results.csv"
    if len(df) == 0:
        return paths
    agg = aggregate(df)
    utility = pd.read_csv(folder / "utility.csv") if (folder / "utility.csv").is_file() else None
    dr = defense_ranking(agg, utility)
    ar = attack_ranking(agg)
    md = leaderboard_markdown(suite, description, df, agg, dr, ar, utility)
    _write_text(folder / "leaderboard.md", md)
    _write_text(folder / "leaderboard.csv", dr.to_csv(index=False))
    detail = agg.assign(extra=agg["extra"].map(lambda d: json.dumps(d, sort_keys=True)))
    _write_text(folder / "leaderboard_by_case.csv", detail.to_csv(index=False))
    tex_cols = [c for c in ["rank", "defense", "defense_params", "worst_attack", "psnr", "ssim", "verdict", "label_acc"] if c in dr]
    tex = dr[tex_cols].to_latex(index=False, float_format="%.3f", na_rep="")
    _write_text(folder / "leaderboard.tex", tex)
    paths.update({n: folder / n for n in ("leaderboard.md", "leaderboard.csv", "leaderboard_by_case.csv", "leaderboard.tex")})
    return paths
