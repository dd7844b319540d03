import pytest
import torch

from gleak.mechanics import metrics, perceptual, verdicts


def test_identical_images_score_perfectly():
    x = torch.rand(3, 3, 16, 16)
    s = metrics.score(x, torch.tensor([1, 2, 3]), x.clone(), torch.tensor([3, 2, 1]))
    assert s["mse"] == 0 and s["psnr"] == metrics.PSNR_CEILING and s["ssim"] == pytest.approx(1.0)
    assert s["label_acc"] == 1.0 and s["verdict"] == "recovered" and s["matched"] == 3


def test_matching_undoes_a_permutation():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(6, 1, 8, 8, generator=g)
    perm = torch.randperm(6, generator=g)
    ti, ri = metrics.match(x, x[perm])
    assert all(int(perm[r]) == int(t) for t, r in zip(ti, ri))


def test_label_accuracy_is_order_free_multiset_overlap():
    assert metrics.label_accuracy(torch.tensor([1, 1, 2, 3]), torch.tensor([3, 1, 2, 2])) == 0.75
    assert metrics.label_accuracy(torch.tensor([0]), None) is None


def test_psnr_and_verdict_bands():
    a = torch.zeros(1, 1, 4, 4)
    assert float(metrics.psnr(a, a + 0.1)[0]) == pytest.approx(20.0)
    assert [verdicts.verdict(v) for v in (0.0299, 0.03, 0.199, 0.2)] == ["recovered", "partial", "partial", "defended"]


def test_ssim_is_scikit_image_with_gaussian_weights():
    from skimage.metrics import structural_similarity

    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(1, 3, 32, 32, generator=g, dtype=torch.float64), torch.rand(1, 3, 32, 32, generator=g, dtype=torch.float64)
    ref = structural_similarity(a[0].permute(1, 2, 0).numpy(), b[0].permute(1, 2, 0).numpy(), data_range=1.0,
                                channel_axis=-1, gaussian_weights=True, sigma=1.5, use_sample_covariance=False)  # fmt: skip
    assert float(metrics.ssim(a, b)[0]) == pytest.approx(ref)


def test_relative_gradient_distance():
    g = torch.tensor([3.0, 4.0])
    assert metrics.relative_distance(g, torch.zeros(2)) == 1.0
    assert metrics.relative_distance(g, g) == 0.0


