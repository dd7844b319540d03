"""The aggregation and ranking of a suite's trials: pandas frames in, frames out.

Aggregation over the trials of one (case, defense, attack) group: mean PSNR, SSIM, LPIPS, cosine and label accuracy,
median MSE, the verdict of the median MSE, and the share of trials recovered. A defense is only as strong as the
best attack against it: defenses are ranked by their worst case (the highest mean PSNR any attack reaches in any
case); attacks are ranked by their mean PSNR against the undefended baseline. The documents written from these
frames are in gleak.reporting.documents; gleak.reporting.report writes a folder's files.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd

from gleak.mechanics.metrics import PSNR_CEILING, leakiest_first, safest_first

from gleak.mechanics.verdicts import VERDICT_ORDER, trial_verdict
from gleak.mechanics.verdicts import TEXT_VERDICT_RULE
from gleak.orchestration.store import DONE, NOT_APPLICABLE
from gleak.reporting.attribution import attribute_measured_configuration

CASE_KEYS = ["dataset", "model", "batch_size"]



def varying_keys(df: pd.DataFrame, kind: str, set_params: dict[str, dict[str, list[str]]] | None = None) -> dict[str, set[str]]:
    """For each plugin name, the parameters the reports name beside it whatever their value: those whose value
    differs between the suite's configurations of it, and those its suite file sets (`set_params`, the store's meta
    of that name: kind -> name -> keys), so that 'ratio = 0.9' written in the file is shown, default or not."""
    out: dict[str, set[str]] = {}
    written = (set_params or {}).get(kind, {})
    for name, g in df.groupby(kind):
        dicts = [json.loads(s) for s in g[f"{kind}_params"].dropna().unique()]
        keys = set().union(*dicts) if dicts else set()
        # A key a configuration leaves out of its stored parameters (one its method does not read, or one added
        # later at its default) compares as its default, so that it is not named beside every variant.
        base = _plugin_defaults(kind, str(name).rpartition("+")[2])
        filled = [{**{k: v for k, v in base.items() if k in keys}, **d} for d in dicts]
        out[name] = {k for k in keys if len({json.dumps(d.get(k), sort_keys=True) for d in filled}) > 1}
        out[name] |= {k for k in written.get(str(name).rpartition("+")[2], ()) if k in keys}  # 'cgd+none': none's
    return out


def _plugin_defaults(kind: str, name: str) -> dict[str, Any]:
    """The registered plugin's parameter defaults (JSON values); {} for one not loadable now."""
    from gleak.contracts.registry import plugin_info

    try:
        return json.loads(json.dumps(plugin_info(kind, name).defaults(), default=str))
    except Exception:  # noqa: BLE001 - a plugin of a file not loaded now: its stored parameters alone
        return {}


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


def with_threat_models(df: pd.DataFrame) -> pd.DataFrame:
    """Every row's threat model (gleak.contracts.threat_model: letter and extras): the suite's where the trial's
    config names one, else the smallest that grants what the attack declares; a value already read is kept."""
    from gleak.contracts.threat_model import of_row

    if df.empty:
        return df.assign(threat_model=pd.Series(dtype=object))
    have = df["threat_model"] if "threat_model" in df else pd.Series([None] * len(df), index=df.index)
    configs = df["config"] if "config" in df else pd.Series([None] * len(df), index=df.index)
    tm = [h if isinstance(h, str) and h else of_row(a, p, c)
          for h, a, p, c in zip(have, df["attack"], df["attack_params"], configs)]  # fmt: skip
    return df.assign(threat_model=tm)


def _numeric_extras(series: pd.Series) -> dict[str, float]:
    vals: dict[str, list[float]] = {}
    for s in series.dropna():
        for k, v in json.loads(s).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                vals.setdefault(k, []).append(float(v))
    return {k: float(np.mean(v)) for k, v in vals.items()}


# Case keys a variant never names: the three of every label, and the protocol, which names the defense already
# (protocol_pairs: 'cgd+none'); download says how the data arrived, not what was computed.
_UNLABELLED = {*CASE_KEYS, "protocol", "download"}
# Case keys holding a plugin's parameters, stored with its defaults filled in: the plugin kind and the case key
# naming it, so that only the parameters that differ from that plugin's defaults name the variant.
_PLUGIN_PARAMS = {"model_params": ("model", "model"), "protocol_params": ("protocol", "protocol")}


