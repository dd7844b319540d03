"""Seed 000's accuracy tables (3, 7 and 8) from the cgd suite's stored [utility] runs, printed beside the paper's
MNIST numbers (a different data set: compare the shape, not the values). Nothing is retrained here.

    python -m gleak run suites/cgd.toml               # trains and stores the runs (results/cgd/)
    python benchmarks/cgd_tables.py                   # prints the tables and writes results/cgd/paper_tables.md
    python benchmarks/cgd_tables.py --out results/cgd --no-write

The rows are the cgd and local-training runs of the folder's utility table: from its results.sqlite when there is
one (gleak.orchestration.utility.utility_frame), else from its published utility.csv (the same rows), so a fresh clone can print
the published tables. Accuracy is the worst evaluated confined model (as the paper reports) and, beside it, the mean
over the evaluated models; a row repeated over seeds (utility_seed) shows the mean over seeds and the range.
"centralized" is each run's own baseline_accuracy: full-batch gradient descent on the same training samples with
the same init law and schedule (the protocol with one participant). Vertical rows name their reading of Algorithm 2
(vfl: pre-activations summed across a sample block's feature groups; literal: each participant on its own block).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gleak.orchestration.store import Store  # noqa: E402
from gleak.orchestration.utility import utility_config, utility_frame  # noqa: E402

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


def _frame(folder: Path):
    """(header facts, utility frame): the store's when the folder has one, else its utility.csv."""
    import pandas as pd

    if (folder / "results.sqlite").is_file():
        store = Store.open_existing(folder)
        try:
            cfg, frame = utility_config(store), utility_frame(store)
        finally:
            store.close()
        if cfg is not None:
            return f"{cfg.dataset}, model {cfg.model}, T = {cfg.training_rounds} full-batch iterations, alpha = {cfg.server_step}", frame
    csv = folder / "utility.csv"
    if not csv.is_file():
        return None, None
    frame = pd.read_csv(csv, keep_default_na=False, na_values=[""])
    if not len(frame):
        return None, None
    r = frame.iloc[0]
    return f"{r['dataset']}, model {r['model']}, T = {r['rounds']} full-batch iterations (from {csv.name})", frame


def stored_runs(folder: Path) -> tuple[str, list[dict]]:
    """The folder's utility header and its cgd / local-training runs that finished ok."""
    head, frame = _frame(folder)
    if frame is None:
        print(f"{folder}: no [utility] runs stored (neither results.sqlite nor utility.csv); "
              "run `python -m gleak run suites/cgd.toml` first", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    out = []
    for _, r in frame.iterrows():
        if r["defense"] not in ("cgd", "local-training") or r["status"] != "ok":
            continue
        params, extra = json.loads(r["defense_params"]), json.loads(r["extra"] if isinstance(r["extra"], str) else "{}")
        if not params.get("confined", True):  # FedSGD + secure sum (the attack comparison): not a table row
            continue
        mode = "local" if r["defense"] == "local-training" else "cgd"
        out.append({"mode": mode, "params": params, "accuracy": float(r["accuracy"]),
                    **{k: v for k, v in extra.items() if k != "accuracy"}})  # fmt: skip
    return head, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "cgd"), help="the suite's output folder")
    ap.add_argument("--no-write", action="store_true", help="print only (default: also write OUT/paper_tables.md)")
    args = ap.parse_args()
    folder = Path(args.out)
    head, results = stored_runs(folder)
    lines = [f"[utility] {head}; {len(results)} stored cgd / local-training runs (gleak run suites/cgd.toml).", ""]
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


def _reading(r: dict) -> str:
    """vfl / literal for a vertical cgd row (runs stored before the parameter existed were literal), '' otherwise."""
    if r["mode"] != "cgd" or int(_part(r).split("x")[1]) == 1:
        return ""
    return r["params"].get("vertical", "literal")


def _samples(r: dict) -> int | None:
    """The number of training samples the run trained on (utility runs record it)."""
    n = r.get("train_samples")
    return None if n is None or n != n else int(n)


def _agg(rows: list[dict], key: str = "accuracy") -> tuple[float, float, float] | None:
    """(mean, min, max) in percent over the rows (seeds) that have `key`."""
    vals = [100 * float(r[key]) for r in rows if r.get(key) is not None]
    return (sum(vals) / len(vals), min(vals), max(vals)) if vals else None


def _show(a: tuple[float, float, float] | None, n: int) -> str:
    if a is None:
        return ""
    return f"{a[0]:.2f}%" if n <= 1 or a[1] == a[2] else f"{a[0]:.2f}% [{a[1]:.2f}, {a[2]:.2f}]"


