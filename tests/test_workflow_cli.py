"""`gleak show` and `gleak compare` as a user meets them (subprocess: exit codes and output are the user's)."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICK = ROOT / "results" / "quick"


def _run(cmd, args, env):
    return subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_show_attack_dlg_lists_parameters_defaults_choices_needs_and_docstring(gleak_cmd, run_env):
    r = _run(gleak_cmd, ["show", "attack", "dlg"], run_env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("attack dlg")
    # the columns are as wide as the longest parameter name
    assert re.search(r"^  iterations +int; default 300$", out, re.M)
    assert re.search(r"^  labels +one of 'soft', 'idlg', 'bias-sign', 'row-sign', 'count-aware', 'given'; default 'soft'$", out, re.M)
    assert "needs: architecture, batch_size, parameters" in out and "active: no" in out
    assert "L-BFGS steps (calls of `optimizer.step`)" in out  # the docstring, deviations and all
    assert "check-plugin runs it with: iterations=2, max_iter=5" in out


def test_show_defense_protocol_and_model(gleak_cmd, run_env, capsys):
    """The defense as the user runs it; the protocol and the model through cli.main, as `python -m gleak` calls it."""
    from gleak.cli import main

    topk = _run(gleak_cmd, ["show", "defense", "topk"], run_env)
    assert topk.returncode == 0 and "ratio" in topk.stdout and "stateful:" in topk.stdout
    assert main(["show", "protocol", "secure-aggregation"]) == 0
    assert "Bonawitz" in capsys.readouterr().out
    assert main(["show", "model", "resnet20"]) == 0
    model = capsys.readouterr().out
    assert "width" in model and "input_shape" not in model


def test_show_unknown_name_is_exit_2_with_close_matches(gleak_cli):
    code, err = gleak_cli(["show", "attack", "dgl"])
    assert code == 2 and "did you mean 'dlg'" in err and err.count("\n") == 1


def test_show_a_plugin_from_a_file(tmp_path, gleak_cmd, run_env):
    f = tmp_path / "mine.py"
    f.write_text('''
from typing import Literal
from gleak import register_attack
from gleak.contracts.plugin import Attack

@register_attack("mine")
class Mine(Attack):
    """My attack (a test). Longer text."""
    needs = frozenset({"architecture"})

    def __init__(self, steps: int = 7, mode: Literal["a", "b"] = "a"):
        self.steps, self.mode = steps, mode
''')
    r = _run(gleak_cmd, ["show", "attack", "mine", "--plugin", str(f)], run_env)
    assert r.returncode == 0, r.stderr
    assert "steps  int; default 7" in r.stdout and "mode   one of 'a', 'b'; default 'a'" in r.stdout
    assert "needs: architecture" in r.stdout and "Longer text." in r.stdout
    assert f"[plugin file: {f}" in r.stdout.splitlines()[0] and "builtin" not in r.stdout.splitlines()[0]


def _shifted_copy(tmp_path):
    """results/quick's results.csv with one cell's PSNR moved by far more than its spread and one defense dropped."""
    df = pd.read_csv(QUICK / "results.csv", dtype={"trial_id": str})
    topk = df["defense_params"].map(lambda s: json.loads(s).get("ratio")) == 0.5
    cell = (df["attack"] == "closed-form") & topk & (df["batch_size"] == 4)
    spread = df.loc[cell, "psnr"].std(ddof=0)
    shift = 10 * spread + 1
    df.loc[cell, "psnr"] += shift
    sigma = df["defense_params"].map(lambda s: json.loads(s).get("sigma")) == 0.1
    df = df[~sigma]
    (tmp_path / "b").mkdir()
    df.to_csv(tmp_path / "b" / "results.csv", index=False)
    return tmp_path / "b", shift


def test_compare_finds_the_moved_cell_and_the_missing_ones(tmp_path, gleak_cmd, run_env):
    from gleak.api import compare

    b, shift = _shifted_copy(tmp_path)
    table = compare(QUICK, b)
    both = table[table["in"] == "both"]
    moved = both[both["beyond_spread"]]
    assert len(moved) == 1 and moved.iloc[0]["case"] == "skimage/mlp/B=4"
    assert moved.iloc[0]["defense"].startswith("topk (") and "ratio=0.5" in moved.iloc[0]["defense"]
    assert moved.iloc[0]["d_psnr"] == pytest.approx(shift) and moved.iloc[0]["spread"] < shift
    assert (both.drop(moved.index)["d_psnr"].fillna(0) == 0).all()
    assert (table["in"] == "A").sum() == 4 and (table["in"] == "B").sum() == 0  # sigma 0.1: 2 cases x 2 attacks
    r = _run(gleak_cmd, ["compare", str(QUICK), str(b)], run_env)
    assert r.returncode == 0, r.stderr
    assert "36 cells in both, 1 moved beyond their spread, 4 only in A, 0 only in B" in r.stdout
    assert "| skimage/mlp/B=4 |" in r.stdout and r.stdout.count("\n| ") == 1 + 1 + 4  # header, the moved cell, 4 in A
    named = [line for line in r.stdout.splitlines() if line.startswith("  moved: ")]  # the moved cell by name
    assert len(named) == 1 and "skimage/mlp/B=4, topk (ratio=0.5) x closed-form" in named[0], r.stdout


def test_compare_pairs_identical_cells_whatever_else_the_other_folder_holds(tmp_path, gleak_cmd, run_env):
    """B holds A's trials and a second grid's at resolution 16: A's cells are the same cells in B (a case that does not
    set resolution is not 'resolution=None' because another grid set it), B's extra cells are only in B."""
    from gleak.api import compare

    df = pd.read_csv(QUICK / "results.csv", dtype={"trial_id": str})
    extra = df[df["defense"] == "none"].copy()
    extra["case"] = extra["case"].map(lambda s: json.dumps({**json.loads(s), "resolution": 16}, sort_keys=True))
    extra["trial_id"] = extra["trial_id"] + "r16"
    for side, frame in (("a", df), ("b", pd.concat([df, extra], ignore_index=True))):
        (tmp_path / side).mkdir()
        frame.to_csv(tmp_path / side / "results.csv", index=False)
    table = compare(tmp_path / "a", tmp_path / "b")
    assert (table["in"] == "both").sum() == 40 and (table["in"] == "A").sum() == 0
    assert not table[table["in"] == "both"]["changed"].any()
    only_b = table[table["in"] == "B"]
    assert len(only_b) == 4 and set(only_b["case"]) == {"skimage/mlp/B=1 (resolution=16)", "skimage/mlp/B=4 (resolution=16)"}
    assert not table["case"].str.contains("None").any()


