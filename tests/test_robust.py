"""Holding under bad input, crashes and hostile folders (issue 15): trials isolated in worker processes by default,
an output folder gleak owns, a store it checks, and one line with exit 2 for every bad input."""
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import textwrap
from pathlib import Path

import pytest

from gleak import cli

CRASHY = '''
import ctypes
import os
import signal
import sys
import time

import torch

from gleak import register_attack, register_defense
from gleak.contracts.plugin import Attack, Defense
from gleak.contracts.wire import Reconstruction


@register_attack("crashy")
class Crashy(Attack):
    """Test attack that crashes its process in one of several ways."""

    needs = frozenset({"architecture"})

    def __init__(self, mode: str = "ok"):
        self.mode = mode

    def reconstruct(self, observation, rng):
        m = self.mode
        if m == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif m == "ctypes":
            ctypes.string_at(0)  # a null-pointer read in native code
        elif m == "os_exit":
            os._exit(7)
        elif m == "sys_exit":
            sys.exit(3)
        elif m == "interrupt":
            raise KeyboardInterrupt
        elif m == "hang":
            while True:
                time.sleep(0.05)
        x = torch.zeros((1, *observation.knowledge.input_shape))
        return Reconstruction(x=x, extra={"bad": {1, 2}} if m == "nonjson" else {})


@register_defense("in-place")
class InPlace(Defense):
    """Test defense that scales the update it is given in place (breaking the contract) and returns it."""

    def transform(self, update, rng):
        for t in update.tensors.values():
            t.mul_(0.5)
        return update
'''


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def rows(folder: Path) -> list[dict]:
    con = sqlite3.connect(folder / "results.sqlite")
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute("SELECT * FROM trials")]
    finally:
        con.close()


TINY = '[suite]\nname = "tiny"\nsave_images = false\n[case]\ndataset = "uniform"\nmodel = "linear"\n' \
       '[[attack]]\nname = "closed-form"\n[[defense]]\nname = "none"\n'  # fmt: skip


