"""Running at scale and under faults: worker processes, Ray, the folder lock, killed workers and killed runs.

One small suite (36 trials of 50-150 ms: closed-form and iDLG on an MLP, with and without defenses) is the yardstick:
a clean in-process run of it is the reference that every other way of running it must reproduce exactly.
"""
import csv
import fcntl
import hashlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from _store_sql import connect

from gleak.orchestration.runner import estimated_costs, longest_first, run_suite
from gleak.orchestration.store import Store, arrays_digest
from gleak.orchestration.suite import load_suite

SCALE = """
[suite]
name = "scale"
seeds = [0, 1, 2]
[case]
dataset = "uniform"
resolution = 16
channels = 3
model = "mlp"
model_params = { hidden = [512] }
batch_size = [1, 4]
[[attack]]
name = "closed-form"
[[attack]]
name = "idlg"
[[defense]]
name = "none"
[[defense]]
name = "noise"
sigma = 1e-3
[[defense]]
name = "topk"
ratio = 0.9
"""
N_SCALE = 36
METRICS = "status, error, mse, psnr, rpsnr, ssim, lpips, label_acc, cosine, iip, grad_dist, matched, verdict, extra"


def metrics(folder: Path) -> dict[str, tuple]:
    con = sqlite3.connect(folder / "results.sqlite")
    try:
        return {r[0]: r[1:] for r in con.execute(f"SELECT trial_id, {METRICS} FROM trials")}
    finally:
        con.close()


def _read(folder: Path) -> sqlite3.Connection:
    """A read-only connection: a plain connect would create an empty results.sqlite while a run is about to create
    its store, and the run then (rightly) refuses the empty file."""
    return sqlite3.connect(f"file:{folder / 'results.sqlite'}?mode=ro", uri=True, timeout=0.1)


