"""Data Leakage in Federated Averaging (attacks/fedavg_leakage.py): its simulation of the client's local training is
the client's, its epoch prior ignores the order inside an epoch, it beats one-gradient inverting gradients on FedAvg
updates, it passes conformance; and FedAvg's `shuffle` option (protocols/fedavg.py) keeps earlier trial ids."""
from __future__ import annotations

import statistics

import pytest
import torch

import gleak
from gleak.attacks import fedavg_leakage as fl
from gleak.contracts import registry
from gleak.contracts.wire import ClientBatch
from gleak.mechanics.client_update import fedavg_update
from gleak.mechanics.models import create_model


def _client(n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    model = create_model("mlp", (1, 6, 6), 5, seed=seed, hidden=[12]).double()
    x = torch.randn((n, 1, 6, 6), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (n,), generator=gen)
    return model, ClientBatch(x, y, torch.zeros(1), torch.ones(1))


@pytest.mark.parametrize("steps, local_bs, lr", [(1, None, 0.1), (10, 3, 0.1), (7, 4, 0.3), (5, 6, 0.05)])
def test_the_simulation_reproduces_the_clients_delta_step_for_step(steps, local_bs, lr):
    """Given the true inputs and labels, the attack's differentiable simulation, with the local-training settings it
    reads from the update's meta, gives the client's w_before - w_after (partial last mini-batches included)."""
    model, batch = _client()
    update = fedavg_update(model, batch, lr, steps, local_bs)
    got_lr, got_steps, got_bs = fl.FedAvgLeakage.local_training(update, batch.size)
    names = list(update.tensors)
    sim = fl.simulated_delta(model, names, [batch.x], batch.y, got_lr, got_steps, got_bs, create_graph=False)
    for n, s in zip(names, sim):
        torch.testing.assert_close(s, update.tensors[n], rtol=1e-12, atol=1e-14)


def test_a_shuffling_client_is_reproduced_from_its_orders_and_the_shuffle_keeps_trial_ids():
    """With `shuffle` the client draws one order per epoch from its generator; the simulation given those orders
    (one input tensor per epoch) reproduces its delta. Without it the delta is the in-order one, and `shuffle`
    False stays out of the protocol's stored parameters (earlier trial ids unchanged)."""
    model, batch = _client()
    plain = fedavg_update(model, batch, 0.1, 6, 3, rng=torch.Generator().manual_seed(5))
    again = fedavg_update(model, batch, 0.1, 6, 3, rng=torch.Generator().manual_seed(5), shuffle=False)
    shuffled = fedavg_update(model, batch, 0.1, 6, 3, rng=torch.Generator().manual_seed(5), shuffle=True)
    gen = torch.Generator().manual_seed(5)
    orders = [torch.randperm(batch.size, generator=gen) for _ in range(3)]  # 6 steps of 3 on 6 samples: 3 epochs
    names = list(plain.tensors)
    sim = fl.simulated_delta(model, names, [batch.x[o] for o in orders], [batch.y[o] for o in orders], 0.1, 6, 3,
                             create_graph=False)  # fmt: skip
    for n, s in zip(names, sim):
        assert torch.equal(plain.tensors[n], again.tensors[n])
        torch.testing.assert_close(s, shuffled.tensors[n], rtol=1e-12, atol=1e-14)
    assert any(not torch.allclose(plain.tensors[n], shuffled.tensors[n]) for n in names)
    assert "shuffle" not in registry.check_params("protocol", "fedavg", {"local_steps": 3})
    assert registry.check_params("protocol", "fedavg", {"local_steps": 3, "shuffle": True})["shuffle"] is True


@pytest.mark.parametrize("kind", fl.PRIORS[:-1])
def test_the_epoch_prior_ignores_the_order_inside_an_epoch(kind):
    """Zero for epochs that hold the same samples in any order, positive once an epoch holds another sample; the
    random-convolution features keep that."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((4, 1, 6, 6), generator=gen)
    same = torch.stack([x, x[[2, 0, 3, 1]], x[[3, 2, 1, 0]]])
    other = same.clone()
    other[1, 0] = torch.randn((1, 6, 6), generator=gen)
    conv = torch.randn((8, 1, 3, 3), generator=gen)
    for c in (None, conv):
        assert float(fl.epoch_prior(same, kind, c)) == pytest.approx(0.0, abs=1e-6)
        assert float(fl.epoch_prior(other, kind, c)) > 1e-3


def test_the_default_attack_pulls_its_epochs_together(monkeypatch):
    """The paper's default: one set of variables per epoch and the order-invariant prior (weight 1000, their FEMNIST
    scripts) in every iteration's objective; prior = "none" (the ablation) leaves it out."""
    calls = []
    real = fl.epoch_prior
    monkeypatch.setattr(fl, "epoch_prior", lambda x, kind, conv=None: calls.append((x.shape[0], kind)) or real(x, kind, conv))
    case = dict(dataset="skimage", resolution=8, model="mlp", model_params={"hidden": [8]}, batch_size=2,
                protocol={"name": "fedavg", "local_steps": 6, "local_batch_size": 1, "shuffle": True})  # fmt: skip
    r = gleak.run_trial(attack={"name": "fedavg-leakage", "iterations": 3}, seed=0, **case)
    assert r.extra["epochs"] == 3 and calls == [(3, "l2-mean")] * 3
    calls.clear()
    gleak.run_trial(attack={"name": "fedavg-leakage", "iterations": 3, "prior": "none"}, seed=0, **case)
    assert calls == []


# The rate test's case: 5 local epochs of a shuffling FedAvg client (whole-batch steps, local lr 0.1) on 4 skimage
# photographs at 8x8, an MLP of 32 units.
RATE_CASE = dict(dataset="skimage", resolution=8, model="mlp", model_params={"hidden": [32]}, batch_size=4,
                 protocol={"name": "fedavg", "local_steps": 5, "local_batch_size": 4, "local_lr": 0.1, "shuffle": True})  # fmt: skip
IG = {"name": "inverting-gradients", "iterations": 500, "tv": 1e-2, "labels": "given"}


def test_it_beats_one_gradient_inverting_gradients_and_the_blind_guess_over_seeds():
    """Over seeds 0-3: fedavg-leakage (200 iterations, its own label estimate) above inverting-gradients reading the
    delta as one gradient (given the true labels, 500 iterations, TV 1e-2) in every seed, by a median of at least
    3 dB, and 8 dB above the blind guess (median). Measured, seeds 0-5: PSNR 25.0, 26.4, 27.4, 26.0, 22.3, 27.6 dB
    against 19.3, 19.4, 23.4, 20.4, 19.6, 22.1 (gains 2.7 to 7.0 dB); blind guesses 11.8 to 14.2 dB."""
    gains, blind = [], []
    for seed in range(4):
        ours = gleak.run_trial(attack={"name": "fedavg-leakage", "iterations": 200}, seed=seed, **RATE_CASE)
        ig = gleak.run_trial(attack=IG, seed=seed, **RATE_CASE)
        gains.append(ours.row["psnr"] - ig.row["psnr"])
        blind.append(ours.row["psnr"] - ours.extra["blind_psnr"])
    assert min(gains) > 0 and statistics.median(gains) >= 3.0, gains
    assert statistics.median(blind) >= 8.0, blind


def test_it_passes_conformance():
    from gleak.orchestration.conformance import check_plugin

    failed = [f"{c.name}: {c.detail}" for c in check_plugin("attack", "fedavg-leakage") if not c.passed]
    assert not failed