def test_each_crash_kind_is_its_trials_failure_and_the_others_finish(tmp_path, gleak_cmd, run_env):
    """Default settings (one worker, child process): segfault, null-pointer read, os._exit, sys.exit, KeyboardInterrupt
    in a plugin, a hang past --trial-timeout, a non-JSON extra and a defense editing its input in place are each
    stored as that trial's failure with its reason; the healthy trials finish with their metrics."""
    plugin = tmp_path / "crashy.py"
    plugin.write_text(CRASHY)
    suite = tmp_path / "crashes.toml"
    suite.write_text(textwrap.dedent("""
        [suite]
        name = "crashes"
        save_images = false
        [case]
        dataset = "uniform"
        model = "linear"
        [[grid]]
        attack = [{ name = "crashy", mode = ["segv", "ctypes", "os_exit", "sys_exit", "interrupt", "hang", "nonjson", "ok"] },
                  { name = "closed-form" }]
        defense = [{ name = "none" }]
        [[grid]]
        attack = [{ name = "closed-form" }]
        defense = [{ name = "in-place" }]
    """))
    out = tmp_path / "out"
    r = subprocess.run(gleak_cmd + ["run", str(suite), "--out", str(out), "--no-progress", "--plugin", str(plugin),
                                    "--trial-timeout", "4"], env=run_env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    by = {}
    for x in rows(out):
        params = json.loads(x["attack_params"])
        by[params.get("mode", x["attack"]) if x["defense"] == "none" else x["defense"]] = x
    assert len(by) == 10
    assert "killed by SIGSEGV" in by["segv"]["error"] and "on all 2 attempts" in by["segv"]["error"]
    assert "killed by SIGSEGV" in by["ctypes"]["error"]
    assert "exit status 7" in by["os_exit"]["error"]
    assert by["sys_exit"]["error"] == "SystemExit: the trial called sys.exit(3)"
    assert by["interrupt"]["error"].startswith("KeyboardInterrupt: raised inside the trial")
    assert by["hang"]["error"].startswith("TimedOut: the trial timed out after 4 s")
    assert 4 <= by["hang"]["seconds"] < 30
    assert "extra is not JSON" in by["nonjson"]["error"] and "set is not JSON serializable" in by["nonjson"]["error"]
    assert "modified client 0's update in place" in by["in-place"]["error"]
    for healthy in ("ok", "closed-form"):
        assert by[healthy]["status"] == "ok", by[healthy]
    assert by["closed-form"]["mse"] < 1e-10
    failed = {k for k, x in by.items() if x["status"] != "ok"}
    assert failed == {"segv", "ctypes", "os_exit", "sys_exit", "interrupt", "hang", "nonjson", "in-place"}
    assert (out / "results.csv").is_file() and "crashy" in (out / "results.csv").read_text()


def test_in_place_defense_was_recorded_wrongly_without_the_guard(tmp_path, monkeypatch):
    """The seam check is what catches it: with the guard bypassed, the same trial 'succeeds' with grad_dist 0."""
    from gleak.contracts.registry import load_plugin_file
    from gleak.orchestration import trial
    from gleak.orchestration.suite import load_suite

    plugin = tmp_path / "crashy.py"
    plugin.write_text(CRASHY)
    load_plugin_file(plugin)
    (tmp_path / "s.toml").write_text(TINY.replace('name = "none"', 'name = "in-place"'))
    cfg = load_suite(tmp_path / "s.toml").trials[0]
    row = trial.run_trial(cfg)
    assert row["status"] == "failed" and "in place" in row["error"]
    from gleak.mechanics import rounds

    monkeypatch.setattr(rounds, "unmodified", lambda send, d, u, *a: send(d, u, *a))
    row = trial.run_trial(cfg)
    assert row["status"] == "ok" and row["grad_dist"] == 0.0  # the wrong number the guard prevents


def test_suite_named_dotdot_or_dot_writes_nothing(tmp_path, capsys, monkeypatch, gleak_cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "mine.txt").write_text("user's")
    before = tree(tmp_path)
    for name in ["..", ".", "a/b", "x\\\\y", "." + "h", "n" * 101, "tab\\there"]:
        (tmp_path / "s.toml").write_text(TINY.replace('name = "tiny"', f'name = "{name}"'))
        before = tree(tmp_path)
        code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--no-progress", "--in-process"])
        assert code == 2, (name, err)
        assert len(err.strip().splitlines()) == 1 and "[suite] key 'name'" in err, err
        assert tree(tmp_path) == before


USER_FILES = {
    "utility.csv": b"user's own table\n",
    "figures/reconstructions_mine.png": b"not a png, the user's",
    "figures/.strength_x.png.a1b2c3d4": b"dot file shaped like an old temporary file",
    "images/.0123456789abcdef.png.a1b2c3d4": b"another",
    ".results.csv.gleak-tmp-abcdefgh": b"shaped like gleak's temporary file, but not in a gleak folder",
    "notes/.leaderboard.md.zzzzzzzz": b"deep",
    "notes.txt": b"hello",
}


def test_out_at_a_folder_of_user_files_changes_nothing_of_theirs(tmp_path, capsys, gleak_cli):
    user = tmp_path / "user"
    for rel, data in USER_FILES.items():
        (user / rel).parent.mkdir(parents=True, exist_ok=True)
        (user / rel).write_bytes(data)
    (tmp_path / "s.toml").write_text(TINY)
    before = tree(user)
    code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", str(user), "--no-progress"])
    assert code == 2 and "not a gleak output folder" in err and len(err.strip().splitlines()) == 1
    assert tree(user) == before
    # --force accepts the folder, but not a user's file where gleak writes (utility.csv, a figure of gleak's name)
    code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", str(user), "--no-progress", "--force"])
    assert code == 2 and "a file gleak did not write" in err
    assert tree(user) == before
    (user / "utility.csv").rename(user / "utility.mine.csv")
    (user / "figures/reconstructions_mine.png").rename(user / "figures/mine.png")
    before = tree(user)
    code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", str(user), "--no-progress", "--force"])
    assert code == 0, err
    code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", str(user), "--no-progress"])  # gleak's now
    assert code == 0, err
    after = tree(user)
    assert {k: after.get(k) for k in before} == before  # every user file byte-identical
    assert (user / "results.csv").is_file()
    manifest = json.loads((user / "gleak-manifest.json").read_text())["files"]
    assert not set(manifest) & set(before)
    # A user's figure dropped into gleak's figures/ later is never deleted as stale, a user dot file never cleaned
    (user / "figures" / "strength_user.png").write_bytes(b"mine")
    (user / "figures" / ".frontier.png.gleak-tmp-abcdefgh").write_bytes(b"mine too")  # not listed, but gleak-shaped
    code, err = gleak_cli(["leaderboard", str(user)])
    assert code == 0, err
    assert (user / "figures" / "strength_user.png").read_bytes() == b"mine"


def test_gleak_deletes_its_own_stale_figure_but_not_a_users(tmp_path, capsys, gleak_cli):
    """The manifest rule, both ways: a stale figure gleak wrote goes; the same name written by the user stays."""
    out = tmp_path / "o"
    (tmp_path / "s.toml").write_text(TINY.replace("save_images = false", "save_images = true"))
    assert gleak_cli(["run", str(tmp_path / "s.toml"), "--out", str(out), "--no-progress", "--in-process"])[0] == 0
    figs = sorted(p.name for p in (out / "figures").glob("*.png"))
    assert figs, "the run wrote a reconstruction figure"
    from gleak.orchestration import output_folder as folder

    m = folder.Manifest.load(out)
    stale = out / "figures" / "strength_gone_sigma.png"
    stale.write_bytes(b"old figure of gleak's")
    m.add([stale])
    m.save()
    users = out / "figures" / "strength_users_sigma.png"
    users.write_bytes(b"user's")
    assert gleak_cli(["leaderboard", str(out)])[0] == 0
    assert not stale.exists() and users.read_bytes() == b"user's"


def _stored_run(tmp_path, gleak_cli, name="o") -> Path:
    out = tmp_path / name
    (tmp_path / "s.toml").write_text(TINY.replace("save_images = false", "save_images = true"))
    code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", str(out), "--no-progress", "--in-process"])
    assert code == 0, err
    return out


def test_image_column_pointing_outside_moves_deletes_and_reads_nothing(tmp_path, capsys, gleak_cli):
    out = _stored_run(tmp_path, gleak_cli)
    # the grids drawn from the folder's own images: never redrawn from a path the store names elsewhere (kept as
    # they are, since gleak never deletes a grid it cannot redraw)
    grids = {p: p.read_bytes() for p in (out / "figures").glob("reconstructions_*.png")}
    outside = tmp_path / "outside.png"
    outside.write_bytes((out / "images").glob("*.png").__next__().read_bytes())  # a real PNG: a figure would use it
    secret = tmp_path / "secret.png"
    secret.write_bytes(outside.read_bytes())
    (out / "images" / "link.png").symlink_to(secret)
    con = sqlite3.connect(out / "results.sqlite")
    with con:  # an old id (so the run re-keys it, linking and unlinking images) and a path outside
        con.execute("UPDATE trials SET trial_id = 'aaaaaaaaaaaaaaaa', image = '../../outside.png'")
    con.close()
    before = {p: (p.read_bytes(), p.stat().st_nlink) for p in (outside, secret)}
    code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", str(out), "--no-progress", "--in-process"])
    assert code == 0, err
    assert {p: (p.read_bytes(), p.stat().st_nlink) for p in (outside, secret)} == before
    assert not list(tmp_path.glob("*.png.*"))
    for image in ("/etc/passwd", "../../outside.png", "link.png", "a/../../x.png"):
        con = sqlite3.connect(out / "results.sqlite")
        with con:
            con.execute("UPDATE trials SET image = ?", (image,))
        con.close()
        code, err = gleak_cli(["leaderboard", str(out)])
        assert code == 0, err
        csv_text = (out / "results.csv").read_text()
        assert image not in csv_text
        assert {p: p.read_bytes() for p in (out / "figures").glob("reconstructions_*.png")} == grids  # nothing read in
    assert {p: (p.read_bytes(), p.stat().st_nlink) for p in (outside, secret)} == before


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"", "an empty file"),
        (b"hello, not a database at all" * 10, "not an SQLite file"),
        ("foreign", "another application"),
        ("empty-sqlite", "an empty SQLite file"),
        ("other-tables", "tables are not gleak's"),
        ("newer", "written by a newer gleak"),
        ("damaged", "damaged"),
    ],
)
def test_a_store_that_is_not_gleaks_is_refused_and_left_untouched(tmp_path, capsys, content, needle, gleak_cli):
    out = tmp_path / "o"
    if content == "damaged":
        out = _stored_run(tmp_path, gleak_cli)
        for side in ("results.sqlite-wal", "results.sqlite-shm"):
            (out / side).unlink(missing_ok=True)
        db = out / "results.sqlite"
        data = bytearray(db.read_bytes())
        for i in range(200, len(data), 97):
            data[i] = 0xA5 ^ data[i]
        db.write_bytes(bytes(data))
    else:
        out.mkdir()
        db = out / "results.sqlite"
        if isinstance(content, bytes):
            db.write_bytes(content)
        else:
            con = sqlite3.connect(db)
            if content == "foreign":
                con.execute("PRAGMA application_id = 1234")
                con.execute("CREATE TABLE trials (trial_id TEXT, config TEXT, status TEXT)")
            elif content == "empty-sqlite":
                con.execute("PRAGMA user_version = 0")
                con.execute("CREATE TABLE t (x)")
                con.execute("DROP TABLE t")
            elif content == "other-tables":
                con.execute("CREATE TABLE customers (name TEXT)")
            elif content == "newer":
                from gleak.orchestration.store import APPLICATION_ID, SCHEMA_VERSION

                con.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                con.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
                con.execute("CREATE TABLE trials (trial_id TEXT)")
            con.commit()
            con.close()
    (tmp_path / "s.toml").write_text(TINY.replace("save_images = false", "save_images = true"))
    before = tree(out)
    for args in (["run", str(tmp_path / "s.toml"), "--out", str(out), "--no-progress", "--force"], ["leaderboard", str(out)], ["plot", str(out)]):
        code, err = gleak_cli(args)
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1 and needle in err, err
        assert tree(out) == before


