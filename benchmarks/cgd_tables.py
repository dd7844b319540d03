"""Seed 000's accuracy tables (3, 7 and 8) from the cgd suite's stored [utility] runs, printed beside the paper's
MNIST numbers (a different data set: compare the shape, not the values). Nothing is retrained here.

    python -m gleak run suites/cgd.toml               # trains and stores the runs (results/cgd/)
    python benchmarks/cgd_tables.py                   # prints the tables and writes results/cgd/paper_tables.md
    python benchmarks/cgd_tables.py --out results/cgd --no-write

The rows are the cgd and local-training runs of the folder's utility table (gleak.utility.utility_frame, the same
rows as utility.csv). Accuracy is the worst evaluated confined model (as the paper reports; the mean is in
utility.csv's extra); "centralized" is each run's own baseline_accuracy: full-batch gradient descent on the same
training samples with the same init law and schedule (the protocol with one participant).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gleak.store import Store  # noqa: E402
from gleak.utility import utility_config, utility_frame  # noqa: E402

# Seed 000 (MNIST, FC ReLU 256 + softmax): Table 3 (vertical, delta 0.1), Table 8 (horizontal, delta 0.1), Table 7.
PAPER = {
    "centralized": {"0.1": 97.54, "0.01": 97.61, "random": None},
    ("10x7", "cgd"): {"0.1": 96.5, "0.01": 97.21, "random": 96.59},
    ("100x49", "cgd"): {"0.1": 94.21, "0.01": 97.15, "random": 96.13},
    ("10x7", "local"): {"0.1": 54.39},
    ("100x49", "local"): {"0.1": 23.53},
    ("10x1", "cgd"): {"0.1": 95.62},
    ("100x1", "cgd"): {"0.1": 94.22},
    ("1000x1", "cgd"): {"0.1": 93.76},
    ("10x1", "local"): {"0.1": 92.01},
    ("100x1", "local"): {"0.1": 82.89},
    ("1000x1", "local"): {"0.1": 50.11},
}


def delta_key(p: dict) -> str:
    return "random" if p.get("delta_high") is not None else str(p.get("delta", 0.1))


def stored_runs(folder: Path) -> tuple[object, list[dict]]:
    """The folder's utility config and its cgd / local-training runs that finished ok."""
    store = Store.open_existing(folder)
    try:
        cfg, frame = utility_config(store), utility_frame(store)
    finally:
        store.close()
    if frame is None:
        raise SystemExit(f"{folder}: no [utility] runs stored; run `python -m gleak run suites/cgd.toml` first")
    out = []
    for _, r in frame.iterrows():
        if r["defense"] not in ("cgd", "local-training") or r["status"] != "ok":
            continue
        params, extra = json.loads(r["defense_params"]), json.loads(r["extra"] or "{}")
        if not params.get("confined", True):  # FedSGD + secure sum (the attack comparison): not a table row
            continue
        mode = "local" if r["defense"] == "local-training" else "cgd"
        out.append({"mode": mode, "params": params, "accuracy": float(r["accuracy"]), **{k: v for k, v in extra.items() if k != "accuracy"}})
    return cfg, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "cgd"), help="the suite's output folder")
    ap.add_argument("--no-write", action="store_true", help="print only (default: also write OUT/paper_tables.md)")
    args = ap.parse_args()
    folder = Path(args.out)
    cfg, results = stored_runs(folder)
    lines = [f"[utility] {cfg.dataset}, model {cfg.model}, T = {cfg.rounds} full-batch iterations, alpha = {cfg.lr}; "
             f"{len(results)} stored cgd / local-training runs (gleak run suites/cgd.toml).", ""]  # fmt: skip
    lines += tables(results)
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        (folder / "paper_tables.md").write_text(f"# Seed 000's Tables 3, 7, 8 on Fashion-MNIST\n\n"
                                                f"Written by `python benchmarks/cgd_tables.py` from this folder's stored runs.\n\n{text}\n")  # fmt: skip
    return 0


def _cell(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}%"


def _part(r: dict) -> str:
    return r["params"].get("partition", "10x1")


def tables(results: list[dict]) -> list[str]:
    """Markdown tables: each CGD row beside its own centralized run (same samples, delta and schedule)."""

    def find(part: str, mode: str, dk: str) -> dict | None:
        return next((r for r in results if r["mode"] == mode and _part(r) == part and delta_key(r["params"]) == dk), None)

    def pct(r: dict | None, key: str = "accuracy") -> float | None:
        return None if r is None or r.get(key) is None else 100 * float(r[key])

    note = "Fashion-MNIST (here) vs MNIST (paper): different data sets, compare the shape, not the values."
    out = []
    for title, parts in (("Table 3 (vertical, Algorithm 2, delta 0.1)", ["10x7", "100x49"]),
                         ("Table 8 (horizontal, Algorithm 1, delta 0.1)", ["10x1", "100x1", "1000x1"])):  # fmt: skip
        out += [f"{title}. {note}", "",
                "| m | samples | CGD (worst) | CGD (mean) | local (worst) | centralized | CGD - centralized | paper CGD | paper local | paper centralized |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for p in parts:
            c, loc = find(p, "cgd", "0.1"), find(p, "local", "0.1")
            cv, base = pct(c), pct(c, "baseline_accuracy")
            gap = f"{cv - base:+.2f}" if cv is not None and base is not None else ""
            pc, pl = PAPER.get((p, "cgd"), {}).get("0.1"), PAPER.get((p, "local"), {}).get("0.1")
            n = (c or loc or {}).get("train_samples", "")
            out.append(f"| ({p}) | {n} | {_cell(cv)} | {_cell(pct(c, 'mean_accuracy'))} | {_cell(pct(loc))} | "
                       f"{_cell(base)} | {gap} | {_cell(pc)} | {_cell(pl)} | {_cell(PAPER['centralized']['0.1'])} |")  # fmt: skip
        out.append("")
    parts = sorted({_part(r) for r in results if r["mode"] == "cgd"}, key=lambda s: (int(s.split("x")[1]), int(s.split("x")[0])))
    dks = ["0.1", "0.01", "random"]
    out += [f"Table 7 (worst confined model's accuracy by delta, gap to its centralized run in points; random: each "
            f"participant's delta ~ U[0.001, 0.1]). {note}", "",
            "| m | " + " | ".join(f"delta {d}" for d in dks) + " | " + " | ".join(f"paper {d}" for d in dks) + " |",
            "| --- " * (1 + 2 * len(dks)) + "|"]  # fmt: skip
    out.append("| paper centralized | " + " | " * (len(dks) - 1) + " | " + " | ".join(_cell(PAPER["centralized"].get(d)) for d in dks) + " |")
    for p in parts:
        cells = []
        for d in dks:
            r = find(p, "cgd", d)
            v, b = pct(r), pct(r, "baseline_accuracy")
            cells.append("" if v is None else f"{v:.2f}% ({v - b:+.2f})" if b is not None else f"{v:.2f}%")
        paper = PAPER.get((p, "cgd"), {})
        out.append(f"| ({p}) | " + " | ".join(cells) + " | " + " | ".join(_cell(paper.get(d)) for d in dks) + " |")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
