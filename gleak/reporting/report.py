"""A folder's report: its trials loaded (from the store, or from the committed files of a fresh clone), aggregated
(gleak.reporting.aggregate), written as documents (gleak.reporting.documents: Markdown, HTML, CSV, LaTeX) and figures (gleak.reporting.figures).

`write_reports(folder)` regenerates every file from the store; `write_folder_reports(folder)` does so as gleak's
files (the folder must be gleak's; what it writes is recorded in the folder's manifest, gleak.orchestration.output_folder). The names of
the aggregation and the documents stay importable from here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pandas as pd

from gleak.contracts.escaping import strip_controls
from gleak.mechanics.atomic_files import atomic_write_bytes
from gleak.mechanics.metrics import leakiest_first
from gleak.orchestration.output_folder import FIGURE_PREFIXES
from gleak.orchestration.store import CSV_COLUMNS, Store, check_store
from gleak.orchestration.utility import utility_config, utility_frame
from gleak.reporting.aggregate import (
    CASE_KEYS,
    aggregate,
    apply_verdicts,
    as_float,
    attack_ranking,
    with_threat_models,
    case_variants,
    defense_ranking,
    protocol_pairs,
    strength_series,
    varying_keys,
)  # fmt: skip
from gleak.reporting.attribution import undefended_baseline
from gleak.reporting.claims import folder_claims, with_claims
from gleak.reporting.documents import tables
from gleak.reporting.documents.cells import attack_label, data, defense_label
from gleak.reporting.documents.html import render_html
from gleak.reporting.documents.leaderboard import leaderboard_document, leaderboard_notes
from gleak.reporting.documents.markdown import render_markdown
from gleak.reporting.documents.text import worst_rouge_per_config

META_JSON = "suite.json"


def results_frame(store: Store) -> pd.DataFrame:
    df = with_threat_models(protocol_pairs(store.frame()))
    for c in CSV_COLUMNS:
        if c not in df.columns:
            df[c] = None
    return df


def leaderboard_markdown(
    suite: str, description: str, df: pd.DataFrame, agg: pd.DataFrame, dr: pd.DataFrame, ar: pd.DataFrame,
    utility: pd.DataFrame | None = None, notes: list[str] | None = None,
) -> str:  # fmt: skip
    return render_markdown(leaderboard_document(suite, description, df, agg, dr, ar, utility, notes))


def _write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def _load(folder: Path) -> dict[str, Any]:
    """The folder's trials and suite settings: from its store, or, where only the committed files are (a fresh
    clone: stores are not committed, except small ones), from results.csv, utility.csv and suite.json."""
    if not Store.exists(folder) and (folder / "results.csv").is_file():
        return _load_committed(folder)
    store = Store.open_existing(folder)
    try:
        rule = store.verdict_rule()
        return {"df": apply_verdicts(results_frame(store), rule), "utility": utility_frame(store), "rule": rule,
                "utility_cfg": utility_config(store), "suite": store.get_meta("suite", folder.name),
                "description": store.get_meta("description", ""),
                "set_params": store.get_meta("set_params", None) or {}, "imaged": store.named_image_ids()}  # fmt: skip
    finally:
        store.close()


def folder_suite_name(folder: Path) -> str | None:
    """The name of the suite whose trials the folder holds (its store's meta, else suite.json)."""
    if Store.exists(folder):
        store = Store.open_existing(folder)
        try:
            return store.get_meta("suite", None)
        finally:
            store.close()
    meta = folder / META_JSON
    return json.loads(meta.read_text()).get("suite") if meta.is_file() else None


def _load_committed(folder: Path) -> dict[str, Any]:
    from gleak.contracts.config import UtilityConfig

    meta = json.loads((folder / META_JSON).read_text()) if (folder / META_JSON).is_file() else {}
    df = pd.read_csv(folder / "results.csv", dtype={"attack_params": str, "defense_params": str, "extra": str, "case": str})
    for c in CSV_COLUMNS:
        if c not in df.columns:
            df[c] = None
    df = tables.unquoted(df.astype(object).where(df.notna(), None))  # the text as stored (a formula-like cell quoted)
    df = with_threat_models(df)
    for c in ("mse", "psnr", "ssim", "lpips", "label_acc", "cosine", "grad_dist", "seconds", "matched", "batch_size", "seed",
              "rpsnr", "iip", "feat_mse"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    utility = tables.unquoted(pd.read_csv(folder / "utility.csv")) if (folder / "utility.csv").is_file() else None
    cfg = meta.get("utility_config")
    rule = meta.get("verdict", "margin")
    return {"df": apply_verdicts(df, rule), "utility": utility, "rule": rule,
            "utility_cfg": UtilityConfig.from_dict(cfg) if cfg else None, "suite": meta.get("suite", folder.name),
            "description": meta.get("description", ""), "set_params": meta.get("set_params") or {}}  # fmt: skip


def _slug(text: str) -> str:
    """A file-name part for `text`: at most 80 characters; a longer one is cut and ends in 8 hex digits of the
    whole text's digest, so that two cases differing only past the cut (FedAvg's local steps) keep two files."""
    import hashlib
    import re

    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")
    if len(slug) <= 80:
        return slug
    return f"{slug[:71]}_{hashlib.sha256(text.encode()).hexdigest()[:8]}"



def _grid_figures(df: pd.DataFrame, folder: Path, fig_dir: Path, vd: dict, va: dict, add: Any,
                  imaged: set[str] = frozenset()) -> None:  # fmt: skip
    """Reconstruction grids: one per case; rows defense configs (suite order), columns attacks; first seed with an
    image (`imaged`: trials whose stored row names one that is no longer a plain file: drawn from the store)."""
    from gleak.reporting import figures as fg

    ok = df.assign(variant=case_variants(df))
    ok = ok[ok["status"] == "ok"]
    for case_key, g in ok.groupby(CASE_KEYS + ["variant"], sort=False):  # a case variant (trained, ...) apart
        g = g[g["image"].notna() | g["trial_id"].isin(imaged)].sort_values("seed", kind="stable")
        case = f"{case_key[0]}/{case_key[1]}/B={case_key[2]}" + (f" ({case_key[3]})" if case_key[3] else "")
        name = f"reconstructions_{_slug('_'.join(str(k) for k in case_key if k != ''))}.png"
        drawn = None
        if len(g):
            first = g.drop_duplicates(["defense", "defense_params", "attack", "attack_params"])
            cells = pd.DataFrame({
                "row_label": [defense_label(r["defense"], r["defense_params"], vd) for _, r in first.iterrows()],
                "col_label": [attack_label(r["attack"], r["attack_params"], va) for _, r in first.iterrows()],
                "image": first["image"].tolist(), "psnr": first["psnr"].tolist(), "trial_id": first["trial_id"].tolist(),
            })  # fmt: skip
            title = f"Reconstructions, {case}, seed {int(g['seed'].min())}"
            drawn = fg.reconstruction_grid(cells, folder / "images", fig_dir / name, title,
                                           lambda ids: _from_store(folder, ids))  # fmt: skip
        if drawn is None and (fig_dir / name).is_file():
            drawn = fig_dir / name  # no image to draw from (images/ gone, or not plain files): the grid drawn before stays
        add(drawn, f"Reconstructions per attack (columns) and defense (rows), {data(case)}.")


def _from_store(folder: Path, trial_ids: list[str]) -> dict:
    """The reconstruction PNGs of `trial_ids` drawn again from the store's arrays; arrays that are not their
    trial's are left out with one line (the panel shows "no image"), never drawn under another trial's name."""
    from gleak.orchestration.reconstructions import stored_images

    def say(line: str) -> None:
        print(f"gleak: {strip_controls(line)}; its panel is left empty", file=sys.stderr)

    return stored_images(folder, trial_ids, say)


def _worst_per_config(agg: pd.DataFrame, va: dict) -> pd.DataFrame:
    """The most leaky case of each (defense config, attack config), with the spread over its seeds (error bars)."""
    order = agg.assign(_p=agg["psnr"].fillna(-math.inf), _l=agg["label_acc"].fillna(-math.inf))
    order = order.sort_values(["_p", "mse_median", "_l"], ascending=leakiest_first("psnr", "mse_median", "label_acc"),
                              kind="stable")  # fmt: skip (_p, _l: psnr and label_acc with missing values last)
    worst = order.drop_duplicates(["defense", "defense_params", "attack", "attack_params"])
    worst = worst.set_index(["defense", "defense_params", "attack", "attack_params"]).reindex(
        list(dict.fromkeys(zip(agg["defense"], agg["defense_params"], agg["attack"], agg["attack_params"])))).reset_index()
    for m in ("psnr", "ssim", "lpips", "label_acc"):
        worst[f"{m}_err"] = worst[f"{m}_std"]
    worst["attack_label"] = [attack_label(a, ap, va) for a, ap in zip(worst["attack"], worst["attack_params"])]
    return worst


def _strength_figures(agg: pd.DataFrame, utility: pd.DataFrame | None, fig_dir: Path, vd: dict, va: dict, add: Any,
                      rouge: dict | None = None) -> None:  # fmt: skip
    """Each metric against defense strength, one line per attack (worst case over cases per configuration); text
    trials' ROUGE-1 (`rouge`: gleak.reporting.documents.text.worst_rouge_per_config) beside the image metrics."""
    rouge = rouge or {}
    from gleak.reporting import figures as fg

    worst = _worst_per_config(agg, va)
    base = worst[worst["defense"] == "none"]
    acc_of = {}
    if utility is not None:
        acc_of = {(u["defense"], u["defense_params"]): as_float(u["accuracy"]) for _, u in utility.iterrows()}
    base_acc = undefended_baseline(utility)
    for name, key, series in strength_series(agg, vd):
        lines, accs = [], []
        for label, xs in series:
            for js, x in xs.items():
                w = worst[(worst["defense"] == name) & (worst["defense_params"] == js)]
                for _, r in w.iterrows():
                    r1, r1_err = rouge.get((name, js, r["attack"], r["attack_params"]), (None, None))
                    lines.append({"attack": r["attack_label"], "group": label, "x": x,
                                  **{m: as_float(r[m]) for m in ("psnr", "ssim", "mse_median", "lpips", "label_acc")},
                                  **{f"{m}_err": as_float(r[f"{m}_err"]) for m in ("psnr", "ssim", "lpips", "label_acc")},
                                  "rouge1": r1, "rouge1_err": r1_err})  # fmt: skip
                if acc_of.get((name, js)) is not None:
                    accs.append({"group": label, "x": x, "accuracy": acc_of[(name, js)]})
        baselines: dict[str, Any] = {m: {r["attack_label"]: as_float(r[m]) for _, r in base.iterrows()}
                                     for m in ("psnr", "ssim", "mse_median", "lpips", "label_acc")}  # fmt: skip
        baselines["rouge1"] = {r["attack_label"]: rouge.get(("none", r["defense_params"], r["attack"], r["attack_params"]),
                                                            (None, None))[0] for _, r in base.iterrows()}  # fmt: skip
        baselines["accuracy"] = base_acc
        path = fig_dir / f"strength_{_slug(name)}_{_slug(key)}.png"
        drawn = fg.strength_figure(pd.DataFrame(lines), pd.DataFrame(accs) if accs else None, baselines, key, path,
                                   f"{name}: each metric against {key}")  # fmt: skip
        drew = [m for m in ("psnr", "ssim", "mse_median", "lpips", "label_acc", "rouge1") if any(ln[m] is not None for ln in lines)]
        what = ("median PSNR and MSE, mean SSIM, LPIPS and label accuracy" if set(drew) - {"rouge1"} else "")
        if "rouge1" in drew:
            what += ("; " if what else "") + "text trials: mean ROUGE-1"
        accuracy = " and the test accuracy" if accs else ""  # the caption names only the panels drawn
        add(drawn, f"{data(name)}: the best attack result (worst case over cases; {what}; bars: ± one standard "
                   f"deviation over seeds){accuracy} against {data(key)}, one line per attack." if what else
                   f"{data(name)}: the test accuracy against {data(key)}.")  # fmt: skip


def _frontier_figures(dr: pd.DataFrame, utility: pd.DataFrame | None, fig_dir: Path, vd: dict, add: Any) -> None:
    """The privacy-utility frontier, and the utility runs' learning curves."""
    from gleak.reporting import figures as fg

    base_acc = undefended_baseline(utility)
    if utility is not None and "accuracy" in dr and "psnr" in dr and dr["accuracy"].notna().any() and dr["psnr"].notna().any():
        pts = pd.DataFrame({"label": [defense_label(r["defense"], r["defense_params"], vd) for _, r in dr.iterrows()],
                            "accuracy": dr["accuracy"], "psnr": dr["psnr"], "psnr_err": dr["psnr_std"]})  # fmt: skip
        add(fg.frontier_figure(pts, fig_dir / "frontier.png", "Privacy-utility frontier: worst-case attack PSNR against test accuracy", base_acc),
            "Privacy-utility frontier: each defense configuration's worst-case attack PSNR (median; bars: ± one "
            "standard deviation over seeds) against its test accuracy; the Pareto front in red.")  # fmt: skip
        curves = [(u["defense"], defense_label(u["defense"], u["defense_params"], vd),
                   json.loads(u["extra"] or "{}").get("curve", [])) for _, u in utility.iterrows()]  # fmt: skip
        if any(c for _, _, c in curves):
            add(fg.curves_figure(curves, fig_dir / "utility_curves.png", "Test accuracy during federated training"),
                "Test accuracy against round for each utility run (is the baseline converged?).")


def _setting_figures(df: pd.DataFrame, fig_dir: Path, vd: dict, va: dict, add: Any) -> None:
    """The share of trials recovered and the median PSNR against each case setting that a suite varies (batch size,
    clients, FedAvg's local steps), one line per attack with everything else fixed."""
    from gleak.reporting.setting_figure import setting_figure, setting_series

    for axis, lines in setting_series(df, vd, va):
        shown = axis.removeprefix("protocol_params.")
        add(setting_figure(lines, axis, fig_dir / f"setting_{_slug(axis)}.png", f"What leaks against {shown}"),
            f"The share of trials recovered (verdict recovered) and the median PSNR against {data(shown)}, one line "
            "per attack and fixed other settings (named where the lines differ in them).")


def _remove_stale_figures(folder: Path, fig_dir: Path, written: set[str]) -> None:
    """Our figures of configurations no longer in the suite would mislead; others are left alone."""
    from gleak.orchestration.output_folder import remove_owned

    if fig_dir.is_dir():
        for f in fig_dir.glob("*.png"):
            if f.name not in written and f.name.startswith(FIGURE_PREFIXES):
                remove_owned(folder, f)  # only a figure gleak wrote (its manifest says so), never a user's


def write_figures(folder: str | Path, data: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """Write DIR/figures/*.png from the store; returns [(path relative to DIR, caption)]."""
    folder = Path(folder)
    data = data or _load(folder)
    df, utility = data["df"], data["utility"]
    out: list[tuple[str, str]] = []
    fig_dir = folder / "figures"
    if len(df) == 0:
        return out
    agg = aggregate(df)
    dr = defense_ranking(agg, utility)
    sp = data.get("set_params")
    vd, va = varying_keys(df, "defense", sp), varying_keys(df, "attack", sp)
    written: set[str] = set()

    def add(path: Path | None, caption: str) -> None:
        if path is not None:
            rel = str(path.relative_to(folder))
            written.add(path.name)
            out.append((rel, caption))

    with warnings.catch_warnings():
        # A plugin's name or parameter may hold control characters (ESC, BEL): matplotlib's missing-glyph warning
        # would print them raw to the terminal. The figure shows a box for each; the warning says nothing more.
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from")
        _grid_figures(df, folder, fig_dir, vd, va, add, data.get("imaged", set()))
        _strength_figures(agg, utility, fig_dir, vd, va, add, worst_rouge_per_config(df))
        _frontier_figures(dr, utility, fig_dir, vd, add)
        _setting_figures(df, fig_dir, vd, va, add)
    _remove_stale_figures(folder, fig_dir, written)
    return out


def write_reports(folder: str | Path, suite: str | None = None, description: str | None = None) -> dict[str, Path]:
    """Regenerate results.csv, utility.csv, the leaderboard files (Markdown, CSV, LaTeX, HTML) and the figures of an
    output folder from its store."""
    folder = Path(folder)
    data = _load(folder)
    df, utility = data["df"], data["utility"]
    suite = suite or data["suite"]
    description = description if description is not None else data["description"]
    paths = {}
    _write_text(folder / "results.csv", tables.results_csv(df))
    paths["results.csv"] = folder / "results.csv"
    ucfg = data["utility_cfg"]
    meta = {"suite": suite, "description": description, "verdict": data["rule"],
            "utility_config": dataclasses.asdict(ucfg) if ucfg is not None else None,
            "claims": folder_claims(folder)}  # fmt: skip
    if data["set_params"]:  # what a clone names beside each plugin (absent for folders run before it was kept)
        meta["set_params"] = data["set_params"]
    _write_text(folder / META_JSON, json.dumps(meta, indent=1, sort_keys=True) + "\n")  # what a clone rebuilds from
    paths[META_JSON] = folder / META_JSON
    if utility is not None:
        _write_text(folder / "utility.csv", tables.csv_text(utility))
        paths["utility.csv"] = folder / "utility.csv"
    else:
        from gleak.orchestration.output_folder import remove_owned

        remove_owned(folder, Path(folder) / "utility.csv")  # written from the store only: never a stale one (and never a user's)
    if len(df) == 0:
        return paths
    agg = aggregate(df)
    dr = defense_ranking(agg, utility)
    ar = attack_ranking(agg, df)
    figures = write_figures(folder, data)
    doc = leaderboard_document(suite, description, df, agg, dr, ar, utility, leaderboard_notes(df), data["utility_cfg"],
                               figures, data["rule"], data["set_params"])  # fmt: skip
    doc = with_claims(doc, folder, df, agg)  # the suite's published claims and the DP bound (gleak.reporting.claims)
    _write_text(folder / "leaderboard.md", render_markdown(doc))
    _write_text(folder / "leaderboard.html", render_html(doc, folder))
    _write_text(folder / "leaderboard.csv", tables.ranking_csv(dr))
    _write_text(folder / "leaderboard_by_case.csv", tables.by_case_csv(agg))
    _write_text(folder / "leaderboard.tex", tables.ranking_tex(dr, df, data["set_params"]))
    names = ("leaderboard.md", "leaderboard.html", "leaderboard.csv", "leaderboard_by_case.csv", "leaderboard.tex")
    paths.update({n: folder / n for n in names})
    paths.update({rel: folder / rel for rel, _ in figures})
    return paths


def write_folder_reports(folder: str | Path, suite: str | None = None, description: str | None = None, *,
                         locked: bool = False) -> dict[str, Path]:
    """Write the folder's reports from its store (`write_reports`) and record them in its manifest (gleak.orchestration.output_folder);
    the folder must be gleak's (InputError otherwise, nothing written). Under the folder's lock: taken here (InputError,
    nothing written, while a run holds it), or already held by the caller (locked=True: the run writing its own
    reports before it lets the folder go)."""
    from gleak.orchestration import output_folder as owned
    from gleak.orchestration.folder_lock import holding_lock

    folder = Path(folder)
    owned.claim_results(folder, check_store)  # read-only: a folder gleak may not write gets no lock file either
    with contextlib.nullcontext() if locked else holding_lock(folder):
        m = owned.claim_results(folder, check_store)  # again under the lock: what a run left meanwhile
        m.add(folder / name for name in owned.REPORT_FILES)
        m.save()
        paths = write_reports(folder, suite, description)
        owned.record(folder, paths.values())
    return paths