def test_compare_of_a_folder_with_itself_says_nothing_moved(capsys):
    """Through cli.main, as `python -m gleak` calls it (the subprocess is the moved-cell test's)."""
    from gleak.cli import main

    assert main(["compare", str(QUICK), str(QUICK)]) == 0
    out = capsys.readouterr().out
    assert "40 cells in both, 0 moved beyond their spread" in out and "same aggregates" in out
    assert main(["compare", str(QUICK), "/nonexistent/folder"]) == 2
    assert "no results here" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # aggregate's std over infinite PSNRs
def test_compare_one_seed_and_exact_cells_unchanged(tmp_path):
    """One seed: the spread is 0, so only a real change counts; two exact (infinite PSNR) cells have not moved."""
    from gleak.api import compare

    df = pd.read_csv(QUICK / "results.csv", dtype={"trial_id": str})
    df = df[df["seed"] == 0].copy()
    exact = (df["attack"] == "closed-form") & (df["defense"] == "none")
    df.loc[exact, "psnr"] = float("inf")
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        df.to_csv(tmp_path / side / "results.csv", index=False)
    table = compare(tmp_path / "a", tmp_path / "b")
    assert len(table) == 40 and not table["beyond_spread"].any() and not table["changed"].any()
    inf_cells = table[(table["attack"] == "closed-form") & (table["defense"] == "none")]  # read as capped PSNR
    assert len(inf_cells) == 2 and (inf_cells["d_psnr"] == 0).all()
    df.loc[df.index[(df["attack"] == "closed-form") & ~exact][0], "psnr"] += 0.01
    df.to_csv(tmp_path / "b" / "results.csv", index=False)
    assert compare(tmp_path / "a", tmp_path / "b")["beyond_spread"].sum() == 1


