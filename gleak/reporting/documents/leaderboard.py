"""The leaderboard as blocks, one list that the Markdown and HTML renderers (gleak.reporting.documents.markdown, .html) both
draw: ("h1"|"h2"|"h3"|"p", text), ("table", header, rows), ("list", items), ("figure", relative path, caption)."""
from __future__ import annotations

import json
from typing import Any

import pandas as pd

from gleak.mechanics.metrics import PSNR_CEILING

from gleak.mechanics.verdicts import verdict_rule_text

from gleak.mechanics.perceptual import LPIPS_HOWTO
from gleak.orchestration.store import DONE, NOT_APPLICABLE
from gleak.reporting.aggregate import CASE_KEYS, as_float, extra_value, varying_keys
from gleak.reporting.attribution import undefended_baseline
from gleak.reporting.documents.cells import (
    accuracy_change,
    attack_label,
    data,
    extras_text,
    fmt,
    label_text,
    mean_std,
    params_text,
    text_of,
    trials_text,
    worst_attack_text,
)  # fmt: skip
from gleak.reporting.documents.text import only_text, text_blocks, text_rows


def attack_defense_matrix(agg: pd.DataFrame, dr: pd.DataFrame, vd: dict, va: dict) -> tuple[list[str], list[list[str]]]:
    """Each attack's best result against each defense configuration (over cases): the PSNR and verdict of its best
    image reconstruction, or its best label accuracy for label-only attacks. Rows in the defense ranking's order."""
    attacks = list(dict.fromkeys(zip(agg["attack"], agg["attack_params"])))
    header = ["defense", "params"] + [data(attack_label(a, ap, va)) for a, ap in attacks]
    rows = []
    for _, d in dr.iterrows():
        g = agg[(agg["defense"] == d["defense"]) & (agg["defense_params"] == d["defense_params"])]
        row = [data(d["defense"]), data(params_text(d["defense_params"], "defense", d["defense"], vd.get(d["defense"])))]
        for a, ap in attacks:
            c = g[(g["attack"] == a) & (g["attack_params"] == ap)]
            img = c[c["psnr"].notna()]
            if len(img):
                best = img.loc[img["psnr"].idxmax()]
                row.append(f"{fmt(best['psnr'], '2')} ({best['verdict']})")
            elif c["label_acc"].notna().any():
                row.append(f"labels {fmt(float(c['label_acc'].max()), '3')}")
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
        f"Accuracy: top-1 on the test split after federated training of `{data(cfg.model)}` on `{data(cfg.dataset)}`: {algo}, "
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
    figures: list[tuple[str, str]] | None = None, rule: str = "margin", set_params: dict | None = None,
) -> list[tuple]:  # fmt: skip
    """The leaderboard as blocks, rendered to Markdown and HTML alike: ("h1"|"h2"|"h3"|"p", text),
    ("table", header, rows), ("list", items), ("figure", relative path, caption). set_params: the parameters the
    suite file sets (gleak.reporting.aggregate.varying_keys), named with their values."""
    vd, va = varying_keys(df, "defense", set_params), varying_keys(df, "attack", set_params)
    show_util = utility is not None and "accuracy" in dr.columns
    # Text cases are scored by ROUGE, in tables of their own (gleak.reporting.documents.text); a suite of text cases only has
    # no image scores to tabulate, and its text ranking comes first.
    images = not only_text(df)
    text = text_blocks(df, vd, va, utility if show_util else None)
    doc = _intro_blocks(suite, description, df, rule, images)
    if images:
        doc += _defense_blocks(dr, vd, va, show_util)
    else:
        doc += text
    if show_util:
        doc += _utility_blocks(dr, utility, utility_cfg, vd, images)
    if images:
        doc += _attack_blocks(agg, dr, ar, vd, va)
    if figures:
        doc.append(("h2", "Figures"))
        for rel, caption in figures:
            doc.append(("figure", rel, caption))
    if images:
        doc += text + _case_blocks(agg, vd, va)
    doc += _trouble_blocks(df)
    if images:
        doc += _method_blocks(rule)
    footnotes = list(notes or [])
    coverage = metric_coverage(df)
    if coverage:
        footnotes.append(coverage)
    if footnotes:
        doc += [("h2", "Notes"), ("list", footnotes)]
    return doc


