"""The Python API (gleak.api): the same trials, ids and numbers as a suite run, and results as a flat DataFrame."""
import json
import math
import shutil
from pathlib import Path

import pytest

import gleak
from gleak.contracts.errors import InputError

ROOT = Path(__file__).resolve().parent.parent

SUITE = """
[suite]
name = "api"
seeds = [0, 1]
[case]
dataset = "skimage"
model = "mlp"
model_params = { hidden = [64] }
batch_size = 2
[[attack]]
name = "closed-form"
[[attack]]
name = "idlg"
[[defense]]
name = "none"
[[defense]]
name = "topk"
ratio = [0.5, 0.9]
"""


@pytest.fixture(scope="module")
def api_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    (d / "api.toml").write_text(SUITE)
    return d, gleak.run(d / "api.toml", out=d / "out", progress=False)


def _same(a, b) -> bool:
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)) or (isinstance(b, float) and math.isnan(b)):
        return (a is None or (isinstance(a, float) and math.isnan(a))) and (b is None or (isinstance(b, float) and math.isnan(b)))
    return a == b


def test_run_returns_the_counts_the_folder_and_the_rows(api_run):
    _, s = api_run
    assert (s.total, s.ran, s.skipped, s.failed, s.exit_code) == (12, 12, 0, 0, 0)
    assert s.leaderboard.is_file() and len(s.rows) == 12
    assert {"attack.labels", "defense.ratio", "case.model_params.hidden"} <= set(s.rows.columns)


def test_run_trial_gets_the_suite_trial_ids_and_bit_identical_numbers(api_run):
    from gleak.orchestration.suite import load_suite

    d, s = api_run
    suite = load_suite(d / "api.toml")
    rows = s.rows.set_index("trial_id")
    seen = set()
    for t in suite.trials:
        attack = {"name": t.attack, **({"labels": t.attack_params["labels"]} if t.attack == "idlg" else {})}
        defense = {"name": t.defense, **({"ratio": t.defense_params["ratio"]} if t.defense == "topk" else {})}
        r = gleak.run_trial(attack=attack, defense=defense, seed=t.seed, dataset="skimage", model="mlp",
                            model_params={"hidden": [64]}, batch_size=2)  # fmt: skip
        assert r.trial_id == t.trial_id  # defaults filled exactly as the suite fills them
        stored = rows.loc[r.trial_id]
        for k in ("mse", "psnr", "ssim", "label_acc", "grad_dist"):
            assert _same(r.metrics[k], stored[k]), (t.attack, t.defense, k)
        seen.add(r.trial_id)
    assert len(seen) == 12


def test_a_trial_config_runs_as_given():
    cfg = gleak.trial_config("closed-form", {"name": "noise", "sigma": 0.01}, seed=3, batch_size=1)
    r = gleak.run_trial(cfg)
    assert r.config is cfg and r.status == "ok" and r.metrics["psnr"] > 15


def test_the_result_holds_the_images_and_plots_truth_above_reconstruction():
    r = gleak.run_trial(attack="closed-form", batch_size=1, seed=0)
    assert r.truth.shape == r.reconstruction.shape == (1, 3, 32, 32)
    assert float((r.truth - r.reconstruction).pow(2).mean()) == pytest.approx(r.metrics["mse"], rel=1e-6)
    fig = r.plot()
    axes = fig.get_axes()
    assert len(axes) == 2 and axes[0].get_ylabel() == "truth" and axes[1].get_ylabel() == "reconstruction"
    assert "dB" in axes[1].get_title()
    labels_only = gleak.run_trial(attack="idlg", batch_size=2)
    assert labels_only.reconstruction is None and len(labels_only.plot().get_axes()) == 2


def test_bad_arguments_are_one_clear_line():
    with pytest.raises(InputError, match=r"gleak.run_trial: \[case\] key 'batchsize': unknown key; did you mean 'batch_size'"):
        gleak.run_trial(attack="closed-form", batchsize=2)
    with pytest.raises(InputError, match=r"\[attack #1\] key 'name'.*did you mean 'closed-form'"):
        gleak.run_trial(attack="closed-from")
    with pytest.raises(InputError, match="expand to 2 trials"):
        gleak.run_trial(attack="closed-form", batch_size=[1, 2])
    with pytest.raises(InputError, match="TrialConfig or attack"):
        gleak.run_trial()


def test_protocol_is_passed_as_the_suite_passes_it():
    via_protocol = gleak.trial_config("closed-form", protocol="secure-aggregation", clients=2)
    as_defense = gleak.trial_config("closed-form", "secure-aggregation", clients=2)
    assert via_protocol.trial_id == as_defense.trial_id
    # With a client transform the protocol is the case's: the pair a suite names as [case] protocol = "...".
    pair = gleak.trial_config("closed-form", "topk", protocol="secure-aggregation", clients=2)
    assert pair.case.protocol == "secure-aggregation" and pair.defense == "topk"
    assert pair.trial_id != gleak.trial_config("closed-form", "topk", clients=2).trial_id


