"""ATS: the authors' transformations (checked against PIL, which their code uses), the policy as published, and the
gradient of the transformed batch."""
import numpy as np
import pytest
import torch
from gleak.defenses.ats import ATS, RANGES, TRANSFORMS, apply_op, parse_policy, transform_images
from PIL import Image, ImageEnhance, ImageOps

import gleak
from gleak.contracts.plugin import batch_gradient
from gleak.mechanics.models import create_model


def _image(seed: int, size: int = 16, channels: int = 3) -> np.ndarray:
    """A smooth-ish 8-bit test image with both black and white pixels."""
    g = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    base = np.stack([(xx * 13 + yy * 7 + 40 * c) % 256 for c in range(channels)], -1).astype(float)
    img = np.clip(base + g.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    img[0, 0], img[-1, -1] = 0, 255
    return img[..., 0] if channels == 1 else img


def _pil(img: np.ndarray, op: str, m: float, sign: int) -> np.ndarray:
    """The authors' operation through PIL, with the random sign fixed."""
    im = Image.fromarray(img)
    w, h = im.size
    fns = {
        "translateX": lambda: im.transform(im.size, Image.AFFINE, (1, 0, m * w * sign, 0, 1, 0), fillcolor=0),
        "translateY": lambda: im.transform(im.size, Image.AFFINE, (1, 0, 0, 0, 1, m * h * sign), fillcolor=0),
        "contrast": lambda: ImageEnhance.Contrast(im).enhance(1 + m * sign),
        "brightness": lambda: ImageEnhance.Brightness(im).enhance(1 + m * sign),
        "color": lambda: ImageEnhance.Color(im).enhance(1 + m * sign),
        "sharpness": lambda: ImageEnhance.Sharpness(im).enhance(1 + m * sign),
        "posterize": lambda: ImageOps.posterize(im, int(m)),
        "solarize": lambda: ImageOps.solarize(im, m),
        "autocontrast": lambda: ImageOps.autocontrast(im),
        "equalize": lambda: ImageOps.equalize(im),
        "invert": lambda: ImageOps.invert(im),
    }
    return np.asarray(fns[op]())


def _ours(img: np.ndarray, op: str, m: float, sign: int) -> np.ndarray:
    t = torch.from_numpy(img).double() / 255
    t = t.permute(2, 0, 1) if t.dim() == 3 else t.unsqueeze(0)
    out = apply_op(t, op, m, sign)
    out = out.permute(1, 2, 0) if img.ndim == 3 else out[0]
    return out.numpy() * 255


POINTWISE = ["translateX", "translateY", "contrast", "brightness", "color", "sharpness", "posterize", "solarize",
             "autocontrast", "equalize", "invert"]  # fmt: skip
EXACT = {"posterize", "solarize", "equalize", "invert", "translateX", "translateY"}  # integer ops in PIL too


@pytest.mark.parametrize("op", POINTWISE)
def test_operations_match_pil_at_every_magnitude_the_list_uses(op):
    """Every (operation, magnitude) of the authors' list, both signs, RGB and grey: within PIL's 8-bit rounding."""
    mags = sorted({m for o, m in TRANSFORMS if o == op}) or [9]
    for seed, channels, gamma in [(0, 3, 1), (1, 3, 2), (2, 1, 1), (3, 1, 3)]:
        # skewed histograms too; 32 x 32 because PIL's equalize is the identity below 511 pixels (its step is 0)
        img = (255 * (_image(seed, size=32, channels=channels) / 255.0) ** gamma).astype(np.uint8)
        for mi in mags:
            for sign in (1, -1):
                want = _pil(img, op, RANGES[op][mi], sign).astype(float)
                got = _ours(img, op, RANGES[op][mi], sign)
                tol = 1e-6 if op in EXACT else 1.5  # PIL's 8-bit rounding of blends and autocontrast's lut
                assert np.abs(got - want).max() <= tol, (op, mi, sign, channels, np.abs(got - want).max())


@pytest.mark.parametrize("op,mi", [("rotate", 2), ("shearY", 2), ("shearY", 5)])
def test_geometric_operations_are_close_to_pil(op, mi):
    img = _image(3)
    sign = 1
    im = Image.fromarray(img)
    m = RANGES[op][mi]
    if op == "rotate":
        rot = im.convert("RGBA").rotate(m)
        want = np.asarray(Image.composite(rot, Image.new("RGBA", rot.size, (128,) * 4), rot).convert("RGB"))
    else:
        want = np.asarray(im.transform(im.size, Image.AFFINE, (1, 0, 0, m * sign, 1, 0), Image.BICUBIC, fillcolor=0))
    got = _ours(img, op, m, sign)
    assert np.abs(got - want.astype(float)).mean() < 12, np.abs(got - want).mean()  # resampling kernels differ
    assert np.abs(got - img.astype(float)).mean() > 2 * np.abs(got - want.astype(float)).mean()


def test_a_known_policy_on_a_known_image():
    """Policy 3-1-7 on a ramp: translateX by 0.41 of the width, contrast 1 +- 1/3 about the grey mean, translateY by
    0.10 of the height, each with its sign from the generator; the result equals that chain written out by hand."""
    h = w = 16
    ramp = (torch.arange(w, dtype=torch.float64) / (w - 1)).expand(1, h, w).clone()
    for seed in range(6):
        rng = torch.Generator().manual_seed(seed)
        got = transform_images(ramp.unsqueeze(0), parse_policy("3-1-7"), rng)[0]
        replay = torch.Generator().manual_seed(seed)
        int(torch.randint(1, (), generator=replay))  # the sub-policy draw (one sub-policy)
        signs = [1 if int(torch.randint(2, (), generator=replay)) else -1 for _ in range(3)]
        dx = int(np.floor(150 / 331 * w * signs[0] + 0.5))  # 7 either way at w = 16
        step1 = torch.zeros_like(ramp)
        if dx > 0:
            step1[..., : w - dx] = ramp[..., dx:]
        else:
            step1[..., -dx:] = ramp[..., : w + dx]
        mean = torch.round(step1.mean() * 255) / 255
        step2 = (mean + (1 + 0.5 * 6 / 9 * signs[1]) * (step1 - mean)).clamp(0, 1)
        dy = int(np.floor(150 / 331 / 9 * 2 * h * signs[2] + 0.5))
        want = torch.zeros_like(step2)
        if dy > 0:
            want[:, : h - dy] = step2[:, dy:]
        elif dy < 0:
            want[:, -dy:] = step2[:, : h + dy]
        else:
            want = step2
        assert torch.allclose(got, want, atol=1e-12), seed


def test_hybrid_policy_uses_both_sub_policies_per_image():
    img = torch.from_numpy(_image(4)).double().permute(2, 0, 1) / 255
    batch = img.expand(64, -1, -1, -1)
    out = transform_images(batch, parse_policy("0+29"), torch.Generator().manual_seed(0))  # invert, or invert 0
    # both entries are 'invert' (magnitude unused): every image is inverted
    assert torch.allclose(out, 1 - batch)
    out = transform_images(batch, parse_policy("15+47"), torch.Generator().manual_seed(0))  # brightness 1 +- 0.5 | invert
    inverted = torch.isclose(out, 1 - batch).flatten(1).all(1)
    assert 10 < int(inverted.sum()) < 54


def test_gradient_is_the_plain_gradient_of_the_transformed_batch():
    model = create_model("convnet", (3, 16, 16), 4, seed=0, dtype=torch.float64, width=4)
    g = torch.Generator().manual_seed(5)
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    pixels = torch.rand(3, 3, 16, 16, generator=g, dtype=torch.float64)
    x = (pixels - torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
    y = torch.tensor([0, 1, 3])
    d = gleak.create("defense", "ats", mean=mean, std=std)
    got = d.client_gradient(model, x, y, torch.Generator().manual_seed(9))
    want_pixels = transform_images(pixels, parse_policy(d.policy), torch.Generator().manual_seed(9), d.augment)
    want_x = (want_pixels - torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
    want = batch_gradient(model, want_x, y)
    assert all(torch.allclose(got[n], want[n], atol=1e-12) for n in want)
    plain = batch_gradient(model, x, y)
    assert not all(torch.allclose(got[n], plain[n]) for n in plain)


def test_policy_validation():
    assert parse_policy("3-1-7+43-18-18") == [[3, 1, 7], [43, 18, 18]]
    for bad in ("", "3--1", "50", "a-b", "-1"):
        with pytest.raises(ValueError, match="policy"):
            ATS(policy=bad)
    with pytest.raises(ValueError, match="together"):
        ATS(mean=[0.5])


def test_batch_range_reading_takes_the_batch_extremes_as_black_and_white():
    """pixels = "batch-range": black and white are the batch's per-channel extremes, exact when the batch holds both."""
    g = torch.Generator().manual_seed(1)
    pixels = torch.rand(4, 1, 12, 12, generator=g, dtype=torch.float64)
    pixels[0, 0, 0, 0], pixels[1, 0, 3, 3] = 0.0, 1.0
    x = (pixels - 0.286) / 0.353
    a = ATS(policy="3-1-7+43-18-18", pixels="batch-range").transform_batch(x, torch.Generator().manual_seed(2))
    b = ATS(policy="3-1-7+43-18-18", mean=[0.286], std=[0.353]).transform_batch(x, torch.Generator().manual_seed(2))
    assert torch.allclose(a, b, atol=1e-10)


def _bound(pixels: str = "data-stats", policy: str = "3-1-7+43-18-18") -> ATS:
    d = ATS(policy=policy, pixels=pixels)
    d.bind_data(torch.tensor([0.45, 0.4, 0.35]), torch.tensor([0.25, 0.2, 0.3]))
    return d


def test_an_image_is_transformed_independently_of_the_rest_of_its_batch():
    """With the data's mean/std (the default reading) image 0's result is the same whatever images share its
    batch; the batch-range reading (black and white from the batch) changes it. Autocontrast (index 8) and
    contrast (1) read the image's own statistics; the published hybrid is checked too."""
    g = torch.Generator().manual_seed(4)
    mean, std = torch.tensor([0.45, 0.4, 0.35]).view(1, 3, 1, 1), torch.tensor([0.25, 0.2, 0.3]).view(1, 3, 1, 1)
    first = 0.3 + 0.4 * torch.rand(1, 3, 16, 16, generator=g, dtype=torch.float64)  # no pure black or white
    dim = 0.3 + 0.4 * torch.rand(3, 3, 16, 16, generator=g, dtype=torch.float64)
    bright = torch.rand(3, 3, 16, 16, generator=g, dtype=torch.float64)  # other companions: the full range
    for policy in ("3-1-7+43-18-18", "8-1", "3-1-7"):
        outs = {}
        for pixels in ("data-stats", "batch-range"):
            for name, rest in (("dim", dim), ("bright", bright)):
                x = (torch.cat([first, rest]) - mean) / std
                outs[pixels, name] = _bound(pixels, policy).transform_batch(x, torch.Generator().manual_seed(7))[0]
        assert torch.allclose(outs["data-stats", "dim"], outs["data-stats", "bright"], atol=1e-12), policy
        assert not torch.allclose(outs["batch-range", "dim"], outs["batch-range", "bright"], atol=1e-3), policy
    # and the data-stats reading is the transformation of the image in [0, 1] as the authors apply it
    x = (torch.cat([first, bright]) - mean) / std
    got = _bound().transform_batch(x, torch.Generator().manual_seed(7))
    want = transform_images(torch.cat([first, bright]), parse_policy("3-1-7+43-18-18"), torch.Generator().manual_seed(7),
                            "crop-flip")
    assert torch.allclose(got, (want - mean) / std, atol=1e-10)


def test_the_data_stats_reading_needs_the_data_normalisation_and_keeps_old_ids():
    with pytest.raises(RuntimeError, match="bind_data"):
        ATS().transform_batch(torch.zeros(1, 3, 4, 4), torch.Generator().manual_seed(0))
    from gleak.contracts.registry import check_params

    def check(name, params):
        return check_params("defense", name, params)

    assert check("ats", {})["pixels"] == "data-stats"  # the new default: new ids for the new computation
    # The first reading is stored by name: left out, a stored trial would rebuild with the default and run data-stats.
    assert check("ats", {"pixels": "batch-range"})["pixels"] == "batch-range"
    assert gleak.create("defense", "ats", **check("ats", {"pixels": "batch-range"})).pixels == "batch-range"


def test_a_trial_binds_the_data_normalisation_to_the_client_defense(monkeypatch):
    """The runner hands each client's ATS its data's mean/std (the case's data set), so the default reading runs."""
    from gleak.mechanics.data import load_dataset

    seen = []
    original = ATS.bind_data

    def record(self, m, s):
        seen.append(([float(v) for v in m], [float(v) for v in s]))
        original(self, m, s)

    monkeypatch.setattr(ATS, "bind_data", record)
    res = gleak.run_trial(attack="closed-form", defense="ats", dataset="skimage", model="mlp", batch_size=1, resolution=8)
    ds = load_dataset("skimage", resolution=8)
    assert res.row["status"] == "ok" and seen and all(m == ds.mean.tolist() and s == ds.std.tolist() for m, s in seen)
