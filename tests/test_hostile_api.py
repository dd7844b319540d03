"""The Python API checks its arguments at the call: one gleak.InputError naming the argument, never a TypeError or
RuntimeError from deep inside (gleak.api); an LPIPS backbone that is not AlexNet's weights is one line before any
trial runs, on the command line and in the API (gleak.mechanics.perceptual.check_lpips_weights)."""
import os
import sqlite3
import textwrap

import pytest
import torch

import gleak
from gleak import cli
from gleak.orchestration import trial
from tests.test_hostile_store import copy, refused, t1  # noqa: F401 - t1: the shared finished folder

T1 = textwrap.dedent('''
    [suite]
    name = "t1"
    seeds = [0]
    [case]
    dataset = "uniform"
    model = "linear"
    [[attack]]
    name = "closed-form"
    [[defense]]
    name = "none"
''')
CASE = {"dataset": "uniform", "model": "linear"}


@pytest.fixture
def no_trial_runs(monkeypatch):
    def ran(*a, **k):
        raise AssertionError("a trial ran before the arguments were checked")

    monkeypatch.setattr(trial, "run_trial", ran)
    monkeypatch.setattr(trial, "execute", ran)


def _one_line(exc, *needles):
    text = str(exc.value)
    assert isinstance(exc.value, gleak.InputError) and "\n" not in text, text
    for n in needles:
        assert n in text, text


@pytest.mark.parametrize("kwargs, needles", [
    ({"config": "closed-form"}, ["config must be a gleak.contracts.config.TrialConfig", "run_trial(attack='closed-form')"]),
    ({"config": 3}, ["config must be a gleak.contracts.config.TrialConfig", "int"]),
    ({"attack": "closed-form", "seed": -1, **CASE}, ["seed must be in [0, 2**63), got -1"]),
    ({"attack": "closed-form", "seed": 2**63, **CASE}, ["seed must be in [0, 2**63)"]),
    ({"attack": "closed-form", "seed": 1.5, **CASE}, ["seed must be an integer"]),
    ({"attack": "closed-form", "threads": 0, **CASE}, ["threads must be >= 1, got 0"]),
    ({"attack": "closed-form", "threads": "2", **CASE}, ["threads must be an integer, got '2'"]),
    ({"attack": "closed-form", "threads": True, **CASE}, ["threads must be an integer"]),
    ({"attack": "closed-form", "check": "yes", **CASE}, ["check must be True or False"]),
    ({"attack": "closed-form", "device": 0, **CASE}, ["device must be auto, cpu, cuda or cuda:N"]),
    ({"attack": "closed-form", "lpips_weights": "/nonexistent/alexnet.pth", **CASE}, ["lpips_weights", "not found"]),
])  # fmt: skip
def test_run_trial_refuses_bad_arguments_at_the_call(kwargs, needles, no_trial_runs):
    config = kwargs.pop("config", None)
    with pytest.raises(gleak.InputError) as exc:
        gleak.run_trial(config, **kwargs)
    _one_line(exc, "gleak.run_trial:", *needles)
    assert torch.get_num_threads() == 1  # nothing was changed on the way


def test_run_refuses_bad_arguments_before_the_folder_is_touched(tmp_path, no_trial_runs):
    (tmp_path / "t1.toml").write_text(T1)
    out = tmp_path / "o"
    for kwargs, needle in [({"threads": 0}, "threads must be >= 1, got 0"), ({"threads": "1"}, "threads must be an integer"),
                           ({"executor": "slurm"}, "executor must be one of local, ray"),
                           ({"plugins": "mine.py"}, "plugins must be a list of plugin files"),
                           ({"progress": "no"}, "progress must be True or False"),
                           ({"workers": 0}, "workers must be a number >= 1")]:  # fmt: skip
        with pytest.raises(gleak.InputError) as exc:
            gleak.run(str(tmp_path / "t1.toml"), out=out, **kwargs)
        _one_line(exc, "gleak.run:", needle)
    with pytest.raises(gleak.InputError) as exc:
        gleak.run(str(tmp_path / "t1.toml"), out=42)
    _one_line(exc, "gleak.run: out must be a folder's path")
    assert not out.exists()