def test_a_not_applicable_trial_raises_unsupported_case_or_returns_its_row():
    # closed-form needs a linear first layer: on LeNet it cannot run
    with pytest.raises(gleak.UnsupportedCase, match="not applicable: UnsupportedCase"):
        gleak.run_trial(attack="closed-form", model="lenet")
    r = gleak.run_trial(attack="closed-form", model="lenet", check=False)
    assert r.status == "not-applicable" and "UnsupportedCase" in r.error and r.truth is None


def test_a_failed_trial_raises_trial_failed_with_its_reason(monkeypatch):
    from gleak.orchestration import trial

    def broken(*a, **k):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(trial, "execute", broken)
    with pytest.raises(gleak.TrialFailed, match="RuntimeError: broken on purpose") as info:
        gleak.run_trial(attack="closed-form")
    assert info.value.row["status"] == "failed" and "Traceback" in info.value.row["traceback"]


def _params_match(df) -> None:
    """Every key of every row's attack_params / defense_params JSON is in its own column, with the row's value."""
    for kind in ("attack", "defense"):
        for js, (_, row) in zip(df[f"{kind}_params"], df.iterrows()):
            for k, v in json.loads(js).items():
                got = row[f"{kind}.{k}"]
                assert _same(got, v) or (isinstance(v, list) and list(got) == v), (kind, k, got, v)


def test_results_of_a_published_folder_has_one_column_per_plugin_parameter():
    df = gleak.results(ROOT / "results" / "quick")  # results.csv only: what a fresh clone has
    assert len(df) == 120 and df["trial_id"].map(len).eq(16).all()
    _params_match(df)
    assert {"defense.ratio", "defense.sigma", "defense.format", "attack.labels", "case.batch_size"} <= set(df.columns)
    assert df["psnr"].dtype.kind == "f"


def test_results_from_the_store_and_from_results_csv_agree(api_run, tmp_path):
    d, s = api_run
    from_store = gleak.results(d / "out")
    shutil.copy(d / "out" / "results.csv", tmp_path / "results.csv")
    from_csv = gleak.results(tmp_path)
    assert list(from_store.columns) == list(from_csv.columns)
    _params_match(from_store)
    for c in from_store.columns:
        for a, b in zip(from_store[c], from_csv[c]):
            if isinstance(a, float) and isinstance(b, float):
                assert _same(a, b) or a == pytest.approx(b, rel=1e-12), c
            elif c not in ("seconds",):
                assert _same(a, b) or str(a) == str(b), (c, a, b)
    with pytest.raises(InputError, match="no results here"):
        gleak.results(tmp_path / "nothing")


def test_the_checkpoint_example_of_the_models_page_runs_and_case_model_is_the_trials_own_model(tmp_path, monkeypatch):
    """docs/models.md's train-your-checkpoint example runs as written, and its file attacks in a trial; and
    gleak.case_model(seed=s) holds the weights a trial with seed s starts from: its state saved as a checkpoint
    gives that trial's numbers exactly, another seed's state other numbers (DLG's few iterations depend on them)."""
    import re

    import torch

    root = Path(__file__).resolve().parents[1]
    code = re.search(r"```python\n(# train_checkpoint\.py.*?)```", (root / "docs" / "models.md").read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(code.group(1), "train_checkpoint.py", "exec"), {})
    case = dict(dataset="skimage", model="mlp", resolution=16)
    trained = gleak.run_trial(attack="closed-form", model_state=f"file:{tmp_path / 'mine.pt'}", **case)
    assert trained.metrics["psnr"] > 40  # the closed form on the trained checkpoint
    attack = {"name": "dlg", "iterations": 2, "max_iter": 5, "restarts": 1}
    for seed in (0, 1):
        plain = gleak.run_trial(attack=attack, seed=seed, **case).metrics["mse"]
        for other, same in ((seed, True), (1 - seed, False)):
            torch.save(gleak.case_model(seed=other, **case).state_dict(), tmp_path / "m.pt")
            loaded = gleak.run_trial(attack=attack, seed=seed, model_state=f"file:{tmp_path / 'm.pt'}", **case)
            assert (loaded.metrics["mse"] == plain) is same, (seed, other)


def test_run_overrides_need_their_own_folder_and_are_validated_like_the_command_lines(tmp_path):
    import gleak

    with pytest.raises(gleak.InputError, match="name the folder"):
        gleak.run("quick", overrides=["seeds=1"], progress=False)
    with pytest.raises(gleak.InputError, match="KEY=VALUE"):
        gleak.run("quick", out=tmp_path / "o", overrides="seeds=1", progress=False)
    with pytest.raises(gleak.InputError, match="nope"):
        gleak.run("quick", out=tmp_path / "o", overrides=["nope=1"], progress=False)
    assert not (tmp_path / "o").exists()