def stored(folder: Path) -> int:
    try:
        con = _read(folder)
        try:
            return con.execute("SELECT COUNT(*) FROM trials WHERE status = 'ok'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def wait_until(cond, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not cond():
        time.sleep(0.02)


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def children() -> dict[int, list[int]]:
    """parent pid -> child pids, from /proc."""
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def scale_suite(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("suite") / "scale.toml"
    p.write_text(SCALE)
    return p


@pytest.fixture(scope="module")
def reference(scale_suite, tmp_path_factory) -> dict[str, tuple]:
    """The suite run cleanly, one trial after another (on one worker process, the default)."""
    out = tmp_path_factory.mktemp("reference")
    summary = run_suite(load_suite(scale_suite), out, workers=1, progress=False)
    assert summary.ran == N_SCALE and summary.failed == 0
    ref = metrics(out)
    assert len(ref) == N_SCALE and all(m[0] == "ok" for m in ref.values())
    assert sum(m[2] is not None and m[2] < 1e-6 for m in ref.values()) >= 6  # closed form recovers: not a vacuous yardstick
    return ref


def test_same_metrics_when_run_twice_and_with_1_or_2_workers(tmp_path, scale_suite, reference):
    suite = load_suite(scale_suite)
    run_suite(suite, tmp_path / "again", workers=1, progress=False, in_process=True)  # the debugging mode
    assert metrics(tmp_path / "again") == reference
    summary = run_suite(suite, tmp_path / "two", workers=2, progress=False)
    assert summary.ran == N_SCALE
    assert metrics(tmp_path / "two") == reference
    assert len(list((tmp_path / "two" / "images").glob("*.png"))) == N_SCALE // 2  # idlg reconstructs labels only


def test_trials_stored_under_an_older_id_rule_are_rekeyed_not_recomputed(tmp_path, scale_suite, reference):
    """A change of the id rule that changes no computation (a later CaseConfig field at its default) must not make a
    rerun recompute the stored trials: the run re-derives each stored trial's id from its stored config."""
    suite, out = load_suite(scale_suite), tmp_path / "old"
    run_suite(suite, out, workers=1, progress=False)
    db = connect(out)
    with db:  # what an older rule's ids look like: other hashes of the same configs, images named after them
        for (tid, image) in db.execute("SELECT trial_id, image FROM trials").fetchall():
            old = hashlib.sha256(tid.encode()).hexdigest()[:16]
            if image:
                (out / "images" / image).rename(out / "images" / f"{old}.png")
            db.execute("UPDATE trials SET trial_id = ?, image = ? WHERE trial_id = ?", (old, f"{old}.png" if image else None, tid))
            for (arrays,) in db.execute("SELECT arrays FROM reconstructions WHERE trial_id = ?", (tid,)).fetchall():
                db.execute("UPDATE reconstructions SET trial_id = ?, digest = ? WHERE trial_id = ?",
                           (old, arrays_digest(old, arrays), tid))  # fmt: skip
    db.close()
    summary = run_suite(suite, out, workers=1, progress=False)
    assert summary.ran == 0
    assert metrics(out) == reference
    store = Store(out, create=False)  # the arrays follow their trial to its new id, still bound to it
    assert len(store.reconstructions()) == N_SCALE // 2
    store.close()
    db = sqlite3.connect(out / "results.sqlite")
    named = sorted(r[0] for r in db.execute("SELECT trial_id FROM trials WHERE image = trial_id || '.png'"))
    db.close()
    assert len(named) == N_SCALE // 2
    assert sorted(p.stem for p in (out / "images").glob("*.png")) == named


def test_ray_executor_on_a_local_cluster_gives_the_same_results(tmp_path, scale_suite, reference, gleak_cmd, run_env):
    """The scale suite through Ray matches the reference trial by trial; in the same run, a trial whose worker dies
    once is retried and stored, one whose worker dies twice is stored as failed."""
    if not os.environ.get("CI"):
        pytest.importorskip("ray")  # CI installs it (README's set-up line): there the test must run
    plugin = tmp_path / "faulty.py"
    plugin.write_text(FAULTY)
    suite = tmp_path / "scale-and-faults.toml"
    suite.write_text(scale_suite.read_text() + textwrap.dedent(f"""
        [[grid]]
        name = "scale"
        [[grid]]
        name = "faults"
        seeds = [0]
        case = {{ batch_size = 1 }}
        attack = [{{ name = "faulty", mode = "die", deaths = 1, marks = "{tmp_path / 'once'}" }},
                  {{ name = "faulty", mode = "die", deaths = 2, marks = "{tmp_path / 'twice'}" }}]
        defense = [{{ name = "none" }}]
    """))  # fmt: skip
    out = tmp_path / "ray"
    r = subprocess.run(gleak_cmd + ["run", str(suite), "--out", str(out), "--no-progress", "--executor", "ray",
                                    "--workers", "2", "--plugin", str(plugin)], env=run_env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "on Ray" in r.stderr and f"{N_SCALE + 2} trials run" in r.stderr
    got = metrics(out)
    assert {t: got[t] for t in reference} == reference
    faulty = {json.loads(x["attack_params"])["deaths"]: x for x in csv.DictReader((out / "results.csv").open()) if x["attack"] == "faulty"}
    assert faulty[1]["status"] == "ok"
    assert faulty[2]["status"] == "failed" and faulty[2]["error"].startswith("WorkerDied") and "on all 2 attempts" in faulty[2]["error"]
    assert len(list((tmp_path / "twice").iterdir())) == 2
    images = {p.name for p in (out / "images").glob("*.png")}  # written by the driver from bytes the tasks return
    assert len(images) == N_SCALE // 2 + 1
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {x["image"] for x in rows if x["image"]} == images


FAULTY = '''
import os
import signal
from pathlib import Path

import torch

from gleak import register_attack
from gleak.contracts.plugin import Attack
from gleak.contracts.wire import Reconstruction


@register_attack("faulty")
class Faulty(Attack):
    """Test attack: raises, returns NaN, or kills its own process the first `deaths` times it runs."""

    needs = frozenset({"architecture"})

    def __init__(self, mode: str = "raise", deaths: int = 0, marks: str = ""):
        self.mode, self.deaths, self.marks = mode, deaths, marks

    def reconstruct(self, observation, rng):
        if self.mode == "raise":
            raise RuntimeError("boom")
        if self.mode == "die":
            Path(self.marks).mkdir(exist_ok=True)
            n = len(list(Path(self.marks).iterdir()))
            if n < self.deaths:
                (Path(self.marks) / str(n)).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        x = torch.zeros((1, *observation.knowledge.input_shape))
        return Reconstruction(x=x * float("nan") if self.mode == "nan" else x)
'''


def test_raising_nan_and_dying_trials_are_stored_as_failed_and_the_run_goes_on(tmp_path, gleak_cmd, run_env):
    plugin = tmp_path / "faulty.py"
    plugin.write_text(FAULTY)
    suite = tmp_path / "faults.toml"
    suite.write_text(textwrap.dedent(f"""
        [suite]
        name = "faults"
        save_images = false
        [case]
        dataset = "uniform"
        model = "linear"
        [[attack]]
        name = "faulty"
        mode = ["raise", "nan"]
        [[attack]]
        name = "faulty"
        mode = "die"
        deaths = 1
        marks = "{tmp_path / 'once'}"
        [[attack]]
        name = "faulty"
        mode = "die"
        deaths = 2
        marks = "{tmp_path / 'twice'}"
        [[attack]]
        name = "closed-form"
        [[defense]]
        name = "none"
    """))
    out = tmp_path / "out"
    r = subprocess.run(gleak_cmd + ["run", str(suite), "--out", str(out), "--workers", "2", "--plugin", str(plugin)],
                       env=run_env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "failed 3" in r.stderr and "left" in r.stderr  # the progress bar counts failures and estimates time left
    by = {}
    for x in csv.DictReader((out / "results.csv").open()):
        params = json.loads(x["attack_params"])
        by[(x["attack"], params.get("mode"), params.get("deaths"))] = x
    assert by[("faulty", "raise", 0)]["error"] == "RuntimeError: boom"
    assert by[("faulty", "nan", 0)]["error"] == "FloatingPointError: the reconstruction has NaN or infinite pixels"
    assert by[("faulty", "die", 1)]["status"] == "ok"  # killed once, retried once on a fresh worker
    died = by[("faulty", "die", 2)]
    assert died["status"] == "failed" and died["error"].startswith("WorkerDied") and "(killed by SIGKILL) on all 2 attempts" in died["error"]
    assert by[("closed-form", None, None)]["status"] == "ok" and float(by[("closed-form", None, None)]["mse"]) < 1e-10
    assert len(list((tmp_path / "twice").iterdir())) == 2  # it ran exactly twice


def test_a_second_run_on_a_locked_folder_refuses_in_one_line_and_changes_nothing(tmp_path, gleak_cmd, run_env):
    suite = tmp_path / "tiny.toml"
    suite.write_text('[suite]\nname = "tiny"\n[case]\ndataset = "uniform"\nmodel = "linear"\n'
                     '[[attack]]\nname = "closed-form"\n[[defense]]\nname = "none"\n')  # fmt: skip
    out = tmp_path / "out"
    run_suite(load_suite(suite), out, progress=False)
    partial = out / "images" / ".0123456789abcdef.png.gleak-tmp-a1b2c3d4"  # what a writer killed mid-image leaves
    partial.write_bytes(b"half")
    digest = tree_digest(out)
    with open(out / ".lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running gleak holds it
        r = subprocess.run(gleak_cmd + ["run", str(suite), "--out", str(out), "--workers", "2"], env=run_env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "another gleak run" in lines[0], lines
    assert tree_digest(out) == digest
    run_suite(load_suite(suite), out, progress=False)
    assert not partial.exists()  # the next run that holds the lock cleans up


def test_two_runs_started_at_once_on_one_folder(tmp_path, scale_suite, reference, gleak_cmd, run_env):
    out = tmp_path / "out"
    cmd = gleak_cmd + ["run", str(scale_suite), "--out", str(out), "--no-progress", "--workers", "2"]
    procs = [subprocess.Popen(cmd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = sorted((p.wait(300), p.stderr.read()) for p in procs)
    assert [code for code, _ in results] == [0, 2], results
    refused = results[1][1].strip().splitlines()
    assert len(refused) == 1 and "another gleak run" in refused[0]
    assert metrics(out) == reference


def test_killing_workers_and_the_main_process_at_random_points(tmp_path, scale_suite, reference, gleak_cmd, run_env):
    """Several runs, each killed (a worker, the main process, or both, with SIGKILL) after a random number of stored
    trials; then one run to the end. Every trial must appear exactly once, with the clean run's metrics, trials
    stored before a kill are never recomputed, a killed run leaves no process behind, nothing is half-written."""
    rng = random.Random(2024)
    out = tmp_path / "out"
    cmd = gleak_cmd + ["run", str(scale_suite), "--out", str(out), "--no-progress", "--workers", "2"]
    kills: Counter = Counter()
    kept: dict[str, float] = {}  # ok trials stored before a kill of the main process -> their finished_at
    targets = ["main", "both", "both"]
    rng.shuffle(targets)
    for target in targets + ["worker"]:  # the last run loses a worker and goes on to the end
        before = stored(out)
        proc = subprocess.Popen(cmd, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        k = rng.randint(1, 6)
        wait_until(lambda: proc.poll() is not None or stored(out) >= before + k, 120)
        if target in ("worker", "both") and proc.poll() is None:
            workers = [w for c in children().get(proc.pid, []) for w in children().get(c, [])]
            if workers:
                os.kill(rng.choice(workers), signal.SIGKILL)
                kills["worker"] += 1
            if target == "both":
                time.sleep(rng.uniform(0.0, 0.25))
        if target in ("main", "both") and proc.poll() is None:
            family = [c for c in children().get(proc.pid, [])]
            family += [g for c in family for g in children().get(c, [])]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills["main"] += 1
            wait_until(lambda: not any(alive(p) for p in family), 20)
            assert not [p for p in family if alive(p)], "processes of a killed run are still running"
            if (out / "results.sqlite").exists():  # a run killed before it created its store stored nothing
                con = _read(out)
                kept.update(con.execute("SELECT trial_id, finished_at FROM trials WHERE status = 'ok'").fetchall())
                con.close()
    assert proc.wait(300) == 0, proc.stderr.read()  # the last run: a worker killed mid-trial, its trial retried
    assert kills["main"] == 3 and kills["worker"] == 3, kills
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert Counter(x["trial_id"] for x in rows) == Counter({t: 1 for t in reference})  # each trial exactly once
    assert metrics(out) == reference
    con = sqlite3.connect(out / "results.sqlite")
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    now = dict(con.execute("SELECT trial_id, finished_at FROM trials").fetchall())
    con.close()
    assert kept and all(now[t] == f for t, f in kept.items())  # stored before a kill: never recomputed
    leftovers = [p.name for p in out.rglob("*") if p.name.startswith(".") and p.name != ".lock" or p.name.endswith("-journal")]
    assert not leftovers
    from PIL import Image

    images = sorted((out / "images").glob("*.png"))
    assert len(images) == N_SCALE // 2
    for p in images:
        with Image.open(p) as im:
            im.load()  # a truncated PNG raises here


def test_cost_estimates_order_long_trials_first(tmp_path, monkeypatch):
    suite = tmp_path / "mixed.toml"
    suite.write_text(SCALE + '[[grid]]\ncase = { model_params = { hidden = [16] } }\n'
                     '[[grid]]\ncase = { model_params = { hidden = [1024] } }\n')  # fmt: skip
    trials = load_suite(suite).trials
    costs = estimated_costs(trials)
    by = {(t.case.model_params["hidden"][0], t.case.batch_size, t.attack): costs[t.trial_id] for t in trials}
    assert by[(1024, 1, "idlg")] > by[(16, 1, "idlg")] and by[(16, 4, "idlg")] > by[(16, 1, "idlg")]
    assert by[(1024, 4, "idlg")] > by[(1024, 1, "idlg")]
    order = longest_first(trials, costs)
    assert [costs[t.trial_id] for t in order] == sorted(costs.values(), reverse=True)

    from gleak.contracts.plugin import Plugin
    from gleak.contracts.registry import plugin_info

    ClosedForm = plugin_info("attack", "closed-form").obj

    assert Plugin.estimated_cost({"iterations": 300, "restarts": 2}, None) == 600  # the default for optimisers
    monkeypatch.setattr(ClosedForm, "estimated_cost", classmethod(lambda cls, params, case: 1e9), raising=False)
    costs = estimated_costs(trials)
    assert longest_first(trials, costs)[0].attack == "closed-form"  # a plugin's own estimate is used


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["--workers", "lots"], "--workers must be a number or 'auto', got 'lots'"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--address", "auto"], "--address names a Ray cluster: use it with --executor ray"),
    ],
)
def test_bad_run_options_are_one_line_exit_2(tmp_path, gleak_cmd, run_env, gleak_cli, args, needle):
    """Each in this process (cli.main, as `python -m gleak` calls it); the first also as a subprocess, the user's
    own exit code and stderr."""
    runs = [gleak_cli(["run", "quick", "--out", str(tmp_path / "o")] + args)]
    if args[0] == "--workers" and args[1] == "0":
        r = subprocess.run(gleak_cmd + ["run", "quick", "--out", str(tmp_path / "o")] + args, env=run_env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        runs.append((r.returncode, r.stderr))
    for code, err in runs:
        assert code == 2 and err.strip() == f"gleak: error: {needle}"
        assert not (tmp_path / "o").exists()
