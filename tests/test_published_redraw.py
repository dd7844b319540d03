"""Code test of the reporting path against the published folders: each folder's committed files (its results.csv,
suite.json, images/ and, where committed, its store) are copied and its reports written again with the current
code (`gleak leaderboard` does the same); every report file and figure must come out byte-identical to the
committed one. A change that alters a published table or figure therefore cannot land without regenerating it.

The quick folders run here; the others (5 to 11 s each on 2 cores) run with GLEAK_REDRAW_ALL=1, so that the
whole suite stays within its time budget. Measured on the whole set: all ten folders byte-identical, 42 s.
"""
import filecmp
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = sorted(p.parent.name for p in (ROOT / "results").glob("*/results.csv"))
QUICK = {"geiping-table1", "text", "malicious-server", "closed-form-sweep", "quick"}
REPORTS = ("leaderboard.md", "leaderboard.html", "leaderboard.csv", "leaderboard_by_case.csv", "leaderboard.tex",
           "results.csv", "utility.csv")  # fmt: skip


def _committed(folder: str) -> list[str]:
    """The folder's files as git has them (paths relative to the folder)."""
    out = subprocess.run(["git", "ls-files", f"results/{folder}"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [line[len(f"results/{folder}/"):] for line in out.stdout.splitlines() if line]


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_published_folder_redraws_byte_identical(folder, tmp_path):
    if folder not in QUICK and not os.environ.get("GLEAK_REDRAW_ALL"):
        pytest.skip(f"{folder}: a slower redraw; GLEAK_REDRAW_ALL=1 runs it")
    from gleak.reporting.report import write_folder_reports

    files = _committed(folder)
    if not files:
        pytest.skip("not a git checkout")
    copy = tmp_path / folder
    for rel in files:
        if rel.startswith("figures/"):
            continue  # drawn again below, compared with the committed ones
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "results" / folder / rel, copy / rel)
    write_folder_reports(copy)
    drawn = [rel for rel in files if rel.startswith("figures/") or rel in REPORTS]
    # every folder draws figures, unless its suite has nothing to draw them from (no images kept, no swept strength)
    assert any(rel.startswith("figures/") for rel in drawn) or not (copy / "figures").is_dir(), drawn
    differ = [rel for rel in drawn if not (copy / rel).is_file()
              or not filecmp.cmp(ROOT / "results" / folder / rel, copy / rel, shallow=False)]  # fmt: skip
    assert differ == [], f"{folder}: {differ} differ from the committed files (regenerate the folder)"
