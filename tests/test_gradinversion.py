"""GradInversion: the BatchNorm prior helps on a BatchNorm model, label restoration on batches of 8, the group term
pulls the agents together, and the schedule is what the docstring says."""
import copy

import pytest
import torch
import torch.nn.functional as F
from gleak.attacks.gradinversion import BNStatistics, GradInversion
from gleak.attacks.idlg import recover_labels
from torch import nn

import gleak
from gleak.contracts.plugin import batch_gradient
from gleak.contracts.wire import ClientBatch, Knowledge, Observation, Update, denormalize
from gleak.mechanics.data import load_dataset
from gleak.mechanics.metrics import score

RES, BATCH = 8, 8


def _bn_net(seed: int) -> nn.Module:
    """A small convnet with BatchNorm after each convolution (ResNet-style conv-BN-ReLU stages)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


def _distinct_batch(ds, gen: torch.Generator):
    """BATCH images with distinct labels, and the indices of every other image."""
    perm = torch.randperm(len(ds), generator=gen).tolist()
    idx, classes = [], set()
    for i in perm:
        if int(ds.y[i]) not in classes:
            classes.add(int(ds.y[i]))
            idx.append(i)
        if len(idx) == BATCH:
            break
    chosen = set(idx)
    return torch.tensor(idx), torch.tensor([i for i in perm if i not in chosen])


def _case(seed: int, train_steps: int = 0):
    """A victim batch of 8 distinct labels on a BatchNorm model whose running statistics come from the other
    images of the distribution (as a trained model's would), its train-mode FedSGD gradient, and the observation."""
    ds = load_dataset("skimage", resolution=RES)
    victim, rest = _distinct_batch(ds, torch.Generator().manual_seed(seed))
    model = _bn_net(seed).train()
    if train_steps:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(seed + 100)
        for _ in range(train_steps):
            b = rest[torch.randint(len(rest), (32,), generator=g)]
            opt.zero_grad()
            F.cross_entropy(model(ds.normalized(b)), ds.y[b]).backward()
            opt.step()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = None  # cumulative average over the pass below
                m.reset_running_stats()
        model(ds.normalized(rest))
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = 0.1
    batch = ClientBatch(ds.normalized(victim), ds.y[victim], ds.mean, ds.std)
    grad = batch_gradient(copy.deepcopy(model), batch.x, batch.y)  # the client's copy: its buffers move, not ours
    k = Knowledge(ds.input_shape, 10, batch_size=BATCH, mean=ds.mean, std=ds.std, labels=batch.y.clone())
    return Observation(Update(grad, "gradient", BATCH), k, copy.deepcopy(model)), batch, ds


def _psnr(seed: int, **params) -> float:
    obs, batch, ds = _case(seed)
    rec = gleak.create("attack", "gradinversion", **params).reconstruct(obs, torch.Generator().manual_seed(seed))
    return score(batch.images(), batch.y, denormalize(rec.x, ds.mean, ds.std), rec.y, None)["psnr"]


def test_batchnorm_prior_beats_the_same_optimisation_without_it():
    """Restored labels, 150 steps, one agent, no Langevin noise; with the prior (a_BN = 0.1, first layer x10) and
    without (0). Measured: with 13.0, 15.6, 15.3 dB; without 12.5, 14.6, 12.4 dB (seeds 0, 1, 2)."""
    fast = dict(iterations=150, restarts=1, noise=0.0, labels="yin")
    seeds = (0, 1, 2)
    with_prior = [_psnr(s, **fast) for s in seeds]
    without = [_psnr(s, **fast, bn=0.0) for s in seeds]
    wins = sum(a > b for a, b in zip(with_prior, without))
    margin = sum(with_prior) / len(seeds) - sum(without) / len(seeds)
    assert wins >= 2 and margin > 0.2, (with_prior, without)


def test_restored_labels_beat_the_same_optimisation_without_them():
    """The same optimisation (150 steps, one agent, no Langevin noise, the BN prior on), with the labels restored by
    Yin's rule and without restoration: a naive guess (8 distinct classes from the trial's generator).
    Measured: restored 13.0, 15.6, 15.3 dB; guessed 12.4, 12.3, 12.4 dB (seeds 0, 1, 2). Joint soft labels (labels
    "soft") are not the comparison here: on this small net they find the labels themselves (12.5, 16.0, 15.0 dB)."""
    fast = dict(iterations=150, restarts=1, noise=0.0)
    seeds = (0, 1, 2)
    restored = [_psnr(s, **fast, labels="yin") for s in seeds]
    guessed = [_psnr(s, **fast, labels="guess") for s in seeds]
    wins = sum(a > b for a, b in zip(restored, guessed))
    margin = sum(restored) / len(seeds) - sum(guessed) / len(seeds)
    assert wins >= 2 and margin > 1.0, (restored, guessed)


def test_soft_labels_are_optimised_and_read_as_their_argmax():
    obs, batch, _ = _case(0)
    rec = GradInversion(iterations=150, restarts=1, noise=0.0, labels="soft").reconstruct(obs, torch.Generator().manual_seed(0))
    assert rec.y.shape == (BATCH,) and rec.y.dtype == torch.int64
    # the starting logits' argmax matches about 4.6 of the 8 classes; optimised, the logits find 8 (measured)
    assert len(set(rec.y.tolist()) & set(batch.y.tolist())) >= BATCH - 1


def test_label_restoration_on_batches_of_eight_distinct_labels():
    """The row-minimum rule on 12 batches of 8 distinct labels, half on a briefly trained BatchNorm model."""
    accs = {"yin": [], "idlg": []}
    for seed in range(12):
        obs, batch, _ = _case(seed, train_steps=60 if seed % 2 else 0)
        for rule in accs:
            y = recover_labels(obs.update, obs.model, obs.knowledge, BATCH, rule)
            accs[rule].append(len(set(y.tolist()) & set(batch.y.tolist())) / BATCH)
    yin = sum(accs["yin"]) / len(accs["yin"])
    assert yin >= 0.95, accs
    rec = GradInversion(iterations=1, restarts=1).reconstruct(obs, torch.Generator().manual_seed(0))
    assert sorted(rec.y.tolist()) == sorted(recover_labels(obs.update, obs.model, obs.knowledge, BATCH, "yin").tolist())


def test_batchnorm_prior_is_zero_at_the_running_statistics_and_grows_away_from_them():
    model = _bn_net(0).train()
    stats = BNStatistics(model)
    for m in stats.layers:
        m.momentum = 0.0
    x = torch.randn(64, 3, RES, RES, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(x)
    first = float(stats.prior())
    stats.targets = [(mu.detach(), var.detach()) for mu, var in stats.seen]  # targets = this batch's statistics
    stats.seen.clear()
    with torch.no_grad():
        model(x)
    assert float(stats.prior()) < 1e-6 < first
    stats.seen.clear()
    with torch.no_grad():
        model(x * 2 + 1)
    assert float(stats.prior()) > 0.1
    stats.remove()
    assert len(stats.layers) == 2 and all(float(m.running_mean.abs().sum()) == 0 for m in stats.layers)


def test_group_consistency_pulls_the_agents_together():
    obs, _, _ = _case(0)

    def spread(group: float) -> float:
        attack = GradInversion(iterations=40, restarts=3, noise=0.0, group=group)
        x = attack.reconstruct_all(obs, torch.Generator().manual_seed(0))[0]
        return float((x - x.mean(0)).norm())

    assert spread(1.0) < 0.8 * spread(0.0)


def test_schedule_warms_up_then_decays_to_zero():
    a = GradInversion(iterations=100, warmup=10)
    assert a.schedule(0) == pytest.approx(0.1) and a.schedule(9) == pytest.approx(1.0)
    assert a.schedule(10) == pytest.approx(1.0) and a.schedule(55) == pytest.approx(0.5)
    assert a.schedule(99) < 0.01
    with pytest.raises(ValueError, match="group"):
        GradInversion(group=-1)
