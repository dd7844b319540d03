"""Registered PSNR, image identifiability precision, feature-space MSE and BLEU: the metrics a breaching user reads,
each checked against a reference implementation (kornia's ImageRegistrator as breaching configures it, breaching's
FMSE formula, sacreBLEU) and against what it must do on images whose answer is known."""
import random
from functools import partial

import pytest
import torch

from gleak.mechanics import metrics
from gleak.mechanics.registration import registered_psnr
from gleak.mechanics.text.metrics import bleu


def _photos(side=32):
    from skimage import data
    from skimage.transform import resize

    names = ("astronaut", "chelsea", "coffee", "rocket")
    return torch.stack([torch.tensor(resize(getattr(data, n)(), (side, side)), dtype=torch.float32).permute(2, 0, 1)
                        for n in names])  # fmt: skip


def _plain_psnr(a, b):
    return 10 * torch.log10(1 / ((a.double() - b.double()) ** 2).flatten(1).mean(1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_registration_undoes_a_shift_and_never_scores_below_plain_psnr(seed):
    g = torch.Generator().manual_seed(seed)
    img = _photos()
    dy, dx = (int(v) for v in torch.randint(1, 3, (2,), generator=g))
    shifted = torch.roll(img, shifts=(dy, dx), dims=(2, 3))
    plain, reg = _plain_psnr(shifted, img), registered_psnr(shifted, img)
    assert (reg >= plain - 1e-9).all()
    assert (reg > plain + 6).all(), (plain, reg)  # a 1-2 pixel shift costs 6+ dB of plain PSNR; registration wins it back
    noise = torch.rand(img.shape, generator=g)
    assert (registered_psnr(noise, img) < reg - 5).all()  # noise stays noise: no transform makes it the image


def test_an_exact_reconstruction_is_at_the_ceiling_and_the_identity_changes_nothing():
    img = _photos()
    assert (registered_psnr(img, img, ceiling=metrics.PSNR_CEILING) == metrics.PSNR_CEILING).all()


def test_registered_psnr_is_kornias_registrator_as_breaching_runs_it():
    """breaching: ImageRegistrator("similarity", num_iterations=2500) with a reflection-padded HomographyWarper,
    the better of plain and registered PSNR. Skips where kornia is not installed (it is in gleak[dev])."""
    kornia = pytest.importorskip("kornia.geometry")
    g = torch.Generator().manual_seed(0)
    img = _photos()
    rec = torch.roll(img, shifts=(1, 2), dims=(2, 3)).clone()
    rec[1] = torch.roll(img[1], shifts=(-2, 0), dims=(1, 2))
    rec[2] = (img[2] + 0.1 * torch.randn(img[2].shape, generator=g)).clamp(0, 1)
    rec[3] = torch.flip(img[3], dims=(2,))
    ref = []
    for a, b in zip(rec, img):
        a, b = a[None], b[None]
        r = kornia.ImageRegistrator("similarity", num_iterations=2500)
        r.warper = partial(kornia.HomographyWarper, padding_mode="reflection")
        r.register(a, b)
        warped = r.warp_src_into_dst(a).detach()
        ref.append(max(float(_plain_psnr(a, b)[0]), float(_plain_psnr(warped, b)[0])))
    assert registered_psnr(rec, img).tolist() == pytest.approx(ref, abs=0.02)


def _pool(seed):
    """A small labelled split and a victim batch drawn from it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(60, 1, 8, 8, generator=g)
    y = torch.arange(60) % 3
    idx = torch.randperm(60, generator=g)[:4]
    return x, y, idx


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_iip_counts_the_images_whose_reconstruction_finds_them_among_their_class(seed):
    x, y, idx = _pool(seed)
    truth, labels = x[idx], y[idx]
    g = torch.Generator().manual_seed(100 + seed)
    close = (truth + 0.05 * torch.randn(truth.shape, generator=g)).clamp(0, 1)
    assert metrics.score(truth, labels, close, None, search=(x, y))["iip"] == 1.0
    # Two reconstructions replaced by another image of their class: those two are identified as that image.
    wrong = close.clone()
    for i in (0, 1):
        same = [int(j) for j in torch.nonzero(y == labels[i]).flatten() if int(j) != int(idx[i])]
        wrong[i] = x[same[0]]
    assert metrics.score(truth, labels, wrong, None, search=(x, y))["iip"] == 0.5
    # Closer to an image of another class than to its own: the search is among the truth's class only (Yin et al.),
    # so the reconstruction still identifies it.
    mixed = close.clone()
    for i in range(4):
        other = int(torch.nonzero(y != labels[i]).flatten()[0])
        mixed[i] = 0.6 * x[other] + 0.4 * truth[i]
    assert metrics.score(truth, labels, mixed, None, search=(x, y))["iip"] == 1.0
    # An attack that returns one image: the other three are not identified (the blind guess identifies nothing).
    assert metrics.score(truth, labels, close[:1], None, search=(x, y))["iip"] == 0.25


def test_iip_is_empty_not_zero_where_it_is_undefined():
    x, y, idx = _pool(0)
    truth = x[idx]
    assert metrics.score(truth, y[idx], truth, None)["iip"] is None  # no split to search
    outsider = torch.rand(truth.shape, generator=torch.Generator().manual_seed(9))
    assert metrics.score(outsider, y[idx], outsider, None, search=(x, y))["iip"] is None  # not in the split
    assert metrics.score(truth, y[idx], None, y[idx], search=(x, y))["iip"] is None  # labels only


def test_iip_identifies_the_untransformed_image_where_a_defense_transformed_it():
    x, y, idx = _pool(1)
    sent = torch.flip(x[idx], dims=(3,))  # what entered the gradient: not in the split
    assert metrics.score(sent, y[idx], sent, None, search=(x, y))["iip"] is None
    # Against the client's own images the flipped reconstruction may or may not identify them; it is defined.
    assert metrics.score(sent, y[idx], sent, None, search=(x, y), targets=x[idx])["iip"] is not None


def test_score_fills_rpsnr_and_iip_in_the_results_of_a_run(tmp_path, gleak_cli):
    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "m"\nseeds = [0, 1]\n[case]\ndataset = "skimage"\nbatch_size = 2\nmodel = "mlp"\n'
                     '[[attack]]\nname = "closed-form"\n[[attack]]\nname = "idlg"\n'
                     '[[defense]]\nname = "none"\n[[defense]]\nname = "noise"\nsigma = [0.01]\n')  # fmt: skip
    code, err = gleak_cli(["run", str(suite), "--out", str(tmp_path / "o"), "--workers", "1"])
    assert code == 0, err
    import pandas as pd

    df = pd.read_csv(tmp_path / "o" / "results.csv")
    images = df[df["psnr"].notna()]
    labels_only = df[df["psnr"].isna()]
    assert len(images) and len(labels_only)
    assert (images["rpsnr"] >= images["psnr"] - 1e-6).all() and images["iip"].between(0, 1).all()
    assert labels_only["rpsnr"].isna().all() and labels_only["iip"].isna().all()  # empty, never zero
    undefended = images[images["defense"] == "none"]
    assert (undefended["iip"] == 1.0).all()  # the closed form is exact at batch 2 without a defense
    # Feature-space MSE: filled for every image row, empty for label-only rows; zero where the recovery is exact,
    # above zero where noise moved it.
    assert images["feat_mse"].notna().all() and labels_only["feat_mse"].isna().all()
    assert (undefended["feat_mse"] < 1e-9).all()
    assert (images.loc[images["defense"] == "noise", "feat_mse"] > 1e-9).all()


def test_bleu_is_sacrebleus_corpus_bleu():
    sacrebleu = pytest.importorskip("sacrebleu")
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(12)]
    for _ in range(300):
        truths = [[rng.choice(vocab) for _ in range(rng.randint(0, 9))] for _ in range(rng.randint(1, 4))]
        guesses = [t[:] if rng.random() < 0.3 else t[1:] + [rng.choice(vocab)] if rng.random() < 0.5
                   else [rng.choice(vocab) for _ in range(rng.randint(0, 9))] for t in truths]  # fmt: skip
        ref = sacrebleu.corpus_bleu([" ".join(g) for g in guesses], [[" ".join(t) for t in truths]], tokenize="none")
        assert bleu(truths, guesses) == pytest.approx(ref.score / 100, abs=1e-9), (truths, guesses)


def test_bleu_of_the_truth_is_one_and_of_nothing_in_common_zero():
    t = [["a", "b", "c", "d", "e"]]
    assert bleu(t, t) == pytest.approx(1.0)
    assert bleu(t, [["x", "y", "z", "q", "r"]]) == 0.0
    assert 0 < bleu(t, [["a", "b", "c", "d", "x"]]) < 1


def test_each_new_metric_declares_which_way_it_leaks():
    assert metrics.METRICS["rpsnr"].leaks_higher and metrics.METRICS["iip"].leaks_higher
    assert not metrics.METRICS["feat_mse"].leaks_higher  # an error: lower leaks, as MSE


def _breaching_fmse(model, a, b):
    """breaching.analysis.report's FMSE for one query: (model(rec) - model(truth)).pow(2).mean() over the batch."""
    with torch.no_grad():
        return float((model(a) - model(b)).pow(2).mean())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_feature_mse_is_breachings_formula_per_image_and_blind_to_the_models_null_space(seed):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5)).double()
    a, b = torch.rand(6, 3, 4, 4, generator=g).double(), torch.rand(6, 3, 4, 4, generator=g).double()
    per_image = metrics.feature_mse(a, b, model)
    assert per_image.shape == (6,)
    assert float(per_image.mean()) == pytest.approx(_breaching_fmse(model, a, b), rel=1e-12)
    for i in range(6):  # each image's value is that of the image alone
        assert float(per_image[i]) == pytest.approx(_breaching_fmse(model, a[i : i + 1], b[i : i + 1]), rel=1e-12)
    assert (metrics.feature_mse(a, a, model) == 0).all()
    # A change the model cannot see (its weights' null space) moves the pixels, not the features.
    w = model[1].weight.detach()
    null = torch.linalg.svd(w, full_matrices=True).Vh[-1]  # orthogonal to every row of w
    moved = a + 0.5 * null.reshape(1, 3, 4, 4)
    assert float(metrics.mse(moved, a).min()) > 1e-3
    assert float(metrics.feature_mse(moved, a, model).max()) < 1e-20


def test_feature_mse_scores_each_image_at_the_models_running_statistics_and_restores_its_mode():
    """Batch norm in training mode normalises by the batch: an image's features would depend on the images scored
    beside it. model_features scores in evaluation mode and gives the model back in the mode it found it."""
    from gleak.mechanics.modality import model_features

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.LazyLinear(3))
    model(torch.rand(2, 1, 6, 6))  # materialise the lazy layer
    model.train()
    f = model_features(model, torch.tensor([0.5]), torch.tensor([0.25]))
    x = torch.rand(5, 1, 6, 6)
    together, alone = f(x), torch.cat([f(x[i : i + 1]) for i in range(5)])
    assert torch.allclose(together, alone, atol=1e-6)
    assert model.training
    # The clients' normalisation is applied: the same images read raw give other outputs.
    model.eval()
    with torch.no_grad():
        assert torch.allclose(f(x), model((x - 0.5) / 0.25), atol=1e-6)