def test_a_folder_of_64px_pngs_in_train_and_test_runs_at_64px(tmp_path, gleak_cmd, run_env):
    import numpy as np
    from PIL import Image

    data = tmp_path / "pngs"
    rng = np.random.default_rng(0)
    for split, n in (("train", 4), ("test", 2)):
        for c in ("cat", "dog", "ship"):
            (data / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray((rng.random((64, 64, 3)) * 255).astype("uint8")).save(data / split / c / f"{i}.png")
    suite = tmp_path / "folder.toml"
    suite.write_text(f"""
[suite]
name = "folder"
seeds = [0, 1]
[case]
dataset = "folder:{data}"
model = "mlp"
model_params = {{ hidden = [16] }}
batch_size = 1
[[attack]]
name = "closed-form"
[[defense]]
name = "none"
""")
    out = tmp_path / "out"
    r = _run(gleak_cmd, ["run", str(suite), "--out", str(out), "--no-progress"], run_env)
    assert r.returncode == 0, r.stderr
    rows = pd.read_csv(out / "results.csv")
    assert (rows["status"] == "ok").all() and (rows["psnr"] > 60).all()  # the closed form is exact at batch size 1
    for name in rows["image"]:
        w, h = Image.open(out / "images" / name).size
        assert (w, h) == (64 + 4, 2 * (64 + 2) + 2)  # one 64x64 image above its 64x64 reconstruction


def test_unsupported_cases_are_not_applicable_exit_0_and_not_retried(tmp_path, gleak_cmd, run_env, capfd):
    """closed-form cannot attack LeNet (no linear first layer): those trials are stored as "not-applicable" with the reason, the
    run exits 0, the leaderboard says so, and a rerun does not compute them again."""
    suite = tmp_path / "conv.toml"
    suite.write_text("""
[suite]
name = "conv"
seeds = [0, 1]
[case]
dataset = "skimage"
model = "lenet"
batch_size = 1
[[attack]]
name = "closed-form"
[[attack]]
name = "idlg"
[[defense]]
name = "none"
""")
    out = tmp_path / "out"
    r = _run(gleak_cmd, ["run", str(suite), "--out", str(out), "--no-progress"], run_env)
    assert r.returncode == 0, r.stderr
    assert "4 trials run: 2 ok, 0 failed, 2 not applicable, 0 already stored" in r.stderr, r.stderr
    rows = pd.read_csv(out / "results.csv")
    na = rows[rows["attack"] == "closed-form"]
    assert len(na) == 2 and (na["status"] == "not-applicable").all() and na["error"].str.startswith("UnsupportedCase").all()
    assert (rows[rows["attack"] == "idlg"]["status"] == "ok").all()
    md = (out / "leaderboard.md").read_text()
    assert "4 trials: 2 ok, 0 failed, 2 not applicable" in md and "## Not applicable" in md
    assert "## Failed trials" not in md
    from gleak.cli import main  # the rerun through cli.main, as `python -m gleak` calls it

    capfd.readouterr()
    assert main(["run", str(suite), "--out", str(out), "--no-progress"]) == 0
    assert "0 trials run, 4 already stored" in capfd.readouterr().err


def test_a_rerun_with_every_trial_stored_leaves_the_published_folder_byte_identical(tmp_path):
    """The first `gleak run` in a fresh checkout is `gleak run` of quick into results/quick, whose store is committed
    with every trial: it must change no tracked file (git status clean). Here on a copy of that folder."""
    import hashlib

    from gleak.cli import main

    out = tmp_path / "quick"
    shutil.copytree(QUICK, out)

    def digests():
        return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*"))
                if p.is_file() and p.name != ".lock" and not p.name.endswith(("-wal", "-shm"))}  # fmt: skip

    committed = digests()
    # The reports as this code writes them (the committed ones are redrawn at each release: `gleak leaderboard`)
    from gleak.reporting.report import write_folder_reports as write_reports

    write_reports(out)
    before = digests()
    assert before["results.sqlite"] == committed["results.sqlite"]  # reading the store to report writes nothing
    assert main(["run", "quick", "--out", str(out), "--no-progress", "--in-process"]) == 0
    after = digests()
    assert [k for k in before if before[k] != after.get(k)] == [] and set(after) == set(before)
