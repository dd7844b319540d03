"""R-GAP: exact recursive inversion of invertible networks, its rank analysis, and clean refusals."""
import copy

import pytest
import torch
from torch import nn

import gleak
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import batch_gradient
from gleak.contracts.wire import Knowledge, Observation, Update
from gleak.mechanics.models import create_model
from gleak.orchestration.trial import execute

SEEDS = (0, 1, 2)


def _observe(model: nn.Module, shape, seed: int, labels: bool = False):
    """A random float64 input of `shape`, its label, and the observation of its FedSGD gradient."""
    g = torch.Generator().manual_seed(seed)
    model = model.double()
    x = torch.randn((1, *shape), generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (1,), generator=g)
    k = Knowledge(tuple(shape), 10, batch_size=1, labels=y.clone() if labels else None)
    return Observation(Update(batch_gradient(model, x, y), "gradient", 1), k, copy.deepcopy(model)), x, y


def _attack(obs, **params):
    return gleak.create("attack", "rgap", **params).reconstruct(obs, torch.Generator().manual_seed(0))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _fc(seed, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.LeakyReLU(0.2), nn.Linear(32, 24), nn.Sigmoid(),
                         nn.Linear(24, 10, bias=bias))  # fmt: skip


def _conv(seed, bias=True):
    """Two convolutions without pooling (stride 1 and 2, zero padding), LeakyReLU and tanh, a linear classifier."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=bias),
                         nn.Tanh(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10, bias=bias))  # fmt: skip


@pytest.mark.parametrize("bias", [True, False])
def test_fully_connected_network_is_inverted_to_machine_precision(bias):
    for seed in SEEDS:
        obs, x, y = _observe(_fc(seed, bias), (3, 4, 4), seed)
        rec = _attack(obs)
        assert _rel(rec.x, x) < 1e-10, (seed, _rel(rec.x, x))
        assert rec.y.tolist() == y.tolist()
        assert rec.extra["invertible"] and rec.extra["rank_deficiency"] == 0


@pytest.mark.parametrize("bias", [True, False])
def test_convolutional_network_without_pooling_is_inverted_to_machine_precision(bias):
    for seed in SEEDS:
        obs, x, y = _observe(_conv(seed, bias), (3, 8, 8), seed)
        rec = _attack(obs)
        assert _rel(rec.x, x) < 1e-9, (seed, _rel(rec.x, x))
        assert rec.y.tolist() == y.tolist()
        assert rec.extra["invertible"] and rec.extra["rank/0"] == "192/192" and rec.extra["rank/2"] == "512/512"
        assert rec.extra["gradient_residual"] < 1e-9


def test_given_label_is_used_and_needs_the_labels():
    attack = gleak.create("attack", "rgap", labels="given")
    assert "labels" in attack.needs and "labels" not in gleak.create("attack", "rgap").needs
    obs, x, y = _observe(_conv(0), (3, 8, 8), 0, labels=True)
    rec = attack.reconstruct(obs, torch.Generator().manual_seed(0))
    assert rec.y.tolist() == y.tolist() and _rel(rec.x, x) < 1e-9


def test_rank_deficient_layer_is_reported_and_not_recovered():
    """One 3x3 filter at stride 2 on a 3x8x8 input: 27 gradient + 9 forward constraints for 192 unknowns."""
    for seed in SEEDS:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Conv2d(3, 1, 3, stride=2), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(9, 10))
        obs, x, _ = _observe(model, (3, 8, 8), seed)
        rec = _attack(obs)
        assert not rec.extra["invertible"]
        assert rec.extra["deficiency/0"] >= 192 - 36 and rec.extra["deficiency/3"] == 0
        assert rec.extra["count_deficiency"] == 192 - 36
        assert _rel(rec.x, x) > 0.3  # the minimum-norm solution misses the null space
        assert rec.extra["gradient_residual"] < 1e-8  # ...yet explains the gradient: the gradient alone cannot tell


def test_noisy_gradient_degrades_the_reconstruction():
    obs, x, _ = _observe(_conv(0), (3, 8, 8), 0)
    g = torch.Generator().manual_seed(1)
    noisy = obs.update.map(lambda _, t: t + 1e-3 * torch.randn(t.shape, generator=g, dtype=t.dtype))
    rec = _attack(Observation(noisy, obs.knowledge, obs.model))
    assert torch.isfinite(rec.x).all() and _rel(rec.x, x) > 1e-4


@pytest.mark.parametrize(
    "model, words",
    [
        (nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.ReLU(), nn.Linear(16, 10)), "ReLU is not invertible"),
        (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.LeakyReLU(0.2), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 10)), "pooling"),
        (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(64, 10)), "normalisation"),
    ],
)
def test_models_outside_the_paper_raise_unsupported_case_with_the_reason(model, words):
    obs, _, _ = _observe(model, (3, 4, 4), 0)
    with pytest.raises(UnsupportedCase, match=words):
        _attack(obs)


def test_skip_connections_and_batches_raise_unsupported_case():
    resnet = create_model("resnet20", (3, 8, 8), 10, width=1)
    obs, _, _ = _observe(resnet, (3, 8, 8), 0)
    with pytest.raises(UnsupportedCase):
        _attack(obs)
    obs, _, _ = _observe(_fc(0), (3, 4, 4), 0)
    two = Observation(obs.update, Knowledge((3, 4, 4), 10, batch_size=2), obs.model)
    with pytest.raises(UnsupportedCase, match="batch size 1"):
        _attack(two)


def test_trial_on_dlg_lenet_recovers_the_image():
    """The whole trial chain on gleak's LeNet (sigmoid convolutions, no pooling) at 16x16 in float64."""
    case = CaseConfig(dataset="skimage", model="lenet", resolution=16, dtype="float64")
    s = execute(TrialConfig("t", "rgap", {}, "none", {}, case, 0))
    assert s["psnr"] > 100 and s["label_acc"] == 1.0 and s["extra"]["invertible"]


def test_numerical_rank_catches_what_constraint_counting_misses():
    """Six filters at stride 2 on an 8x8x8 input: 6*72 gradient + 6*16 forward = 528 constraints for 512 unknowns,
    enough by counting, yet the gradient constraints are dependent: the numerical rank says deficient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(8, 6, 3, stride=2, padding=1),
                          nn.Tanh(), nn.Flatten(), nn.Linear(6 * 4 * 4, 10))  # fmt: skip
    obs, x, _ = _observe(model, (3, 8, 8), 0)
    rec = _attack(obs)
    assert rec.extra["count_deficiency"] == 0 and rec.extra["deficiency/2"] > 0 and not rec.extra["invertible"]
    assert _rel(rec.x, x) > 1e-3
