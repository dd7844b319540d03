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


def _copy(folder, tmp_path):
    """A copy of the module's folder that a test may damage."""
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    (out / ".lock").unlink(missing_ok=True)
    return out


def _edit(out, *statements):
    """Run SQL on the folder's store and close it (its log folded back into the file)."""
    db = sqlite3.connect(out / "results.sqlite")
    try:
        with db:
            for sql, args in statements:
                db.execute(sql, args)
    finally:
        db.close()


def _swap_two_arrays(out) -> tuple[str, str]:
    db = sqlite3.connect(out / "results.sqlite")
    (a, blob_a), (b, blob_b) = db.execute("SELECT trial_id, arrays FROM reconstructions ORDER BY trial_id LIMIT 2").fetchall()
    db.close()
    _edit(out, ("UPDATE reconstructions SET arrays = ? WHERE trial_id = ?", (blob_b, a)),
          ("UPDATE reconstructions SET arrays = ? WHERE trial_id = ?", (blob_a, b)))  # fmt: skip
    return a, b


def test_rescore_refuses_arrays_moved_to_another_trial(folder, tmp_path, gleak_cli):
    """Each stored reconstruction carries its trial's digest (gleak.orchestration.store.arrays_digest): arrays
    swapped between two trials are refused with one line naming a trial, exit 2, the store unchanged, where they
    would otherwise be rescored as the other trial's (an exact recovery scored as a poor one, or the reverse)."""
    out = _copy(folder, tmp_path)
    a, _ = _swap_two_arrays(out)
    before = (out / "results.sqlite").read_bytes()
    code, err = gleak_cli(["rescore", str(out), "--metrics", "psnr"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert a in err and "digest" in err
    assert (out / "results.sqlite").read_bytes() == before


def test_plot_draws_the_grid_from_the_store_when_the_pngs_are_gone(folder, tmp_path, gleak_cli):
    """images/ removed (or its files turned into links): `gleak plot` draws each reconstruction again from the
    store's arrays, the same pixels as the PNG the trial wrote; arrays that are another trial's are not drawn (one
    line each), and a grid left with nothing to draw keeps the figure drawn before."""
    import numpy as np
    from PIL import Image

    out = _copy(folder, tmp_path)
    grids = sorted((out / "figures").glob("reconstructions_*.png"))
    assert grids
    drawn = {p.name: np.asarray(Image.open(p)) for p in grids}
    for case in ("gone", "links"):
        if case == "gone":
            shutil.rmtree(out / "images")
        else:  # every PNG a link to a white image of the same size
            shutil.copytree(folder / "images", out / "images")
            for png in (out / "images").glob("*.png"):
                white = tmp_path / f"white_{png.name}"
                Image.fromarray(np.full_like(np.asarray(Image.open(png)), 255)).save(white)
                png.unlink()
                png.symlink_to(white)
        for p in grids:
            p.unlink()
        code, err = gleak_cli(["plot", str(out)])
        assert code == 0 and all(p.is_file() for p in grids), (case, err)
        for p in grids:
            assert np.array_equal(np.asarray(Image.open(p)), drawn[p.name]), (case, p.name)
    shutil.rmtree(out / "images")
    db = sqlite3.connect(out / "results.sqlite")
    rows = db.execute("SELECT trial_id, arrays FROM reconstructions ORDER BY trial_id").fetchall()
    db.close()
    _edit(out, *(("UPDATE reconstructions SET arrays = ? WHERE trial_id = ?", (blob, tid))
                 for (tid, _), (_, blob) in zip(rows, rows[1:] + rows[:1])))  # every stored array moved one trial on
    kept = {p.name: p.read_bytes() for p in grids}
    code, err = gleak_cli(["plot", str(out)])
    assert code == 0 and "do not match their digest" in err, err
    assert {p.name: p.read_bytes() for p in grids} == kept  # nothing drawable: the grids drawn before stay


def test_a_store_from_before_the_digest_is_upgraded_once_and_then_checked(folder, tmp_path):
    """A version-1 store (arrays without digests) opened by this gleak: each array stamped with its trial's digest
    in one step and the version raised; from then on a swap is found."""
    from gleak.contracts.errors import InputError
    from gleak.orchestration.store import SCHEMA_VERSION, Store

    out = _copy(folder, tmp_path)
    _edit(out, ("ALTER TABLE reconstructions DROP COLUMN digest", ()), ("PRAGMA user_version = 1", ()))
    store = Store(out, create=False)
    n = len(store.reconstructions())
    assert n > 0 and store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    store.close()
    _swap_two_arrays(out)
    store = Store(out, create=False)
    with pytest.raises(InputError, match="digest"):
        store.reconstructions()
    skipped = []
    assert len(store.reconstructions(on_mismatch=skipped.append)) == n - 2 and len(skipped) == 2
    store.close()


def test_a_version_3_store_gets_an_empty_feature_mse_column_which_rescore_refuses_to_fill(folder, tmp_path, gleak_cli):
    """A store from before feature-space MSE: a writer adds the column empty (never zero); `gleak rescore --metrics
    feat_mse` refuses in one line, because the store keeps no model to compute it with, and changes nothing."""
    from gleak.orchestration.store import SCHEMA_VERSION

    out = _copy(folder, tmp_path)
    _edit(out, ("ALTER TABLE trials DROP COLUMN feat_mse", ()), ("PRAGMA user_version = 3", ()))
    before = (out / "results.sqlite").read_bytes()
    code, err = gleak_cli(["rescore", str(out), "--metrics", "feat_mse"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "feat_mse" in err and "rerun" in err, err
    assert (out / "results.sqlite").read_bytes() == before
    code, err = gleak_cli(["rescore", str(out), "--metrics", "ssim"])
    assert code == 0, err
    con = sqlite3.connect(out / "results.sqlite")
    try:
        assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert con.execute("SELECT COUNT(*) FROM trials WHERE feat_mse IS NOT NULL").fetchone()[0] == 0
    finally:
        con.close()
    assert pd.read_csv(out / "results.csv")["feat_mse"].isna().all()


def test_a_version_2_store_gets_registered_psnr_and_iip_columns_and_rescore_fills_them(folder, tmp_path, gleak_cli):
    """A store from before the registered PSNR and IIP columns: opened by a writer it gains them, empty (never
    zero); `gleak rescore --metrics rpsnr,iip` fills them from the stored arrays and the victims' split, with the
    values a fresh run stores."""
    out = _copy(folder, tmp_path)
    fresh = pd.read_csv(folder / "results.csv")
    _edit(out, ("ALTER TABLE trials DROP COLUMN rpsnr", ()), ("ALTER TABLE trials DROP COLUMN iip", ()),
          ("PRAGMA user_version = 2", ()))  # fmt: skip
    code, err = gleak_cli(["rescore", str(out), "--metrics", "rpsnr,iip"])
    assert code == 0, err
    again = pd.read_csv(out / "results.csv")
    images = fresh["psnr"].notna()
    assert images.any() and fresh.loc[images, "iip"].notna().all() and fresh.loc[~images, "iip"].isna().all()
    for col in ("rpsnr", "iip"):
        pd.testing.assert_series_equal(fresh[col], again[col], check_exact=False, rtol=1e-9)
