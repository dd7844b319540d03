"""A damaged store, damaged stored arrays or a damaged published folder: one line, exit 2, the folder unchanged
(gleak.orchestration.stored_values, gleak.orchestration.reconstructions.unpack)."""
import hashlib
import io
import shutil
import sqlite3
import textwrap
from pathlib import Path

import numpy as np
import pytest

from _store_sql import connect
from gleak import cli


T1 = textwrap.dedent('''
    [suite]
    name = "t1"
    seeds = [0, 1]
    [case]
    dataset = "uniform"
    model = "linear"
    [[attack]]
    name = "closed-form"
    [[defense]]
    name = "none"
''')


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}  # fmt: skip


@pytest.fixture(scope="module")
def t1(tmp_path_factory):
    """A finished 2-trial folder of a closed-form suite (images, arrays, reports)."""
    d = tmp_path_factory.mktemp("t1")
    (d / "t1.toml").write_text(T1)
    assert cli.main(["run", str(d / "t1.toml"), "--out", str(d / "o"), "--no-progress", "--in-process"]) == 0
    return d / "o"


def copy(t1: Path, tmp_path: Path) -> Path:
    out = tmp_path / "o"
    shutil.copytree(t1, out)
    return out


def refused(args, folder, capsys, needle=""):
    """The command exits 2 with one line (containing needle) and leaves `folder` byte-identical."""
    capsys.readouterr()
    before = tree(folder)
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("gleak: error: ") and "Traceback" not in err, err
    assert needle in err, err
    assert tree(folder) == before
    return err


def _sql(folder, statement, *args):
    con = connect(folder)
    with con:
        con.execute(statement, args)
    con.close()


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _good(folder) -> dict:
    con = connect(folder)
    blob = con.execute("SELECT arrays FROM reconstructions").fetchone()[0]
    con.close()
    with np.load(io.BytesIO(blob)) as z:
        return {k: z[k] for k in z.files}


def _arrays(kind, good):
    if kind == "random":
        return np.random.default_rng(0).bytes(300)
    if kind == "empty":
        return b""
    if kind == "truncated":
        return _npz(**good)[:200]
    if kind == "wrong-shape":
        return _npz(**{**good, "rec": good["rec"].reshape(-1)})
    if kind == "missing-key":
        return _npz(**{k: v for k, v in good.items() if k != "truth"})
    if kind == "pickled":
        return _npz(**{**good, "rec": np.array([{"a": 1}], dtype=object)})
    if kind == "nan":
        return _npz(**{**good, "rec": np.full_like(good["rec"], np.nan)})
    if kind == "huge-label":
        return _npz(**{**good, "rec_y": np.array([10**12])})
    if kind == "int-images":
        return _npz(**{**good, "rec": good["rec"].astype(np.int64)})
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["random", "empty", "truncated", "wrong-shape", "missing-key", "pickled", "nan",
                                  "huge-label", "int-images"])  # fmt: skip
def test_damaged_arrays_make_rescore_one_line(t1, tmp_path, capsys, kind):
    out = copy(t1, tmp_path)
    _sql(out, "UPDATE reconstructions SET arrays = ?", _arrays(kind, _good(out)))
    (out / ".lock").write_text("1")  # another process's id: taking the lock would rewrite it
    refused(["rescore", str(out)], out, capsys, "table reconstructions")


STORE_EDITS = {
    "extra-not-json": ("UPDATE trials SET extra = '{not json'", "column extra"),
    "extra-a-list": ("UPDATE trials SET extra = '[1, 2]'", "column extra"),
    "attack-params-text": ("UPDATE trials SET attack_params = 'x'", "column attack_params"),
    "case-a-list": ("UPDATE trials SET \"case\" = '[1]'", "column case"),
    "case-key-unknown": ("UPDATE trials SET \"case\" = 'ffffffffffffffff'", "column case"),
    "config-case-key-unknown": ("UPDATE trials SET config = json_set(config, '$.case', 'ffffffffffffffff')",
                                "column config"),
    "cases-entry-a-list": ("UPDATE cases SET \"case\" = '[1]'", "table cases"),
    "cases-entry-not-json": ("UPDATE cases SET \"case\" = '{nope'", "table cases"),
    "config-empty": ("UPDATE trials SET config = '{}'", "column config"),
    "mse-negative": ("UPDATE trials SET mse = -1", "column mse"),
    "ssim-minus-inf": ("UPDATE trials SET ssim = -1e999", "column ssim"),
    "psnr-text": ("UPDATE trials SET psnr = 'high'", "column psnr"),
    "label-acc-2": ("UPDATE trials SET label_acc = 2", "column label_acc"),
    "verdict-odd": ("UPDATE trials SET verdict = 'pwned'", "column verdict"),
    "meta-suite-list": ("UPDATE meta SET value = '[1]' WHERE key = 'suite'", "key 'suite'"),
    "meta-verdict-number": ("UPDATE meta SET value = '5' WHERE key = 'verdict'", "key 'verdict'"),
    "meta-claims-text": ("UPDATE meta SET value = 'claims!' WHERE key = 'claims'", "key 'claims'"),
    "meta-claims-not-tables": ("UPDATE meta SET value = '[1, 2]' WHERE key = 'claims'", "key 'claims'"),
    "meta-set-params-shape": ("UPDATE meta SET value = '{\"defense\": {\"topk\": 5}}' WHERE key = 'set_params'",
                              "key 'set_params'"),
}  # fmt: skip


