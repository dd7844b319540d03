"""Noise in DP mode: per-example clipping inside the client's computation, Gaussian noise z * C, and the epsilon of
opacus' accountant for the run's delta, sampling rate and steps."""
import dataclasses

import pytest
import torch

import gleak
from gleak.contracts.config import CaseConfig, TrialConfig, UtilityConfig
from gleak.contracts.plugin import batch_gradient, loss_fn, trainable
from gleak.contracts.registry import ParamError, check_params
from gleak.contracts.wire import ClientBatch
from gleak.mechanics.client_update import fedsgd_update
from gleak.mechanics.models import create_model
from gleak.orchestration.trial import run_trial
from gleak.orchestration.utility import accounting, load_utility_data, run_utility


def _mlp_batch(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    model = create_model("mlp", (1, 8, 8), 4, seed=seed, hidden=[16])
    return model, torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _clipped_mean_by_loop(model, x, y, clip):
    """Per-example gradients one autograd call at a time, each scaled to norm <= clip, averaged."""
    params = [p for _, p in trainable(model)]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        g = torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]), params)
        norm = torch.sqrt(sum((t**2).sum() for t in g))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        total = [a + factor * t for a, t in zip(total, g)]
    return [t / len(x) for t in total]


@pytest.mark.parametrize("clip", [1e-3, 0.5, 1e3])  # every example clipped, some, none
def test_per_example_clipping_matches_a_loop(clip):
    model, x, y = _mlp_batch()
    d = gleak.create("defense", "noise", mode="dp", clip=clip, noise_multiplier=0.0)
    got = d.client_gradient(model, x, y, torch.Generator().manual_seed(0))
    ref = _clipped_mean_by_loop(model, x, y, clip)
    for (name, _), r in zip(trainable(model), ref):
        assert torch.allclose(got[name], r, rtol=1e-4, atol=1e-9), name
    if clip == 1e3:  # nothing clipped: the plain mean gradient
        plain = batch_gradient(model, x, y)
        assert all(torch.allclose(got[n], plain[n], rtol=1e-4, atol=1e-8) for n in plain)


def test_noise_is_gaussian_with_std_z_times_c_over_batch():
    model, x, y = _mlp_batch(n=4)
    z, clip = 2.0, 0.3
    clean = gleak.create("defense", "noise", mode="dp", clip=clip, noise_multiplier=0.0).client_gradient(
        model, x, y, torch.Generator().manual_seed(0))  # fmt: skip
    noisy = gleak.create("defense", "noise", mode="dp", clip=clip, noise_multiplier=z).client_gradient(
        model, x, y, torch.Generator().manual_seed(1))  # fmt: skip
    resid = torch.cat([(noisy[n] - clean[n]).flatten() for n in clean]) * len(x) / (z * clip)
    assert resid.numel() > 1000 and abs(float(resid.std()) - 1) < 0.06 and abs(float(resid.mean())) < 0.06


def test_the_dp_hook_runs_inside_fedsgd_and_every_fedavg_step():
    model, x, y = _mlp_batch()
    batch = ClientBatch(x, y, torch.zeros(1), torch.ones(1))
    d = gleak.create("defense", "noise", mode="dp", clip=1e-4, noise_multiplier=0.0)
    u = fedsgd_update(model, batch, d, torch.Generator().manual_seed(0))
    assert float(u.flat().norm()) <= 1e-4 * (1 + 1e-5)  # the mean of clipped gradients
    from gleak.mechanics.client_update import fedavg_update

    delta = fedavg_update(model, batch, lr=1.0, local_steps=3, local_batch_size=2, defense=d, rng=torch.Generator().manual_seed(0))
    assert float(delta.flat().norm()) <= 3 * 1e-4 * (1 + 1e-5)  # three clipped steps at lr 1


def test_a_utility_run_reports_the_epsilon_opacus_reports():
    """The acceptance test: the epsilon of a DP noise run equals opacus' accountant stepped through the same run."""
    from opacus.accountants import RDPAccountant

    for algorithm, steps in (("fedsgd", 1), ("fedavg", 2)):
        cfg = UtilityConfig(dataset="skimage", model="mlp", model_params={"hidden": [16]}, clients=2, training_rounds=3,
                            batch_size=10, algorithm=algorithm, local_steps=steps, delta=1e-4)  # fmt: skip
        row = run_utility(cfg, "noise", {"mode": "dp", "noise_multiplier": 0.9, "clip": 1.0})
        assert row["status"] == "ok", row["error"]
        train, _ = load_utility_data(cfg)
        acc = RDPAccountant()
        for _ in range(cfg.training_rounds * steps):  # one step per gradient a client takes
            acc.step(noise_multiplier=0.9, sample_rate=cfg.batch_size / (len(train) // cfg.clients))
        assert row["epsilon"] == pytest.approx(acc.get_epsilon(delta=1e-4), rel=1e-12)
        assert accounting(cfg, len(train)) == (10 / 100, 3 * steps)
    assert run_utility(dataclasses.replace(cfg, training_rounds=1), "noise", {"sigma": 0.1})["epsilon"] is None


def test_target_epsilon_is_opacus_noise_multiplier():
    from opacus.accountants.utils import get_noise_multiplier

    d = gleak.create("defense", "noise", mode="dp", target_epsilon=2.0, delta=1e-5, sample_rate=0.01, steps=500)
    assert d.z == get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=500)
    assert 2.0 - 0.01 <= d.epsilon(delta=1e-5, sample_rate=0.01, steps=500) <= 2.0


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"mode": "dp"}, "exactly one of noise_multiplier and target_epsilon"),
        ({"mode": "dp", "noise_multiplier": 1.0, "sigma": 0.1}, "sigma applies to mode 'absolute' only"),
        ({"noise_multiplier": 1.0}, "apply to mode 'dp' only"),
        ({"mode": "dp", "target_epsilon": 1.0}, "needs the accounting horizon"),
        ({"mode": "dp", "noise_multiplier": 1.0, "distribution": "laplace"}, "distribution must be 'gaussian'"),
        ({"mode": "dp", "noise_multiplier": 1.0, "clip": 0.0}, "clip must be > 0"),
    ],
)
def test_dp_parameters_are_validated(params, needle):
    with pytest.raises(ParamError, match=needle):
        gleak.create("defense", "noise", **params)


def test_dp_noise_passes_check_plugin_and_runs_in_a_trial():
    from gleak.orchestration.conformance import check_plugin

    params = {"mode": "dp", "noise_multiplier": 1.0, "clip": 1.0}
    assert all(c.passed for c in check_plugin("defense", "noise", params))
    case = CaseConfig(dataset="skimage", model="mlp", resolution=16, batch_size=1)
    full = check_params("defense", "noise", params)
    row = run_trial(TrialConfig("t", "closed-form", {}, "noise", full, case, 0))
    assert row["status"] == "ok", row["error"]
    assert row["grad_dist"] > 0.5  # measured against the plain gradient, not the already privatised one
