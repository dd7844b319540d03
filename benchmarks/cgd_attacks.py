"""For which number of participants m each attack still recovers the victim's sample through CGD and through FedSGD
with the same secure sum, with no colluders (t = 0) and with t = m - 2: the cgd-attacks suite's stored trials as one
table per model (rows: attack, protocol, colluders; columns: m; cells: the share of seeds recovered and the median
PSNR). Nothing is rerun here.

    python -m gleak run suites/cgd-attacks.toml      # trains nothing, attacks: results/cgd-attacks/
    python benchmarks/cgd_attacks.py --out results/cgd-attacks
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent


_DATA: dict = {}


def honest_labels(case: dict, seed: int, honest: int) -> list[int]:
    """The labels of the first `honest` clients' samples of the trial with this case and seed: the trial's own draw
    (gleak.orchestration.trial.draw_batches), recomputed from the stored case (the data sets are loaded once)."""
    from gleak.contracts.config import CaseConfig, TrialConfig
    from gleak.orchestration.trial import DTYPES, draw_batches, load_case_data

    cfg = TrialConfig("cgd-attacks", "closed-form", {}, "cgd", {}, CaseConfig.from_dict(case), seed)
    key = (cfg.case.dataset, cfg.case.resolution, cfg.case.channels)
    if key not in _DATA:
        _DATA[key] = load_case_data(cfg)
    batches = draw_batches(_DATA[key], cfg, DTYPES[cfg.case.dtype])
    return [int(v) for b in batches[:honest] for v in b.y]


def frame(folder: Path) -> pd.DataFrame:
    """One row per finished trial: model, m, protocol, t kind, attack, verdict, PSNR, and whether two of the honest
    participants' samples share a label (`collision`; their sum then mixes two samples of one class)."""
    csv = folder / "results.csv"
    if not csv.is_file():
        print(f"{folder}: no results.csv; run `python -m gleak run suites/cgd-attacks.toml` first", file=sys.stderr)
        raise SystemExit(2)
    df = pd.read_csv(csv, keep_default_na=False, na_values=[""])
    df = df[(df["defense"] == "cgd") & (df["status"] == "ok")]
    rows = []
    for _, r in df.iterrows():
        p, case = json.loads(r["defense_params"]), json.loads(r["case"])
        m = int(case.get("clients", 1))
        cols = int(str(p.get("partition", "1x1")).split("x")[1]) if p.get("split_features") else 1
        if cols > 1:  # sample blocks of cols participants: colluders are whole blocks, default all but the victim's
            t = m * cols - cols if p.get("colluders") is None else int(p["colluders"])
            kind = "t = 0" if t == 0 else "t = m - cols" if t == m * cols - cols else f"t = {t}"
        else:
            t = m - 2 if p.get("colluders") is None else int(p["colluders"])
            kind = "t = 0" if t == 0 else "t = m - 2" if t == m - 2 else f"t = {t}"
        labels = honest_labels(case, int(r["seed"]), m - t) if cols == 1 else []
        rows.append({"model": r["model"], "m": m, "protocol": "cgd" if p.get("confined", True) else "fedsgd+secure-sum",
                     "colluders": kind, "attack": r["attack"], "recovered": r["verdict"] == "recovered",
                     "psnr": float(r["psnr"]), "vertical": f"{m}x{cols}" if cols > 1 else "",
                     "iterations": int(p.get("iterations", 1)), "batch": int(case.get("batch_size", 1)),
                     "collision": len(set(labels)) < len(labels), "seed": int(r["seed"]), "honest": m * cols - t})  # fmt: skip
    return pd.DataFrame(rows)


def vertical_table(df: pd.DataFrame) -> list[str]:
    """The split_features trials: rows attack, partition, colluders, observed iterations; columns batch size."""
    if df.empty:
        return []
    bs = sorted(df["batch"].unique())
    out = ["Vertical partitions (vfl reading, split_features): share of seeds recovered (median PSNR in dB) by the "
           "victim block's batch size; the aggregator also sees the block's summed pre-activations.", "",
           "| attack | partition | colluders | iterations | " + " | ".join(f"batch {b}" for b in bs) + " |",
           "| --- " * (4 + len(bs)) + "|"]  # fmt: skip
    for (a, part, t, k), h in df.groupby(["attack", "vertical", "colluders", "iterations"], sort=True):
        cells = []
        for b in bs:
            c = h[h["batch"] == b]
            cells.append("" if c.empty else f"{int(c['recovered'].sum())}/{len(c)} ({c['psnr'].median():.1f})")
        out.append(f"| {a} | ({part}) | {t} | {k} | " + " | ".join(cells) + " |")
    return [*out, ""]


def tables(df: pd.DataFrame) -> list[str]:
    out = []
    vertical = df[df["vertical"] != ""] if len(df) else df
    df = df[df["vertical"] == ""] if len(df) else df
    ms = sorted(df["m"].unique())
    for model, g in df.groupby("model", sort=False):
        out += [f"{model}: share of seeds recovered (median PSNR in dB) by the number of participants m; the victim "
                f"holds one sample, the observer the sum over the m - t honest participants; [k same label]: k of the "
                f"cell's trials have two honest samples of one class.", "",
                "| attack | protocol | colluders | " + " | ".join(f"m = {m}" for m in ms) + " |",
                "| --- " * (3 + len(ms)) + "|"]  # fmt: skip
        for (a, proto, t), h in g.groupby(["attack", "protocol", "colluders"], sort=True):
            cells = []
            for m in ms:
                c = h[h["m"] == m]
                same = f" [{int(c['collision'].sum())} same label]" if not c.empty and c["collision"].any() else ""
                cells.append("" if c.empty else f"{int(c['recovered'].sum())}/{len(c)} ({c['psnr'].median():.1f}){same}")
            out.append(f"| {a} | {proto} | {t} | " + " | ".join(cells) + " |")
        out += ["", collision_line(g), ""]
    return out + vertical_table(vertical)


def collision_line(g: pd.DataFrame) -> str:
    """How many trials whose sum is over two honest samples (t = m - 2, and m = 2) had the two labels coincide,
    and how those fared: two samples of one class are what the closed form cannot separate."""
    two = g[g["honest"] == 2]
    if two.empty:
        return ""
    same = two[two["collision"]]
    victims = two.drop_duplicates(["m", "seed"])
    return (f"Two honest samples (t = m - 2, or m = 2): {int(victims['collision'].sum())} of {len(victims)} victim "
            f"pairs (m, seed) share one label ({len(same)} of {len(two)} trials; recovered in {int(same['recovered'].sum())} "
            f"of those {len(same)}, in {int(two[~two['collision']]['recovered'].sum())} of the other {len(two) - len(same)}).")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "cgd-attacks"), help="the suite's output folder")
    args = ap.parse_args()
    print("\n".join(tables(frame(Path(args.out)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
