"""Robbing the Fed's imprint attack: exact recovery of every sample alone in its bin, and what defenses do to it."""
import pytest
import torch
from gleak.attacks.imprint import ENCODER

import gleak
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.seeds import derive_seed, generator
from gleak.contracts.wire import ClientBatch, Knowledge, Observation, Update
from gleak.mechanics.client_update import fedsgd_update
from gleak.mechanics.metrics import psnr
from gleak.mechanics.models import create_model
from gleak.orchestration.trial import attacker_knowledge, draw_batches, execute, load_case_data

B32 = CaseConfig(dataset="skimage", model="mlp", batch_size=32)


def _share(attack_params, defense="none", defense_params=None, seeds=(0, 1, 2)):
    rows = [execute(TrialConfig("t", "imprint", attack_params, defense, defense_params or {}, B32, s)) for s in seeds]
    return sum(r["extra"]["share_psnr40"] for r in rows) / len(rows), rows


def test_every_sample_alone_in_its_bin_is_recovered_exactly():
    for seed in range(2):
        cfg = TrialConfig("t", "imprint", {"bins": 64}, "none", {}, B32, seed)
        ds = load_case_data(cfg)
        victim = draw_batches(ds, cfg, torch.float32)[0]
        attack = gleak.create("attack", "imprint", bins=64)
        knowledge = attacker_knowledge(attack, ds, victim, load_case_data(cfg, "test"))
        model = create_model("mlp", ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"))
        served = attack.prepare(model, knowledge, generator(seed, "attack-prepare"))
        enc = served.imprint.encoder
        thresholds = -enc.bias.detach().double() * attack.gain  # bin i fires when <m, x> > q_i
        measured = victim.x.flatten(1).double() @ (enc.weight[0].detach().double() * attack.gain)
        interval = torch.bucketize(measured, thresholds)  # 0: below every threshold (fires no bin)
        counts = torch.bincount(interval, minlength=65)
        alone = int(((counts[interval] == 1) & (interval > 0)).sum())
        s = execute(cfg)
        assert round(s["extra"]["share_psnr40"] * 32) == alone, (seed, s["extra"], alone)
        assert alone >= 12  # 64 bins for 32 samples: collisions are common, isolation too


def test_undefended_imprint_recovers_half_a_batch_of_32_with_64_bins():
    share, rows = _share({"bins": 64})
    assert share >= 0.5, [r["extra"] for r in rows]
    assert all(r["psnr"] > 40 for r in rows)  # the exact ones dominate the mean PSNR


def test_exact_in_float64_when_the_bins_separate_the_batch():
    case = CaseConfig(dataset="skimage", model="mlp", batch_size=4, dtype="float64")
    s = execute(TrialConfig("t", "imprint", {"bins": 512}, "none", {}, case, 0))
    assert s["extra"]["share_psnr40"] == 1.0 and s["mse"] < 1e-20


def test_prepare_leaves_the_model_alone_and_the_body_unchanged():
    model = create_model("lenet", (3, 16, 16), 10, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    public = torch.randn(20, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    k = gleak.contracts.wire.Knowledge(input_shape=(3, 16, 16), num_classes=10, batch_size=2, public_x=public)
    served = gleak.create("attack", "imprint", bins=8).prepare(model, k, torch.Generator().manual_seed(0))
    assert served is not model and all(torch.equal(v, model.state_dict()[n]) for n, v in before.items())
    assert all(torch.equal(p, served.state_dict()[f"body.{n}"]) for n, p in model.state_dict().items())
    w = served.imprint.encoder.weight
    assert torch.equal(w, w[:1].expand_as(w))  # every bin measures the same direction
    assert torch.all(served.imprint.encoder.bias[:-1] > served.imprint.encoder.bias[1:])  # thresholds increase


def test_gaussian_noise_does_not_stop_a_loud_imprint_but_stops_a_quiet_one():
    loud, rows = _share({"gain": 1e6}, "noise", {"sigma": 1e-2})
    assert loud >= 0.5, [r["extra"] for r in rows]
    quiet, _ = _share({"gain": 1.0}, "noise", {"sigma": 1e-2}, seeds=(0,))
    assert quiet == 0.0


def test_dgp_and_layerwise_topk_stop_imprint_whatever_its_gain():
    for gain in (1.0, 1e6):
        assert _share({"gain": gain}, "dgp", seeds=(0,))[0] == 0.0
        assert _share({"gain": gain}, "topk", {"ratio": 0.8, "scope": "layer"}, seeds=(0,))[0] == 0.0


def _gaussian_batch(seed: int, n: int, shape=(3, 8, 8)) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("lowest_bin,lost", [("below-data", "none"), ("quantile", "some")])
def test_at_batch_32_with_64_bins_no_sample_is_lost_below_the_first_bin(lowest_bin, lost):
    """Victims drawn from the distribution the server fits (Gaussian images, public data from the same law): with the
    reference's layout every sample fires the first bin and each one alone in its interval, the lowest included, is
    read exactly from the real gradient; the i/(k+1) layout loses the samples below its first threshold."""
    below = exact = alone_total = 0
    for seed in range(8):
        public, x = _gaussian_batch(100 + seed, 2000), _gaussian_batch(seed, 32)
        k = Knowledge(input_shape=(3, 8, 8), num_classes=10, batch_size=32, public_x=public)
        attack = gleak.create("attack", "imprint", bins=64, lowest_bin=lowest_bin)
        served = attack.prepare(create_model("mlp", (3, 8, 8), 10, seed=seed), k, torch.Generator().manual_seed(0))
        enc = served.imprint.encoder
        q = -enc.bias.detach().double() * attack.gain
        measured = x.flatten(1).double() @ (enc.weight[0].detach().double() * attack.gain)
        interval = torch.bucketize(measured, q)  # 0: below the first threshold, fires no bin
        below += int((interval == 0).sum())
        counts = torch.bincount(interval, minlength=65)
        alone = (counts[interval] == 1) & (interval > 0)
        alone_total += int(alone.sum())
        y = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(seed))
        update = fedsgd_update(served, ClientBatch(x, y, torch.zeros(3), torch.ones(3)))
        rec = attack.reconstruct(Observation(update, k), torch.Generator()).x
        # every sample alone in its interval is one of the reconstructions, exactly (> 40 dB on its own range)
        for i in torch.nonzero(alone).flatten():
            best = float(psnr(rec.double(), x[i : i + 1].double(), float(x[i].max() - x[i].min())).max())
            exact += best > 40
    assert exact == alone_total > 8 * 12  # 64 bins for 32 samples: more than 12 alone per batch
    if lost == "none":
        assert below == 0
    else:
        assert below > 0  # about 32/65 a batch: the layout the test guards against does lose samples


def _observation(dw: torch.Tensor, db: torch.Tensor, batch: int) -> Observation:
    k = Knowledge(input_shape=(1, 1, dw.shape[1]), num_classes=2, batch_size=batch)
    return Observation(Update({f"{ENCODER}.weight": dw, f"{ENCODER}.bias": db}), k)


@pytest.mark.parametrize("selection,expected", [("weight", 10.0), ("bias", 2.0)])
def test_selection_keeps_the_interval_the_rule_names(selection, expected):
    """Three intervals with a non-zero bias difference, a batch of one: "weight" (the reference's rule) keeps the one
    of largest |mean weight difference|, "bias" the one of largest |bias difference|."""
    images, s = torch.tensor([10.0, 2.0, -1.0]), torch.tensor([8.0, -30.0, 5.0])  # |s x|: 80, 60, 5; |s|: 8, 30, 5
    upward = lambda t: t.flip(0).cumsum(0).flip(0)  # noqa: E731 - bin i fires for the intervals i .. top
    dw, db = upward(s * images).unsqueeze(1).repeat(1, 4), upward(s)
    attack = gleak.create("attack", "imprint", bins=3, selection=selection)
    rec = attack.reconstruct(_observation(dw, db, batch=1), torch.Generator()).x
    assert torch.allclose(rec.flatten(), torch.full((4,), expected))


def test_default_gain_is_the_reference_blocks_loudness_and_survives_noise():
    """The reference block's decoder entries are 1 / its gain 1e-3 = 1e3; the default here has the same, and Gaussian
    noise of 1e-2 leaves it most of the exact recoveries it has undefended (gain 1, 64,000 times quieter, loses them
    all: test_gaussian_noise_does_not_stop_a_loud_imprint_but_stops_a_quiet_one)."""
    public = torch.randn(50, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    k = Knowledge(input_shape=(3, 8, 8), num_classes=10, batch_size=4, public_x=public)
    served = gleak.create("attack", "imprint", bins=64).prepare(create_model("mlp", (3, 8, 8), 10, seed=0), k, torch.Generator())
    assert torch.all(served.imprint.decoder.weight == 1e3)
    noisy, rows = _share({"bins": 64}, "noise", {"sigma": 1e-2})
    clean, _ = _share({"bins": 64})
    assert clean >= 0.5 and noisy >= 0.8 * clean, (clean, [r["extra"] for r in rows])