def metric_coverage(df: pd.DataFrame) -> str:
    """How many finished trials got each metric, and why the others did not: an empty LPIPS column or a missing
    PSNR reads as a result otherwise. '' when every finished trial got every metric."""
    ok = df[df["status"] == "ok"] if "status" in df.columns else df
    ok = ok.drop(index=text_rows(ok).index)  # text trials have metrics of their own (gleak.reporting.documents.text)
    n = len(ok)
    if not n:
        return ""
    images = int(ok["mse"].notna().sum())
    lp = int(ok["lpips"].notna().sum()) if "lpips" in ok.columns else 0
    labels = int(ok["label_acc"].notna().sum()) if "label_acc" in ok.columns else 0
    if images == lp == labels == n:
        return ""
    parts = [f"PSNR, MSE and SSIM for {images} of {n}"
             + (f" (the other {n - images}: no image reconstructed, label-only attacks)" if images < n else "")]
    lp_text = f"LPIPS for {lp} of {n}"
    if lp < images:
        lp_text += (f" ({images - lp} with an image but no LPIPS: LPIPS is unavailable on the machine that scored them, "
                    f"no backbone weights; {LPIPS_HOWTO}, then `gleak rescore DIR --metrics lpips`)")  # fmt: skip
    parts.append(lp_text)
    parts.append(f"label accuracy for {labels} of {n}" + (" (the others: the attack recovered no labels)" if labels < n else ""))
    return "Metrics over the finished trials: " + "; ".join(parts) + "."


def _intro_blocks(suite: str, description: str, df: pd.DataFrame, rule: str, images: bool = True) -> list[tuple]:
    """The title, the suite's description and how to read every number below (the image scores' rules only where
    there are image trials: text trials say theirs in their own section)."""
    ok, failed = int((df.status == "ok").sum()), int((~df.status.isin(DONE)).sum())
    n_a = int((df.status == NOT_APPLICABLE).sum())
    doc: list[tuple] = [("h1", f"Leaderboard: {data(suite)}")]
    if description:
        doc.append(("p", data(description.strip())))
    counts = (f"{len(df)} trials: {ok} ok, {failed} failed" + (f", {n_a} not applicable" if n_a else "")
              + ". Written by `gleak run`; regenerate with `gleak leaderboard DIR`. ")
    if not images:
        doc.append(("p", counts))
        return doc
    doc.append(("p", counts + "How every number below is made: the section \"How the numbers are made\" at the end."))
    return doc


def _method_blocks(rule: str) -> list[tuple]:
    """How the image scores are made, as short notes (after the tables: the first screen is the ranking)."""
    return [("h2", "How the numbers are made"), ("list", [
        "Whole batch: every image of the victim's batch is scored; reconstructions are paired with the images by "
        "optimal assignment, and an image left without one is scored against the blind guess.",
        "Blind guess: the data set's mean image (the per-pixel mean of the split the victims come from), scored on the "
        "same batches and shown beside each case.",
        "Truth: the batch as it entered the victim's gradient (under a defense that transforms the client's inputs, "
        "such as ATS, the transformed batch; the row's extra also scores against the untransformed images).",
        f"PSNR per image is capped at {PSNR_CEILING:g} dB (exact recoveries); PSNR and MSE are medians over trials "
        "(seeds); beside them, and for SSIM, LPIPS, label accuracy and time: mean ± std [95% interval of the mean, "
        "Student t over seeds].",
        verdict_rule_text(rule) + " A group's verdict is the one at least half of its trials reach or exceed; "
        "'recovered' is the share of its trials recovered.",
        "Ranks: equal values (to 0.01) share a rank.",
    ])]  # fmt: skip


def _defense_blocks(dr: pd.DataFrame, vd: dict, va: dict, show_util: bool) -> list[tuple]:
    """The defense ranking, and in words the defenses an attack gets through."""
    h = ["rank", "defense", "params", "worst attack", "worst case", "PSNR (median)", "PSNR mean ± std [95%]",
         "blind PSNR", "MSE (median)", "SSIM mean ± std", "LPIPS", "verdict", "recovered", "label acc (attack)",
         "grad dist"]  # fmt: skip
    if show_util:
        h += ["accuracy", "epsilon"]
    rows = []
    for _, r in dr.iterrows():
        row = [str(r["rank"]), data(r["defense"]), data(params_text(r["defense_params"], "defense", r["defense"], vd.get(r["defense"]))),
               data(worst_attack_text(r, va)), data(text_of(r.get("worst_case"))), fmt(r.get("psnr"), "2"), mean_std(r, "psnr", "2", ci=True),
               fmt(r.get("blind_psnr"), "2"), fmt(r.get("mse_median"), "e"), mean_std(r, "ssim", "3", mean_key="ssim"),
               fmt(r.get("lpips"), "3"), text_of(r.get("verdict")), fmt(r.get("recovered"), "pct"), label_text(r),
               fmt(r.get("grad_dist"), "3")]  # fmt: skip
        if show_util:
            row += [fmt(r.get("accuracy"), "pct"), fmt(r.get("epsilon"), "2")]
        rows.append(row)
    doc: list[tuple] = [("h2", "Defenses, ranked by their worst case over attacks")]
    doc.append(("p", "Beside the worst attack, in brackets, the threat model it needs (Carletti et al., USENIX "
                     "Security 2025; see the attack table): two defenses whose worst cases need different threat "
                     "models are ranked against different adversaries."))  # fmt: skip
    if show_util:
        doc.append(("p", "A defense is only as strong as the best attack against it. Accuracy and epsilon: see "
                         "'Utility' below."))  # fmt: skip
    doc.append(("table", h, rows))
    if len(dr) and "lpips" in dr and dr["lpips"].isna().all():  # said here, not only in the notes at the end
        doc.append(("p", "The LPIPS column is empty: no AlexNet weights where these results were scored (the notes "
                         "at the end say how to fill it)."))  # fmt: skip
    broken = []  # said in words, not only in a column: a defense an attack gets through does not protect that case
    for name, g in dr[dr["defense"] != "none"].groupby("defense", sort=False):
        hit = g[g["verdict"] == "recovered"] if "verdict" in g else g.iloc[:0]
        if len(hit):
            by = ", ".join(sorted({data(worst_attack_text(r, va)) for _, r in hit.iterrows()}))
            broken.append(f"{data(name)} in {len(hit)} of its {len(g)} configurations (by {by})")
    if broken:
        doc.append(("p", "Broken: an attack recovers the victim's data (verdict recovered, by the rule under \"How the numbers are made\") through "
                         + "; ".join(broken) + "."))  # fmt: skip
    return doc


