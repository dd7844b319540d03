"""What leaks as the deployment carries more data per update: the share of trials recovered and the median PSNR
against a case setting (batch size, clients in a secure sum, FedAvg's local steps), one line per attack and the
other settings held fixed.

This is the figure the realistic-FL question is read from: "does batching, aggregation or local training stop the
attack?" A line joins trials that differ in the one setting on its x axis and in nothing else (attack, defense and
every other case key equal), so that no line mixes an untrained model with a trained one, or a plain update with a
secure sum.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from gleak.reporting.documents.cells import attack_label, defense_label
from gleak.reporting.figures import ATTACK_COLORS, LINE_STYLES, MARKERS, PSNR_CAP, _clip, _figure, _legend_columns, \
    plain_text, save_figure  # fmt: skip

# Case settings that change how much data one observed update carries, and the protocol parameters that do (FedAvg's
# local steps and mini-batch). Other case keys (the dataset, the model's training) only name a line.
MAX_LINES = 12
# What a line's trials may be protected by: nothing, or a protocol that changes only what is summed or how the client
# trains (a defense label is 'PROTOCOL+DEFENSE' where a case names its protocol: gleak.reporting.aggregate).
UNPERTURBED = {"none", "fedsgd", "fedavg", "secure-aggregation"}
AXES = ("batch_size", "clients", "local_steps", "protocol_params.local_steps", "protocol_params.local_batch_size")


def _flat_case(js: str) -> dict[str, Any]:
    """A case's JSON as one level: top-level values, and protocol_params.NAME for the protocol's parameters."""
    case = json.loads(js) if isinstance(js, str) else {}
    flat = {k: json.dumps(v, sort_keys=True) for k, v in case.items() if k != "protocol_params"}
    for k, v in (case.get("protocol_params") or {}).items():
        flat[f"protocol_params.{k}"] = json.dumps(v, sort_keys=True)
    return flat


def setting_series(df: pd.DataFrame, vd: dict, va: dict) -> list[tuple[str, pd.DataFrame]]:
    """[(axis, lines)] for each setting in AXES along which some attack's trials form a line of two or more values.
    `lines`: one row per (line, x) with label, x, recovered (share of its trials with verdict 'recovered'), psnr
    (median), n (trials). Only undefended trials that return images count (label-only attacks have no PSNR; what a
    defense does is the strength figures' subject), and a setting with more than MAX_LINES lines gets no figure (a
    key of dozens of lines is read by nobody)."""
    plain = df["defense"].astype(str).map(lambda d: set(d.split("+")) <= UNPERTURBED)
    # a defense-aware variant on an undefended update is its plain attack: one line, not two drawn on each other
    aware = df["attack_params"].map(lambda js: bool(json.loads(js).get("defense_aware")) if isinstance(js, str) else False)
    ok = df[(df["status"] == "ok") & df["psnr"].notna() & df["case"].notna() & plain & ~aware]
    if not len(ok):
        return []
    flats = [_flat_case(js) for js in ok["case"]]
    keys = sorted({k for f in flats for k in f})
    cases = pd.DataFrame(flats, index=ok.index, columns=keys).fillna("null")
    who = pd.Series([f"{attack_label(a, p, va)}|{defense_label(d, q, vd)}" for a, p, d, q in
                     zip(ok["attack"], ok["attack_params"], ok["defense"], ok["defense_params"])], index=ok.index)  # fmt: skip
    out = []
    for axis in AXES:
        if axis not in cases or cases[axis].nunique() < 2:
            continue
        xs = pd.to_numeric(cases[axis].map(json.loads), errors="coerce")
        others = [k for k in keys if k != axis]
        rest = cases[others].astype(str).agg("\x1f".join, axis=1) if others else pd.Series("", index=ok.index)
        groups = []
        for (w, r), idx in ok.groupby([who, rest], sort=False).groups.items():
            if xs[idx].notna().all() and xs[idx].nunique() >= 2:
                groups.append((w, r, idx))
        if not groups or len(groups) > MAX_LINES:
            continue
        # A line is named by its attack and the settings that differ between that attack's lines (the model's
        # state, a secure sum's clients), and by its protocol where that is not FedSGD.
        lines_of: dict[str, list] = {}
        for w, _, idx in groups:
            lines_of.setdefault(w.split("|", 1)[0], []).append(idx)
        rows, used = [], set()
        for w, _, idx in groups:
            attack = w.split("|", 1)[0]
            shown = [k for k in others if len({cases.loc[i[0], k] for i in lines_of[attack]}) > 1]
            if "model" in shown and "model_params" in shown:  # the model's name says enough
                shown.remove("model_params")
            values = {k: json.loads(cases.loc[idx[0], k]) for k in shown}
            extra = [f"{k.removeprefix('protocol_params.')}={v}" for k, v in values.items() if v is not None]
            protocol = json.loads(cases.loc[idx[0], "protocol"]) if "protocol" in cases else None
            if protocol not in (None, "fedsgd") and "protocol" not in shown:
                extra.append(str(protocol))
            label = ", ".join([attack] + extra)
            while label in used:  # two lines told apart only by unset settings: still two lines
                label += " (another)"
            used.add(label)
            g = ok.loc[idx].assign(x=xs[idx])
            for x, at in g.groupby("x", sort=True):
                rows.append({"label": label, "attack": attack, "x": float(x), "n": len(at),
                             "recovered": float((at["verdict"] == "recovered").mean()), "psnr": float(at["psnr"].median())})  # fmt: skip
        out.append((axis, pd.DataFrame(rows)))
    return out


@plain_text
def setting_figure(lines: pd.DataFrame, axis: str, path: Path, title: str) -> Path:
    """Two panels against `axis`: the share of trials recovered and the median PSNR (above PSNR_CAP drawn at it, a
    triangle), a colour per attack and a line style per other setting."""
    labels = list(dict.fromkeys(lines["label"]))
    attacks = list(dict.fromkeys(lines["attack"]))
    width = 7.2
    ncol = _legend_columns(labels, width)
    fig = _figure(width, 3.3 + 0.17 * -(-len(labels) // ncol))
    share_ax, psnr_ax = fig.subplots(1, 2, squeeze=True, sharex=True)
    styles: dict[str, int] = {}
    for label in labels:
        d = lines[lines["label"] == label].sort_values("x")
        attack = d["attack"].iloc[0]
        color = ATTACK_COLORS[attacks.index(attack) % len(ATTACK_COLORS)]
        s = styles.setdefault(attack, 0)
        styles[attack] += 1
        style, marker = LINE_STYLES[s % len(LINE_STYLES)], MARKERS[s % len(MARKERS)]
        share_ax.plot(d["x"], 100 * d["recovered"], style, marker=marker, color=color, label=label, markersize=4)
        ys, clipped = _clip([float(v) for v in d["psnr"]], "psnr")
        psnr_ax.plot(d["x"], ys, style, marker=marker, color=color, markersize=4)
        cx = [x for x, c in zip(d["x"], clipped) if c]
        if cx:
            psnr_ax.scatter(cx, [PSNR_CAP] * len(cx), marker="^", s=40, color=color, zorder=5)
    xs = sorted(set(lines["x"]))
    for ax in (share_ax, psnr_ax):
        if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel(axis.removeprefix("protocol_params."))
        ax.grid(True, alpha=0.3)
    share_ax.set_ylim(-5, 105)
    share_ax.set_ylabel("trials recovered (%)")
    psnr_ax.set_ylabel("PSNR, median (dB)")
    fig.legend(loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)
    clipped = (lines["psnr"] > PSNR_CAP).any()
    note = f"  (PSNR above {PSNR_CAP:.0f} dB, visually exact, drawn at {PSNR_CAP:.0f} as triangles)" if clipped else ""
    fig.suptitle(title + note, fontsize=10)
    return save_figure(fig, path)
