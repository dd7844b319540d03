"""MixUp and InstaHide as Huang et al. (NeurIPS 2021) evaluate them: k-way mixtures of the client's batch with soft
labels (InstaHide: times a random sign per entry); their trials scored against the client's private images, the
encodings sent scored beside them (extra *_sent); an attack given the labels handed the soft labels the gradient
was computed with."""
import pytest
import torch
from gleak.defenses._mixing import draw_mixing, mix
from gleak.defenses.instahide import InstaHide
from gleak.defenses.mixup import MixUp

import gleak
from gleak import register_attack
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, batch_gradient
from gleak.contracts.seeds import generator
from gleak.contracts.wire import ClientBatch, Reconstruction
from gleak.mechanics.models import create_model
from gleak.orchestration.reconstructions import unpack
from gleak.orchestration.trial import draw_batches, load_case_data

CASE = dict(dataset="skimage", model="mlp", batch_size=4, resolution=16)


@register_attack("test-given-labels")
class GivenLabels(Attack):
    """Test attack that returns the mean image and keeps the labels it was handed in its extra."""

    needs = frozenset({"architecture", "parameters", "labels", "batch_size"})

    def reconstruct(self, observation, rng):
        k = observation.knowledge
        return Reconstruction(x=torch.zeros((k.batch_size, *k.input_shape)), y=None,
                              extra={"given": k.labels.tolist(), "given_dtype": str(k.labels.dtype)})  # fmt: skip


def test_the_coefficients_and_selections_follow_gradattacks_law():
    """Over 40 draws of 8 encodings: k distinct examples each, coefficients in [0, 0.65] summing to 1, the first
    drawn from Dirichlet(3, 1, 1, 1) (its mean near 3/6 before the bound, well above the others' 1/6)."""
    lams, sels = [], []
    for seed in range(40):
        lam, sel = draw_mixing(8, 4, [3.0, 1.0, 1.0, 1.0], 0.0, 0.65, torch.Generator().manual_seed(seed))
        lams.append(lam)
        sels.append(sel)
    lam, sel = torch.cat(lams), torch.cat(sels)
    assert torch.allclose(lam.sum(1), torch.ones(len(lam), dtype=lam.dtype))
    assert float(lam.max()) <= 0.65 and float(lam.min()) >= 0
    assert all(len(set(r.tolist())) == 4 for r in sel)
    first, rest = float(lam[:, 0].mean()), float(lam[:, 1:].mean())
    assert 0.35 < first < 0.5 and rest < 0.22, (first, rest)
    counts = torch.bincount(sel.reshape(-1), minlength=8).double()  # every example of the batch used alike
    assert float(counts.min()) > 0.8 * float(counts.mean())


def test_an_encoding_is_the_mixture_its_soft_label_says():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 1, 4, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    lam, sel = draw_mixing(6, 4, [3.0, 1.0, 1.0, 1.0], 0.0, 0.65, torch.Generator().manual_seed(1))
    xm, ym = mix(x, y, lam, sel, 3)
    for i in range(6):
        want = sum(float(lam[i, j]) * x[sel[i, j]] for j in range(4))
        assert torch.allclose(xm[i], want)
        for c in range(3):
            assert float(ym[i, c]) == pytest.approx(sum(float(lam[i, j]) for j in range(4) if int(y[sel[i, j]]) == c))
    assert xm.dtype == x.dtype and ym.dtype == x.dtype and torch.allclose(ym.sum(1), torch.ones(6, dtype=ym.dtype))


def test_instahide_is_mixup_times_a_random_sign_per_entry():
    x, y = torch.rand(8, 3, 5, 5), torch.arange(8) % 4
    mixed, soft = MixUp(num_classes=4).gradient_batch(x, y, torch.Generator().manual_seed(0))
    hidden, soft2 = InstaHide(num_classes=4).gradient_batch(x, y, torch.Generator().manual_seed(0))
    assert torch.equal(soft, soft2) and torch.allclose(hidden.abs(), mixed.abs())
    flipped = float((hidden * mixed < 0).float().mean())
    assert 0.4 < flipped < 0.6, flipped  # per pixel and channel, not per image


