"""The command line as a user meets it: exit codes, one-line errors, nothing stored changed on bad input."""
import csv
import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

CONTRACT = ["suite", "trial_id", "attack", "attack_params", "defense", "defense_params", "model", "dataset",
            "batch_size", "seed", "status", "mse", "psnr", "ssim", "lpips", "label_acc", "verdict", "seconds", "error"]  # fmt: skip

SMALL = """
[suite]
name = "small"
seeds = [0, 1]
[case]
dataset = "skimage"
resolution = 16
model = "mlp"
model_params = { hidden = [32] }
batch_size = [1, 2]
[[attack]]
name = "closed-form"
[[attack]]
name = "idlg"
[[defense]]
name = "none"
[[defense]]
name = "topk"
ratio = [0.5, 0.99]
"""


def _run(cmd, args, env, **kw):
    return subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=600, **kw)


def _tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_run_writes_the_output_contract_and_rerun_skips(tmp_path, gleak_cmd, run_env):
    suite = tmp_path / "small.toml"
    suite.write_text(SMALL)
    out = tmp_path / "out"
    r = _run(gleak_cmd, ["run", str(suite), "--out", str(out), "--no-progress"], run_env)
    assert r.returncode == 0, r.stderr
    assert "leaderboard.md" in r.stdout
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 24 and set(CONTRACT) <= set(rows[0])
    cf = [x for x in rows if x["attack"] == "closed-form" and x["defense"] == "none" and x["batch_size"] == "1"]
    assert all(float(x["mse"]) < 1e-10 for x in cf)
    idlg = [x for x in rows if x["attack"] == "idlg"]
    assert all(x["mse"] == "" and x["psnr"] == "" for x in idlg)  # unavailable metrics are empty, not zero
    assert all(x["lpips"] == "" for x in rows)  # no backbone weights on this machine
    md = (out / "leaderboard.md").read_text()
    assert "## Defenses, ranked by their worst case" in md and "LPIPS is unavailable" in md
    assert (out / "leaderboard.tex").is_file() and (out / "leaderboard.csv").is_file()
    assert any((out / "images").glob("*.png"))

    before = {x["trial_id"]: x["seconds"] for x in rows}
    r = _run(gleak_cmd, ["run", str(suite), "--out", str(out), "--no-progress"], run_env)
    assert r.returncode == 0 and "0 trials run, 24 already stored" in r.stderr
    after = {x["trial_id"]: x["seconds"] for x in csv.DictReader((out / "results.csv").open())}
    assert after == before


