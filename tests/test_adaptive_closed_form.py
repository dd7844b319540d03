"""The defense-aware closed form (issue 13): its advantage where it has one, and never worse where it falls back."""
import torch

import gleak
from gleak.attacks.closed_form import completed_under_pruning, pooled_under_noise
from gleak.contracts import registry
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.orchestration.trial import execute

MLP = CaseConfig(dataset="skimage", model="mlp")
AWARE = {"defense_aware": True}


def _runs(defense, params, attack_params, case=MLP, seeds=range(4)):
    return [execute(TrialConfig("t", "closed-form", attack_params, defense, params, case, s)) for s in seeds]


def test_pooled_rows_beat_one_row_under_noise():
    """Gaussian noise sigma 0.03 on the update (3x DLG's 'defending' 1e-2): one row is defended or partial in every
    seed; pooling all rows recovers in every seed."""
    plain, aware = _runs("noise", {"sigma": 3e-2}, {}), _runs("noise", {"sigma": 3e-2}, AWARE)
    assert sum(r["verdict"] == "recovered" for r in plain) == 0, [r["psnr"] for r in plain]
    assert all(r["verdict"] == "recovered" and r["extra"]["adaptive"] == 1 for r in aware), [r["psnr"] for r in aware]
    assert min(a["psnr"] - p["psnr"] for a, p in zip(aware, plain)) > 5


def test_rank_one_completion_beats_one_row_under_dgp():
    """DGP (seed 001's k1 = 5%, k2 = 75%) removes the largest bias entries and every row's largest pixels: the plain
    closed form is defended; reading each pixel from a row where it survived, and the pruned rows' bias gradients
    from their ratios, recovers every seed."""
    plain, aware = _runs("dgp", {}, {}), _runs("dgp", {}, AWARE)
    assert all(r["verdict"] == "defended" for r in plain), [r["psnr"] for r in plain]
    assert all(r["verdict"] == "recovered" for r in aware), [r["psnr"] for r in aware]
    assert all(a["extra"]["pixels_read"] > p["extra"]["row_kept"] + 0.2 for a, p in zip(aware, plain))


def test_noise_correction_removes_the_shrinkage():
    """Many weak rows (n v = a quarter of the bias energy): without the errors-in-variables correction the estimate
    would be 20% too small; with it the scale is within 3%."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, generator=g, dtype=torch.float64)
    c = torch.randn(2000, generator=g, dtype=torch.float64) * 0.01
    sd = 0.005
    dw = c[:, None] * x + torch.randn(2000, 100, generator=g, dtype=torch.float64) * sd
    db = c + torch.randn(2000, generator=g, dtype=torch.float64) * sd
    est = pooled_under_noise(dw, db, sd**2)
    assert abs(float(est @ x / (x @ x)) - 1) < 0.03
    assert float(((est - x) ** 2).mean()) < 0.01


def test_completion_recovers_pruned_bias_rows_exactly():
    """A rank-one gradient with its largest bias entries and half of every row pruned: rows without a bias entry
    get theirs from the ratios and contribute pixels no anchored row kept."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, generator=g, dtype=torch.float64)
    c = torch.randn(30, generator=g, dtype=torch.float64)
    dw = c[:, None] * x
    keep = torch.rand(30, 50, generator=g) < 0.5
    db = c.clone()
    db[c.abs().argsort(descending=True)[:10]] = 0
    anchored_cols = keep[db != 0].any(0)
    keep[db != 0, 0] = False  # pixel 0 survives only in rows whose bias was pruned
    keep[db == 0, 0] = True
    est = completed_under_pruning(dw * keep, db)
    assert torch.allclose(est, x, atol=1e-10), (est - x).abs().max()
    assert anchored_cols.all()


def test_never_worse_than_the_plain_closed_form_and_falls_back_exactly():
    """Over small cases (batch 1 and 4, three seeds) and defenses with and without an answer, the defense-aware
    closed form's PSNR is never below the plain one's; where it has no answer (quantization, batch 4) it is the
    plain one, to the bit."""
    everything = [("none", {}), ("noise", {"sigma": 1e-3}), ("noise", {"sigma": 1e-1}), ("topk", {"ratio": 0.9}),
                  ("topk", {"ratio": 0.99, "scope": "layer"}), ("dgp", {}), ("quantization", {"format": "int", "bits": 8})]
    batch4 = CaseConfig(dataset="skimage", model="mlp", batch_size=4)
    for case, defenses in ((MLP, everything), (batch4, [("noise", {"sigma": 1e-2}), ("dgp", {})])):
        for d, dp in defenses:
            for p, a in zip(_runs(d, dp, {}, case, range(3)), _runs(d, dp, AWARE, case, range(3))):
                assert a["psnr"] >= p["psnr"] - 1e-6, (case.batch_size, d, dp, p["psnr"], a["psnr"])
                if case.batch_size > 1 or d in ("none", "quantization"):
                    assert a["extra"]["adaptive"] == 0 and a["psnr"] == p["psnr"], (d, dp)


def test_the_option_keeps_old_ids_and_asks_for_the_defense():
    assert registry.check_params("attack", "closed-form", {"defense_aware": False}) == registry.check_params("attack", "closed-form", {})
    assert "defense_aware" in registry.check_params("attack", "closed-form", AWARE)
    assert "knows_defense" not in gleak.create("attack", "closed-form").needs
    assert "knows_defense" in gleak.create("attack", "closed-form", defense_aware=True).needs
    base = TrialConfig("t", "closed-form", registry.check_params("attack", "closed-form", {}), "none", {}, MLP, 0)
    off = TrialConfig("t", "closed-form", registry.check_params("attack", "closed-form", {"defense_aware": False}), "none", {}, MLP, 0)
    assert base.trial_id == off.trial_id
