"""model_state = "file:PATH": a trial attacks the user's own weights; a checkpoint of another architecture is one line
naming the file and the key; the trial id follows the checkpoint's content."""
from __future__ import annotations

import pytest
import torch

import gleak
from gleak.contracts.errors import InputError
from gleak.mechanics.models import create_model


def _save(path, model_name="mlp", seed=5, shape=(3, 32, 32)):
    model = create_model(model_name, shape, 10, seed=seed)
    torch.save(model.state_dict(), path)
    return model


def test_a_trial_attacks_the_users_checkpoint(tmp_path):
    path = tmp_path / "mine.pt"
    saved = _save(path)
    r = gleak.run_trial(attack="closed-form", model="mlp", model_state=f"file:{path}", batch_size=1, seed=0)
    assert r.metrics["verdict"] == "recovered" and r.extra["model_file"] == str(path)
    # The weights attacked are the file's: the round's model is built from them (not from the trial seed's init).
    from gleak.mechanics.data import load_dataset
    from gleak.mechanics.pretrain import build_model

    model, info = build_model(r.config.case, load_dataset("skimage"), 0, torch.float32)
    for (k, a), b in zip(model.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(a, b), k
    untrained = gleak.trial_config(attack="closed-form", model="mlp", batch_size=1, seed=0)
    assert untrained.trial_id != r.trial_id


def test_the_trial_id_follows_the_checkpoints_content(tmp_path):
    path = tmp_path / "mine.pt"
    _save(path, seed=5)
    a = gleak.trial_config(attack="closed-form", model="mlp", model_state=f"file:{path}").trial_id
    assert gleak.trial_config(attack="closed-form", model="mlp", model_state=f"file:{path}").trial_id == a
    _save(path, seed=6)  # other weights, same path, same size
    import os

    os.utime(path, ns=(10**18, 10**18))  # a modification time surely apart from the first file's
    b = gleak.trial_config(attack="closed-form", model="mlp", model_state=f"file:{path}").trial_id
    assert b != a


@pytest.mark.parametrize("bad, needle", [
    ("lenet", "key 'net"),           # another architecture: its first key is not the MLP's
    ("mlp-wrong-shape", "has shape"),
])  # fmt: skip
def test_a_checkpoint_of_another_architecture_is_one_line(tmp_path, bad, needle):
    path = tmp_path / "other.pt"
    if bad == "lenet":
        _save(path, "lenet")
    else:
        _save(path, shape=(1, 32, 32))  # the MLP for grey images: its first layer has another width
    with pytest.raises(InputError) as err:
        gleak.trial_config(attack="closed-form", model="mlp", model_state=f"file:{path}")
    msg = str(err.value)
    assert str(path) in msg and "model_state" in msg and len(msg.splitlines()) == 1, msg


def test_a_missing_or_unreadable_checkpoint_is_bad_input(tmp_path):
    with pytest.raises(InputError, match="no such checkpoint file"):
        gleak.trial_config(attack="closed-form", model_state=f"file:{tmp_path / 'nope.pt'}")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(InputError, match="weights_only"):
        gleak.trial_config(attack="closed-form", model_state=f"file:{tmp_path / 'junk.pt'}")
    with pytest.raises(InputError, match="'untrained', 'trained' or 'file:PATH'"):
        gleak.trial_config(attack="closed-form", model_state="pretrained")