def test_failed_trials_exit_1_and_say_why(tmp_path, gleak_cmd, run_env):
    plugin = tmp_path / "boom.py"  # an attack that raises: a failure (an UnsupportedCase would be not-applicable)
    plugin.write_text(textwrap.dedent('''
        from gleak import register_attack
        from gleak.contracts.plugin import Attack

        @register_attack("boom")
        class Boom(Attack):
            """Raises (a test)."""
            def reconstruct(self, observation, rng):
                raise RuntimeError("boom on purpose")
    '''))
    suite = tmp_path / "boom.toml"
    suite.write_text(SMALL.replace('name = "closed-form"', 'name = "boom"').replace("batch_size = [1, 2]", "batch_size = 1"))
    out = tmp_path / "out"
    r = _run(gleak_cmd, ["run", str(suite), "--out", str(out), "--no-progress", "--plugin", str(plugin)], run_env)
    assert r.returncode == 1
    rows = list(csv.DictReader((out / "results.csv").open()))
    failed = [x for x in rows if x["status"] == "failed"]
    assert failed and all(x["attack"] == "boom" and "RuntimeError: boom on purpose" in x["error"] for x in failed)
    assert all(x["status"] == "ok" for x in rows if x["attack"] == "idlg")


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A good suite and the folder its run wrote (in this process: what is tested is the bad runs after it)."""
    from gleak.cli import main

    root = tmp_path_factory.mktemp("good")
    good = root / "good.toml"
    good.write_text(SMALL.replace("seeds = [0, 1]", "seeds = [0]").replace("batch_size = [1, 2]", "batch_size = 1"))
    out = root / "out"
    assert main(["run", str(good), "--out", str(out), "--no-progress", "--in-process"]) == 0
    return good, out


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda s: s.replace('name = "closed-form"', 'name = "closed-from"'), "[attack #1] key 'name': unknown attack 'closed-from'; did you mean 'closed-form'"),
        (lambda s: s.replace('model = "mlp"', 'model = "mlp"\nbatchsize = 3'), "[case] key 'batchsize': unknown key; did you mean 'batch_size'"),
        (lambda s: s.replace("ratio = [0.5, 0.99]", 'ratio = "high"'), "[defense #2] key 'ratio': defense 'topk' parameter 'ratio' must be float"),
        (lambda s: s.replace('batch_size = 1', 'batch_size = "two"'), "[case] key 'batch_size': must be int"),
        (lambda s: s.replace('dataset = "skimage"', 'dataset = "fashion-mnist"\ndata_root = "/nonexistent"'), "[case] key 'dataset': dataset 'fashion-mnist': /nonexistent/train-images-idx3-ubyte.gz not found"),
        (lambda s: s.replace('dataset = "skimage"', 'dataset = "cifar10"\ndata_root = "/nonexistent"'), "[case] key 'dataset': dataset 'cifar10': not found under /nonexistent"),
        (lambda s: s.replace("[suite]", "[suit]"), "[suit]: unknown table; did you mean 'suite'"),
        (lambda s: s + "\n[[defense]\n", "not valid TOML"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(tmp_path, good_run, gleak_cmd, run_env, capfd, edit, needle):
    """Each bad suite in this process (cli.main, as `python -m gleak` calls it); the first also as a subprocess, the
    user's own exit code and stderr."""
    from gleak.cli import main

    good, done = good_run
    out = tmp_path / "out"
    shutil.copytree(done, out)  # a folder a good run wrote (once for all cases: each bad run gets its own copy)
    digest = _tree_digest(out)
    bad = tmp_path / "bad.toml"
    bad.write_text(edit(good.read_text()))
    capfd.readouterr()
    runs = [(main(["run", str(bad), "--out", str(out), "--no-progress"]), capfd.readouterr().err)]
    if "closed-from" in needle:
        r = _run(gleak_cmd, ["run", str(bad), "--out", str(out), "--no-progress"], run_env)
        runs.append((r.returncode, r.stderr))
    for code, err in runs:
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and str(bad) in lines[0] and needle in lines[0], lines
        assert _tree_digest(out) == digest


def test_plugin_file_that_does_not_import_is_exit_2(tmp_path, gleak_cmd, run_env):
    plug = tmp_path / "plug.py"
    plug.write_text("def broken(:\n")
    r = _run(gleak_cmd, ["run", "quick", "--plugin", str(plug), "--out", str(tmp_path / "o")], run_env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "plug.py" in r.stderr and "SyntaxError" in r.stderr
    assert not (tmp_path / "o").exists()
    r = _run(gleak_cmd, ["check-plugin", str(plug)], run_env)
    assert r.returncode == 2 and "plug.py" in r.stderr


def test_unknown_plugin_name_in_check_plugin(gleak_cmd, run_env):
    r = _run(gleak_cmd, ["check-plugin", "top-k"], run_env)
    assert r.returncode == 2 and "did you mean 'topk'" in r.stderr


def test_list_shows_builtins_with_summaries(gleak_cmd, run_env):
    r = _run(gleak_cmd, ["list", "attacks"], run_env)
    assert r.returncode == 0
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()}
    assert "closed-form" in lines and "idlg" in lines and all(len(ln.split()) > 2 for ln in lines.values())
    r = _run(gleak_cmd, ["list", "defenses"], run_env)
    assert {"none", "noise", "quantization", "topk"} <= {ln.split()[0] for ln in r.stdout.splitlines()}


