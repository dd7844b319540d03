"""gleak writes and deletes only inside its folder and never over a user's file: links at its paths are refused,
suite.json is protected under --force, a relative --out survives a plugin's chdir (gleak.orchestration.output_folder)."""
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from gleak import cli
from gleak.contracts.errors import InputError
from gleak.orchestration import output_folder as owned
from tests.test_hostile_store import T1, copy, refused, t1, tree  # noqa: F401 - t1: the shared fixture


def test_force_does_not_overwrite_a_users_suite_json(tmp_path, capsys):
    a1 = tmp_path / "a1"
    a1.mkdir()
    (a1 / "suite.json").write_text('{"my": 1}')
    (a1 / "notes.txt").write_text("n")
    (tmp_path / "t1.toml").write_text(T1)
    refused(["run", str(tmp_path / "t1.toml"), "--out", str(a1), "--force", "--no-progress", "--in-process"], a1, capsys,
            "suite.json")  # fmt: skip


def test_a_folder_gleak_wrote_before_listing_suite_json_is_still_gleaks(t1, tmp_path, capsys):
    out = copy(t1, tmp_path)
    manifest = (out / "gleak-manifest.json").read_text()
    assert '"suite.json"' in manifest
    (out / "gleak-manifest.json").write_text(manifest.replace('  "suite.json",\n', ""))
    assert cli.main(["leaderboard", str(out)]) == 0


def _outside(tmp_path) -> Path:
    d = tmp_path / "outside"
    d.mkdir()
    for name in ("reconstructions_uniform_linear_1.png", "frontier.png", "0123456789abcdef.png", "mine.txt"):
        (d / name).write_text("the user's")
    return d


@pytest.mark.parametrize("name", ["figures", "images"])
def test_a_linked_subfolder_is_refused_by_every_writer(t1, tmp_path, capsys, name):
    out = copy(t1, tmp_path)
    outside = _outside(tmp_path)
    before = tree(outside)
    for p in (out / name).iterdir():
        p.unlink()
    (out / name).rmdir()
    (out / name).symlink_to(outside, target_is_directory=True)
    for args in (["plot", str(out)], ["leaderboard", str(out)], ["rescore", str(out)],
                 ["run", str(t1.parent / "t1.toml"), "--out", str(out), "--no-progress", "--in-process"]):  # fmt: skip
        refused(args, out, capsys, f"{out / name}: a symbolic link")
    assert tree(outside) == before and sorted(os.listdir(outside)) == sorted(before)


def test_an_output_folder_that_is_a_link_is_refused_before_anything_is_written(t1, tmp_path, capsys):
    """`--out LINK`, LINK a symbolic link to an empty folder elsewhere (and to a gleak folder, for the commands that
    read one): exit 2, one line, and nothing written where the link points (the store is opened only after the
    check)."""
    empty = tmp_path / "empty-elsewhere"
    empty.mkdir()
    link = tmp_path / "link"
    link.symlink_to(empty, target_is_directory=True)
    refused(["run", str(t1.parent / "t1.toml"), "--out", str(link), "--no-progress", "--in-process"], empty, capsys,
            f"{link}: the output folder is a symbolic link")  # fmt: skip
    assert os.listdir(empty) == []
    out = copy(t1, tmp_path)
    to_results = tmp_path / "results-link"
    to_results.symlink_to(out, target_is_directory=True)
    for args in (["plot", str(to_results)], ["leaderboard", str(to_results)], ["rescore", str(to_results)]):
        refused(args, out, capsys, "the output folder is a symbolic link")


def test_a_linked_store_is_refused(t1, tmp_path, capsys):
    out = copy(t1, tmp_path)
    elsewhere = tmp_path / "elsewhere.sqlite"
    (out / "results.sqlite").rename(elsewhere)
    (out / "results.sqlite").symlink_to(elsewhere)
    before = elsewhere.read_bytes()
    for args in (["leaderboard", str(out)], ["rescore", str(out)],
                 ["run", str(t1.parent / "t1.toml"), "--out", str(out), "--no-progress", "--in-process"]):  # fmt: skip
        refused(args, out, capsys, "a symbolic link")
    assert elsewhere.read_bytes() == before


def test_no_write_through_a_folder_that_became_a_link(tmp_path):
    from gleak.reporting.figures import atomic_write_bytes

    outside = _outside(tmp_path)
    before = tree(outside)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "figures").symlink_to(outside, target_is_directory=True)
    with pytest.raises(InputError, match="a symbolic link"):
        atomic_write_bytes(tmp_path / "o" / "figures" / "frontier.png", b"gleak's")
    assert tree(outside) == before


def test_remove_owned_with_a_relative_folder_deletes_its_own_file_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "o" / "figures").mkdir(parents=True)
    stale = tmp_path / "o" / "figures" / "frontier.png"
    stale.write_bytes(b"old figure")
    owned.Manifest("o", ["figures/frontier.png"]).save()
    assert owned.remove_owned("o", "o/figures/frontier.png") and not stale.exists()



