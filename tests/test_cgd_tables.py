"""benchmarks/cgd_tables.py: seed 000's tables from a folder's stored utility runs (a code test on synthetic rows,
and a data check on the published folder)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("cgd_tables", ROOT / "benchmarks" / "cgd_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(partition, accuracy, samples, seed=None, mode="cgd", delta=0.1, **params):
    p = {"partition": partition, "delta": delta, **params}
    if seed is not None:
        p["utility_seed"] = seed
    return {"mode": mode, "params": p, "accuracy": accuracy, "baseline_accuracy": 0.8, "mean_accuracy": accuracy,
            "train_samples": samples}  # fmt: skip


def test_rows_on_different_training_sets_are_never_pooled_or_overwritten():
    """(100x1) on 6,000 and on 2,000 samples are two configurations: each keeps its own line, and a vertical row is
    compared with the horizontal one on its own samples (a run once overwrote the other in the tables)."""
    rows = [_row("100x1", 0.70, 6000), _row("100x1", 0.60, 2000), _row("100x1", 0.62, 2000, seed=1),
            _row("100x49", 0.64, 2000, vertical="vfl"), _row("100x49", 0.10, 2000, mode="local")]  # fmt: skip
    text = "\n".join(_module().tables(rows))
    table8 = text.split("Table 8")[1].split("Table 7")[0]
    assert "| (100x1) | - | 6000 | 1 | 70.00% |" in table8
    assert "| (100x1) | - | 2000 | 2 | 61.00% [60.00, 62.00] |" in table8
    table3 = text.split("Table 8")[0]
    line = next(x for x in table3.splitlines() if x.startswith("| (100x49) | vfl"))
    assert "| 61.00% | +3.00 |" in line and "| 10.00% |" in line  # its horizontal and local rows: 2,000 samples


def test_the_published_folder_prints_its_tables_on_a_clone():
    """Data check: results/cgd as committed (its store or utility.csv) gives Tables 3, 7 and 8."""
    if not (ROOT / "results" / "cgd" / "utility.csv").is_file():
        pytest.skip("results/cgd not published in this checkout")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cgd_tables.py"), "--out", str(ROOT / "results" / "cgd"),
                          "--no-write"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for table in ("Table 3", "Table 8", "Table 7"):
        assert table in out.stdout