def test_a_run_that_dies_midway_hides_no_stored_trial(tmp_path, capsys, gleak_cmd, run_env, gleak_cli):
    """The folder's membership changes only once a run's trials are all stored: a run of the same suite, extended,
    that dies in the middle (here: in-process, a trial's os._exit takes the run down) leaves the leaderboard with
    every row it had, never a header-only results.csv."""
    out = _stored_run(tmp_path, gleak_cli)
    before = (out / "results.csv").read_text().splitlines()
    assert len(before) == 2
    plugin = tmp_path / "crashy.py"
    plugin.write_text(CRASHY)
    (tmp_path / "s2.toml").write_text(TINY.replace('name = "closed-form"', 'name = "crashy"\nmode = "os_exit"'))
    r = subprocess.run(gleak_cmd + ["run", str(tmp_path / "s2.toml"), "--out", str(out), "--no-progress", "--in-process",
                                    "--plugin", str(plugin)], env=run_env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 7
    code, err = gleak_cli(["leaderboard", str(out)])
    assert code == 0, err
    assert (out / "results.csv").read_text().splitlines() == before


def test_another_suite_into_a_folder_is_refused(tmp_path, capsys, gleak_cli):
    out = _stored_run(tmp_path, gleak_cli)
    (tmp_path / "other.toml").write_text(TINY.replace('name = "tiny"', 'name = "other"'))
    before = tree(out)
    code, err = gleak_cli(["run", str(tmp_path / "other.toml"), "--out", str(out), "--no-progress"])
    assert code == 2 and "holds the results of suite 'tiny'" in err
    assert tree(out) == before


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda s: s.replace('name = "none"', 'name = "noise"\nsigma = nan'), "parameter 'sigma' must be a finite number, got nan"),
        (lambda s: s.replace('name = "none"', 'name = "noise"\nsigma = inf'), "parameter 'sigma' must be a finite number, got inf"),
        (lambda s: s.replace('name = "closed-form"', 'name = "dlg"\nlr = -inf'), "parameter 'lr' must be a finite number, got -inf"),
        (lambda s: s.replace('model = "linear"', 'model = "linear"\ntrain_lr = nan'), "[case] key 'train_lr': must be a finite number, got nan"),
        (lambda s: s.replace('model = "linear"', 'model = "mlp"\nmodel_params = { hidden = [-5] }'), "key 'model_params.hidden'"),
        (lambda s: s.replace('model = "linear"', 'model = "mlp"\nmodel_params = { hidden = [100000000] }'), "must be in [1, 65536]"),
        (lambda s: s.replace('model = "linear"', 'model = "linear"\nrounds = 100000000000'), "[case] key 'warmup_rounds': must be <= 10_000"),
        (lambda s: s.replace('save_images = false', 'seeds = [18446744073709551616]'), "[suite] key 'seeds': each seed must be in [0, 2**63)"),
        (lambda s: s.replace('name = "closed-form"', 'name = "dlg"\niterations = 1000000000000'), "over the budget"),
        (lambda s: s + '[[grid]]\ncase = 3\n', "[grid #1] key 'case': must be a table"),
        (lambda s: s.replace('[case]', '[case]\nbatch_size = 1').encode("latin-1") + b"# caf\xe9\n", "not UTF-8"),
    ],
)  # fmt: skip
def test_bad_values_are_one_line_exit_2(tmp_path, capsys, edit, needle, gleak_cli):
    bad = tmp_path / "bad.toml"
    text = edit(TINY)
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "o"
    code, err = gleak_cli(["run", str(bad), "--out", str(out), "--no-progress"])
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_a_plugin_init_raising_anything_is_one_line(tmp_path, capsys, gleak_cli):
    plugin = tmp_path / "p.py"
    plugin.write_text(textwrap.dedent('''
        from gleak import register_attack
        from gleak.contracts.plugin import Attack

        @register_attack("init-fails")
        class InitFails(Attack):
            """Raises ZeroDivisionError in __init__."""
            def __init__(self, k: int = 0):
                self.k = 1 / k
    '''))
    (tmp_path / "s.toml").write_text(TINY.replace('name = "closed-form"', 'name = "init-fails"'))
    code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "--plugin", str(plugin)])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert str(tmp_path / "s.toml") in err and "[attack #1]" in err and "ZeroDivisionError" in err