@pytest.mark.parametrize("name", ["r", "res", "lea"])
def test_a_relative_out_folder_whose_name_begins_a_file_name_runs_twice(tmp_path, monkeypatch, name):
    """--out r: the manifest compares whole path components, so results.sqlite in r is listed as gleak's (a text
    prefix read it as r/esults.sqlite, and the run refused its own store); a rerun resumes, the leaderboard rebuilds."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t1.toml").write_text(T1)
    args = ["run", "t1.toml", "--out", name, "--no-progress", "--in-process"]
    assert cli.main(args) == 0
    assert {"results.sqlite", "results.csv", "leaderboard.md"} <= set(owned.Manifest.load(name).files)
    assert cli.main(args) == 0 and cli.main(["leaderboard", name]) == 0

CHDIR = textwrap.dedent('''
    import os

    from gleak import register_attack
    from gleak.contracts.plugin import Attack
    from gleak.contracts.registry import create


    @register_attack("wanders")
    class Wanders(Attack):
        """Test attack: closed-form, after changing the working directory of its process."""

        needs = frozenset({"architecture"})

        def __init__(self, to: str = "."):
            self.to = to

        def reconstruct(self, observation, rng):
            os.chdir(self.to)
            return create("attack", "closed-form").reconstruct(observation, rng)
''')


def test_a_plugins_chdir_does_not_move_the_images_of_a_relative_out(tmp_path, gleak_cmd, run_env):
    (tmp_path / "wanders.py").write_text(CHDIR)
    (tmp_path / "elsewhere").mkdir()
    suite = T1.replace('name = "closed-form"', f'name = "wanders"\nto = "{tmp_path / "elsewhere"}"')
    (tmp_path / "s.toml").write_text(suite)
    r = subprocess.run(gleak_cmd + ["run", "s.toml", "--out", "o", "--plugin", "wanders.py", "--no-progress"], cwd=tmp_path,
                       env=run_env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "o" / "images").glob("*.png"))) == 2
    assert not list((tmp_path / "elsewhere").rglob("*"))


def _six_pngs(root: Path) -> None:
    from tests.test_data import _png

    for c in ("a", "b"):
        (root / c / "nested").mkdir(parents=True)
        for i in range(2):
            _png(root / c / f"{i}.png", 8, 8, i)
        _png(root / c / "nested" / "deep.png", 8, 8, 7)


def _samples(root: Path) -> int:
    from gleak.mechanics.data import load_dataset

    return len(load_dataset(f"folder:{root}")) + len(load_dataset(f"folder:{root}", "test"))


def test_symlink_loops_in_an_image_folder_do_not_multiply_its_images(tmp_path):
    """6 PNGs stay 6 samples with a link loop to the folder's top, a link to the class folder itself, a second
    link to a folder already read and a link to a file already read (torchvision alone followed every link)."""
    root = tmp_path / "imgs"
    _six_pngs(root)
    (root / "a" / "nested" / "up").symlink_to(root)  # a loop through the top: a/nested/up/a/nested/up/...
    (root / "a" / "self").symlink_to(root / "a")
    (root / "b" / "again").symlink_to(root / "b" / "nested")
    (root / "b" / "twice.png").symlink_to(root / "b" / "0.png")
    assert _samples(root) == 6


def test_a_link_out_of_an_image_folder_is_one_line_naming_it(tmp_path):
    root = tmp_path / "imgs"
    _six_pngs(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    from tests.test_data import _png

    _png(elsewhere / "secret.png", 8, 8, 3)
    (root / "a" / "out.png").symlink_to(elsewhere / "secret.png")
    from gleak.mechanics.data import load_dataset

    with pytest.raises(InputError, match=r"a/out.png is a symbolic link out of the folder") as e:
        load_dataset(f"folder:{root}")
    assert "\n" not in str(e.value)
    (root / "a" / "out.png").unlink()
    (root / "c").symlink_to(elsewhere)  # a whole class folder that lies elsewhere
    with pytest.raises(InputError, match=r"imgs/c is a symbolic link out of the folder"):
        load_dataset(f"folder:{root}")


def test_an_image_folder_without_links_reads_as_torchvision_reads_it(tmp_path):
    """Same files, same order, same classes as torchvision's ImageFolder: a suite's trials on a folder data set
    keep their numbers."""
    from torchvision import datasets

    root = tmp_path / "imgs"
    _six_pngs(root)
    (root / "a" / "nested" / "z.PNG").write_bytes((root / "a" / "0.png").read_bytes())
    (root / "a" / "notes.txt").write_text("not an image")
    theirs = datasets.ImageFolder(str(root)).samples
    from gleak.mechanics import data

    captured = {}
    real = datasets.ImageFolder.__init__

    def keep(self, *a, **k):
        real(self, *a, **k)
        captured.setdefault("samples", self.samples)

    import unittest.mock

    with unittest.mock.patch.object(datasets.ImageFolder, "__init__", keep):
        data._load_folder(data.DataRequest("folder:", "train", None, False, None, None, str(root)))
    assert captured["samples"] == theirs and len(theirs) == 7


@pytest.mark.parametrize("name", ["images", "figures"])
def test_a_file_where_gleak_writes_a_folder_is_refused_before_any_trial(tmp_path, name):
    # a user's file named images failed every trial after its work
    import gleak
    from gleak.contracts.errors import InputError

    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("a user's file")
    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "s"\n[case]\ndataset = "uniform"\nmodel = "linear"\n'
                     '[[attack]]\nname = "closed-form"\n[[defense]]\nname = "none"\n')  # fmt: skip
    with pytest.raises(InputError, match=f"{name}: a file where gleak writes its {name}/ folder"):
        gleak.run(str(suite), out=str(out), progress=False)
    from gleak import cli

    assert cli.main(["run", str(suite), "--out", str(out), "--force", "--no-progress", "--in-process"]) == 2
    assert sorted(p.name for p in out.iterdir()) == [name] and (out / name).read_text() == "a user's file"