def test_results_of_a_binary_csv_or_a_damaged_store_is_one_input_error(tmp_path):
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "results.csv").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(gleak.InputError) as exc:
        gleak.results(binary)
    _one_line(exc, "results.csv", "not a text file")
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "results.csv").write_text("trial_id,status,attack,defense\n=1+1,ok,a,d\n")
    with pytest.raises(gleak.InputError) as exc:
        gleak.results(edited)
    _one_line(exc, "results.csv", "line 2")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "results.sqlite").write_bytes(os.urandom(4096))
    with pytest.raises(gleak.InputError) as exc:
        gleak.results(damaged)
    _one_line(exc, "results.sqlite")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    con = sqlite3.connect(foreign / "results.sqlite")
    con.execute("CREATE TABLE x (a)")
    con.commit()
    con.close()
    with pytest.raises(gleak.InputError) as exc:
        gleak.results(foreign)
    _one_line(exc, "results.sqlite", "not gleak's")
    for bad in (None, 42, ""):
        with pytest.raises(gleak.InputError) as exc:
            gleak.results(bad)
        _one_line(exc, "gleak.results: folder must be a folder's path")


def _random_bytes(tmp_path):
    path = tmp_path / "alexnet.pth"
    path.write_bytes(os.urandom(1 << 16))
    return path


def test_an_lpips_backbone_of_random_bytes_is_one_line_before_any_trial(tmp_path, capsys, monkeypatch, no_trial_runs):
    (tmp_path / "t1.toml").write_text(T1)
    monkeypatch.delenv("GLEAK_LPIPS_BACKBONE", raising=False)
    wrong = tmp_path / "other.pth"
    torch.save({"features.0.weight": torch.zeros(3, 3)}, wrong)
    for path, needle in [(_random_bytes(tmp_path), "is not a weights file torch can read"),
                         (wrong, "is not AlexNet's state dict")]:  # fmt: skip
        out = tmp_path / "o"
        code = cli.main(["run", str(tmp_path / "t1.toml"), "--out", str(out), "--no-progress", "--in-process",
                         "--lpips-backbone", str(path)])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "--lpips-backbone" in err and str(path) in err and needle in err, err
        assert not out.exists()
    monkeypatch.setenv("GLEAK_LPIPS_BACKBONE", str(_random_bytes(tmp_path)))
    assert cli.main(["run", str(tmp_path / "t1.toml"), "--out", str(tmp_path / "o"), "--no-progress", "--in-process"]) == 2
    err = capsys.readouterr().err
    assert "$GLEAK_LPIPS_BACKBONE" in err and "is not a weights file" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(gleak.InputError) as exc:
        gleak.run_trial(attack="closed-form", lpips_weights=str(_random_bytes(tmp_path)), **CASE)
    _one_line(exc, "lpips_weights", "is not a weights file")


def test_alexnet_weights_pass_the_backbone_check(tmp_path, published):
    """The check accepts the file it is for (a state dict of torchvision's AlexNet, random weights here, taken as
    the published file)."""
    import torchvision

    from gleak.mechanics.perceptual import check_lpips_weights

    path = tmp_path / "alexnet.pth"
    torch.save(torchvision.models.alexnet().state_dict(), path)
    check_lpips_weights(published(path), "--lpips-backbone")


def test_rescore_with_a_random_alexnet_backbone_is_one_line_and_changes_nothing(t1, tmp_path, capsys):
    """`gleak rescore DIR --metrics lpips --lpips-backbone random.pth`, a randomly initialised AlexNet saved with
    torch.save (every key and shape right): exit 2, one line naming the file and its digest, the folder unchanged."""
    import torchvision

    out = copy(t1, tmp_path)
    path = tmp_path / "random.pth"
    torch.save(torchvision.models.alexnet().state_dict(), path)
    refused(["rescore", str(out), "--metrics", "lpips", "--lpips-backbone", str(path)], out, capsys,
            f"--lpips-backbone: {path} is not torchvision's ImageNet AlexNet weights")  # fmt: skip