def test_bad_output_folders_are_one_line_exit_2(tmp_path, capsys, gleak_cli):
    (tmp_path / "s.toml").write_text(TINY)
    afile = tmp_path / "afile"
    afile.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    cases = [(str(afile), "is a file"), (str(afile / "sub"), "is a file, not a folder"), (str(tmp_path / ("n" * 300)), "too long"),
             ("/dev/null", "is a file (or a device)")]  # fmt: skip
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((str(ro / "o"), "read-only"))
    for out, needle in cases:
        code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", out, "--no-progress"])
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, (out, err)
    assert afile.read_text() == "x" and not list(ro.iterdir())
    code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", "a\0b", "--no-progress"])
    assert code == 2 and "NUL" in err


def test_a_full_disk_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch, gleak_cli):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    (tmp_path / "s.toml").write_text(TINY)
    code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2 and "the disk is full" in err and not (tmp_path / "o").exists()


def test_an_unreachable_ray_address_is_one_line(tmp_path, capsys, gleak_cli):
    pytest.importorskip("ray")
    (tmp_path / "s.toml").write_text(TINY)
    code, err = gleak_cli(["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "--executor", "ray",
                       "--address", "127.0.0.1:1"])  # fmt: skip
    assert code == 2 and "did not answer" in err and not (tmp_path / "o").exists()


