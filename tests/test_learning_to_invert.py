"""Learning to Invert (attacks/learning_to_invert.py): it learns to invert, it learns through the defense, it caches
what it learned per (model, defense), and it passes the plugin conformance check."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

import gleak
from gleak.attacks import learning_to_invert as l2i

FMNIST = Path("/usr/share/datasets/fashion-mnist")
# A case one CPU core trains the inversion model for in seconds: Fashion-MNIST at 14x14 on a trained MLP of 64 ReLU
# units (one trained model for every seed, so one inversion model serves all of them).
CASE = dict(dataset="fashion-mnist", resolution=14, model="mlp", model_params={"hidden": [64]}, model_state="trained",
            batch_size=1)  # fmt: skip
FAST = dict(hidden=256, epochs=60, public_samples=2000, train_batch=32, lr=1e-3, features=1024, reduce="subset",
            scaling="unit")  # fmt: skip

needs_fmnist = pytest.mark.skipif(not FMNIST.is_dir(), reason="Fashion-MNIST not installed (dataset-fashion-mnist)")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """A fresh cache folder: a model cached by another test (or an earlier version of the code) is never read."""
    monkeypatch.setenv("GLEAK_CACHE", str(tmp_path / "cache"))


def _trial(seed: int, defense="none", **params):
    return gleak.run_trial(attack={"name": "learning-to-invert", **FAST, **params}, defense=defense, seed=seed, **CASE)


@needs_fmnist
def test_undefended_it_recovers_the_image_10_db_above_the_blind_guess():
    """Median over 5 seeds of PSNR minus the trial's blind guess >= 10 dB (measured: about 11-12 dB); it caches the
    inversion model after the first seed and records its training cost."""
    gains, rows = [], []
    for seed in range(5):
        r = _trial(seed)
        gains.append(r.row["psnr"] - r.extra["blind_psnr"])
        rows.append(r.extra)
    assert statistics.median(gains) >= 10.0, gains
    assert [e["cached"] for e in rows] == [0, 1, 1, 1, 1]
    assert rows[0]["public_samples"] == 2000 and rows[0]["train_seconds"] > 0 and rows[0]["features"] == 1024
    assert rows[-1]["train_seconds"] == pytest.approx(rows[0]["train_seconds"])  # the cost of the model it used


class _Spy(torch.nn.Module):
    """The inversion MLP, recording every input it is given."""

    seen: list[torch.Tensor] = []

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        _Spy.seen.append(x.detach().clone())
        return self.net(x)


def _spied(monkeypatch):
    _Spy.seen = []
    make = l2i.inversion_mlp
    monkeypatch.setattr(l2i, "inversion_mlp", lambda *a: _Spy(make(*a)))
    return _Spy.seen


@pytest.mark.parametrize("adaptive", [True, False])
def test_its_training_updates_pass_through_the_defense_only_when_adaptive(monkeypatch, adaptive):
    """Through sign compression every entry the (unscaled, unreduced) MLP is trained on is -1, 0 or 1, when adaptive;
    the non-adaptive ablation trains on raw gradients. The observed update is the defended one either way."""
    seen = _spied(monkeypatch)
    r = gleak.run_trial(attack={"name": "learning-to-invert", "hidden": 16, "epochs": 2, "public_samples": 40,
                                "train_batch": 8, "adaptive": adaptive},
                        defense="sign", dataset="skimage", resolution=8, model="mlp", model_params={"hidden": [8]},
                        batch_size=1, seed=0)  # fmt: skip
    assert r.status == "ok"
    training, observed = torch.cat(seen[:-1]), seen[-1]
    assert len(training) == 2 * 40  # two epochs over the 40 pairs: every public sample made a pair
    signs = lambda t: bool(((t == 1) | (t == -1) | (t == 0)).all())  # noqa: E731
    assert signs(observed)
    assert signs(training) is adaptive
    needs = gleak.contracts.registry.create("attack", "learning-to-invert", adaptive=adaptive).needs
    assert ("knows_defense" in needs) is adaptive


def test_the_cached_model_is_keyed_by_the_defense_and_its_strength(monkeypatch):
    """A second trial at the same (model, defense) reads the cached model; another Top-k ratio trains a new one."""
    small = dict(hidden=16, epochs=1, public_samples=20, train_batch=8)
    case = dict(dataset="skimage", resolution=8, model="mlp", model_params={"hidden": [8]}, model_state="trained", batch_size=1)

    def cached(seed, ratio):
        return gleak.run_trial(attack={"name": "learning-to-invert", **small}, defense={"name": "topk", "ratio": ratio},
                               seed=seed, **case).extra["cached"]  # fmt: skip

    assert [cached(0, 0.9), cached(1, 0.9), cached(0, 0.5), cached(2, 0.5)] == [0, 1, 0, 1]


def test_batches_are_matched_order_free():
    """The batch loss matches each prediction to a target (Hungarian): a permuted prediction costs nothing."""
    t = torch.rand(3, 4, 10)
    assert float(l2i.matched_mse(t[:, [2, 0, 3, 1]], t)) == pytest.approx(0.0, abs=1e-6)
    assert float(l2i.matched_mse(t, torch.rand(3, 4, 10))) > 0.01


def test_it_passes_conformance():
    from gleak.orchestration.conformance import check_plugin

    failed = [f"{c.name}: {c.detail}" for c in check_plugin("attack", "learning-to-invert") if not c.passed]
    assert not failed
