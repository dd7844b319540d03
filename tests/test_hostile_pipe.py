"""Output into a reader that goes away (`gleak list | head -1`): the command stops printing, exits with its own
status and no traceback, and a run still stores every trial and writes every report (gleak.cli._ClosedPipeQuiet)."""
import hashlib
import os
import subprocess
import sys

from tests.test_hostile_store import T1


def _closed_pipe_run(args, run_env, cwd, stderr_too=False):
    """Run the CLI with its stdout (and stderr) a pipe whose reader is gone before the first line: every write
    meets a broken pipe."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "gleak", *args], stdout=w, stderr=w if stderr_too else subprocess.PIPE,
                           env=run_env, cwd=cwd, timeout=300)  # fmt: skip
    finally:
        os.close(w)
    return p


def test_list_into_a_closed_pipe_is_quiet_and_exit_0(run_env, tmp_path):
    p = _closed_pipe_run(["list", "attacks"], run_env, tmp_path)
    assert p.returncode == 0 and p.stderr == b"", p.stderr.decode()[-2000:]


def test_list_into_head_prints_its_first_line(run_env, tmp_path):
    p = subprocess.run(f"{sys.executable} -m gleak list attacks | head -1; exit ${{PIPESTATUS[0]}}", shell=True,
                       executable="/bin/bash", env=run_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0 and p.stdout.startswith("closed-form") and p.stdout.count("\n") == 1, p
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def _tree(folder):
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.rglob("*"))
            if f.is_file() and f.name not in (".lock", "results.sqlite")}  # fmt: skip


def test_a_run_into_a_closed_pipe_finishes_with_its_reports(run_env, tmp_path):
    (tmp_path / "t1.toml").write_text(T1)
    out = tmp_path / "o"
    p = _closed_pipe_run(["run", "t1.toml", "--out", "o", "--in-process"], run_env, tmp_path, stderr_too=True)
    assert p.returncode == 0
    for name in ("leaderboard.md", "leaderboard.html", "results.csv", "leaderboard.csv", "suite.json"):
        assert (out / name).is_file(), name
    before = _tree(out)
    again = subprocess.run([sys.executable, "-m", "gleak", "leaderboard", "o"], env=run_env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert _tree(out) == before  # the reports were complete: written again, byte for byte the same
