"""What a reconstruction is scored against: the batch that entered the victim's gradient (what was sent). A defense
that trains on transformed inputs (ATS) declares it (Defense.gradient_batch); the trial scores against its output
and, beside it, against the untransformed images (extra's *_original); check-plugin fails an undeclared transform."""
import textwrap

import pytest
import torch
from gleak.defenses.ats import ATS, crop_flip, crop_padding

import gleak
from gleak.contracts.seeds import generator
from gleak.contracts.wire import ClientBatch
from gleak.orchestration.conformance import check_plugin
from gleak.orchestration.reconstructions import rescore_rows, unpack
from gleak.orchestration.trial import sent_batch

ATS_HYBRID = {"name": "ats", "policy": "3-1-7+43-18-18"}


def _ats_closed_form(seed: int) -> gleak.TrialResult:
    return gleak.run_trial(attack="closed-form", defense=ATS_HYBRID, dataset="skimage", model="mlp", batch_size=1,
                           resolution=16, seed=seed)  # fmt: skip


def test_a_transforming_defense_is_scored_against_what_was_sent():
    """The closed form inverts the MLP's first layer exactly, so it recovers the image that entered the gradient:
    scored against it, the PSNR ceiling; against the untransformed image (ATS's crop, flip and policy moved every
    pixel), far less. Scoring against the original would fail here on every seed."""
    for seed in range(3):
        res = _ats_closed_form(seed)
        e = res.extra
        assert res.row["psnr"] >= 40 and res.row["verdict"] == "recovered", (seed, res.row["psnr"])
        assert e["psnr_original"] < 30 and e["psnr_original"] < res.row["psnr"] - 20, (seed, e)
        assert {"mse_original", "ssim_original"} <= set(e) and e["ssim_original"] < res.row["ssim"]
        # the truth kept is ATS's transform of the victim's batch under the client's own generator
        victim = res.config
        ds = gleak.orchestration.trial.load_case_data(victim)
        batch = gleak.orchestration.trial.draw_batches(ds, victim, torch.float32)[0]
        d = ATS(policy=ATS_HYBRID["policy"])
        d.bind_data(ds.mean, ds.std)
        want = ClientBatch(d.transform_batch(batch.x, generator(seed, "client/0")), batch.y, ds.mean, ds.std).images()
        assert torch.allclose(res.truth, want, atol=1e-6)
        arrays = unpack(res.row["reconstruction"])
        assert torch.allclose(arrays["truth"], want, atol=1e-6)
        assert torch.allclose(arrays["original"], batch.images(), atol=1e-6)


def test_rescore_scores_against_the_same_truth_and_the_original_beside_it():
    res = _ats_closed_form(0)
    # stored extra left empty: the *_original scores must be recomputed from the stored arrays
    (_, cols, extra), = rescore_rows([(res.trial_id, res.row["reconstruction"], "{}")], ["psnr", "mse", "ssim"])
    assert cols["psnr"] == pytest.approx(res.row["psnr"], abs=1e-3)
    assert extra["psnr_original"] == pytest.approx(res.extra["psnr_original"], abs=1e-3)
    assert extra["ssim_original"] == pytest.approx(res.extra["ssim_original"], abs=1e-6)


def test_an_undefended_trial_has_one_truth():
    res = gleak.run_trial(attack="closed-form", dataset="skimage", model="mlp", batch_size=1, resolution=16)
    assert res.row["psnr"] >= 40 and "psnr_original" not in res.extra
    assert unpack(res.row["reconstruction"])["original"] is None


def test_the_sent_batch_takes_each_image_from_the_first_gradient_it_entered():
    """FedAvg's local steps on mini-batches: every image's first transformed version, in the victim's order."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 1, 3, 3, generator=g), torch.tensor([0, 1, 2, 3])
    victim = ClientBatch(x, y, torch.zeros(1), torch.ones(1))
    kept = [(x[2:], -x[2:], y[2:]), (x[:2], 2 * x[:2], y[:2]), (x[2:], 5 * x[2:], y[2:])]
    got = sent_batch(victim, kept)
    assert torch.equal(got.x, torch.cat([2 * x[:2], -x[2:]])) and torch.equal(got.y, y)
    with pytest.raises(RuntimeError, match="victim image 0"):
        sent_batch(victim, kept[:1])


def test_crop_flip_is_torchvisions_random_crop_and_flip():
    """Every output is one of RandomCrop(padding)'s crops of the black-padded image, flipped or not (torchvision's
    functional ops), and all (2 pad + 1)^2 offsets and both flips occur."""
    import torchvision.transforms.functional as TF

    img = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(1))
    pad = crop_padding(16, 16)
    assert pad == 2 and crop_padding(32, 32) == 4  # the authors' RandomCrop(32, padding=4)
    padded = TF.pad(img, [pad])
    candidates = {(i, j, f): TF.crop(padded, i, j, 16, 16) for i in range(2 * pad + 1) for j in range(2 * pad + 1)
                  for f in (False, True)}  # fmt: skip
    candidates = {k: TF.hflip(v) if k[2] else v for k, v in candidates.items()}
    rng, hits = torch.Generator().manual_seed(3), set()
    for _ in range(400):
        out = crop_flip(img, rng)
        found = [k for k, v in candidates.items() if torch.equal(v, out)]
        assert found
        hits.update(found)
    assert hits == set(candidates)


BAD = '''
from gleak import register_defense
from gleak.contracts.plugin import Defense
from gleak.contracts.plugin import batch_gradient


@register_defense("test-undeclared-flip")
class Undeclared(Defense):
    """Trains on the mirrored batch without saying so."""

    def client_gradient(self, model, x, y, rng):
        return batch_gradient(model, x.flip(-1), y)


@register_defense("test-misdeclared-flip")
class Misdeclared(Defense):
    """Declares one transform, trains on another."""

    def gradient_batch(self, x, y, rng):
        return x.flip(-1), y

    def client_gradient(self, model, x, y, rng):
        self.training_batch(x, y, rng)
        return batch_gradient(model, x.flip(-2), y)


@register_defense("test-declared-flip")
class Declared(Defense):
    """Trains on the mirrored batch, declared."""

    def gradient_batch(self, x, y, rng):
        return x.flip(-1), y
'''


def test_check_plugin_fails_an_undeclared_or_misdeclared_input_transform(tmp_path):
    from gleak.contracts.registry import load_plugin_file

    f = tmp_path / "flips.py"
    f.write_text(textwrap.dedent(BAD))
    load_plugin_file(f)
    name = "declares the inputs it trains on"
    results = {d: {c.name: c for c in check_plugin("defense", d)}[name]
               for d in ("test-undeclared-flip", "test-misdeclared-flip", "test-declared-flip")}  # fmt: skip
    assert not results["test-undeclared-flip"].passed and "declare" in results["test-undeclared-flip"].detail
    assert not results["test-misdeclared-flip"].passed
    assert results["test-declared-flip"].passed, results["test-declared-flip"].detail