def _closed_form_suite(name: str, seeds: int) -> str:
    """A suite of `seeds` cheap closed-form trials on 8x8 uniform images: many trials, each well under a second, for
    the tests that stop a run part-way."""
    return textwrap.dedent(f"""
        [suite]
        name = "{name}"
        seeds = {seeds}
        save_images = false
        [case]
        dataset = "uniform"
        resolution = 8
        channels = 1
        model = "linear"
        [[attack]]
        name = "closed-form"
        [[defense]]
        name = "noise"
    """)


def test_sigkill_halfway_then_resume_recomputes_nothing(tmp_path, gleak_cmd, run_env):
    suite = tmp_path / "long.toml"
    suite.write_text(_closed_form_suite("long", 120))
    out = tmp_path / "out"
    proc = subprocess.Popen(gleak_cmd + ["run", str(suite), "--out", str(out), "--no-progress"], env=run_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    db = out / "results.sqlite"
    deadline = time.time() + 120
    n = 0
    while time.time() < deadline:
        if db.exists():
            try:
                n = sqlite3.connect(db).execute("SELECT COUNT(*) FROM trials").fetchone()[0]
            except sqlite3.Error:
                n = 0
            if n >= 30:
                break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    con = sqlite3.connect(db)
    first = dict(con.execute("SELECT trial_id, finished_at FROM trials").fetchall())
    con.close()
    assert 30 <= len(first) < 120, len(first)
    r = _run(gleak_cmd, ["run", str(suite), "--out", str(out), "--no-progress"], run_env)
    assert r.returncode == 0, r.stderr
    con = sqlite3.connect(db)
    rows = con.execute("SELECT trial_id, finished_at FROM trials").fetchall()
    assert len(rows) == 120 and len({t for t, _ in rows}) == 120
    assert all(dict(rows)[t] == f for t, f in first.items())  # finished trials were not recomputed
    n = 120 - len(first)
    assert f"{n} trials run: {n} ok, 0 failed, 0 not applicable, {len(first)} already stored" in r.stderr
    assert len(list(csv.DictReader((out / "results.csv").open()))) == 120


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads processes' environments from /proc")
def test_sigterm_stops_the_run_and_its_workers_and_resume_recomputes_nothing(tmp_path, gleak_cmd, run_env):
    """`kill PID` (SIGTERM) on a run: exit 143 with one line, no worker process left computing (they are children of
    a forkserver, not of the run, so they outlived it before), and a rerun finishes only what was missing."""
    suite = tmp_path / "slow.toml"
    suite.write_text(_closed_form_suite("slow", 12))
    out, tag = tmp_path / "out", f"gleak-sigterm-{os.getpid()}-{time.time_ns()}"
    env = {**run_env, "GLEAK_TEST_TAG": tag}
    proc = subprocess.Popen(gleak_cmd + ["run", str(suite), "--out", str(out), "--no-progress", "--workers", "2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    db, deadline = out / "results.sqlite", time.time() + 120
    while time.time() < deadline and not (db.exists() and _count(db) >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "gleak: terminated; finished trials are stored" in err
    time.sleep(1.0)
    assert _tagged_processes(tag) == [], "worker processes outlived the terminated run"
    r = _run(gleak_cmd, ["run", str(suite), "--out", str(out), "--no-progress"], run_env)
    assert r.returncode == 0, r.stderr
    assert _count(db) == 12


def _count(db: Path) -> int:
    try:
        return sqlite3.connect(db).execute("SELECT COUNT(*) FROM trials").fetchone()[0]
    except sqlite3.Error:
        return 0


def _tagged_processes(tag: str) -> list[int]:
    """Processes whose environment carries `tag` (a run and everything it started inherit it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if tag.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def test_a_bad_suite_is_refused_before_the_lpips_weights_are_fetched(tmp_path, monkeypatch, capsys):
    """The weights are 233 MB: a suite that cannot run (an unknown attack) is one line before any fetch starts."""
    from gleak.cli import main
    from gleak.mechanics import perceptual

    fetched = []
    monkeypatch.setattr(perceptual, "fetch_weights", lambda say=None: fetched.append(1))
    monkeypatch.setattr(perceptual, "hub_weights_file", lambda: tmp_path / "absent.pth")
    monkeypatch.delenv("GLEAK_LPIPS_NO_DOWNLOAD", raising=False)
    monkeypatch.delenv(perceptual.LPIPS_ENV, raising=False)
    suite = tmp_path / "bad.toml"
    suite.write_text('[suite]\nname = "bad"\nseeds = [0]\n[case]\ndataset = "uniform"\nmodel = "linear"\n'
                     '[[attack]]\nname = "no-such-attack"\n[[defense]]\nname = "none"\n')
    assert main(["run", str(suite), "--out", str(tmp_path / "o"), "--no-progress", "--in-process"]) == 2
    assert "no-such-attack" in capsys.readouterr().err and fetched == []


def test_set_changes_one_setting_and_is_validated_like_the_file(tmp_path, gleak_cli):
    """`gleak run SUITE --set KEY=VALUE --out DIR` (gleak.orchestration.suite_overrides): the changed suite's trials
    are the file's own trials where they coincide (same ids); a bad key or value is one located line, exit 2,
    nothing written; without --out it is refused (results/NAME keeps the suite as its file says)."""
    import csv
    import json

    from gleak.orchestration.suite import load_suite
    from tests.test_hostile_store import T1

    suite = tmp_path / "t1.toml"
    suite.write_text(T1.replace("[[defense]]", '[[defense]]\nname = "noise"\nsigma = [0.1, 0.01]\n[[defense]]', 1))
    full = {t.trial_id: t for t in load_suite(suite).trials}
    out = tmp_path / "o"
    code, err = gleak_cli(["run", str(suite), "--out", str(out), "--no-progress", "--in-process", "--set", "seeds=[1]",
                           "--set", "defense.sigma=0.1"])  # fmt: skip
    assert code == 0, err
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {r["seed"] for r in rows} == {"1"}
    assert {r["trial_id"] for r in rows} <= set(full)  # the same trials as the file's, where they coincide
    assert sorted(json.loads(r["defense_params"]).get("sigma", 0) for r in rows) == [0, 0.1]  # noise at 0.1; none as it was
    for bad, said in [("seeds", "KEY=VALUE"), ("nope=1", "not a [suite] key"), ("case.nope=1", "[case] key 'nope'"),
                      ("case.batch_size=0", "must be >= 1"), ("utility.clients=2", "no [utility] table"),
                      ("defense.sigma=-1", "sigma"), ("attack.sigma=1", "no [[attack]] table")]:  # fmt: skip
        code, err = gleak_cli(["run", str(suite), "--out", str(tmp_path / "bad"), "--no-progress", "--set", bad])
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, (bad, err)
    assert not (tmp_path / "bad").exists()
    code, err = gleak_cli(["run", str(suite), "--no-progress", "--set", "seeds=1"])
    assert code == 2 and "--out" in err


def test_set_on_a_case_key_wins_over_every_grid_that_sets_it():
    from gleak.orchestration.suite import SUITE_KEYS
    from gleak.orchestration.suite_overrides import apply_overrides

    doc = {"case": {"batch_size": 1}, "grid": [{"case": {"batch_size": 4}}, {"case": {"model": "mlp"}}],
           "attack": {"name": "closed-form"}}  # fmt: skip
    out = apply_overrides(doc, ["case.batch_size=8", "case.dataset=skimage"], SUITE_KEYS)
    assert out["case"] == {"batch_size": 8, "dataset": "skimage"}  # a bare word is a string
    assert out["grid"] == [{"case": {"batch_size": 8}}, {"case": {"model": "mlp"}}]
    assert doc["case"] == {"batch_size": 1}  # the file's document is left as read
