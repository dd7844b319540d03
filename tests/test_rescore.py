"""Reconstructions kept as arrays: `gleak rescore` recomputes metrics without the attacks; leaderboards rebuild
from the committed files of a results folder (issue 11)."""
import shutil
import sqlite3
import subprocess

import pandas as pd
import pytest
from _store_sql import connect

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
    with connect(folder) as db:  # damage the stored metrics
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
    db = connect(out)
    try:
        with db:
            for sql, args in statements:
                db.execute(sql, args)
    finally:
        db.close()


def _swap_two_arrays(out) -> tuple[str, str]:
    db = connect(out)
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
    before = [(out / f).read_bytes() for f in ("results.sqlite", "reconstructions.sqlite")]
    code, err = gleak_cli(["rescore", str(out), "--metrics", "psnr"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert a in err and "digest" in err
    assert [(out / f).read_bytes() for f in ("results.sqlite", "reconstructions.sqlite")] == before


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
    db = connect(out)
    rows = db.execute("SELECT trial_id, arrays FROM reconstructions ORDER BY trial_id").fetchall()
    db.close()
    _edit(out, *(("UPDATE reconstructions SET arrays = ? WHERE trial_id = ?", (blob, tid))
                 for (tid, _), (_, blob) in zip(rows, rows[1:] + rows[:1])))  # every stored array moved one trial on
    kept = {p.name: p.read_bytes() for p in grids}
    code, err = gleak_cli(["plot", str(out)])
    assert code == 0 and "do not match their digest" in err, err
    assert {p.name: p.read_bytes() for p in grids} == kept  # nothing drawable: the grids drawn before stay


def _legacy(out, version: int) -> None:
    """The folder's store as gleak wrote it before the arrays had their own file (version 4), or before they carried
    a digest too (version 1): the arrays back in results.sqlite, the arrays file gone."""
    digest = ", digest" if version >= 2 else ""
    _edit(out, (f"CREATE TABLE main.reconstructions (trial_id TEXT PRIMARY KEY, arrays BLOB NOT NULL{digest})", ()),
          (f"INSERT INTO main.reconstructions SELECT trial_id, arrays{digest} FROM arrays.reconstructions", ()),
          (f"PRAGMA main.user_version = {version}", ()))  # fmt: skip
    (out / "reconstructions.sqlite").unlink()


@pytest.mark.parametrize("version", [1, 4])
def test_a_store_from_before_the_arrays_file_is_upgraded_once_and_then_checked(folder, tmp_path, version):
    """A store that kept its arrays in results.sqlite (version 4; version 1: without digests too) opened by this
    gleak: the arrays move to reconstructions.sqlite (each stamped with its trial's digest where it had none), the
    store's copy is dropped and the file compacted, the version raised; a kill after the copy and before the drop
    repeats the copy when next opened; from then on a swap is found."""
    from gleak.contracts.errors import InputError
    from gleak.orchestration.store import SCHEMA_VERSION, Store

    out = _copy(folder, tmp_path)
    reference = Store(folder, create=False)
    want = sorted(reference.reconstructions())
    reference.close()
    _legacy(out, version)
    legacy_size = (out / "results.sqlite").stat().st_size
    for attempt in ("killed after the copy", "whole"):
        store = Store(out, create=False)
        if attempt == "killed after the copy":  # what a kill between the two commits leaves: both copies, old version
            store.db.execute(f"PRAGMA main.user_version = {version}")
            store.close()
            _edit(out, ("CREATE TABLE main.reconstructions AS SELECT * FROM arrays.reconstructions", ()))
            continue
        assert sorted(store.reconstructions()) == want
        assert store.db.execute("PRAGMA main.user_version").fetchone()[0] == SCHEMA_VERSION
        assert "reconstructions" not in store._tables("main")
        store.close()
    assert (out / "results.sqlite").stat().st_size < legacy_size / 2  # the arrays' pages went with them
    _swap_two_arrays(out)
    store = Store(out, create=False)
    with pytest.raises(InputError, match="digest"):
        store.reconstructions()
    skipped = []
    assert len(store.reconstructions(on_mismatch=skipped.append)) == len(want) - 2 and len(skipped) == 2
    store.close()


def test_a_folder_without_its_arrays_file_reads_every_row_and_refuses_only_rescore(folder, tmp_path, gleak_cli):
    """A published folder that commits results.sqlite but not its (large) arrays file: the leaderboard rebuilds from
    the rows, and `gleak rescore` says in one line which file is missing, changing nothing, creating nothing."""
    out = _copy(folder, tmp_path)
    (out / "reconstructions.sqlite").unlink()
    before = (out / "results.sqlite").read_bytes()
    code, err = gleak_cli(["leaderboard", str(out)])
    assert code == 0, err
    code, err = gleak_cli(["rescore", str(out), "--metrics", "psnr"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "reconstructions.sqlite: absent" in err, err
    assert (out / "results.sqlite").read_bytes() == before and not (out / "reconstructions.sqlite").exists()


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
    con = connect(out)
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


def test_a_trial_row_is_never_stored_without_its_arrays(folder, tmp_path):
    """The two files cannot share one transaction: a trial's arrays are committed before its row, so a write that
    fails (or a process killed) between the two leaves at most arrays without a row, which no reader uses and the
    trial's rerun replaces, never a stored trial whose reconstruction is missing."""
    import sqlite3 as sql

    from gleak.contracts.config import TrialConfig
    from gleak.orchestration.store import Store

    out = _copy(folder, tmp_path)
    store = Store(out, create=False)
    trial_id, config = next(iter(store.configs().items()))
    (_, blob, _), = store.reconstructions([trial_id])
    row = {**store.frame().set_index("trial_id").loc[trial_id].to_dict(), "status": "ok", "reconstruction": blob}
    cfg = TrialConfig.from_json(config)
    store.db.execute("DELETE FROM trials WHERE trial_id = ?", (trial_id,))
    store.db.execute("DELETE FROM arrays.reconstructions WHERE trial_id = ?", (trial_id,))
    for table in ("arrays.reconstructions", "main.trials"):  # each write failing in turn
        schema, name = table.split(".")
        store.db.execute(f"CREATE TRIGGER {schema}.fail BEFORE INSERT ON {name} BEGIN SELECT RAISE(ABORT, 'full'); END")
        with pytest.raises(sql.IntegrityError):
            store.put(cfg, row)
        store.db.execute(f"DROP TRIGGER {schema}.fail")
        assert trial_id not in store.finished_ids(), table
        assert store.reconstructions([trial_id]) == []
    store.put(cfg, row)  # the rerun: row and arrays, the arrays left behind replaced
    assert trial_id in store.finished_ids() and store.reconstructions([trial_id])[0][1] == blob
    store.close()


def test_each_case_is_held_once_and_read_back_as_written(folder):
    """Schema version 6: the case column and the config's case name an entry of the cases table (one per distinct
    case, not one per row), and a reader gets back exactly the JSON a trial's config writes."""
    import json

    from gleak.contracts.config import TrialConfig
    from gleak.orchestration.store import Store

    con = connect(folder)
    try:
        keys = [r[0] for r in con.execute('SELECT "case" FROM trials')]
        config_keys = {json.loads(r[0])["case"] for r in con.execute("SELECT config FROM trials")}
        entries = {r[0] for r in con.execute("SELECT key FROM cases")}
    finally:
        con.close()
    # batch sizes 1 and 2: two cases, each held once as the case column writes it and once as the config's
    # identity writes it (which leaves out keys at their defaults)
    assert len(keys) == 16 and len(set(keys)) == len(config_keys) == 2 and entries == set(keys) | config_keys
    store = Store(folder, create=False)
    try:
        df, configs = store.frame(), store.configs()
    finally:
        store.close()
    for _, r in df.iterrows():
        cfg = TrialConfig.from_json(r["config"])
        assert r["config"] == configs[r["trial_id"]] == cfg.to_json() and cfg.trial_id == r["trial_id"]
        assert r["case"] == json.dumps(cfg.case.to_dict(), sort_keys=True, default=str)


def test_a_version_5_store_with_inline_cases_is_compacted_and_reads_the_same(folder, tmp_path, gleak_cli):
    """A store of version 5 (each row held its case's JSON twice) opened by this gleak: every row names its case by
    key, the file does not grow, and results.csv is rebuilt byte for byte as before."""
    from gleak.orchestration.store import SCHEMA_VERSION, Store

    out = _copy(folder, tmp_path)
    reference = Store(folder, create=False)
    want, configs = reference.frame(), reference.configs()
    reference.close()
    csv = (folder / "results.csv").read_bytes()
    _edit(out, *(('UPDATE trials SET "case" = ?, config = ? WHERE trial_id = ?', (case, configs[tid], tid))
                 for tid, case in zip(want["trial_id"], want["case"])),
          ("DROP TABLE cases", ()), ("PRAGMA user_version = 5", ()))  # fmt: skip
    con = connect(out)
    assert con.execute("SELECT COUNT(*) FROM trials WHERE config LIKE '%\"batch_size\"%'").fetchone()[0] == 16
    con.close()
    code, err = gleak_cli(["leaderboard", str(out)])
    assert code == 0, err
    assert (out / "results.csv").read_bytes() == csv
    store = Store(out, create=False)
    try:
        assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert store.db.execute("SELECT COUNT(DISTINCT \"case\") FROM trials").fetchone()[0] == 2
        assert store.db.execute("SELECT COUNT(*) FROM trials WHERE config LIKE '%\"batch_size\"%' "
                                "OR \"case\" LIKE '%\"batch_size\"%'").fetchone()[0] == 0  # every row by key now
        assert store.configs() == configs
        pd.testing.assert_frame_equal(store.frame().drop(columns="finished_at"), want.drop(columns="finished_at"))
    finally:
        store.close()