def _utility_blocks(dr: pd.DataFrame, utility: pd.DataFrame, utility_cfg: Any, vd: dict, images: bool = True) -> list[tuple]:
    """Accuracy under each defense, next to its worst-case leakage (image trials' PSNR; a suite of text trials
    shows its worst cases beside the accuracy in its text ranking instead)."""
    doc: list[tuple] = [("h2", "Utility: accuracy under each defense" + (", next to its worst-case leakage" if images else ""))]
    if utility_cfg is not None:
        doc.append(("p", _utility_intro(utility_cfg, utility)))
    by_cfg = {(r["defense"], r["defense_params"]): r for _, r in dr.iterrows()}
    rows = []
    for _, u in utility.iterrows():
        r = by_cfg.get((u["defense"], u["defense_params"]), {})
        acc = as_float(u["accuracy"])
        rows.append([data(u["defense"]), data(params_text(u["defense_params"], "defense", u["defense"], vd.get(u["defense"]))),
                     fmt(acc, "pct"), accuracy_change(u), fmt(as_float(u["epsilon"]), "2"), fmt(r.get("psnr"), "2"),
                     data(text_of(r.get("worst_attack"))), text_of(r.get("verdict")),
                     data(text_of(u["error"])) if u["status"] != "ok" else ""])  # fmt: skip
    head = ["defense", "params", "accuracy", "change (points)", "epsilon", "worst-case PSNR", "worst attack", "verdict",
            "error"]  # fmt: skip
    if not images:  # no PSNR to show: the text ranking carries the worst cases
        head, rows = head[:5] + head[-1:], [r[:5] + r[-1:] for r in rows]
    doc.append(("table", head, rows))
    return doc


def _attack_blocks(agg: pd.DataFrame, dr: pd.DataFrame, ar: pd.DataFrame, vd: dict, va: dict) -> list[tuple]:
    """The attack ranking and each attack's best result against each defense."""
    rows = [[str(r["rank"]), data(r["attack"]), data(params_text(r["attack_params"], "attack", r["attack"], va.get(r["attack"]))),
             fmt(r["psnr_undefended"], "2"), mean_std(r, "psnr_undefended", "2", ci=True), fmt(r["best_psnr"], "2"),
             text_of(r["defenses_recovered"]), fmt(r["label_acc_undefended"], "3"), mean_std(r, "seconds", "2", mean_key="seconds"),
             data(text_of(r.get("threat_model")))]
            for _, r in ar.iterrows()]  # fmt: skip
    h = ["rank", "attack", "params", "PSNR undefended (median)", "mean ± std [95%]", "best PSNR", "configs recovered",
         "label acc undefended", "seconds per trial", "threat model (needs)"]  # fmt: skip
    doc: list[tuple] = [("h2", "Attacks, ranked by their results against the undefended baseline"), ("table", h, rows)]
    mh, mrows = attack_defense_matrix(agg, dr, vd, va)
    doc += [("h2", "Each attack's best result against each defense"),
            ("p", "Median PSNR (dB) of the attack's best case, with its verdict; label-only attacks: "
                  "their best label accuracy. Defenses in ranking order."),
            ("table", mh, mrows)]  # fmt: skip
    return doc


