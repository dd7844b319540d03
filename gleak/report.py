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

from gleak.attribution import attribute_measured_configuration, undefended_baseline
from gleak.claims import folder_claims, with_claims
from gleak.errors import InputError
from gleak.figures import atomic_write_bytes
from gleak.registry import plugin_info
from gleak.metrics import LPIPS_HOWTO, PSNR_CEILING, VERDICT_ORDER, verdict, verdict_mse, verdict_rule_text
from gleak.store import CSV_COLUMNS, DONE, NOT_APPLICABLE, Store
from gleak.utility import utility_config, utility_frame

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
            d = {k: v for k, v in d.items() if (k in (show or ()) and v is not None) or k not in defaults or defaults[k] != v}
        except InputError:  # a plugin that is not loaded now: show everything
            pass
    return ", ".join(f"{k}={format(v, '.6g') if isinstance(v, float) else v}" for k, v in d.items()) if d else "-"


def _s(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)


def protocol_pairs(df: pd.DataFrame) -> pd.DataFrame:
    """A trial whose case names a protocol (`[case] protocol = "cgd"`) is ranked as the defense 'PROTOCOL+DEFENSE'
    (the pair is what protects the client); the older spelling `[[defense]] name = "cgd"` already names it."""
    if "case" not in df.columns or df.empty:
        return df
    protocols = df["case"].map(lambda s: (json.loads(s) if isinstance(s, str) and s else {}).get("protocol", "fedsgd"))
    named = protocols != "fedsgd"
    if named.any():
        df = df.copy()
        df.loc[named, "defense"] = protocols[named] + "+" + df.loc[named, "defense"].astype(str)
    return df


def results_frame(store: Store) -> pd.DataFrame:
    df = protocol_pairs(store.frame())
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


def spread(values: Any) -> dict[str, float | None]:
    """mean, std (ddof 1) and the two-sided 95% Student-t interval of the mean over the trials (seeds); None where
    undefined (no value; std and interval of a single value)."""
    v = np.asarray([float(x) for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))])
    out: dict[str, float | None] = {"mean": None, "std": None, "lo": None, "hi": None, "n": float(len(v))}
    if len(v) == 0:
        return out
    out["mean"] = float(v.mean())
    if len(v) > 1:
        from scipy.stats import t

        sd = float(v.std(ddof=1))
        half = float(t.ppf(0.975, len(v) - 1)) * sd / math.sqrt(len(v))
        out.update(std=sd, lo=out["mean"] - half, hi=out["mean"] + half)
    return out


def _extra_value(js: Any, key: str) -> float | None:
    if not isinstance(js, str) or not js:
        return None
    v = json.loads(js).get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def apply_verdicts(df: pd.DataFrame, rule: str = "margin") -> pd.DataFrame:
    """Each trial's verdict under the suite's rule (gleak.metrics.verdict), from its MSE, its blind guess's MSE
    (extra.blind_mse) and whether every image had a reconstruction; blind_* columns from extra beside it."""
    df = df.copy()
    for k in ("blind_mse", "blind_psnr", "blind_ssim", "half_mse"):
        df[k] = [_extra_value(js, k) for js in df["extra"]] if "extra" in df else None
    verdicts = []
    for _, r in df.iterrows():
        if r.get("status") != "ok" or _num(r.get("mse")) is None:
            verdicts.append(None)
            continue
        matched, size = _num(r.get("matched")), _num(r.get("batch_size"))
        complete = matched is None or size is None or matched >= size
        m = verdict_mse(float(r["mse"]), _num(r.get("half_mse")), rule)
        verdicts.append(verdict(m, _num(r.get("blind_mse")), rule, complete))
    df["verdict"] = verdicts
    return df


