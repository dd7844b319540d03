"""Progress inside long trials (gleak.mechanics.progress): the optimisation attacks report their iterations, and
`gleak run --verbose` shows them on stderr, from the worker process that runs the trial."""
import re
import subprocess
from pathlib import Path

import pytest

from gleak.api import trial_config
from gleak.mechanics.progress import line_printer, reporting
from gleak.orchestration.trial import run_trial

ROOT = Path(__file__).resolve().parent.parent
CASE = dict(dataset="skimage", model="mlp", model_params={"hidden": [16]}, resolution=8, batch_size=1)

SUITE = """
[suite]
name = "prog"
[case]
dataset = "skimage"
model = "mlp"
model_params = { hidden = [16] }
resolution = 8
batch_size = 1
[[attack]]
name = "dlg"
iterations = 20
max_iter = 2
restarts = 1
[[defense]]
name = "none"
"""


@pytest.mark.parametrize(
    "attack, total, starts",
    [({"name": "dlg", "iterations": 5, "max_iter": 2, "restarts": 2}, 5, 1),  # batched: the starts advance together
     ({"name": "dlg", "iterations": 5, "max_iter": 2, "restarts": 2, "batch_restarts": "loop"}, 5, 2),
     ({"name": "inverting-gradients", "iterations": 6, "restarts": 2}, 6, 1),
     ({"name": "gradinversion", "iterations": 4, "restarts": 2, "warmup": 1}, 4, 1)],
)  # fmt: skip
def test_each_optimisation_attack_reports_every_iteration(attack, total, starts):
    calls = []
    row = run_trial(trial_config(attack, "none", **CASE), progress=lambda s, t, loss: calls.append((s, t, loss)))
    assert row["status"] == "ok", row["error"]
    assert [(s, t) for s, t, _ in calls] == [(s, total) for _ in range(starts) for s in range(1, total + 1)]
    if attack["name"] != "gradinversion":  # the matching loss, where the loop has it
        assert all(loss is not None for _, _, loss in calls)


def test_a_trial_reports_to_its_own_sink_only():
    from gleak.mechanics.progress import report

    outer = []
    dlg = {"name": "dlg", "iterations": 2, "max_iter": 1, "restarts": 1}
    with reporting(lambda *a: outer.append(a)):
        run_trial(trial_config(dlg, "none", **CASE))  # no sink of its own: its iterations go nowhere
        report(1, 1, 0.5)
    report(2, 2, 0.5)  # nobody listens: a no-op
    assert outer == [(1, 1, 0.5)]


def test_line_printer_every_tenth_and_the_last(capsys):
    import torch

    sink = line_printer("trial abc dlg")
    for s in range(1, 26):
        sink(s, 25, torch.tensor(float(s)))
    sink(3, 3, torch.tensor([0.5, 0.25]))  # a loss per restart: the best one
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "gleak: trial abc dlg: iteration 1/25, loss 1"  # the first, at once
    assert [int(re.search(r"iteration (\d+)/", ln).group(1)) for ln in lines[:-1]] == [1, *range(2, 25, 2), 25]
    assert lines[-1] == "gleak: trial abc dlg: iteration 3/3, loss 0.25"