def _case_blocks(agg: pd.DataFrame, vd: dict, va: dict) -> list[tuple]:
    """Every aggregated group, one table per case, with the blind guess's scores on the same batches first."""
    doc: list[tuple] = [("h2", "Results by case")]
    for case_key, g in agg.groupby(CASE_KEYS + ["variant"], sort=False):
        variant = f" {case_key[3]}" if case_key[3] else ""
        doc.append(("h3", f"dataset={data(case_key[0])} model={data(case_key[1])} batch size={case_key[2]}{data(variant)}"))
        h = ["defense", "params", "attack", "attack params", "trials", "PSNR (median)", "PSNR mean ± std [95%]",
             "MSE (median)", "SSIM mean ± std", "LPIPS", "cosine", "label acc mean ± std", "labels exact", "recovered",
             "verdict", "seconds", "grad dist", "diagnostics"]  # fmt: skip
        rows = []
        if g["blind_psnr"].notna().any():  # what an attacker who ignores the update scores on the same batches
            rows.append(["(blind guess)", "mean image", "-", "-", "", fmt(float(g["blind_psnr"].dropna().median()), "2"),
                         "", fmt(float(g["blind_mse"].dropna().median()), "e"),
                         fmt(float(g["blind_ssim"].dropna().mean()), "3"), "", "", "", "", "", "", "", "", ""])  # fmt: skip
        rows += [[data(r["defense"]), data(params_text(r["defense_params"], "defense", r["defense"], vd.get(r["defense"]))),
                  data(r["attack"]), data(params_text(r["attack_params"], "attack", r["attack"], va.get(r["attack"]))),
                  trials_text(r), fmt(r["psnr"], "2"), mean_std(r, "psnr", "2", ci=True),
                  fmt(r["mse_median"], "e"), mean_std(r, "ssim", "3", mean_key="ssim"), fmt(r["lpips"], "3"),
                  fmt(r["cosine"], "3"), mean_std(r, "label_acc", "3", mean_key="label_acc"), text_of(r["labels_exact"]),
                  fmt(r["recovered"], "pct"), text_of(r["verdict"]), mean_std(r, "seconds", "2", mean_key="seconds"),
                  fmt(r["grad_dist"], "3"), data(extras_text(r["extra"]))] for _, r in g.iterrows()]  # fmt: skip
        doc.append(("table", h, rows))
    return doc


def _trouble_blocks(df: pd.DataFrame) -> list[tuple]:
    """The trials that did not apply (UnsupportedCase) and those that failed, with why, counted."""
    doc: list[tuple] = []
    if int((df.status == NOT_APPLICABLE).sum()):
        why = df[df.status == NOT_APPLICABLE].groupby(["attack", "defense", "error"], dropna=False).size().reset_index(name="n")
        doc += [("h2", "Not applicable"), ("table", ["attack", "defense", "reason", "trials"],
                 [[data(r["attack"]), data(r["defense"]), data(r["error"]), str(r["n"])] for _, r in why.iterrows()])]  # fmt: skip
    if int((~df.status.isin(DONE)).sum()):
        errs = df[~df.status.isin(DONE)].groupby(["attack", "defense", "error"], dropna=False).size().reset_index(name="n")
        doc += [("h2", "Failed trials"), ("table", ["attack", "defense", "error", "trials"],
                 [[data(r["attack"]), data(r["defense"]), data(r["error"]), str(r["n"])] for _, r in errs.iterrows()])]  # fmt: skip
    return doc


def leaderboard_notes(df: pd.DataFrame) -> list[str]:
    """Notes a reader must see: attacks run below the budget their settings were tuned for (extra.under_budget)."""
    notes = []
    if "case" in df and any('"model_state": "trained"' in c for c in df["case"].dropna()) and only_text(df):
        notes.append("model_state=trained: the model trained on the data set's training split; the victims' texts come "
                     "from the held-out split, texts it never trained on; the blind guess (the training split's most "
                     "frequent tokens) and the attacks' public text (LAMP's language-model prior) come from the "
                     "training split.")  # fmt: skip
    elif "case" in df and any('"model_state": "trained"' in c for c in df["case"].dropna()):
        notes.append("model_state=trained: the model trained on the data set's training split; the victims' batches "
                     "(and the blind guess, their split's mean image) come from the test split, images it never "
                     "trained on (Geiping et al. attack validation images); attacks given public data get the "
                     "training split.")  # fmt: skip
    if "extra" not in df:
        return notes
    under = df[[bool(extra_value(js, "under_budget")) for js in df["extra"]]]
    for (a, ap), g in under.groupby(["attack", "attack_params"], sort=False):
        tuned = {extra_value(js, "tuned_iterations") for js in g["extra"]} - {None}
        p = json.loads(ap) if isinstance(ap, str) else {}
        notes.append(f"{data(a)} ran {data(p.get('iterations'))} iterations in {len(g)} trials, far below the "
                     f"{', '.join(f'{t:g}' for t in sorted(tuned))} its preset's TV weight was tuned for: its results "
                     "understate the attack.")  # fmt: skip
    return notes