@pytest.mark.parametrize("edit", sorted(STORE_EDITS))
def test_a_damaged_store_field_is_one_line_for_every_command(t1, tmp_path, capsys, edit):
    out = copy(t1, tmp_path)
    statement, needle = STORE_EDITS[edit]
    _sql(out, statement)
    suite = t1.parent / "t1.toml"
    for args in (["leaderboard", str(out)], ["plot", str(out)], ["rescore", str(out)], ["compare", str(out), str(t1)],
                 ["run", str(suite), "--out", str(out), "--no-progress", "--in-process"]):  # fmt: skip
        refused(args, out, capsys, needle)


def _sqlite_file(path: Path, application_id: int, version: int) -> None:
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA application_id = {application_id}")
    con.execute(f"PRAGMA user_version = {version}")
    con.execute("CREATE TABLE reconstructions (trial_id TEXT PRIMARY KEY, arrays BLOB NOT NULL, digest TEXT)")
    con.close()


ARRAYS_FILES = {  # what may sit at reconstructions.sqlite, and the words of its one line
    "random bytes": (lambda p: p.write_bytes(np.random.default_rng(0).bytes(4096)), "not an SQLite file"),
    "empty": (lambda p: p.write_bytes(b""), "an empty file"),
    "another application's": (lambda p: (p.unlink(), _sqlite_file(p, 0x1234, 1)), "another application"),
    "a newer gleak's": (lambda p: (p.unlink(), _sqlite_file(p, 0x474C4B41, 99)), "newer gleak"),
    "no table": (lambda p: (p.unlink(), sqlite3.connect(p).execute("PRAGMA application_id = 1196182337").connection.close()),
                 "no reconstructions table"),
    "damaged": (lambda p: p.write_bytes(p.read_bytes()[:4096] + b"\xff" * 8192), "damaged"),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(ARRAYS_FILES))
def test_a_foreign_or_damaged_arrays_file_is_one_line_for_every_command(t1, tmp_path, capsys, kind):
    """The arrays file beside the store is checked as the store is: each command refuses in one line naming it, and
    nothing in the folder changes."""
    out = copy(t1, tmp_path)
    make, needle = ARRAYS_FILES[kind]
    make(out / "reconstructions.sqlite")
    suite = t1.parent / "t1.toml"
    for args in (["leaderboard", str(out)], ["plot", str(out)], ["rescore", str(out)],
                 ["run", str(suite), "--out", str(out), "--no-progress", "--in-process"]):  # fmt: skip
        refused(args, out, capsys, "reconstructions.sqlite")
        refused(args, out, capsys, needle)


def _published(t1, tmp_path) -> Path:
    """The folder as a clone has it: its reports, no store."""
    out = copy(t1, tmp_path)
    for f in ("results.sqlite", "reconstructions.sqlite", ".lock"):
        (out / f).unlink(missing_ok=True)
    return out


PUBLISHED_EDITS = {
    "suite-json-not-json": ("suite.json", lambda t: "{oops", "suite.json"),
    "suite-json-a-list": ("suite.json", lambda t: "[1]", "suite.json"),
    "suite-json-verdict-number": ("suite.json", lambda t: '{"verdict": 3}', "key 'verdict'"),
    "suite-json-utility-text": ("suite.json", lambda t: '{"utility_config": "x"}', "key 'utility_config'"),
    "suite-json-set-params-shape": ("suite.json", lambda t: '{"set_params": {"defense": [1]}}', "key 'set_params'"),
    "csv-binary": ("results.csv", lambda t: "\udcff", "not UTF-8"),
    "csv-no-header": ("results.csv", lambda t: "a,b\n1,2\n", "no column"),
    "csv-image-outside": ("results.csv", lambda t: t.replace(".png", ".png/../../../outside.png", 1), "column image"),
    "csv-image-absolute": ("results.csv", lambda t: _image(t, "/etc/passwd"), "column image"),
    "csv-image-dotdot": ("results.csv", lambda t: _image(t, "../../x.png"), "column image"),
    "csv-mse-text": ("results.csv", lambda t: _cell(t, "mse", "lots"), "column mse"),
    "csv-mse-negative": ("results.csv", lambda t: _cell(t, "mse", "-1"), "column mse"),
    "csv-ssim-minus-inf": ("results.csv", lambda t: _cell(t, "ssim", "-inf"), "column ssim"),
    "csv-extra-not-json": ("results.csv", lambda t: _cell(t, "extra", "{x"), "column extra"),
    "csv-extra-cells": ("results.csv", lambda t: t.rstrip("\n") + ",1,2,3\n", "more cells"),
    "csv-seed-fraction": ("results.csv", lambda t: _cell(t, "seed", "0.5"), "seed"),
}  # fmt: skip