def tables(results: list[dict]) -> list[str]:
    """Markdown tables: each CGD configuration beside its own centralized runs (same samples, delta, schedule),
    local training and the horizontal partition with the same number of sample blocks."""

    def find(part: str, mode: str, dk: str, reading: str | None = None, samples: int | None = None) -> list[dict]:
        rows = [r for r in results if r["mode"] == mode and _part(r) == part and delta_key(r["params"]) == dk
                and (reading is None or _reading(r) == reading) and (samples is None or _samples(r) == samples)]  # fmt: skip
        # One run per (training set, seed): cgd rows that differ only in attack-trial parameters train identically.
        return list({(_samples(r), r["params"].get("utility_seed")): r for r in reversed(rows)}.values())[::-1]

    def sizes(part: str, reading: str) -> list[int | None]:
        """The training-set sizes a configuration ran on (one table line each: rows on other samples never mix)."""
        got = {_samples(r) for r in results if r["mode"] == "cgd" and _part(r) == part and _reading(r) == reading}
        return sorted(got, key=lambda n: -(n or 0)) or [None]

    note = "Fashion-MNIST (here) vs MNIST (paper): different data sets, compare the shape, not the values."
    seeds_note = "Several seeds: mean [min, max] over seeds (utility_seed)."
    out = []
    vertical_parts = sorted({(_part(r), _reading(r)) for r in results if _reading(r)},
                            key=lambda t: (int(t[0].split("x")[0]), t[1] != "vfl"))  # fmt: skip
    for title, parts in (("Table 3 (vertical, Algorithm 2, delta 0.1)", vertical_parts or [("10x7", "vfl"), ("100x49", "vfl")]),
                         ("Table 8 (horizontal, Algorithm 1, delta 0.1)", [(p, "") for p in ("10x1", "100x1", "1000x1")])):  # fmt: skip
        out += [f"{title}. {note} {seeds_note}", "",
                "| m | reading | samples | seeds | CGD (worst) | CGD (mean model) | local (worst) | centralized | CGD - centralized "
                "| horizontal (m^h x 1) | CGD - horizontal | paper CGD | paper local | paper centralized |",
                "| --- " * 14 + "|"]  # fmt: skip
        for p, reading, n in [(p, reading, n) for p, reading in parts for n in sizes(p, reading)]:
            c, loc = find(p, "cgd", "0.1", reading, n), find(p, "local", "0.1", samples=n)
            cv, base, mean = _agg(c), _agg(c, "baseline_accuracy"), _agg(c, "mean_accuracy")
            gap = f"{cv[0] - base[0]:+.2f}" if cv and base else ""
            rows_h = f"{p.split('x')[0]}x1"
            # The horizontal partition with the same sample blocks, on the same samples (only there).
            hz = _agg(find(rows_h, "cgd", "0.1", samples=n)) if reading else None
            hgap = f"{cv[0] - hz[0]:+.2f}" if cv and hz else ""
            pc, pl = PAPER.get((p, "cgd"), {}).get("0.1"), PAPER.get((p, "local"), {}).get("0.1")
            n = "" if n is None else n
            out.append(f"| ({p}) | {reading or '-'} | {n} | {len(c)} | {_show(cv, len(c))} | {_show(mean, len(c))} | "
                       f"{_show(_agg(loc), len(loc))} | {_show(base, len(c))} | {gap} | "
                       f"{_show(hz, 1) if hz else ''} | {hgap} | {_cell(pc)} | {_cell(pl)} | {_cell(PAPER['centralized']['0.1'])} |")  # fmt: skip
        out.append("")
    parts = sorted({(_part(r), _reading(r), _samples(r)) for r in results if r["mode"] == "cgd"},
                   key=lambda t: (int(t[0].split("x")[1]), int(t[0].split("x")[0]), t[1] != "vfl", -(t[2] or 0)))  # fmt: skip
    dks = ["0.1", "0.01", "random"]
    ran = {delta_key(r["params"]) for r in results if r["mode"] == "cgd"}  # a delta the suite did not run says so
    out += [f"Table 7 (worst confined model's accuracy by delta, gap to its centralized run in points; random: each "
            f"participant's delta ~ U[0.001, 0.1]). The gap at delta 0.1 is the confinement itself: every confined "
            f"model moves by the same public steps, so w^l_k - w^j_k stays at its initial value, delta times a "
            f"draw of the init law (init_law; by default N(0, 1) truncated to [-1, 1]); it shrinks with delta. {note}", "",
            "| m | reading | samples | " + " | ".join(f"delta {d}" + ("" if d in ran else " (not run)") for d in dks)
            + " | " + " | ".join(f"paper {d}" for d in dks) + " |",
            "| --- " * (3 + 2 * len(dks)) + "|"]  # fmt: skip
    out.append("| paper centralized | | | " + " | " * (len(dks) - 1) + " | " + " | ".join(_cell(PAPER["centralized"].get(d)) for d in dks) + " |")
    for p, reading, n in parts:
        cells = []
        for d in dks:
            rs = find(p, "cgd", d, reading, n)
            v, b = _agg(rs), _agg(rs, "baseline_accuracy")
            cells.append("" if v is None else f"{v[0]:.2f}% ({v[0] - b[0]:+.2f})" if b is not None else f"{v[0]:.2f}%")
        paper = PAPER.get((p, "cgd"), {})
        out.append(f"| ({p}) | {reading or '-'} | {'' if n is None else n} | " + " | ".join(cells) + " | " + " | ".join(_cell(paper.get(d)) for d in dks) + " |")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