# Case keys that change nothing unless another key says so (gleak.mechanics.pretrain, gleak.mechanics.protocol): left out of a label
# where they are idle, so an untrained model's label does not carry the training steps a trained one would take.
_IDLE_UNLESS = {
    "train_steps": lambda c: c.get("model_state") == "trained", "train_lr": lambda c: c.get("model_state") == "trained",
    "train_batch_size": lambda c: c.get("model_state") == "trained", "train_seed": lambda c: c.get("model_state") == "trained",
    "local_steps": lambda c: c.get("update") == "fedavg",
    "local_lr": lambda c: c.get("update") == "fedavg" or bool(c.get("rounds")),
    "server_lr": lambda c: bool(c.get("rounds")),
}  # fmt: skip


def _non_default_params(kind: str, name: Any, params: Any) -> dict[str, Any]:
    from gleak.contracts.errors import InputError
    from gleak.contracts.registry import plugin_info

    if not isinstance(params, dict):
        return {}
    try:
        defaults = plugin_info(kind, str(name)).defaults()
    except InputError:  # a plugin that is not loaded now: every parameter names the variant
        return dict(params)
    return {k: v for k, v in params.items() if k not in defaults or defaults[k] != v}


def case_variant(case: dict[str, Any]) -> str:
    """The case settings beyond data set, model and batch size that differ from their defaults, as 'k=v, ...'
    (for example model_state=trained), so that such trials are not averaged together; '' where none do.

    Read from the case alone, never from the other trials of the suite: the same case has the same label in every
    folder (so gleak compare pairs it), and a case that does not set resolution is never labelled resolution=None
    because another grid of its suite set one."""
    from gleak.contracts.config import CaseConfig

    defaults = CaseConfig().to_dict()
    shown = []
    for k in sorted(case):
        if k in _UNLABELLED or (k in _IDLE_UNLESS and not _IDLE_UNLESS[k](case)):
            continue
        v = case[k]
        if k in _PLUGIN_PARAMS:
            kind, named_by = _PLUGIN_PARAMS[k]
            v = _non_default_params(kind, case.get(named_by, defaults.get(named_by)), v)
            if v:
                shown.append(f"{k}={v}")
        elif k not in defaults or json.dumps(v, sort_keys=True) != json.dumps(defaults[k], sort_keys=True):
            shown.append(f"{k}={v}")
    return ", ".join(shown)


def case_variants(df: pd.DataFrame) -> pd.Series:
    """Per trial, its `case_variant` ('' where its case is at the defaults beyond data set, model and batch size)."""
    out = pd.Series("", index=df.index, dtype=object)
    if "case" not in df.columns:
        return out
    seen: dict[str, str] = {}  # a suite has few distinct cases and many trials
    for i, s in df["case"].items():
        if isinstance(s, str) and s:
            out[i] = seen[s] if s in seen else seen.setdefault(s, case_variant(json.loads(s)))
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
        # Student's t quantile by scipy.special (the same values as scipy.stats.t.ppf; scipy.stats takes 0.6 s to import)
        from scipy.special import stdtrit

        sd = float(v.std(ddof=1))
        half = float(stdtrit(len(v) - 1, 0.975)) * sd / math.sqrt(len(v))
        out.update(std=sd, lo=out["mean"] - half, hi=out["mean"] + half)
    return out


