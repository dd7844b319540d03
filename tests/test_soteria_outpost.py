"""Soteria (representation-layer pruning) and Outpost (iteration-dependent probabilistic pruning and noise)."""
import numpy as np
import pytest
import torch
from gleak.defenses.outpost import layer_risk
from gleak.defenses.soteria import Soteria

import gleak
from gleak.contracts.plugin import batch_gradient
from gleak.mechanics.models import create_model


def _mlp(seed, hidden=24, dtype=torch.float64, activation="relu"):
    return create_model("mlp", (1, 6, 6), 5, seed=seed, dtype=dtype, hidden=[hidden], activation=activation)


def _batch(seed, n=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(n, 1, 6, 6, generator=g, dtype=dtype), torch.randint(0, 5, (n,), generator=g)


def _representation(model, x):
    return model[:-1](x)  # the MLP's input of its last Linear layer


# ---- Soteria -----------------------------------------------------------------------------------------------------
def test_soteria_prunes_the_features_with_the_smallest_score_of_an_independent_jacobian():
    for seed in range(4):
        model, (x, y) = _mlp(seed), _batch(seed, n=3)
        jac = torch.autograd.functional.jacobian(lambda v: _representation(model, v), x)  # (B, F, B, ...)
        r = _representation(model, x).detach()
        per = torch.stack([jac[b, :, b].reshape(r.shape[1], -1).norm(dim=1) for b in range(len(x))])
        score = (per / (r + 0.1)).sum(0)
        k = round(0.5 * r.shape[1])
        expected = set(torch.sort(score, stable=True).indices[:k].tolist())
        g = gleak.create("defense", "soteria", rate=0.5).client_gradient(model, x, y, torch.Generator())
        plain = batch_gradient(model, x, y)
        zero_cols = {int(c) for c in torch.nonzero((g["3.weight"] == 0).all(0)).flatten()}
        live = {c for c in range(r.shape[1]) if not (plain["3.weight"][:, c] == 0).all()}
        assert zero_cols & live == expected & live, f"seed {seed}"
        for name in plain:  # everything but the last layer's weight goes out unchanged
            if name != "3.weight":
                assert torch.equal(g[name], plain[name]), name
        kept = [c for c in range(r.shape[1]) if c not in expected]
        assert torch.equal(g["3.weight"][:, kept], plain["3.weight"][:, kept])


def test_soteria_representation_reconstruction_error_rises_with_the_rate():
    """The closed-form inversion of the last layer's input (r = dW_c / db_c for one sample) from the sent gradient
    gets worse as the pruning rate grows, on every seed: strictly with sigmoid features (all alive, the paper's
    LeNet), never better with ReLU ones (dead features score 0 and are pruned first, to no effect)."""
    rates = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    for seed, act in [(s, a) for s in range(4) for a in ("sigmoid", "relu")]:
        model, (x, y) = _mlp(seed, hidden=40, activation=act), _batch(seed)
        r = _representation(model, x).detach()[0]
        errs = []
        for rate in rates:
            g = Soteria(rate=rate).client_gradient(model, x, y, torch.Generator())
            c = int(g["3.bias"].abs().argmax())
            r_hat = g["3.weight"][c] / g["3.bias"][c]
            errs.append(float((r_hat - r).norm() / r.norm()))
        assert errs[0] < 1e-8, errs
        if act == "sigmoid":
            assert all(a < b for a, b in zip(errs, errs[1:])), (seed, errs)
        else:
            assert all(a <= b for a, b in zip(errs, errs[1:])) and errs[-2] > 0.5, (seed, errs)


def test_soteria_rejects_a_bad_rate_and_a_model_without_linear_layer():
    with pytest.raises(ValueError, match="rate"):
        Soteria(rate=1.5)
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten())
    with pytest.raises(ValueError, match="nn.Linear"):
        Soteria().client_gradient(conv, torch.zeros(1, 1, 4, 4), torch.tensor([0]), torch.Generator())


