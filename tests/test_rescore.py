"""Reconstructions kept as arrays: `gleak rescore` recomputes metrics without the attacks; leaderboards rebuild
from the committed files of a results folder (issue 11)."""
import shutil
import sqlite3
import subprocess

import pandas as pd
import pytest

SUITE = """
[suite]
name = "resc"
seeds = [0, 1]
[case]
dataset = "skimage"
model = "mlp"
model_params = { hidden = [32] }
resolution = 16
batch_size = [1, 2]
[[attack]]
name = "closed-form"
[[attack]]
name = "idlg"
[[defense]]
name = "none"
[[defense]]
name = "noise"
sigma = [0.01]
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The suite's folder, written in this process (the commands under test run as subprocesses)."""
    from gleak.cli import main

    d = tmp_path_factory.mktemp("resc")
    (d / "s.toml").write_text(SUITE)
    assert main(["run", str(d / "s.toml"), "--out", str(d / "out"), "--no-progress", "--in-process"]) == 0
    return d / "out"


def test_rescore_recomputes_what_the_run_stored(folder, gleak_cmd, run_env):
    before = pd.read_csv(folder / "results.csv")
    with sqlite3.connect(folder / "results.sqlite") as db:  # damage the stored metrics
        n = db.execute("SELECT COUNT(*) FROM reconstructions").fetchone()[0]
        db.execute("UPDATE trials SET psnr = 0, ssim = 0, mse = 1 WHERE mse IS NOT NULL")
    assert n == int(before["mse"].notna().sum()) > 0  # every image trial kept its arrays, label-only ones none
    r = subprocess.run(gleak_cmd + ["rescore", str(folder), "--metrics", "mse,psnr,ssim"], env=run_env,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    after = pd.read_csv(folder / "results.csv")
    for col in ("mse", "psnr", "ssim", "verdict"):
        pd.testing.assert_series_equal(before[col], after[col], check_exact=False, rtol=1e-6)


def test_rescore_names_a_bad_metric(folder, gleak_cmd, run_env):
    r = subprocess.run(gleak_cmd + ["rescore", str(folder), "--metrics", "psnr,nope"], env=run_env,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "nope" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_leaderboard_and_plot_rebuild_from_the_committed_files(folder, tmp_path, gleak_cmd, run_env):
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("results.csv", "suite.json", "gleak-manifest.json"):  # what a shipped folder commits
        shutil.copy(folder / name, clone / name)
    shutil.copytree(folder / "images", clone / "images")  # committed with the folder (PNG grids)
    for cmd in ("leaderboard", "plot"):
        r = subprocess.run(gleak_cmd + [cmd, str(clone)], env=run_env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert (clone / "leaderboard.md").read_text() == (folder / "leaderboard.md").read_text().replace(
        str(folder), str(clone))
    assert (clone / "leaderboard.csv").read_text() == (folder / "leaderboard.csv").read_text()


def test_rescore_and_the_leaderboard_say_how_many_trials_got_lpips_and_why_not(folder, gleak_cmd, run_env):
    """Without the AlexNet weights no trial gets LPIPS: rescore says 0 of N and why, not 'rescored lpips of N'; the
    leaderboard counts each metric over the finished trials (the label-only ones have no image)."""
    from gleak.mechanics.perceptual import lpips_available

    if lpips_available():
        pytest.skip("LPIPS backbone weights are on this machine: every trial gets LPIPS")
    env = {k: v for k, v in run_env.items() if k != "GLEAK_LPIPS_BACKBONE"}
    r = subprocess.run(gleak_cmd + ["rescore", str(folder), "--metrics", "lpips,psnr"], env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = pd.read_csv(folder / "results.csv")
    n_img, n_ok = int(rows["mse"].notna().sum()), int((rows["status"] == "ok").sum())
    assert 0 < n_img < n_ok  # closed-form reconstructs images, idlg only labels
    assert f"lpips: 0 of {n_img} trials (no backbone weights: pass --lpips-backbone); psnr: {n_img} of {n_img} trials" in r.stderr, r.stderr
    md = (folder / "leaderboard.md").read_text()
    assert f"PSNR, MSE and SSIM for {n_img} of {n_ok} (the other {n_ok - n_img}: no image reconstructed" in md
    assert f"LPIPS for 0 of {n_ok} ({n_img} with an image but no LPIPS" in md
    assert f"label accuracy for {int(rows['label_acc'].notna().sum())} of {n_ok}" in md