def extra_value(js: Any, key: str) -> float | None:
    if not isinstance(js, str) or not js:
        return None
    v = json.loads(js).get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def apply_verdicts(df: pd.DataFrame, rule: str = "margin") -> pd.DataFrame:
    """Each trial's verdict under the suite's rule: the stored one where the row was judged by that rule (extra
    verdict_rule), else gleak.mechanics.verdicts.trial_verdict on its stored scores (rows from before the rule was stored, or
    judged for a suite with another rule); blind_* columns from extra beside it."""
    df = df.copy()
    for k in ("blind_mse", "blind_psnr", "blind_ssim", "half_mse"):
        df[k] = [extra_value(js, k) for js in df["extra"]] if "extra" in df else None
    rules = [json.loads(js).get("verdict_rule") if isinstance(js, str) and js else None for js in df.get("extra", [None] * len(df))]
    verdicts = []
    for (_, r), row_rule in zip(df.iterrows(), rules):
        if r.get("status") != "ok" or (as_float(r.get("mse")) is None and row_rule != TEXT_VERDICT_RULE):
            verdicts.append(None)
        elif row_rule in (rule, TEXT_VERDICT_RULE) and isinstance(r.get("verdict"), str):
            verdicts.append(r["verdict"])  # judged by this rule when it was scored (a text trial: by ROUGE, its only rule)
        else:
            verdicts.append(trial_verdict(r["mse"], r.get("half_mse"), r.get("blind_mse"), r.get("matched"),
                                          r.get("batch_size"), rule))  # fmt: skip
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


SPREAD_METRICS = ("psnr", "mse", "ssim", "lpips", "cosine", "label_acc", "seconds", "rpsnr", "iip", "feat_mse")



