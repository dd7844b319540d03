"""Code tests of the trained-model cache (gleak.mechanics.pretrain): an entry is used only when it is whole and
was trained for the key it is read under; anything else is trained again (named on stderr), never trusted."""
import pytest
import torch

from gleak.contracts.config import CaseConfig
from gleak.mechanics import pretrain
from gleak.mechanics.data import load_dataset

CASE = CaseConfig(dataset="skimage", model="mlp", batch_size=1, model_state="trained", train_steps=3)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(pretrain.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(pretrain, "_MEMORY", {})
    ds = load_dataset("skimage", "train")
    state, info = pretrain.trained_state(CASE, ds, torch.float32)
    (path,) = (tmp_path / "models").glob("*.pt")
    return ds, state, path


def _again(ds):
    pretrain._MEMORY.clear()
    return pretrain.trained_state(CASE, ds, torch.float32)


@pytest.mark.parametrize("damage", ["zeroed weights", "truncated", "another key"])
def test_a_damaged_or_foreign_cache_entry_is_trained_again_not_used(cache, capsys, damage):
    ds, state, path = cache
    saved = torch.load(path, weights_only=True)
    if damage == "zeroed weights":  # loadable, same keys, all-zero weights: the digest no longer checks
        saved["state"] = {k: torch.zeros_like(v) for k, v in saved["state"].items()}
        torch.save(saved, path)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    else:
        saved["key"] = "0" * 16
        torch.save(saved, path)
    again, _ = _again(ds)
    assert all(torch.equal(again[k], state[k]) for k in state)  # trained afresh: the same weights as the first time
    assert str(path) in capsys.readouterr().err
    assert torch.load(path, weights_only=True)["sha256"] == pretrain.state_digest(state)  # the entry replaced


def test_a_whole_entry_is_read_without_training(cache, monkeypatch, capsys):
    ds, state, _ = cache
    monkeypatch.setattr(pretrain, "train", lambda *a, **k: pytest.fail("trained although the cache entry is whole"))
    again, _ = _again(ds)
    assert all(torch.equal(again[k], state[k]) for k in state) and "model cache" not in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["a file", "under a file"])
def test_a_cache_folder_that_cannot_be_written_is_refused_in_one_line_before_any_trial(tmp_path, monkeypatch, bad):
    import gleak
    from gleak.contracts.errors import InputError

    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    monkeypatch.setenv(pretrain.CACHE_ENV, str(blocker if bad == "a file" else blocker / "below"))
    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "s"\n[case]\ndataset = "skimage"\nmodel = "mlp"\nmodel_state = "trained"\ntrain_steps = 2\n'
                     '[[attack]]\nname = "closed-form"\n[[defense]]\nname = "none"\n')  # fmt: skip
    with pytest.raises(InputError) as err:
        gleak.run(str(suite), out=str(tmp_path / "out"), progress=False)
    assert "model cache" in str(err.value) and "GLEAK_CACHE" in str(err.value) and len(str(err.value).splitlines()) == 1
    assert not (tmp_path / "out").exists()