def test_check_plugin_reports_broken_plugins_and_never_hangs(tmp_path, gleak_cmd, run_env):
    plugin = tmp_path / "broken.py"
    plugin.write_text(textwrap.dedent('''
        import time
        import torch
        from gleak import register_attack
        from gleak.contracts.plugin import Attack
        from gleak.contracts.wire import Reconstruction

        @register_attack("returns-none")
        class ReturnsNone(Attack):
            """Returns None."""
            needs = frozenset()
            def reconstruct(self, observation, rng):
                return None

        @register_attack("set-extra")
        class SetExtra(Attack):
            """Returns an extra that is not JSON."""
            needs = frozenset()
            def reconstruct(self, observation, rng):
                return Reconstruction(x=torch.zeros((1, *observation.knowledge.input_shape)), extra={"s": {1}})
    '''))
    r = subprocess.run(gleak_cmd + ["check-plugin", str(plugin)], env=run_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert "FAIL  supports a standard case (" in r.stdout and "must return a Reconstruction, got NoneType" in r.stdout
    assert "FAIL  extra is JSON" in r.stdout and "not JSON" in r.stdout
    hang = tmp_path / "hang.py"
    hang.write_text(CRASHY.replace('mode: str = "ok"', 'mode: str = "hang"'))
    r = subprocess.run(gleak_cmd + ["check-plugin", "crashy", "--kind", "attack", "--timeout", "5"], env={**run_env},
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2  # not registered without the file (a fresh interpreter: this one may hold it): one line
    r = subprocess.run(gleak_cmd + ["check-plugin", str(hang), "--timeout", "5"], env=run_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "did not finish within 5 s" in r.stdout, r.stdout + r.stderr
    assert "FAIL  does not mutate its input" in r.stdout  # the in-place defense of the same file


def test_the_shipped_results_folders_are_gleaks(tmp_path):
    """A fresh clone has results/* without a store (gitignored) but with the manifest committed: `gleak run` may
    write there, and the manifest lists exactly the files gleak writes (nothing else in the folder is touched)."""
    from gleak.orchestration import output_folder as folder
    from gleak.orchestration.store import check_store

    root = Path(__file__).resolve().parent.parent / "results"
    shipped = [d for d in sorted(root.iterdir()) if d.is_dir()]
    assert shipped
    for d in shipped:
        copy = tmp_path / d.name
        shutil.copytree(d, copy, ignore=shutil.ignore_patterns("results.sqlite*", ".lock"))
        m = folder.claim(copy, False, check_store)
        assert m.files and all(folder.is_gleak_name(f) for f in m.files)
        assert "leaderboard.md" in m.files and not (m.files & {"paper_tables.md"})
    (tmp_path / "quick" / "gleak-manifest.json").unlink()
    with pytest.raises(cli.InputError, match="not a gleak output folder"):
        folder.claim(tmp_path / "quick", False, check_store)


LABELLED = '''
from gleak import register_defense
from gleak.contracts.plugin import Defense


@register_defense("labelled")
class Labelled(Defense):
    """Test defense: the identity, with a free-text label (which shows in the leaderboard and the figures)."""

    def __init__(self, label: str = "x"):
        self.label = label
'''


def test_names_and_descriptions_are_escaped_and_never_math(tmp_path, capsys, gleak_cli):
    """HTML and '|' in a description and in parameters reach leaderboard.md as text, and a '$' (bad math text) in a
    parameter does not stop the figures."""
    plugin = tmp_path / "labelled.py"
    plugin.write_text(LABELLED)
    suite = tmp_path / "s.toml"
    suite.write_text(TINY.replace("save_images = false", 'save_images = true\ndescription = "<script>alert(1)</script> & more"')
                     .replace('name = "none"', 'name = "labelled"\nlabel = ["a $\\\\frac{$ b", "<b>bold</b>|pipe"]'))  # fmt: skip
    out = tmp_path / "o"
    code, err = gleak_cli(["run", str(suite), "--out", str(out), "--no-progress", "--in-process", "--plugin", str(plugin)])
    assert code == 0, err
    md = (out / "leaderboard.md").read_text()
    outside_code = "".join(md.split("`")[::2])
    assert "&lt;script>" in md and "<script>" not in outside_code and "<b>" not in outside_code
    assert "a $\\\\frac{$ b" in md and "\\|pipe" in md  # Markdown-escaped: a backslash doubled, renders as written
    assert list((out / "figures").glob("reconstructions_*.png"))