def aggregate(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (case, defense, defense params, attack, attack params) over the trials that finished.

    psnr: the median over trials of the trial PSNR (per image capped at PSNR_CEILING); mse_median the median MSE;
    ssim, lpips, cosine, label_acc, seconds, rpsnr, iip, feat_mse: means. Beside each, METRIC_mean, METRIC_std and METRIC_lo / METRIC_hi
    (95% interval of the mean over seeds). blind_psnr / blind_mse / blind_ssim: the blind guess on the same batches
    (median, median, mean). verdict: `median_verdict` of the trials' verdicts; recovered: their share recovered."""
    keys = CASE_KEYS + ["variant", "defense", "defense_params", "attack", "attack_params"]
    df = attribute_measured_configuration(df)  # a CGD verdict belongs to the partition it was measured at
    df = df.assign(variant=case_variants(df))
    # results from before a metric existed (registered PSNR, IIP, feature MSE) lack its column: empty, never zero
    df = df.assign(**{m: None for m in SPREAD_METRICS if m not in df})
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
        for m in ("ssim", "lpips", "cosine", "label_acc", "seconds", "rpsnr", "iip", "feat_mse"):
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


def as_float(v: Any) -> float | None:
    """The value as a float; None where it is missing (None, NaN)."""
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
            img = img.sort_values(["psnr", "mse_median"], ascending=leakiest_first("psnr", "mse_median"), kind="stable")
            worst = img.iloc[0]
            row.update(worst_attack=worst["attack"], worst_attack_params=worst["attack_params"], worst_case=_case_text(worst),
                       **{k: worst.get(k) for k in _WORST_KEYS})  # fmt: skip
        lab = g[g["label_acc"].notna()]
        if len(lab):
            best = lab.loc[lab["label_acc"].idxmax()]
            row.update(label_acc=float(best["label_acc"]), label_acc_std=as_float(best.get("label_acc_std")),
                       label_attack=best["attack"])  # fmt: skip
        else:
            row.update(label_acc=None, label_acc_std=None, label_attack=None)
        row["grad_dist"] = float(g["grad_dist"].dropna().mean()) if g["grad_dist"].notna().any() else None
        if utility is not None:
            u = utility[(utility["defense"] == d) & (utility["defense_params"] == dp)]
            row["accuracy"] = as_float(u["accuracy"].iloc[0]) if len(u) else None
            row["baseline_accuracy"] = as_float(u["baseline_accuracy"].iloc[0]) if len(u) else None
            row["epsilon"] = as_float(u["epsilon"].iloc[0]) if len(u) else None
        rows.append(row)
    out = pd.DataFrame(rows)
    if "psnr" in out:
        out = out.sort_values(["psnr", "mse_median"], ascending=safest_first("psnr", "mse_median"), na_position="last",
                              kind="stable")  # fmt: skip
        out = out.reset_index(drop=True)
        out.insert(0, "rank", competition_rank(list(out["psnr"]), ascending=safest_first("psnr")[0]))
    else:
        out.insert(0, "rank", range(1, len(out) + 1))
    return out


def threat_model_text(name: str, params_js: str, named: str | None = None) -> str:
    """The threat model the attack ran under (`named`, else the smallest that grants what it declares:
    gleak.contracts.threat_model) with what it needs (gleak.contracts.wire.KNOWLEDGE keys, plus 'active server' for
    an attack that modifies the model it sends): 'B (informed eavesdropper): architecture, parameters'."""
    from gleak.contracts.registry import create
    from gleak.contracts.tags import get_tags
    from gleak.contracts.threat_model import of_attack, parse

    try:
        attack = create("attack", name, **(json.loads(params_js) if isinstance(params_js, str) and params_js else {}))
    except Exception:  # noqa: BLE001 - a plugin that is not loaded now: say nothing rather than guess
        return ""
    tags = get_tags(attack)
    parts = sorted(tags.needs)
    if tags.active:
        parts.append("active server")
    needs = ", ".join(p.replace("_", " ") for p in parts) or "nothing"
    tm = named or of_attack(name, params_js)
    return f"{parse(tm).describe()}: {needs}" if tm else needs


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
        named = sorted({v for v in t["threat_model"] if isinstance(v, str) and v}) if df is not None and "threat_model" in t else []
        row["threat_model"] = threat_model_text(a, ap, named[0] if len(named) == 1 else None)
        rows.append(row)
    out = pd.DataFrame(rows)
    out = out.sort_values(["psnr_undefended", "label_acc_undefended"], ascending=leakiest_first("psnr_undefended", "label_acc_undefended"),
                          na_position="last", kind="stable")  # fmt: skip
    out = out.reset_index(drop=True)
    primary = [p if as_float(p) is not None else (None if as_float(l) is None else -1000 + float(l))
               for p, l in zip(out["psnr_undefended"], out["label_acc_undefended"])]  # fmt: skip
    out.insert(0, "rank", competition_rank(primary, ascending=leakiest_first("psnr")[0]))
    return out


def _case_text(r: Any) -> str:
    variant = f" ({r['variant']})" if r.get("variant") else ""
    return f"{r['dataset']}/{r['model']}/B={r['batch_size']}{variant}"


def strength_series(agg: pd.DataFrame, vd: dict[str, set[str]]) -> list[tuple[str, str, list[tuple[str, dict]]]]:
    """For each defense and numeric parameter, its sweeps: sets of configurations that differ in that parameter and
    in nothing else (defense, parameter, [(line label, {params_json: x})]). A line is named by the other parameters'
    values that differ between the lines (distribution, mode, or a second numeric parameter held fixed along it), so
    that no line mixes two settings of another parameter (CGD's delta at 1 and at 4 iterations; MixUp's k = 4 beside
    k = 6 with pruning, which is no sweep of k)."""
    out = []
    for name, g in agg.groupby("defense", sort=False):
        configs = list(dict.fromkeys(g["defense_params"]))
        if len(configs) < 2:
            continue
        dicts = {js: json.loads(js) for js in configs}
        varying = sorted(k for k in vd.get(name, set()) if len({json.dumps(d.get(k)) for d in dicts.values()}) > 1)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        by_key: dict[str, list[tuple[dict, dict]]] = {}
        for key in varying:
            lines: dict[tuple, list[str]] = {}
            for js, d in dicts.items():  # the configurations that agree on every other varying parameter
                lines.setdefault(tuple(json.dumps(d.get(k)) for k in varying if k != key), []).append(js)
            for members in lines.values():
                if len(members) < 2 or not all(is_num(dicts[m].get(key)) for m in members):
                    continue
                fixed = {k: dicts[members[0]].get(k) for k in varying if k != key}
                by_key.setdefault(key, []).append((fixed, {m: float(dicts[m][key]) for m in members}))
        for key, series in by_key.items():  # name a line by the values that differ between the lines
            shown = [k for k in varying if k != key and len({json.dumps(f.get(k)) for f, _ in series}) > 1]
            out.append((name, key, [(", ".join(f"{k}={f.get(k)}" for k in shown), xs) for f, xs in series]))
    return out