def median_verdict(verdicts: Any) -> str | None:
    """The verdict that at least half of the trials reach or exceed (the median on defended < partial < recovered,
    the attacker's side of it for an even count)."""
    v = sorted((VERDICT_ORDER[x] for x in verdicts if isinstance(x, str)), reverse=True)
    if not v:
        return None
    level = v[(len(v) - 1) // 2]
    return next(k for k, o in VERDICT_ORDER.items() if o == level)


SPREAD_METRICS = ("psnr", "mse", "ssim", "lpips", "cosine", "label_acc", "seconds")


def aggregate(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (case, defense, defense params, attack, attack params) over the trials that finished.

    psnr: the median over trials of the trial PSNR (per image capped at PSNR_CEILING); mse_median the median MSE;
    ssim, lpips, cosine, label_acc, seconds: means. Beside each, METRIC_mean, METRIC_std and METRIC_lo / METRIC_hi
    (95% interval of the mean over seeds). blind_psnr / blind_mse / blind_ssim: the blind guess on the same batches
    (median, median, mean). verdict: `median_verdict` of the trials' verdicts; recovered: their share recovered."""
    keys = CASE_KEYS + ["variant", "defense", "defense_params", "attack", "attack_params"]
    df = attribute_measured_configuration(df)  # a CGD verdict belongs to the partition it was measured at
    df = df.assign(variant=case_variants(df))
    if "psnr" in df:  # rows stored before the per-image cap (an older gleak's inf for exact recoveries)
        df = df.assign(psnr=pd.to_numeric(df["psnr"], errors="coerce").clip(upper=PSNR_CEILING))
    if "blind_mse" not in df:
        df = apply_verdicts(df)
    rows = []
    for key, g in df.groupby(keys, sort=False, dropna=False):
        ok = g[g.status == "ok"]
        row = dict(zip(keys, key))
        row["trials"] = len(g)
        row["failed"] = int((~g.status.isin(DONE)).sum())
        row["not_applicable"] = int((g.status == NOT_APPLICABLE).sum())
        has_img = ok["mse"].notna().any()
        for m in SPREAD_METRICS:
            col = ok[m] if m != "seconds" else g[m]
            st = spread(col.dropna().tolist()) if col.notna().any() else spread([])
            for k in ("mean", "std", "lo", "hi"):
                row[f"{m}_{k}"] = st[k]
        row["psnr"] = float(ok["psnr"].dropna().median()) if has_img else None
        row["mse_median"] = float(ok["mse"].dropna().median()) if has_img else None
        for m in ("ssim", "lpips", "cosine", "label_acc", "seconds"):
            row[m] = row[f"{m}_mean"]
        row["labels_exact"] = f"{int((ok['label_acc'] == 1.0).sum())}/{len(ok)}" if ok["label_acc"].notna().any() else None
        blind = ok[ok["mse"].notna()]
        row["blind_psnr"] = float(blind["blind_psnr"].dropna().median()) if blind["blind_psnr"].notna().any() else None
        row["blind_mse"] = float(blind["blind_mse"].dropna().median()) if blind["blind_mse"].notna().any() else None
        row["blind_ssim"] = float(blind["blind_ssim"].dropna().mean()) if blind["blind_ssim"].notna().any() else None
        verdicts = ok["verdict"].dropna()
        row["recovered"] = float((verdicts == "recovered").mean()) if has_img and len(verdicts) else None
        row["verdict"] = median_verdict(verdicts) if has_img else None
        row["grad_dist"] = float(ok["grad_dist"].dropna().mean()) if ok["grad_dist"].notna().any() else None
        row["extra"] = _numeric_extras(ok["extra"])
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


def _num(v: Any) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def competition_rank(values: list[float | None], ascending: bool) -> list[int]:
    """Ranks 1, 2, 2, 4 ...: equal values (to 0.01, the precision shown) share a rank; missing values come last."""
    key = [(1, 0.0) if v is None or (isinstance(v, float) and math.isnan(v)) else (0, round(float(v), 2) * (1 if ascending else -1))
           for v in values]  # fmt: skip
    return [1 + sum(1 for k2 in key if k2 < k) for k in key]


_WORST_KEYS = ("psnr", *(f"{m}_{k}" for m in ("psnr", "mse", "ssim", "lpips") for k in ("mean", "std", "lo", "hi")),
               "mse_median", "ssim", "lpips", "verdict", "recovered", "blind_psnr", "blind_mse", "blind_ssim", "trials")


def defense_ranking(agg: pd.DataFrame, utility: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each defense config's worst case over attacks and cases: the (case, attack) group with the highest median
    PSNR (the most leaky; ties to the lower median MSE), with its spread and its blind guess; label accuracy is the
    best any attack reaches, with the attack that reached it. Ranked by the worst case's median PSNR, lowest
    first; equal values share a rank."""
    rows = []
    for (d, dp), g in agg.groupby(["defense", "defense_params"], sort=False):
        img = g[g["psnr"].notna()]
        row: dict[str, Any] = {"defense": d, "defense_params": dp}
        if len(img):
            img = img.sort_values(["psnr", "mse_median"], ascending=[False, True], kind="stable")
            worst = img.iloc[0]
            row.update(worst_attack=worst["attack"], worst_attack_params=worst["attack_params"], worst_case=_case_text(worst),
                       **{k: worst.get(k) for k in _WORST_KEYS})  # fmt: skip
        lab = g[g["label_acc"].notna()]
        if len(lab):
            best = lab.loc[lab["label_acc"].idxmax()]
            row.update(label_acc=float(best["label_acc"]), label_acc_std=_num(best.get("label_acc_std")),
                       label_attack=best["attack"])  # fmt: skip
        else:
            row.update(label_acc=None, label_acc_std=None, label_attack=None)
        row["grad_dist"] = float(g["grad_dist"].dropna().mean()) if g["grad_dist"].notna().any() else None
        if utility is not None:
            u = utility[(utility["defense"] == d) & (utility["defense_params"] == dp)]
            row["accuracy"] = _num(u["accuracy"].iloc[0]) if len(u) else None
            row["baseline_accuracy"] = _num(u["baseline_accuracy"].iloc[0]) if len(u) else None
            row["epsilon"] = _num(u["epsilon"].iloc[0]) if len(u) else None
        rows.append(row)
    out = pd.DataFrame(rows)
    if "psnr" in out:
        out = out.sort_values(["psnr", "mse_median"], ascending=[True, False], na_position="last", kind="stable")
        out = out.reset_index(drop=True)
        out.insert(0, "rank", competition_rank(list(out["psnr"]), ascending=True))
    else:
        out.insert(0, "rank", range(1, len(out) + 1))
    return out


def threat_model_text(name: str, params_js: str) -> str:
    """What the attack needs (gleak.threat.KNOWLEDGE keys), plus 'active server' for an attack that modifies the
    model it sends."""
    from gleak.registry import create

    try:
        attack = create("attack", name, **(json.loads(params_js) if isinstance(params_js, str) and params_js else {}))
    except Exception:  # noqa: BLE001 - a plugin that is not loaded now: say nothing rather than guess
        return ""
    parts = sorted(attack.needs)
    if getattr(attack, "active", False):
        parts.append("active server")
    return ", ".join(p.replace("_", " ") for p in parts) or "nothing"


def attack_ranking(agg: pd.DataFrame, df: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each attack config's median PSNR over its undefended trials (every case), with their spread; ranked highest
    first (ties share a rank), then by label accuracy. Time: mean seconds per trial over all its trials."""
    if df is not None:
        df = df if "verdict" in df and "blind_mse" in df else apply_verdicts(df)
    rows = []
    for (a, ap), g in agg.groupby(["attack", "attack_params"], sort=False):
        img = g[g["psnr"].notna()]
        row: dict[str, Any] = {"attack": a, "attack_params": ap}
        if df is not None:
            t = df[(df["attack"] == a) & (df["attack_params"] == ap)]
            base = t[(t["defense"] == "none") & (t["status"] == "ok")]
            p = pd.to_numeric(base["psnr"], errors="coerce").dropna().clip(upper=PSNR_CEILING)  # older stores' inf
            st = spread(p.tolist())
            row.update(psnr_undefended=float(p.median()) if len(p) else None, psnr_undefended_mean=st["mean"],
                       psnr_undefended_std=st["std"], psnr_undefended_lo=st["lo"], psnr_undefended_hi=st["hi"])  # fmt: skip
            la = base["label_acc"].dropna()
            row["label_acc_undefended"] = float(la.mean()) if len(la) else None
            sec = spread(t["seconds"].dropna().tolist())
            row["seconds"], row["seconds_std"] = sec["mean"], sec["std"]
        else:
            base = g[g["defense"] == "none"]
            row["psnr_undefended"] = float(base["psnr"].dropna().median()) if base["psnr"].notna().any() else None
            row["label_acc_undefended"] = float(base["label_acc"].dropna().mean()) if base["label_acc"].notna().any() else None
            row["seconds"] = float(g["seconds"].mean())
        row["best_psnr"] = float(img["psnr"].max()) if len(img) else None
        row["defenses_recovered"] = f"{int((img['verdict'] == 'recovered').sum())}/{len(img)}" if len(img) else None
        row["threat_model"] = threat_model_text(a, ap)
        rows.append(row)
    out = pd.DataFrame(rows)
    out = out.sort_values(["psnr_undefended", "label_acc_undefended"], ascending=False, na_position="last", kind="stable")
    out = out.reset_index(drop=True)
    primary = [p if _num(p) is not None else (None if _num(l) is None else -1000 + float(l))
               for p, l in zip(out["psnr_undefended"], out["label_acc_undefended"])]  # fmt: skip
    out.insert(0, "rank", competition_rank(primary, ascending=False))
    return out


def _case_text(r: Any) -> str:
    variant = f" ({r['variant']})" if r.get("variant") else ""
    return f"{r['dataset']}/{r['model']}/B={r['batch_size']}{variant}"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table (tabulate). The cells are text already formatted (numbers to their shown
    precision, escaped): disable_numparse keeps tabulate from reformatting or realigning them as numbers."""
    from tabulate import tabulate

    return tabulate(rows, headers=header, tablefmt="github", disable_numparse=True)


def _extras_text(d: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3g}" for k, v in sorted(d.items()) if not k.startswith(("_", "blind_")))


def _ms(r: Any, m: str, kind: str, ci: bool = False, mean_key: str | None = None) -> str:
    """'mean ± std' of metric m (with ' [lo, hi]', the 95% interval of the mean, when ci); '' when undefined."""
    mean = _num(r.get(mean_key or f"{m}_mean"))
    if mean is None:
        return ""
    text = _fmt(mean, kind)
    std = _num(r.get(f"{m}_std"))
    text += f" ± {_fmt(std, kind)}" if std is not None else " (1 trial)"
    lo, hi = _num(r.get(f"{m}_lo")), _num(r.get(f"{m}_hi"))
    if ci and lo is not None and hi is not None:
        text += f" [{_fmt(lo, kind)}, {_fmt(hi, kind)}]"
    return text


def _label_text(r: Any) -> str:
    acc = _num(r.get("label_acc"))
    return "" if acc is None else f"{_fmt(acc, '3')} ({r.get('label_attack')})"


def _defense_label(name: str, params_js: str, vd: dict[str, set[str]]) -> str:
    p = _params_text(params_js, "defense", name, vd.get(name))
    return name if p == "-" else f"{name} {p}"


def _attack_label(name: str, params_js: str, va: dict[str, set[str]]) -> str:
    p = _params_text(params_js, "attack", name, va.get(name))
    return name if p == "-" else f"{name} {p}"


def _worst_attack_text(r: Any, va: dict[str, set[str]]) -> str:
    """The worst attack with the parameters that tell it from its siblings in the suite (defense_aware=True for an
    adaptive variant), so a reader sees which of them broke the defense."""
    name, params_js = r.get("worst_attack"), r.get("worst_attack_params")
    if not isinstance(name, str):
        return ""
    return _attack_label(name, params_js, va) if isinstance(params_js, str) else name


def attack_defense_matrix(agg: pd.DataFrame, dr: pd.DataFrame, vd: dict, va: dict) -> tuple[list[str], list[list[str]]]:
    """Each attack's best result against each defense configuration (over cases): the PSNR and verdict of its best
    image reconstruction, or its best label accuracy for label-only attacks. Rows in the defense ranking's order."""
    attacks = list(dict.fromkeys(zip(agg["attack"], agg["attack_params"])))
    header = ["defense", "params"] + [_attack_label(a, ap, va) for a, ap in attacks]
    rows = []
    for _, d in dr.iterrows():
        g = agg[(agg["defense"] == d["defense"]) & (agg["defense_params"] == d["defense_params"])]
        row = [d["defense"], _params_text(d["defense_params"], "defense", d["defense"], vd.get(d["defense"]))]
        for a, ap in attacks:
            c = g[(g["attack"] == a) & (g["attack_params"] == ap)]
            img = c[c["psnr"].notna()]
            if len(img):
                best = img.loc[img["psnr"].idxmax()]
                row.append(f"{_fmt(best['psnr'], '2')} ({best['verdict']})")
            elif c["label_acc"].notna().any():
                row.append(f"labels {_fmt(float(c['label_acc'].max()), '3')}")
            else:
                row.append("")
        rows.append(row)
    return header, rows


def _utility_intro(cfg: Any, utility: pd.DataFrame) -> str:
    algo = (f"FedSGD (server_lr {cfg.server_step})" if cfg.algorithm == "fedsgd"
            else f"FedAvg ({cfg.local_steps} local steps at client_lr {cfg.client_step}, the mean delta applied)")
    base = undefended_baseline(utility)  # not a CGD row's own centralized run
    base_txt = f"{100 * base:.2f}%" if base is not None else "unavailable"
    text = (
        f"Accuracy: top-1 on the test split after federated training of `{cfg.model}` on `{cfg.dataset}`: {algo}, "
        f"{cfg.clients} clients with IID shards, {cfg.training_rounds} rounds, batch {cfg.batch_size} per client"
        f"{' and step' if cfg.algorithm == 'fedavg' else ''}, seed {cfg.seed}, the defense on every "
        f"client's update in every round; every run draws the same batches. Baseline without defense: {base_txt}."
    )
    if utility["epsilon"].notna().any():
        text += (
            f" Epsilon: (epsilon, delta = {cfg.delta:g})-DP of each example of a client's data, from opacus' accountant "
            f"for the run's sampling rate (batch / shard size) and steps (rounds x local steps); empty where undefined."
        )
    return text


def leaderboard_document(
    suite: str, description: str, df: pd.DataFrame, agg: pd.DataFrame, dr: pd.DataFrame, ar: pd.DataFrame,
    utility: pd.DataFrame | None = None, notes: list[str] | None = None, utility_cfg: Any = None,
    figures: list[tuple[str, str]] | None = None, rule: str = "margin",
) -> list[tuple]:  # fmt: skip
    """The leaderboard as blocks, rendered to Markdown and HTML alike: ("h1"|"h2"|"h3"|"p", text),
    ("table", header, rows), ("list", items), ("figure", relative path, caption)."""
    ok, failed = int((df.status == "ok").sum()), int((~df.status.isin(DONE)).sum())
    n_a = int((df.status == NOT_APPLICABLE).sum())
    vd, va = varying_keys(df, "defense"), varying_keys(df, "attack")
    doc: list[tuple] = [("h1", f"Leaderboard: {suite}")]
    if description:
        doc.append(("p", description.strip()))
    doc.append(("p",
        f"{len(df)} trials: {ok} ok, {failed} failed" + (f", {n_a} not applicable" if n_a else "") + ". Written by `gleak run`; regenerate with `gleak leaderboard DIR`. "
        "Every trial is scored against the victim's whole batch: reconstructions are paired with the images by "
        "optimal assignment and an image left without one is scored against the blind guess, the data set's mean "
        "image (the per-pixel mean of the split the victims come from); the blind guess's own PSNR / MSE / SSIM on "
        f"the same batches is shown beside each case. The truth is the batch as it entered the victim's gradient: "
        "under a defense that transforms the client's inputs (ATS), the transformed batch; the row's extra then also "
        "scores the reconstruction against the untransformed images (psnr_original, mse_original, ssim_original). "
        f"Per-image PSNR is capped at {PSNR_CEILING:g} dB (exact "
        "recoveries). PSNR and MSE: medians over trials (seeds); beside them and for SSIM, LPIPS, label accuracy "
        "and time: mean ± std [95% interval of the mean, Student t over seeds]. " + verdict_rule_text(rule)
        + " A group's verdict is the one at least half of its trials reach or exceed; 'recovered' is the share of "
        "its trials recovered. Ranks: equal values (to 0.01) share a rank."))  # fmt: skip
    show_util = utility is not None and "accuracy" in dr.columns
    h = ["rank", "defense", "params", "worst attack", "worst case", "PSNR (median)", "PSNR mean ± std [95%]",
         "blind PSNR", "MSE (median)", "SSIM mean ± std", "LPIPS", "verdict", "recovered", "label acc (attack)",
         "grad dist"]  # fmt: skip
    if show_util:
        h += ["accuracy", "epsilon"]
    rows = []
    for _, r in dr.iterrows():
        row = [str(r["rank"]), r["defense"], _params_text(r["defense_params"], "defense", r["defense"], vd.get(r["defense"])),
               _worst_attack_text(r, va), _s(r.get("worst_case")), _fmt(r.get("psnr"), "2"), _ms(r, "psnr", "2", ci=True),
               _fmt(r.get("blind_psnr"), "2"), _fmt(r.get("mse_median"), "e"), _ms(r, "ssim", "3", mean_key="ssim"),
               _fmt(r.get("lpips"), "3"), _s(r.get("verdict")), _fmt(r.get("recovered"), "pct"), _label_text(r),
               _fmt(r.get("grad_dist"), "3")]  # fmt: skip
        if show_util:
            row += [_fmt(r.get("accuracy"), "pct"), _fmt(r.get("epsilon"), "2")]
        rows.append(row)
    doc += [("h2", "Defenses, ranked by their worst case over attacks")]
    if show_util:
        doc.append(("p", "A defense is only as strong as the best attack against it. Accuracy and epsilon: see "
                         "'Utility' below."))  # fmt: skip
    doc.append(("table", h, rows))
    broken = []  # said in words, not only in a column: a defense an attack gets through does not protect that case
    for name, g in dr[dr["defense"] != "none"].groupby("defense", sort=False):
        hit = g[g["verdict"] == "recovered"] if "verdict" in g else g.iloc[:0]
        if len(hit):
            by = ", ".join(sorted({_worst_attack_text(r, va) for _, r in hit.iterrows()}))
            broken.append(f"{name} in {len(hit)} of its {len(g)} configurations (by {by})")
    if broken:
        doc.append(("p", "Broken: an attack recovers the victim's data (verdict recovered, by the rule above) through "
                         + "; ".join(broken) + "."))  # fmt: skip

    if show_util:
        doc.append(("h2", "Utility: accuracy under each defense, next to its worst-case leakage"))
        if utility_cfg is not None:
            doc.append(("p", _utility_intro(utility_cfg, utility)))
        by_cfg = {(r["defense"], r["defense_params"]): r for _, r in dr.iterrows()}
        rows = []
        for _, u in utility.iterrows():
            r = by_cfg.get((u["defense"], u["defense_params"]), {})
            acc, base = _num(u["accuracy"]), _num(u["baseline_accuracy"])
            delta = f"{100 * (acc - base):+.2f}" if acc is not None and base is not None else ""
            rows.append([u["defense"], _params_text(u["defense_params"], "defense", u["defense"], vd.get(u["defense"])),
                         _fmt(acc, "pct"), delta, _fmt(_num(u["epsilon"]), "2"), _fmt(r.get("psnr"), "2"),
                         _s(r.get("worst_attack")), _s(r.get("verdict")),
                         _s(u["error"]) if u["status"] != "ok" else ""])  # fmt: skip
        doc.append(("table", ["defense", "params", "accuracy", "change (points)", "epsilon", "worst-case PSNR",
                              "worst attack", "verdict", "error"], rows))  # fmt: skip

    rows = [[str(r["rank"]), r["attack"], _params_text(r["attack_params"], "attack", r["attack"], va.get(r["attack"])),
             _fmt(r["psnr_undefended"], "2"), _ms(r, "psnr_undefended", "2", ci=True), _fmt(r["best_psnr"], "2"),
             _s(r["defenses_recovered"]), _fmt(r["label_acc_undefended"], "3"), _ms(r, "seconds", "2", mean_key="seconds"),
             _s(r.get("threat_model"))]
            for _, r in ar.iterrows()]  # fmt: skip
    h = ["rank", "attack", "params", "PSNR undefended (median)", "mean ± std [95%]", "best PSNR", "configs recovered",
         "label acc undefended", "seconds per trial", "threat model (needs)"]  # fmt: skip
    doc += [("h2", "Attacks, ranked by their results against the undefended baseline"), ("table", h, rows)]
    mh, mrows = attack_defense_matrix(agg, dr, vd, va)
    doc += [("h2", "Each attack's best result against each defense"),
            ("p", "Median PSNR (dB) of the attack's best case, with its verdict; label-only attacks: "
                  "their best label accuracy. Defenses in ranking order."),
            ("table", mh, mrows)]  # fmt: skip

    if figures:
        doc.append(("h2", "Figures"))
        for rel, caption in figures:
            doc.append(("figure", rel, caption))

    doc.append(("h2", "Results by case"))
    for case_key, g in agg.groupby(CASE_KEYS + ["variant"], sort=False):
        variant = f" {case_key[3]}" if case_key[3] else ""
        doc.append(("h3", f"dataset={case_key[0]} model={case_key[1]} batch size={case_key[2]}{variant}"))
        h = ["defense", "params", "attack", "attack params", "trials", "PSNR (median)", "PSNR mean ± std [95%]",
             "MSE (median)", "SSIM mean ± std", "LPIPS", "cosine", "label acc mean ± std", "labels exact", "recovered",
             "verdict", "seconds", "grad dist", "diagnostics"]  # fmt: skip
        rows = []
        if g["blind_psnr"].notna().any():  # what an attacker who ignores the update scores on the same batches
            rows.append(["(blind guess)", "mean image", "-", "-", "", _fmt(float(g["blind_psnr"].dropna().median()), "2"),
                         "", _fmt(float(g["blind_mse"].dropna().median()), "e"),
                         _fmt(float(g["blind_ssim"].dropna().mean()), "3"), "", "", "", "", "", "", "", "", ""])  # fmt: skip
        rows += [[r["defense"], _params_text(r["defense_params"], "defense", r["defense"], vd.get(r["defense"])), r["attack"],
                  _params_text(r["attack_params"], "attack", r["attack"], va.get(r["attack"])),
                  _trials_text(r), _fmt(r["psnr"], "2"), _ms(r, "psnr", "2", ci=True),
                  _fmt(r["mse_median"], "e"), _ms(r, "ssim", "3", mean_key="ssim"), _fmt(r["lpips"], "3"),
                  _fmt(r["cosine"], "3"), _ms(r, "label_acc", "3", mean_key="label_acc"), _s(r["labels_exact"]),
                  _fmt(r["recovered"], "pct"), _s(r["verdict"]), _ms(r, "seconds", "2", mean_key="seconds"),
                  _fmt(r["grad_dist"], "3"), _extras_text(r["extra"])] for _, r in g.iterrows()]  # fmt: skip
        doc.append(("table", h, rows))
    if n_a:
        why = df[df.status == NOT_APPLICABLE].groupby(["attack", "defense", "error"], dropna=False).size().reset_index(name="n")
        doc += [("h2", "Not applicable"), ("table", ["attack", "defense", "reason", "trials"],
                 [[r["attack"], r["defense"], str(r["error"]), str(r["n"])] for _, r in why.iterrows()])]  # fmt: skip
    if failed:
        errs = df[~df.status.isin(DONE)].groupby(["attack", "defense", "error"], dropna=False).size().reset_index(name="n")
        doc += [("h2", "Failed trials"), ("table", ["attack", "defense", "error", "trials"],
                 [[r["attack"], r["defense"], str(r["error"]), str(r["n"])] for _, r in errs.iterrows()])]  # fmt: skip
    footnotes = list(notes or [])
    if df["mse"].notna().any() and not df["lpips"].notna().any():
        footnotes.append(f"LPIPS is unavailable on the machine that ran this suite, so its column is empty. {LPIPS_HOWTO}.")
    if footnotes:
        doc += [("h2", "Notes"), ("list", footnotes)]
    return doc


def _trials_text(r: Any) -> str:
    """'ran/all' of a cell, or n/a when its plugin cannot handle the case at all (UnsupportedCase)."""
    na = int(r.get("not_applicable", 0) or 0)
    return "n/a" if na and na == r["trials"] else f"{r['trials'] - r['failed'] - na}/{r['trials']}"


def md_escape(text: str) -> str:
    """Text for Markdown: outside `code` spans, what would start HTML markup (a tag, an entity, a quote at the start
    of a line) as entities, so that a name, a parameter or a description is shown as written, never as markup."""
    import re

    def plain(p: str) -> str:  # only what could start markup: "MSE < 0.03" stays as it is
        p = re.sub(r"&(?=#?\w+;)", "&amp;", p)
        return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", p)

    parts = re.split(r"(`[^`]*`)", str(text))
    out = "".join(p if p.startswith("`") and p.endswith("`") and len(p) > 1 else plain(p) for p in parts)
    return re.sub(r"(?m)^(\s*)>", r"\1&gt;", out)


def leaderboard_notes(df: pd.DataFrame) -> list[str]:
    """Notes a reader must see: attacks run below the budget their settings were tuned for (extra.under_budget)."""
    notes = []
    if "case" in df and any('"model_state": "trained"' in c for c in df["case"].dropna()):
        notes.append("model_state=trained: the model trained on the data set's training split; the victims' batches "
                     "(and the blind guess, their split's mean image) come from the test split, images it never "
                     "trained on (Geiping et al. attack validation images); attacks given public data get the "
                     "training split.")  # fmt: skip
    if "extra" not in df:
        return notes
    under = df[[bool(_extra_value(js, "under_budget")) for js in df["extra"]]]
    for (a, ap), g in under.groupby(["attack", "attack_params"], sort=False):
        tuned = {_extra_value(js, "tuned_iterations") for js in g["extra"]} - {None}
        p = json.loads(ap) if isinstance(ap, str) else {}
        notes.append(f"{a} ran {p.get('iterations')} iterations in {len(g)} trials, far below the "
                     f"{', '.join(f'{t:g}' for t in sorted(tuned))} its preset's TV weight was tuned for: its results "
                     "understate the attack.")  # fmt: skip
    return notes


def render_markdown(doc: list[tuple]) -> str:
    out: list[str] = []
    e = md_escape
    for block in doc:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            out += ["#" * int(kind[1]) + " " + e(block[1]).replace("\n", " "), ""]
        elif kind == "p":
            out += [e(block[1]), ""]
        elif kind == "table":
            cell = lambda c: e(c).replace("|", "\\|").replace("\n", " ")  # noqa: E731 - one row per line
            out += [_md_table([cell(h) for h in block[1]], [[cell(c) for c in r] for r in block[2]]), ""]
        elif kind == "list":
            out += [f"- {e(item)}" for item in block[1]] + [""]
        elif kind == "figure":
            cap = e(block[2]).replace("[", "\\[").replace("]", "\\]")
            out += [f"![{cap}]({block[1]})", "", f"*{e(block[2])}*", ""]
    return "\n".join(out)


_HTML_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto; max-width: 1400px;
       padding: 0 1em; color: #1a1a1a; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05em; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 12.5px; }
th, td { border: 1px solid #d0d0d0; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; position: sticky; top: 0; }
tr:nth-child(even) td { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.verdict-recovered { color: #b00020; font-weight: 600; } .verdict-partial { color: #b35c00; }
.verdict-defended { color: #1b7a2b; font-weight: 600; }
figure { margin: 1em 0 2em; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 12.5px; } code { background: #f4f4f4; padding: 0 3px; border-radius: 3px; }
.scroll { overflow-x: auto; }
"""


def _html_inline(text: str) -> str:
    """Escape, then turn `code` spans into <code>."""
    import html
    import re

    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _cell_class(value: str, header: str) -> str:
    """The CSS classes of a table cell: num for a number, verdict-* for a verdict."""
    import re

    cls = []
    if re.fullmatch(r"[-+]?(\d[\d.,]*(e[-+]?\d+)?%?|inf)", value.strip()):
        cls.append("num")
    for word in ("recovered", "partial", "defended"):
        if header in ("verdict",) and value == word or re.search(rf"\({word}\)$", value):
            cls.append(f"verdict-{word}")
    return " ".join(cls)


# The page (jinja2, autoescaped): texts that may hold `code` spans arrive as Markup from _html_inline, everything else
# is escaped by the template. trim_blocks/lstrip_blocks: one line per element, as a hand-written page would have.
_HTML_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{ title }}</title>
<style>{{ style | safe }}</style>
</head>
<body>
{% for b in blocks %}
{% if b.kind in ("h1", "h2", "h3") %}
<{{ b.kind }}>{{ b.text }}</{{ b.kind }}>
{% elif b.kind == "p" %}
<p>{{ b.text }}</p>
{% elif b.kind == "table" %}
<div class="scroll"><table>
<thead><tr>{% for h in b.header %}<th>{{ h }}</th>{% endfor %}</tr></thead><tbody>
{% for row in b.rows %}
<tr>{% for value, cls in row %}<td{% if cls %} class="{{ cls }}"{% endif %}>{{ value }}</td>{% endfor %}</tr>
{% endfor %}
</tbody></table></div>
{% elif b.kind == "list" %}
<ul>{% for item in b.entries %}<li>{{ item }}</li>{% endfor %}</ul>
{% elif b.kind == "figure" and b.uri %}
<figure><img src="{{ b.uri }}" alt="{{ b.alt }}"><figcaption>{{ b.caption }}</figcaption></figure>
{% elif b.kind == "figure" %}
<p>Figure not embedded (page size limit): {{ b.name }}. {{ b.caption }}</p>
{% endif %}
{% endfor %}
</body>
</html>
"""


def render_html(doc: list[tuple], folder: Path, max_embed_bytes: int = 3 << 20) -> str:
    """A self-contained page: inline CSS, figures embedded as data URIs (no file or network reference)."""
    import base64

    import jinja2
    from markupsafe import Markup

    blocks: list[dict[str, Any]] = []
    embedded = 0
    for block in doc:
        kind = block[0]
        if kind in ("h1", "h2", "h3", "p"):
            blocks.append({"kind": kind, "text": Markup(_html_inline(block[1]))})
        elif kind == "table":
            header = block[1]
            rows = [[(c, _cell_class(c, h)) for c, h in zip(r, header)] for r in block[2]]
            blocks.append({"kind": kind, "header": header, "rows": rows})
        elif kind == "list":
            blocks.append({"kind": kind, "entries": [Markup(_html_inline(i)) for i in block[1]]})
        elif kind == "figure":
            f = folder / block[1]
            if not f.is_file():
                continue
            data = f.read_bytes()
            fig = {"kind": kind, "name": block[1], "alt": block[2], "caption": Markup(_html_inline(block[2])), "uri": None}
            if embedded + len(data) <= max_embed_bytes:
                embedded += len(data)
                fig["uri"] = "data:image/png;base64," + base64.b64encode(data).decode()
            blocks.append(fig)
    env = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    title = next((b[1] for b in doc if b[0] == "h1"), "gleak leaderboard")
    return env.from_string(_HTML_PAGE).render(title=title, style=_HTML_STYLE, blocks=blocks)


def leaderboard_markdown(
    suite: str, description: str, df: pd.DataFrame, agg: pd.DataFrame, dr: pd.DataFrame, ar: pd.DataFrame,
    utility: pd.DataFrame | None = None, notes: list[str] | None = None,
) -> str:  # fmt: skip
    return render_markdown(leaderboard_document(suite, description, df, agg, dr, ar, utility, notes))


def _write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


META_JSON = "suite.json"


def _load(folder: Path) -> dict[str, Any]:
    """The folder's trials and suite settings: from its store, or, where only the committed files are (a fresh
    clone: stores are not committed, except small ones), from results.csv, utility.csv and suite.json."""
    if not Store.exists(folder) and (folder / "results.csv").is_file():
        return _load_committed(folder)
    store = Store.open_existing(folder)
    try:
        rule = store.get_meta("verdict", "margin") or "margin"
        return {"df": apply_verdicts(results_frame(store), rule), "utility": utility_frame(store), "rule": rule,
                "utility_cfg": utility_config(store), "suite": store.get_meta("suite", folder.name),
                "description": store.get_meta("description", "")}  # fmt: skip
    finally:
        store.close()


def _load_committed(folder: Path) -> dict[str, Any]:
    from gleak.config import UtilityConfig

    meta = json.loads((folder / META_JSON).read_text()) if (folder / META_JSON).is_file() else {}
    df = pd.read_csv(folder / "results.csv", dtype={"attack_params": str, "defense_params": str, "extra": str, "case": str})
    for c in CSV_COLUMNS:
        if c not in df.columns:
            df[c] = None
    df = df.astype(object).where(df.notna(), None)
    for c in ("mse", "psnr", "ssim", "lpips", "label_acc", "cosine", "grad_dist", "seconds", "matched", "batch_size", "seed"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    utility = pd.read_csv(folder / "utility.csv") if (folder / "utility.csv").is_file() else None
    cfg = meta.get("utility_config")
    rule = meta.get("verdict", "margin")
    return {"df": apply_verdicts(df, rule), "utility": utility, "rule": rule,
            "utility_cfg": UtilityConfig.from_dict(cfg) if cfg else None, "suite": meta.get("suite", folder.name),
            "description": meta.get("description", "")}  # fmt: skip


def _slug(text: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:80]


def strength_series(agg: pd.DataFrame, vd: dict[str, set[str]]) -> list[tuple[str, str, list[tuple[str, dict]]]]:
    """For each defense, the groups of its configurations that differ in one numeric parameter: (defense, parameter,
    [(group label, {params_json: x})]). Groups split by the non-numeric parameters that vary (distribution, mode)."""
    out = []
    for name, g in agg.groupby("defense", sort=False):
        configs = list(dict.fromkeys(g["defense_params"]))
        if len(configs) < 2:
            continue
        dicts = {js: json.loads(js) for js in configs}
        varying = sorted(vd.get(name, set()))

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        categorical = [k for k in varying if any(d.get(k) is not None and not is_num(d.get(k)) for d in dicts.values())]
        groups: dict[tuple, list[str]] = {}
        for js, d in dicts.items():
            groups.setdefault(tuple(d.get(k) for k in categorical), []).append(js)
        by_key: dict[str, list[tuple[tuple, dict]]] = {}
        for values, members in groups.items():
            numeric = [k for k in varying if k not in categorical
                       and len({json.dumps(dicts[m].get(k)) for m in members}) > 1
                       and all(is_num(dicts[m].get(k)) for m in members)]  # fmt: skip
            if len(members) < 2 or not numeric:
                continue
            key = numeric[0]
            by_key.setdefault(key, []).append((values, {m: float(dicts[m][key]) for m in members}))
        for key, series in by_key.items():  # name a line by the categorical values that differ between the lines
            shown = [j for j, k in enumerate(categorical) if len({v[j] for v, _ in series}) > 1]
            out.append((name, key, [(", ".join(f"{categorical[j]}={v[j]}" for j in shown), xs) for v, xs in series]))
    return out


FIGURE_PREFIXES = ("reconstructions_", "strength_", "frontier", "utility_curves")


def write_figures(folder: str | Path, data: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """Write DIR/figures/*.png from the store; returns [(path relative to DIR, caption)]."""
    from gleak import figures as fg

    folder = Path(folder)
    data = data or _load(folder)
    df, utility = data["df"], data["utility"]
    out: list[tuple[str, str]] = []
    fig_dir = folder / "figures"
    if len(df) == 0:
        return out
    agg = aggregate(df)
    dr = defense_ranking(agg, utility)
    vd, va = varying_keys(df, "defense"), varying_keys(df, "attack")
    written: set[str] = set()

    def add(path: Path | None, caption: str) -> None:
        if path is not None:
            rel = str(path.relative_to(folder))
            written.add(path.name)
            out.append((rel, caption))

    # Reconstruction grids: one per case; rows defense configs (suite order), columns attacks; first seed with an image.
    ok = df.assign(variant=case_variants(df))
    ok = ok[(ok["status"] == "ok") & ok["image"].notna()]
    for case_key, g in ok.groupby(CASE_KEYS + ["variant"], sort=False):  # a case variant (trained, ...) apart
        g = g.sort_values("seed", kind="stable")
        case = f"{case_key[0]}/{case_key[1]}/B={case_key[2]}" + (f" ({case_key[3]})" if case_key[3] else "")
        first = g.drop_duplicates(["defense", "defense_params", "attack", "attack_params"])
        cells = pd.DataFrame({
            "row_label": [_defense_label(r["defense"], r["defense_params"], vd) for _, r in first.iterrows()],
            "col_label": [_attack_label(r["attack"], r["attack_params"], va) for _, r in first.iterrows()],
            "image": first["image"].tolist(), "psnr": first["psnr"].tolist(),
        })  # fmt: skip
        name = f"reconstructions_{_slug('_'.join(str(k) for k in case_key if k != ''))}.png"
        title = f"Reconstructions, {case}, seed {int(g['seed'].min())}"
        add(fg.reconstruction_grid(cells, folder / "images", fig_dir / name, title),
            f"Reconstructions per attack (columns) and defense (rows), {case}.")

    # Each metric against defense strength, one line per attack (worst case over cases per configuration).
    # The most leaky case of each (defense config, attack config), with the spread over its seeds (error bars).
    order = agg.assign(_p=agg["psnr"].fillna(-math.inf), _l=agg["label_acc"].fillna(-math.inf))
    order = order.sort_values(["_p", "mse_median", "_l"], ascending=[False, True, False], kind="stable")
    worst = order.drop_duplicates(["defense", "defense_params", "attack", "attack_params"])
    worst = worst.set_index(["defense", "defense_params", "attack", "attack_params"]).reindex(
        list(dict.fromkeys(zip(agg["defense"], agg["defense_params"], agg["attack"], agg["attack_params"])))).reset_index()
    for m in ("psnr", "ssim", "lpips", "label_acc"):
        worst[f"{m}_err"] = worst[f"{m}_std"]
    worst["attack_label"] = [_attack_label(a, ap, va) for a, ap in zip(worst["attack"], worst["attack_params"])]
    base = worst[worst["defense"] == "none"]
    acc_of = {}
    if utility is not None:
        acc_of = {(u["defense"], u["defense_params"]): _num(u["accuracy"]) for _, u in utility.iterrows()}
    base_acc = undefended_baseline(utility)
    for name, key, series in strength_series(agg, vd):
        lines, accs = [], []
        for label, xs in series:
            for js, x in xs.items():
                w = worst[(worst["defense"] == name) & (worst["defense_params"] == js)]
                for _, r in w.iterrows():
                    lines.append({"attack": r["attack_label"], "group": label, "x": x,
                                  **{m: _num(r[m]) for m in ("psnr", "ssim", "mse_median", "lpips", "label_acc")},
                                  **{f"{m}_err": _num(r[f"{m}_err"]) for m in ("psnr", "ssim", "lpips", "label_acc")}})  # fmt: skip
                if acc_of.get((name, js)) is not None:
                    accs.append({"group": label, "x": x, "accuracy": acc_of[(name, js)]})
        baselines: dict[str, Any] = {m: {r["attack_label"]: _num(r[m]) for _, r in base.iterrows()}
                                     for m in ("psnr", "ssim", "mse_median", "lpips", "label_acc")}  # fmt: skip
        baselines["accuracy"] = base_acc
        path = fig_dir / f"strength_{_slug(name)}_{_slug(key)}.png"
        add(fg.strength_figure(pd.DataFrame(lines), pd.DataFrame(accs) if accs else None, baselines, key, path,
                               f"{name}: each metric against {key}"),
            f"{name}: the best attack result (worst case over cases; median PSNR and MSE, mean SSIM, LPIPS and label "
            f"accuracy; bars: ± one standard deviation over seeds) and the test accuracy against {key}, one line per attack.")  # fmt: skip

    # The privacy-utility frontier.
    if utility is not None and "accuracy" in dr and "psnr" in dr and dr["accuracy"].notna().any() and dr["psnr"].notna().any():
        pts = pd.DataFrame({"label": [_defense_label(r["defense"], r["defense_params"], vd) for _, r in dr.iterrows()],
                            "accuracy": dr["accuracy"], "psnr": dr["psnr"], "psnr_err": dr["psnr_std"]})  # fmt: skip
        add(fg.frontier_figure(pts, fig_dir / "frontier.png", "Privacy-utility frontier: worst-case attack PSNR against test accuracy", base_acc),
            "Privacy-utility frontier: each defense configuration's worst-case attack PSNR (median; bars: ± one "
            "standard deviation over seeds) against its test accuracy; the Pareto front in red.")  # fmt: skip
        curves = [(_defense_label(u["defense"], u["defense_params"], vd), json.loads(u["extra"] or "{}").get("curve", []))
                  for _, u in utility.iterrows()]  # fmt: skip
        if any(c for _, c in curves):
            add(fg.curves_figure(curves, fig_dir / "utility_curves.png", "Test accuracy during federated training"),
                "Test accuracy against round for each utility run (is the baseline converged?).")
    if fig_dir.is_dir():  # our figures of configurations no longer in the suite would mislead; others are left alone
        from gleak.folder import remove_owned

        for f in fig_dir.glob("*.png"):
            if f.name not in written and f.name.startswith(FIGURE_PREFIXES):
                remove_owned(folder, f)  # only a figure gleak wrote (its manifest says so), never a user's
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
    csv = df[CSV_COLUMNS].to_csv(index=False)
    _write_text(folder / "results.csv", csv)
    paths["results.csv"] = folder / "results.csv"
    import dataclasses

    ucfg = data["utility_cfg"]
    meta = {"suite": suite, "description": description, "verdict": data["rule"],
            "utility_config": dataclasses.asdict(ucfg) if ucfg is not None else None,
            "claims": folder_claims(folder)}  # fmt: skip
    _write_text(folder / META_JSON, json.dumps(meta, indent=1, sort_keys=True) + "\n")  # what a clone rebuilds from
    paths[META_JSON] = folder / META_JSON
    if utility is not None:
        _write_text(folder / "utility.csv", utility.to_csv(index=False))
        paths["utility.csv"] = folder / "utility.csv"
    else:
        from gleak.folder import remove_owned

        remove_owned(folder, "utility.csv")  # written from the store only: never a stale one (and never a user's)
    if len(df) == 0:
        return paths
    agg = aggregate(df)
    dr = defense_ranking(agg, utility)
    ar = attack_ranking(agg, df)
    figures = write_figures(folder, data)
    doc = leaderboard_document(suite, description, df, agg, dr, ar, utility, leaderboard_notes(df), data["utility_cfg"],
                               figures, data["rule"])  # fmt: skip
    doc = with_claims(doc, folder, df, agg)  # the suite's published claims and the DP bound (gleak.claims)
    _write_text(folder / "leaderboard.md", render_markdown(doc))
    _write_text(folder / "leaderboard.html", render_html(doc, folder))
    _write_text(folder / "leaderboard.csv", dr.to_csv(index=False))
    detail = agg.assign(extra=agg["extra"].map(lambda d: json.dumps(d, sort_keys=True)))
    _write_text(folder / "leaderboard_by_case.csv", detail.to_csv(index=False))
    vd = varying_keys(df, "defense")
    tex_frame = dr.assign(defense_params=[_params_text(js, "defense", d, vd.get(d)) for d, js in zip(dr["defense"], dr["defense_params"])])
    tex_cols = ["rank", "defense", "defense_params", "worst_attack", "psnr", "ssim", "verdict", "label_acc", "accuracy", "epsilon"]
    tex = tex_frame[[c for c in tex_cols if c in dr]].to_latex(index=False, float_format="%.3f", na_rep="", escape=True)
    _write_text(folder / "leaderboard.tex", tex)
    names = ("leaderboard.md", "leaderboard.html", "leaderboard.csv", "leaderboard_by_case.csv", "leaderboard.tex")
    paths.update({n: folder / n for n in names})
    paths.update({rel: folder / rel for rel, _ in figures})
    return paths
