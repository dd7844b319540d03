"""Guarantees the product makes, tested on values: the gate withholds the victim's weights (value by value), secret
sharing shows the aggregator uniform shares and only their sum, a trial's epsilon is the accountant's after the
noisy steps it took, a resumed run retries its failed trials, and CGD's engines agree on unequal blocks."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gleak.config import derive_seed
from gleak.gate import guess_values, observer_model
from gleak.models import create_model

ARCH = SimpleNamespace(needs=frozenset({"architecture", "batch_size"}))
WHITE_BOX = SimpleNamespace(needs=frozenset({"architecture", "parameters"}))


class Custom(nn.Module):
    """A module of its own: raw nn.Parameters and a buffer, no reset_parameters."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.mix = nn.Parameter(torch.randn(16, 100) * 0.3)
        self.register_buffer("centre", torch.linspace(-1, 1, 16))
        self.register_buffer("steps", torch.tensor(7))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.scale * (x.flatten(1)[:, :100] @ self.mix.T - self.centre))


def models():
    torch.manual_seed(0)
    bn = create_model("resnet20", (3, 16, 16), 10, seed=1, width=1)
    trained_bn = copy.deepcopy(bn)
    with torch.no_grad():  # as after training: BatchNorm's affine and running statistics away from their init
        for m in trained_bn.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5), m.bias.normal_(), m.running_mean.normal_(), m.running_var.uniform_(0.5, 2)
    return {"mlp": create_model("mlp", (1, 8, 8), 10, seed=2), "resnet20-bn": bn, "resnet20-bn-trained": trained_bn,
            "custom": Custom(), "linear-normal": create_model("linear", (1, 8, 8), 10, seed=3, init="normal")}  # fmt: skip


def _tensors(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("name", list(models()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_without_parameters_no_value_of_the_victims_model_reaches_the_attack(name, seed):
    victim = models()[name]
    mine = observer_model(ARCH, victim, SimpleNamespace(seed=seed))
    theirs = _tensors(victim)
    for k, t in _tensors(mine).items():
        assert t.shape == theirs[k].shape and t.dtype == theirs[k].dtype
        if t.is_floating_point():
            assert (t != theirs[k]).all(), f"{name}: {k} keeps {int((t == theirs[k]).sum())} of the victim's values"
    assert observer_model(WHITE_BOX, victim, SimpleNamespace(seed=seed)) is not victim
    for k, t in _tensors(observer_model(WHITE_BOX, victim, SimpleNamespace(seed=seed))).items():
        assert torch.equal(t, theirs[k])  # "parameters" declared: the victim's values


def test_the_guess_is_a_function_of_the_seed_and_of_public_scales():
    victim = Custom()
    a, b = (observer_model(ARCH, victim, SimpleNamespace(seed=s)) for s in (4, 4))
    assert all(torch.equal(x, y) for x, y in zip(_tensors(a).values(), _tensors(b).values()))
    c = observer_model(ARCH, victim, SimpleNamespace(seed=5))
    assert not torch.equal(a.mix, c.mix)
    # a custom weight is N(0, 1 / fan_in): fan_in 100, so std 0.1 whatever the victim's own scale (0.3)
    draws = torch.cat([observer_model(ARCH, victim, SimpleNamespace(seed=s)).mix.detach().flatten() for s in range(5)])
    assert abs(float(draws.std()) - 0.1) < 0.01 and abs(float(draws.mean())) < 0.01
    assert int(a.steps) == 7  # an integer counter is not data: kept


def test_a_shipped_architecture_gets_the_former_guess_bit_for_bit():
    """mlp and linear (every architecture-only attack of the shipped suites): only nn.Linear layers, whose reset
    re-draws every value, so the guess is the reset alone, as before: no published number moves."""
    for victim in (create_model("mlp", (1, 28, 28), 10, seed=0, hidden=[256]),
                   create_model("linear", (1, 8, 8), 10, seed=0, init="normal")):  # fmt: skip
        former = copy.deepcopy(victim)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(3, "attacker-guess"))
            for m in former.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        mine = observer_model(ARCH, victim, SimpleNamespace(seed=3))
        assert all(torch.equal(x, y) for x, y in zip(_tensors(mine).values(), _tensors(former).values()))


def test_guess_values_keeps_a_variance_positive():
    bn = nn.BatchNorm1d(8)
    mine = copy.deepcopy(bn)
    guess_values(mine, bn, 0)
    assert (mine.running_var > 1).all() and (mine.weight > 1).all() and (mine.bias > 0).all()