def test_gleak_run_verbose_shows_a_dlg_trial_iterations_from_its_worker(tmp_path, gleak_cmd, run_env):
    suite = tmp_path / "prog.toml"
    suite.write_text(SUITE)
    base = [*gleak_cmd, "run", str(suite), "--no-progress"]
    r = subprocess.run([*base, "--verbose", "--out", str(tmp_path / "v")], env=run_env, capture_output=True,
                       text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr
    from gleak.orchestration.suite import load_suite

    tid = load_suite(suite).trials[0].trial_id[:12]
    shown = re.findall(rf"^gleak: trial {tid} dlg seed 0: iteration (\d+)/20, loss \S+$", r.stderr, re.M)
    assert shown == ["1", *(str(i) for i in range(2, 21, 2))], r.stderr


def test_gleak_run_without_verbose_shows_no_iterations(tmp_path, capfd):
    from gleak.cli import main

    suite = tmp_path / "prog.toml"
    suite.write_text(SUITE)
    assert main(["run", str(suite), "--no-progress", "--in-process", "--out", str(tmp_path / "q")]) == 0
    err = capfd.readouterr().err
    assert "gleak: suite 'prog'" in err and "iteration" not in err


def test_line_printer_writes_at_least_every_few_seconds(capsys, monkeypatch):
    """Between two tenths of a long loop, a line whenever every_seconds have passed since the last one."""
    clock = iter(range(0, 10_000, 4))  # each iteration takes 4 s
    monkeypatch.setattr("gleak.mechanics.progress.time.monotonic", lambda: float(next(clock)))
    sink = line_printer("t", every_seconds=10.0)
    for s in range(1, 8):
        sink(s, 24_000, None)
    steps = [int(re.search(r"iteration (\d+)/", ln).group(1)) for ln in capsys.readouterr().err.splitlines()]
    assert steps == [1, 4, 7]  # at 0 s, then 12 s and 24 s


class _FirstLine(Exception):
    pass


def test_a_long_inverting_gradients_trial_prints_its_first_line_within_seconds(monkeypatch):
    """The sink `gleak run --verbose` gives a trial (gleak.orchestration.workers.progress_sink), on inverting gradients' paper
    preset (24,000 iterations: on a real model a tenth of them takes minutes): its first line is iteration 1, within
    30 s (a generous bound for the 5 s aim) of the trial's start. The test stops the trial at that line."""
    import time

    from gleak.orchestration.trial import run_trial
    from gleak.orchestration.workers import TrialEnv, progress_sink

    cfg = trial_config({"name": "inverting-gradients", "preset": "paper"}, "none", **CASE)

    class Stderr:
        def write(self, text):
            if "iteration" in text:
                raise _FirstLine(text)

        def flush(self):
            pass

    monkeypatch.setattr("sys.stderr", Stderr())
    t0 = time.perf_counter()
    row = run_trial(cfg, progress=progress_sink(cfg, TrialEnv(verbose=True)))
    elapsed = time.perf_counter() - t0
    assert row["status"] == "failed" and "_FirstLine" in row["error"] and "iteration 1/24000" in row["error"], row["error"]
    assert elapsed < 30, elapsed


def test_the_run_bar_moves_inside_a_trial_from_its_worker(tmp_path, gleak_cmd, run_env):
    """A one-trial run with its bar on: the worker tells the bar where the attack's loop is, so the bar shows the
    trial's iterations (the first and the last at least) before the trial's row arrives."""
    suite = tmp_path / "prog.toml"
    suite.write_text(SUITE)
    r = subprocess.run([*gleak_cmd, "run", str(suite), "--out", str(tmp_path / "b")], env=run_env, capture_output=True,
                       text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr
    from gleak.orchestration.suite import load_suite

    tid = load_suite(suite).trials[0].trial_id[:8]
    shown = re.findall(rf"0/1 trials \[[^\]]*; trial {tid}: (\d+)/20 it\]", r.stderr)
    assert "1" in shown and "20" in shown, r.stderr
    assert "iteration" not in r.stderr  # the bar, not --verbose's lines


def test_the_bar_counts_a_running_trial_s_share_of_its_loop_in_the_time_left(monkeypatch):
    """One trial of a run, half of its 24,000 iterations done after 60 s: about 60 s left, not '?'."""
    from gleak.orchestration.runner import Progress

    now = [0.0]
    monkeypatch.setattr("gleak.orchestration.runner.time.perf_counter", lambda: now[0])
    bar = Progress(1, 10.0, enabled=False)
    now[0] = 60.0
    bar.inside("abcdef0123456789", 10.0, 12_000, 24_000)
    text = bar._postfix()
    assert "left 01:00" in text and "trial abcdef01: 12,000/24,000 it" in text, text
    bar.update(10.0, True, "abcdef0123456789")  # the row: the trial's share is done, its iterations no longer shown
    assert "it" not in bar._postfix().split(";")[-1] and not bar.running