# ---- Outpost -----------------------------------------------------------------------------------------------------
def test_outpost_perturbs_with_probability_one_over_one_plus_beta_t():
    """Over many clients, the share perturbed at iteration t follows 1 / (1 + beta t)."""
    model, (x, y) = _mlp(0, hidden=4), _batch(0, n=2)
    plain = batch_gradient(model, x, y)
    beta, clients, steps = 0.5, 200, 6
    hits = np.zeros(steps)
    for c in range(clients):
        d = gleak.create("defense", "outpost", beta=beta)
        d.reset()
        rng = torch.Generator().manual_seed(c)
        for t in range(steps):
            g = d.client_gradient(model, x, y, rng)
            hits[t] += not all(torch.equal(g[n], plain[n]) for n in plain)
    share = hits / clients
    expected = 1.0 / (1.0 + beta * np.arange(1, steps + 1))  # the paper's schedule, written out
    assert np.all(np.abs(share - expected) < 4 * np.sqrt(expected * (1 - expected) / clients) + 1e-9), (share, expected)
    assert expected[0] == pytest.approx(1 / 1.5) and share[0] > share[-1] + 0.3


def test_outpost_perturbation_prunes_per_layer_and_places_noise_by_fisher_information():
    """A perturbed gradient (beta = 0: always): 80% of each layer below its |g| percentile zeroed, noise of std
    risk x noise_base on exactly the phi% largest g^2 entries, none elsewhere."""
    for seed in range(3):
        model, (x, y) = _mlp(seed, hidden=64), _batch(seed, n=4)
        plain = batch_gradient(model, x, y)
        d = gleak.create("defense", "outpost", beta=0.0, phi=40.0, prune_base=80.0, noise_base=0.8)
        g = d.client_gradient(model, x, y, torch.Generator().manual_seed(seed))
        fisher = torch.cat([p.pow(2).reshape(-1) for p in plain.values()])
        cut = np.percentile(fisher.numpy(), 60.0)
        params = dict(model.named_parameters())
        stds = []
        for n, p in plain.items():
            noisy = p.pow(2) >= cut
            layer_cut = np.percentile(p.abs().numpy(), 80.0)
            pruned = p.abs() < layer_cut
            assert abs(float(pruned.double().mean()) - 0.8) < 0.05, n
            kept = torch.where(pruned, torch.zeros_like(p), p)
            assert torch.equal(g[n][~noisy], kept[~noisy]), n  # no noise off the Fisher mask
            noise = g[n][noisy] - kept[noisy]
            if noise.numel() > 200:
                stds.append((float(noise.std()), layer_risk(params[n]) * 0.8))
        assert stds and all(abs(s - e) / e < 0.2 for s, e in stds), stds
        share = sum(int((p.pow(2) >= cut).sum()) for p in plain.values()) / fisher.numel()
        assert abs(share - 0.4) < 0.01


def test_outpost_layer_risk_is_the_weight_variance_capped_at_one():
    assert layer_risk(torch.tensor([1.0, 3.0])) == pytest.approx(1.0)
    assert layer_risk(torch.tensor([0.0, 0.2])) == pytest.approx(0.02)
    assert layer_risk(torch.tensor([5.0])) == 0.0


def test_outpost_reset_restarts_the_schedule_and_is_deterministic():
    model, (x, y) = _mlp(1), _batch(1, n=2)
    d = gleak.create("defense", "outpost")
    runs = []
    for _ in range(2):
        d.reset()
        rng = torch.Generator().manual_seed(3)
        runs.append([d.client_gradient(model, x, y, rng) for _ in range(5)])
    assert all(torch.equal(a[n], b[n]) for a, b in zip(*runs) for n in a)
    assert d.iteration == 5


def test_outpost_fisher_reading_of_the_code_is_one_value_per_column():
    from gleak.defenses.outpost import fisher_diagonal

    g = torch.tensor([[1.0, -2.0], [3.0, 0.0]])
    assert torch.equal(fisher_diagonal(g, "entry"), g.pow(2))
    assert torch.equal(fisher_diagonal(g, "code"), torch.tensor([[5.0, 2.0], [5.0, 2.0]]))
    assert torch.equal(fisher_diagonal(torch.tensor([1.0, 3.0]), "code"), torch.tensor([5.0, 5.0]))