def test_the_gradient_is_the_soft_label_loss_of_the_encodings():
    model = create_model("mlp", (1, 4, 4), 3, seed=0, dtype=torch.float64, hidden=[6])
    x, y = torch.randn(5, 1, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    d = MixUp(num_classes=3)
    got = d.client_gradient(model, x, y, torch.Generator().manual_seed(4))
    xm, ym = d.gradient_batch(x, y, torch.Generator().manual_seed(4))
    want = batch_gradient(model, xm, ym)
    assert all(torch.allclose(got[n], want[n]) for n in want)
    assert not torch.allclose(got["0.weight"] if "0.weight" in got else next(iter(got.values())),
                              next(iter(batch_gradient(model, x, y).values())))  # fmt: skip


def test_bad_parameters_and_small_batches_say_why():
    with pytest.raises(ValueError, match="coefficients"):
        MixUp(k=4, upper=0.2)
    with pytest.raises(ValueError, match="k must be"):
        MixUp(k=0)
    with pytest.raises(UnsupportedCase, match="k = 4 distinct examples"):
        MixUp(num_classes=3).gradient_batch(torch.rand(3, 1, 2, 2), torch.tensor([0, 1, 2]), torch.Generator())
    with pytest.raises(RuntimeError, match="number of classes"):
        MixUp().gradient_batch(torch.rand(4, 1, 2, 2), torch.tensor([0, 1, 2, 0]), torch.Generator())


def _private_batch(res: gleak.TrialResult) -> ClientBatch:
    ds = load_case_data(res.config)
    return draw_batches(ds, res.config, torch.float32)[0]


@pytest.mark.parametrize("defense", ["mixup", "instahide"])
def test_a_mixing_trial_is_scored_against_the_private_images_and_the_encodings_beside(defense):
    """Scoring against the encodings (what was sent) would make the truth the mixture: the kept truth must be the
    victim's own images, the mixture's scores in extra, and inverting gradients, which recovers the MixUp encodings,
    scores far better against them than against the private images on every seed."""
    steps = 400 if defense == "mixup" else 20  # InstaHide's encodings: only where the scores go is checked
    for seed in range(3):
        res = gleak.run_trial(attack={"name": "inverting-gradients", "iterations": steps, "labels": "given", "tv": 1e-4},
                              defense=defense, seed=seed, **CASE)  # fmt: skip
        assert res.status == "ok", res.error
        private = _private_batch(res)
        assert torch.allclose(res.truth, private.images(), atol=1e-6)
        arrays = unpack(res.row["reconstruction"])
        assert torch.allclose(arrays["truth"], private.images(), atol=1e-6) and arrays["original"] is None
        assert {"psnr_sent", "mse_sent", "ssim_sent"} <= set(res.extra) and "psnr_original" not in res.extra
        if defense == "mixup":
            assert res.extra["psnr_sent"] > res.row["psnr"] + 8, (seed, res.row["psnr"], res.extra["psnr_sent"])


def test_an_attack_given_the_labels_is_handed_the_soft_labels_that_entered_the_gradient():
    for seed in range(3):
        res = gleak.run_trial(attack="test-given-labels", defense="mixup", seed=seed, **CASE)
        given = torch.tensor(res.extra["given"])
        assert res.extra["given_dtype"].startswith("torch.float") and given.shape == (4, 10)
        ds = load_case_data(res.config)
        private = draw_batches(ds, res.config, torch.float32)[0]
        d = MixUp(num_classes=ds.num_classes)
        _, want = d.gradient_batch(private.x, private.y, generator(seed, "client/0"))
        assert torch.allclose(given, want.to(given.dtype), atol=1e-6)
    plain = gleak.run_trial(attack="test-given-labels", defense="none", seed=0, **CASE)
    assert plain.extra["given_dtype"] == "torch.int64"


def test_the_defenses_draw_with_huang_et_als_defaults(monkeypatch):
    import gleak.defenses._mixing as mixing

    seen = []
    real = mixing.draw_mixing
    monkeypatch.setattr(mixing, "draw_mixing", lambda *a: seen.append(a[:5]) or real(*a))
    for cls in (MixUp, InstaHide):
        cls(num_classes=3).gradient_batch(torch.rand(5, 1, 2, 2), torch.tensor([0, 1, 2, 1, 0]), torch.Generator())
    assert seen == [(5, 4, [3.0, 1.0, 1.0, 1.0], 0.0, 0.65)] * 2


def test_a_defense_declaring_another_truth_is_refused_at_registration():
    from gleak.contracts.errors import InputError
    from gleak.contracts.plugin import Defense

    with pytest.raises(InputError, match="scored_against must be 'sent' or 'private', got 'mixture'"):
        @gleak.register_defense("test-bad-truth")
        class BadTruth(Defense):
            """Test defense with an unknown truth."""

            scored_against = "mixture"


def test_unmixing_recovers_each_image_from_exact_encodings_where_the_classes_are_distinct():
    from gleak.attacks._demix import unmix

    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.rand(8, 1, 5, 5, generator=g, dtype=torch.float64), torch.randperm(10, generator=g)[:8]
        lam, sel = draw_mixing(8, 4, [3.0, 1.0, 1.0, 1.0], 0.0, 0.65, g)
        enc, soft = mix(x, y, lam, sel, 10)
        z, classes, info = unmix(enc, soft)
        assert sorted(classes.tolist()) == sorted(y.tolist()) and info["unmix_condition"] >= 1
        for row, c in zip(z, classes):
            assert torch.allclose(row, x[y == c][0], atol=1e-8), seed


def test_the_defense_aware_inverting_gradients_unmixes_mixup_and_only_mixup():
    for defense, unmixed in (("mixup", True), ("instahide", False), ("none", False)):
        res = gleak.run_trial(attack={"name": "inverting-gradients", "iterations": 20, "labels": "given",
                                      "defense_aware": True}, defense=defense, seed=1, **CASE)  # fmt: skip
        assert ("unmix_condition" in res.extra) == unmixed, defense
        if unmixed:
            assert res.extra["wire_reading"] == "mixup-unmixed"


@pytest.mark.parametrize("defense", [MixUp, InstaHide])
def test_huang_et_als_pruning_zeroes_each_tensors_smallest_share_and_stays_out_of_ids_when_off(defense):
    """`prune` (Huang et al.'s MixUp/InstaHide with gradient pruning): each parameter tensor keeps its largest
    1 - p share of entries, the rest exactly zero; at 0 the update is untouched and the parameter is not stored, so
    trials stored before it keep their ids."""
    from gleak.contracts.registry import check_params
    from gleak.contracts.wire import Update

    name = defense.registered_name
    assert check_params("defense", name, {"prune": 0.0}) == check_params("defense", name, {})
    assert "prune" not in check_params("defense", name, {}) and check_params("defense", name, {"prune": 0.9})["prune"] == 0.9
    with pytest.raises(ValueError, match="prune"):
        defense(prune=1.0)
    g = torch.Generator().manual_seed(0)
    update = Update({"w": torch.randn(20, 10, generator=g), "b": torch.randn(20, generator=g)})
    assert defense().transform(update, g) is update
    sent = defense(prune=0.9).transform(update, g)
    for key, t in update.tensors.items():
        s = sent[key]
        kept = s != 0
        assert int(kept.sum()) == t.numel() - round(0.9 * t.numel()) and torch.equal(s[kept], t[kept])
        assert bool(t[kept].abs().min() >= t[~kept].abs().max())  # the largest kept, per tensor
