"""Seed 000's accuracy tables (3, 7 and 8) rerun on Fashion-MNIST through the cgd and local-training defenses, printed
beside the paper's MNIST numbers (a different data set: compare the shape, not the values).

    python benchmarks/cgd_tables.py                     # every row of suites/cgd.toml's utility grid
    python benchmarks/cgd_tables.py --only 10x1 100x1   # some partitions
    python benchmarks/cgd_tables.py --json out.json     # also write the raw results

Every number comes from the same code path as `gleak run suites/cgd.toml`'s [utility] rows (Defense.train_utility
with the same UtilityConfig and defense parameters), so the two agree run for run. Accuracy is the worst evaluated
confined model (as the paper reports); "centralized" is full-batch gradient descent on the same training samples
with the same init law and schedule (the protocol with one participant).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gleak.config import UtilityConfig, generator  # noqa: E402
from gleak.data import load_dataset  # noqa: E402
from gleak.registry import create  # noqa: E402

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


def suite_rows(path: Path) -> tuple[UtilityConfig, list[tuple[str, dict]]]:
    """The [utility] table and the cgd / local-training defenses of the suite's grids, in suite order."""
    doc = tomllib.loads(path.read_text())
    known = {f.name for f in dataclasses.fields(UtilityConfig)}
    cfg = UtilityConfig(**{k: v for k, v in doc["utility"].items() if k in known})
    rows = []
    for grid in doc.get("grid", [doc]):
        for d in grid.get("defense", []):
            if d["name"] in ("cgd", "local-training") and "partition" in d:  # the utility grid's rows
                params = {k: v for k, v in d.items() if k != "name"}
                axes = [k for k, v in params.items() if isinstance(v, list)]  # a list expands the grid
                for combo in itertools.product(*(params[k] for k in axes)):
                    rows.append((d["name"], {**params, **dict(zip(axes, combo))}))
    return cfg, rows


def delta_key(p: dict) -> str:
    return "random" if p.get("delta_high") is not None else str(p.get("delta", 0.1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=str(ROOT / "suites" / "cgd.toml"))
    ap.add_argument("--only", nargs="*", help="partitions to run (default: all)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the suite's utility runs use 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg, rows = suite_rows(Path(args.suite))
    if args.only:
        rows = [r for r in rows if r[1].get("partition", "10x1") in args.only]
    train = load_dataset(cfg.dataset, "train", root=cfg.data_root)
    test = load_dataset(cfg.dataset, "test", root=cfg.data_root)
    print(f"[utility] {cfg.dataset}, model {cfg.model}, T = {cfg.rounds} iterations, alpha = {cfg.lr}; "
          f"{len(rows)} runs", flush=True)  # fmt: skip
    results = []
    for name, params in rows:
        t0 = time.perf_counter()
        out = create("defense", name, **params).train_utility(cfg, train, test, generator(cfg.seed, "utility-protocol"))
        mode = "local" if name == "local-training" else "cgd"
        rec = {"defense": name, "mode": mode, "params": params, **out}
        results.append(rec)
        print(f"  {name:15s} {json.dumps(params, sort_keys=True):70s} acc {100 * out['accuracy']:6.2f}% "
              f"(mean {100 * out['mean_accuracy']:6.2f}%)  centralized {100 * out['baseline_accuracy']:6.2f}%  "
              f"{out['seconds_per_iteration']:.3f} s/it  {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    print()
    print_tables(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


def _cell(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}%"


def print_tables(results: list[dict]) -> None:
    def find(part: str, mode: str, dk: str):
        for r in results:
            if r["mode"] == mode and r["params"].get("partition", "10x1") == part and delta_key(r["params"]) == dk:
                return r
        return None

    central = {}
    for r in results:
        central.setdefault(delta_key(r["params"]), 100 * r["baseline_accuracy"])
    note = "Fashion-MNIST (here) vs MNIST (paper): different data sets, compare the shape."
    for title, parts in (("Table 3 (vertical, delta 0.1)", ["10x7", "100x49"]), ("Table 8 (horizontal, delta 0.1)", ["10x1", "100x1", "1000x1"])):
        print(f"{title}. {note}")
        print(f"| m | CGD | local | CGD - centralized | paper CGD | paper local |")
        print("| --- | --- | --- | --- | --- | --- |")
        print(f"| centralized | {_cell(central.get('0.1'))} | | | {_cell(PAPER['centralized']['0.1'])} | |")
        for p in parts:
            c, loc = find(p, "cgd", "0.1"), find(p, "local", "0.1")
            cv = 100 * c["accuracy"] if c else None
            lv = 100 * loc["accuracy"] if loc else None
            gap = f"{cv - central['0.1']:+.2f}" if cv is not None and "0.1" in central else ""
            pc, pl = PAPER.get((p, "cgd"), {}).get("0.1"), PAPER.get((p, "local"), {}).get("0.1")
            print(f"| ({p}) | {_cell(cv)} | {_cell(lv)} | {gap} | {_cell(pc)} | {_cell(pl)} |")
        print()
    parts = sorted({r["params"].get("partition", "10x1") for r in results if r["mode"] == "cgd"},
                   key=lambda s: (int(s.split("x")[1]), int(s.split("x")[0])))  # fmt: skip
    dks = ["0.1", "0.01", "random"]
    print(f"Table 7 (worst confined model's accuracy by delta; random: each participant's delta ~ U[0.001, 0.1]). {note}")
    print("| m | " + " | ".join(f"delta {d}" for d in dks) + " | " + " | ".join(f"paper {d}" for d in dks) + " |")
    print("| --- " * (1 + 2 * len(dks)) + "|")
    print("| centralized | " + " | ".join(_cell(central.get(d)) for d in dks) + " | "
          + " | ".join(_cell(PAPER["centralized"].get(d)) for d in dks) + " |")  # fmt: skip
    for p in parts:
        vals = [find(p, "cgd", d) for d in dks]
        paper = PAPER.get((p, "cgd"), {})
        print(f"| ({p}) | " + " | ".join(_cell(100 * v["accuracy"]) if v else "" for v in vals) + " | "
              + " | ".join(_cell(paper.get(d)) for d in dks) + " |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
