"""The folder's lock: a run holds it until its last report file is written, `gleak leaderboard` / `plot` /
`rescore` take it (refused with one line while a run writes the folder, the run unharmed), and a refused command
leaves no `.lock` behind (gleak.orchestration.folder_lock.take_lock / release_lock / holding_lock, gleak.orchestration.runner)."""

import pytest

from gleak import cli
from gleak.orchestration import folder_lock as store
from gleak.orchestration.folder_lock import LOCK_NAME
from gleak.reporting import report
from tests.test_hostile_store import T1, tree  # the 2-trial closed-form suite and the folder digest they share


@pytest.fixture
def suite_file(tmp_path):
    (tmp_path / "t1.toml").write_text(T1)
    return tmp_path / "t1.toml"


def _one_line(err: str, needle: str) -> None:
    assert len(err.strip().splitlines()) == 1 and err.startswith("gleak: error: ") and "Traceback" not in err, err
    assert needle in err, err


def test_the_run_holds_its_lock_until_its_last_report_and_a_leaderboard_meanwhile_is_refused(suite_file, tmp_path, monkeypatch, capsys):
    """While the run writes its reports (the last thing it does), `gleak leaderboard`, `plot` and `rescore` of the
    folder are refused with one line and change nothing; the run then ends well, its reports complete."""
    out = tmp_path / "o"
    real = report.write_reports
    seen = []

    def reports_while_others_try(folder, *a, **k):
        capsys.readouterr()
        before = tree(out)
        for cmd in (["leaderboard", str(out)], ["plot", str(out)], ["rescore", str(out), "--metrics", "mse"]):
            code = cli.main(cmd)
            err = capsys.readouterr().err
            seen.append(cmd[0])
            assert code == 2, (cmd, err)
            _one_line(err, "another gleak run")
            assert tree(out) == before, cmd
        return real(folder, *a, **k)

    monkeypatch.setattr(report, "write_reports", reports_while_others_try)
    assert cli.main(["run", str(suite_file), "--out", str(out), "--no-progress", "--in-process"]) == 0
    assert seen == ["leaderboard", "plot", "rescore"]
    for name in ("leaderboard.md", "results.csv", "leaderboard.html", "suite.json"):
        assert (out / name).is_file(), name
    monkeypatch.setattr(report, "write_reports", real)
    assert cli.main(["leaderboard", str(out)]) == 0  # the run let the folder go: the folder is fine
    store.check_unlocked(out)


def test_a_refused_run_leaves_no_lock_file_nor_folder(suite_file, tmp_path, monkeypatch, capsys):
    """A refusal after the lock was taken (here the store refuses) removes the lock file and the folder it created."""
    from gleak.contracts.errors import InputError
    from gleak.orchestration import runner

    def refuse(*a, **k):
        raise InputError("refused on purpose")

    monkeypatch.setattr(runner, "Store", refuse)
    out = tmp_path / "new"
    assert cli.main(["run", str(suite_file), "--out", str(out), "--no-progress", "--in-process"]) == 2
    _one_line(capsys.readouterr().err, "refused on purpose")
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert cli.main(["run", str(suite_file), "--out", str(kept), "--no-progress", "--in-process"]) == 2
    assert list(kept.iterdir()) == []  # the folder was there before: it stays, empty


def test_ray_that_cannot_start_refuses_before_the_folder_is_touched(suite_file, tmp_path, monkeypatch, capsys):
    """`--executor ray --address auto` with no cluster: one line, and neither the folder nor a .lock is created."""
    from gleak.orchestration import ray_executor

    class NoCluster:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            raise store.InputError("--address auto: Ray could not start or connect: no running Ray instance")

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(ray_executor, "RayExecutor", NoCluster)
    monkeypatch.setattr(ray_executor, "ray_available", lambda: True)
    out = tmp_path / "o2"
    code = cli.main(["run", str(suite_file), "--out", str(out), "--no-progress", "--executor", "ray", "--address", "auto"])
    assert code == 2
    _one_line(capsys.readouterr().err, "Ray could not start")
    assert not out.exists()


def test_leaderboard_of_a_published_folder_leaves_no_lock_file(suite_file, tmp_path, capsys):
    """A published folder (results.csv and suite.json, no store, no .lock): the leaderboard takes the lock for its
    writing and removes the lock file it created; the files are byte-identical."""
    out = tmp_path / "o"
    assert cli.main(["run", str(suite_file), "--out", str(out), "--no-progress", "--in-process"]) == 0
    for name in ("results.sqlite", LOCK_NAME):
        (out / name).unlink()
    before = tree(out)
    assert cli.main(["leaderboard", str(out)]) == 0
    assert not (out / LOCK_NAME).exists()
    assert tree(out) == before


def test_release_lock_tidy_removes_only_what_take_lock_created(tmp_path):
    folder = tmp_path / "f"
    lock = store.take_lock(folder)
    store.release_lock(lock, tidy=True)
    assert not folder.exists()
    folder.mkdir()
    (folder / LOCK_NAME).write_text("1")
    store.release_lock(store.take_lock(folder), tidy=True)
    assert (folder / LOCK_NAME).is_file()  # there before: another process may share it
    (folder / LOCK_NAME).unlink()
    lock = store.take_lock(folder)
    (folder / "x.txt").write_text("written meanwhile")
    store.release_lock(lock, tidy=True)
    assert sorted(p.name for p in folder.iterdir()) == ["x.txt"]