def _cell(text, column, value):
    import csv

    rows = list(csv.reader(io.StringIO(text)))
    rows[1][rows[0].index(column)] = value
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def _image(text, value):
    return _cell(text, "image", value)


@pytest.mark.parametrize("edit", sorted(PUBLISHED_EDITS))
def test_a_damaged_published_folder_is_one_line(t1, tmp_path, capsys, edit):
    out = _published(t1, tmp_path)
    name, change, needle = PUBLISHED_EDITS[edit]
    text = change((out / name).read_text())
    (out / name).write_bytes(text.encode("utf-8", "surrogateescape"))
    for args in (["leaderboard", str(out)], ["plot", str(out)]):
        refused(args, out, capsys, needle)


def test_an_intact_published_folder_still_rebuilds(t1, tmp_path, capsys):
    out = _published(t1, tmp_path)
    assert cli.main(["leaderboard", str(out)]) == 0
    assert cli.main(["plot", str(out)]) == 0


def test_rescore_refuses_a_users_report_file_as_leaderboard_does(t1, tmp_path, capsys):
    """The manifest check of `gleak leaderboard`, made by `gleak rescore` before it changes the store."""
    out = copy(t1, tmp_path)
    manifest = (out / "gleak-manifest.json").read_text()
    (out / "gleak-manifest.json").write_text(manifest.replace('  "leaderboard.md",\n', ""))
    (out / "leaderboard.md").write_text("my notes")
    refused(["leaderboard", str(out)], out, capsys, "leaderboard.md")
    refused(["rescore", str(out)], out, capsys, "leaderboard.md")


@pytest.mark.parametrize("edit, needle", [
    ("UPDATE trials SET status = 'exploded'", "status 'exploded'"),
    ("INSERT OR REPLACE INTO meta VALUES ('verdict', '\"bogus\"')", "verdict rule is 'bogus'"),
])  # fmt: skip
def test_an_edited_status_or_verdict_rule_is_refused_in_one_line(t1, tmp_path, capsys, edit, needle):
    # an unknown status was counted as failed (its cell left the ranking, exit 0); a bogus rule was a traceback
    folder = copy(t1, tmp_path)
    _sql(folder, edit)
    refused(["leaderboard", str(folder)], folder, capsys, needle)
    refused(["rescore", str(folder)], folder, capsys, needle)


@pytest.mark.parametrize("damage", ["images gone", "images are links"])
def test_plot_never_deletes_a_grid_it_cannot_redraw(t1, tmp_path, capsys, damage):
    # the reconstruction grids were deleted when images/ was missing (or held links), although nothing else changed
    folder = copy(t1, tmp_path)
    grids = sorted(p.name for p in (folder / "figures").glob("reconstructions_*.png"))
    assert grids
    before = {g: (folder / "figures" / g).read_bytes() for g in grids}
    if damage == "images gone":
        shutil.rmtree(folder / "images")
    else:
        elsewhere = tmp_path / "elsewhere"
        shutil.move(str(folder / "images"), elsewhere)
        (folder / "images").mkdir()
        for p in elsewhere.iterdir():
            (folder / "images" / p.name).symlink_to(p)
    assert cli.main(["plot", str(folder)]) == 0
    assert {g: (folder / "figures" / g).read_bytes() for g in grids} == before


@pytest.mark.parametrize("bad", ["too many pixels", "not a png", "truncated"])
def test_plot_skips_an_image_it_should_not_decode_naming_it(t1, tmp_path, capsys, monkeypatch, bad):
    # a decompression-bomb PNG in images/ made gleak plot print a 35-line traceback
    from gleak.reporting import figures

    folder = copy(t1, tmp_path)
    first = sorted((folder / "images").glob("*.png"))[0]
    if bad == "too many pixels":
        monkeypatch.setattr(figures, "MAX_STORED_PIXELS", 10)  # every stored image is now "too large"
    elif bad == "not a png":
        first.write_bytes(b"GIF89a" + b"\0" * 64)
    else:
        first.write_bytes(first.read_bytes()[:60])
    capsys.readouterr()
    assert cli.main(["plot", str(folder)]) == 0
    err = capsys.readouterr().err
    assert f"{first}: skipped" in err and "Traceback" not in err, err
