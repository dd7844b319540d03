"""Robbing the Fed's imprint attack: exact recovery of every sample alone in its bin, and what defenses do to it."""
import torch

import gleak
from gleak.config import CaseConfig, TrialConfig, derive_seed, generator
from gleak.models import create_model
from gleak.trial import attacker_knowledge, draw_batches, execute, load_case_data

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
        thresholds = -enc.bias.detach().double()  # bin i fires when <w, x> > -b_i
        measured = victim.x.flatten(1).double() @ enc.weight[0].detach().double()
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
    k = gleak.threat.Knowledge(input_shape=(3, 16, 16), num_classes=10, batch_size=2, public_x=public)
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