def test_lpips_unavailable_without_weights(monkeypatch, tmp_path):
    monkeypatch.delenv(perceptual.LPIPS_ENV, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    x = torch.rand(1, 3, 32, 32)
    assert perceptual.lpips(x, x) is None
    assert metrics.score(x, torch.tensor([0]), x, None)["lpips"] is None


def test_lpips_missing_named_file_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(perceptual.LPIPS_ENV, str(tmp_path / "nope.pth"))
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        perceptual.lpips(torch.rand(1, 3, 32, 32), torch.rand(1, 3, 32, 32))


def test_lpips_loads_a_backbone_file(monkeypatch, tmp_path, published):
    """The loading path with a state dict built here (random weights: exercises the code, scores nothing)."""
    import torchvision

    torch.manual_seed(0)
    path = tmp_path / "alexnet.pth"
    torch.save(torchvision.models.alexnet().state_dict(), path)
    published(path)
    monkeypatch.setenv(perceptual.LPIPS_ENV, str(path))
    a, b = torch.rand(2, 3, 32, 32), torch.rand(2, 3, 32, 32)
    d = perceptual.lpips(a, b)
    assert d is not None and d.shape == (2,) and torch.isfinite(d).all()
    assert float(perceptual.lpips(a, a).abs().max()) < 1e-6
    model = perceptual._lpips_model(str(path))
    ref = torchvision.models.alexnet()
    ref.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(model.net.slice1[0].weight, ref.features[0].weight)  # the file's weights, not a random init


def test_lpips_from_the_torch_hub_cache_is_the_lpips_packages_own(monkeypatch, tmp_path, published):
    """With the backbone in torchvision's cache, gleak's LPIPS equals what the lpips package computes when it loads
    that backbone itself (lpips.LPIPS(net='alex', version='0.1') with pretrained trunk). The state dict is built
    here (random weights: a check of the loading and scoring path, not a perceptual score)."""
    import warnings

    import lpips as lpips_pkg
    import torchvision

    torch.manual_seed(1)
    ckpt = tmp_path / "hub" / "checkpoints"
    ckpt.mkdir(parents=True)
    torch.save(torchvision.models.alexnet().state_dict(), ckpt / "alexnet-owt-7be5be79.pth")
    published(ckpt / "alexnet-owt-7be5be79.pth")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.delenv(perceptual.LPIPS_ENV, raising=False)
    assert perceptual.lpips_available() and perceptual.alexnet_weights_path() == ckpt / "alexnet-owt-7be5be79.pth"
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(3, 3, 32, 32, generator=g), torch.rand(3, 3, 32, 32, generator=g)
    ours = perceptual.lpips(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision's deprecation notes about lpips' `pretrained=True`
        ref_model = lpips_pkg.LPIPS(net="alex", version="0.1", pnet_rand=False, verbose=False).eval()
    with torch.no_grad():
        ref = ref_model(a * 2 - 1, b * 2 - 1).flatten().double()
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-7)
    grey = perceptual.lpips(a[:, :1], b[:, :1])  # grey images are scored as three equal channels
    with torch.no_grad():
        ref_grey = ref_model(a[:, :1].expand(-1, 3, -1, -1) * 2 - 1, b[:, :1].expand(-1, 3, -1, -1) * 2 - 1).flatten()
    assert torch.allclose(grey, ref_grey.double(), rtol=1e-5, atol=1e-7)


def test_exact_share_keeps_exact_pairs_the_mse_pairing_would_trade_away():
    from gleak.mechanics.metrics import exact_share, match

    truth = torch.tensor([0.5, 0.6]).view(2, 1, 1, 1)
    rec = torch.tensor([0.5, 0.0]).view(2, 1, 1, 1)  # the first is exact; the second a poor guess
    rows, cols = match(truth, rec)
    assert list(cols[rows.argsort()]) == [1, 0]  # lower total MSE by giving the exact one to the other image
    assert exact_share(truth, rec) == 0.5
    assert exact_share(truth, rec[:1]) == 0.5 and exact_share(truth, truth + 0.05) == 0.0


def test_a_random_backbone_never_scores(monkeypatch, tmp_path):
    """A randomly initialised AlexNet saved as the backbone (any key and shape right) is refused by its digest, named
    in one line, wherever it comes from: the flag's check and LPIPS itself (no number from a random network)."""
    import torchvision

    from gleak.contracts.errors import InputError

    path = tmp_path / "alexnet-owt-7be5be79.pth"
    torch.save(torchvision.models.alexnet().state_dict(), path)
    with pytest.raises(InputError, match="is not torchvision's ImageNet AlexNet weights"):
        perceptual.check_lpips_weights(path, "--lpips-backbone")
    monkeypatch.setenv(perceptual.LPIPS_ENV, str(path))
    with pytest.raises(InputError, match="SHA-256 begins"):
        perceptual.lpips(torch.rand(1, 3, 32, 32), torch.rand(1, 3, 32, 32))


def _served(tmp_path, content: bytes):
    """A weights file at a file:// URL (the download path without the network)."""
    src = tmp_path / "served.pth"
    src.write_bytes(content)
    return src, src.as_uri()


def test_the_backbone_is_fetched_into_the_torch_cache_and_verified(monkeypatch, tmp_path):
    """With no backbone named or cached, the fetch downloads it from torchvision's address into the torch hub cache,
    keeps it only if its digest is the published one, and says each step in one line; with the opt-out set it
    fetches nothing; offline it says how to fill LPIPS."""
    import hashlib

    home = tmp_path / "torch-home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.delenv(perceptual.NO_DOWNLOAD_ENV, raising=False)
    content = b"weights " * 1000
    src, url = _served(tmp_path, content)
    monkeypatch.setattr(perceptual, "weights_url", lambda: url)
    said = []
    # a file whose digest is not the published one: not kept
    assert perceptual.fetch_weights(said.append) is None
    assert not perceptual.hub_weights_file().exists() and "not the published one" in said[-1]
    assert not list(perceptual.hub_weights_file().parent.iterdir())  # no partial file left
    # the published file: kept in the cache, byte for byte
    monkeypatch.setattr(perceptual, "ALEXNET_SHA256_PREFIX", hashlib.sha256(content).hexdigest()[:8])
    got = perceptual.fetch_weights(said.append)
    assert got == perceptual.hub_weights_file() == home / "hub" / "checkpoints" / "alexnet-owt-7be5be79.pth"
    assert got.read_bytes() == content and "fetching" in said[-1]
    n = len(said)
    assert perceptual.fetch_weights(said.append) == got and len(said) == n  # cached: nothing fetched, nothing said
    # the opt-out, and an address that cannot be reached
    got.unlink()
    monkeypatch.setenv(perceptual.NO_DOWNLOAD_ENV, "1")
    assert perceptual.fetch_weights(said.append) is None and len(said) == n and not got.exists()
    monkeypatch.delenv(perceptual.NO_DOWNLOAD_ENV)
    monkeypatch.setattr(perceptual, "weights_url", lambda: (tmp_path / "absent.pth").as_uri())
    assert perceptual.fetch_weights(said.append) is None
    assert "could not fetch" in said[-1] and perceptual.LPIPS_HOWTO in said[-1] and not got.exists()


def test_psnr_is_scikit_images_per_image():
    from skimage.metrics import peak_signal_noise_ratio

    g = torch.Generator().manual_seed(1)
    a, b = torch.rand(3, 3, 16, 16, generator=g, dtype=torch.float64), torch.rand(3, 3, 16, 16, generator=g, dtype=torch.float64)
    ours = metrics.psnr(a, b)
    for i in range(3):
        assert float(ours[i]) == pytest.approx(peak_signal_noise_ratio(a[i].numpy(), b[i].numpy(), data_range=1.0))


def test_rouge_is_the_f_measure_of_unigrams_bigrams_and_the_longest_common_subsequence():
    pytest.importorskip("rouge_score")
    from gleak.mechanics.text.metrics import rouge

    # by hand: unigrams 2 of 3 each way (F 2/3); bigrams {ab, bc} vs {ab, bd}: 1 of 2 (F 1/2); LCS "a b" (F 2/3)
    r = rouge(["a", "b", "c"], ["a", "b", "d"])
    assert (r["rouge1"], r["rouge2"], r["rougeL"]) == pytest.approx((2 / 3, 1 / 2, 2 / 3))
    # order matters to ROUGE-2 and ROUGE-L only: the reversed text keeps every unigram
    r = rouge(["a", "b", "c"], ["c", "b", "a"])
    assert (r["rouge1"], r["rouge2"], r["rougeL"]) == pytest.approx((1.0, 0.0, 1 / 3))


def test_each_metric_declares_the_direction_its_function_leaks():
    """The direction every ranking reads (gleak.mechanics.metrics.METRICS) is the function's own: a closer
    reconstruction moves the value the declared way, on several random batches."""
    from gleak.mechanics.metrics import METRICS, leakiest_first, metric_of, safest_first

    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        truth = torch.rand(4, 3, 16, 16, generator=g)
        near = (truth + 0.02 * torch.randn(truth.shape, generator=g)).clamp(0, 1)
        far = (truth + 0.3 * torch.randn(truth.shape, generator=g)).clamp(0, 1)
        for name in ("psnr", "mse", "ssim", "cosine"):
            fn, higher = METRICS[name].fn, METRICS[name].leaks_higher
            closer, further = float(fn(truth, near).mean()), float(fn(truth, far).mean())
            assert (closer > further) == higher, (name, seed)
    y = torch.tensor([0, 1, 2, 3])
    assert (METRICS["label_acc"].fn(y, y) > METRICS["label_acc"].fn(y, torch.zeros(4, dtype=torch.long))) == METRICS["label_acc"].leaks_higher
    assert metric_of("mse_median") is METRICS["mse"] and metric_of("psnr_undefended") is METRICS["psnr"]
    assert leakiest_first("psnr", "mse_median") == [False, True] and safest_first("psnr", "mse_median") == [True, False]
