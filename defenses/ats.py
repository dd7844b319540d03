"""ATS (Gao et al., CVPR 2021, "Privacy-preserving Collaborative Learning with Automatic Transformation Search";
authors' code gaow0007/ATSPrivacy): the client trains on its batch transformed by a searched augmentation policy."""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Defense, batch_gradient, check_choice
from gleak.contracts.registry import register_defense

# The authors' augmentation list (ATSPrivacy policy.py): index -> (operation, magnitude index 0..9). A policy such as
# "3-1-7" applies entries 3, 1 and 7 in that order; each entry's probability in their list is never used (their
# SubPolicy always applies its operation), so none is kept here.
TRANSFORMS: tuple[tuple[str, int], ...] = (
    ("invert", 7), ("contrast", 6), ("rotate", 2), ("translateX", 9), ("sharpness", 1),
    ("sharpness", 3), ("shearY", 2), ("translateY", 2), ("autocontrast", 5), ("equalize", 2),
    ("shearY", 5), ("posterize", 5), ("color", 3), ("brightness", 5), ("sharpness", 9),
    ("brightness", 9), ("equalize", 5), ("equalize", 1), ("contrast", 7), ("sharpness", 5),
    ("color", 5), ("translateX", 5), ("equalize", 7), ("autocontrast", 8), ("translateY", 3),
    ("sharpness", 6), ("brightness", 6), ("color", 8), ("solarize", 0), ("invert", 0),
    ("equalize", 0), ("autocontrast", 0), ("equalize", 8), ("equalize", 4), ("color", 5),
    ("equalize", 5), ("autocontrast", 4), ("solarize", 4), ("brightness", 3), ("color", 0),
    ("solarize", 1), ("autocontrast", 0), ("translateY", 3), ("translateY", 3), ("autocontrast", 1),
    ("solarize", 1), ("equalize", 5), ("invert", 0), ("translateY", 3), ("autocontrast", 1),
)  # fmt: skip


def _linspace(a: float, b: float) -> list[float]:
    return [a + (b - a) * i / 9 for i in range(10)]


# Magnitude of each magnitude index (AutoAugment's ranges as the authors' autoaugment.py sets them).
RANGES: dict[str, list[float]] = {
    "shearX": _linspace(0, 0.3), "shearY": _linspace(0, 0.3),
    "translateX": _linspace(0, 150 / 331), "translateY": _linspace(0, 150 / 331),
    "rotate": _linspace(0, 30), "color": _linspace(0, 0.5), "contrast": _linspace(0, 0.5),
    "sharpness": _linspace(0, 0.5), "brightness": _linspace(0, 0.5),
    "posterize": [float(round(v)) for v in _linspace(8, 4)], "solarize": _linspace(256, 0),
    "autocontrast": [0.0] * 10, "equalize": [0.0] * 10, "invert": [0.0] * 10,
}  # fmt: skip
SIGNED = {"shearX", "shearY", "translateX", "translateY", "color", "contrast", "sharpness", "brightness"}

# Published policies (the authors' benchmark_attack.sh, ResNet20-4 on CIFAR-100): "3-1-7", "43-18-18" and the hybrid
# "3-1-7+43-18-18" (one of the two chosen at random per image).
PUBLISHED = ("3-1-7+43-18-18", "3-1-7", "43-18-18")


def parse_policy(policy: str) -> list[list[int]]:
    """'3-1-7+43-18-18' -> [[3, 1, 7], [43, 18, 18]] (the authors' aug_list notation), indices checked."""
    try:
        subs = [[int(i) for i in part.split("-")] for part in policy.split("+")]
    except ValueError:
        raise ValueError(f"policy must be indices joined by '-' and sub-policies by '+', got {policy!r}") from None
    bad = [i for s in subs for i in s if not 0 <= i < len(TRANSFORMS)]
    if not subs or any(not s for s in subs) or bad:
        raise ValueError(f"policy indices must be in 0..{len(TRANSFORMS) - 1}, got {policy!r}")
    return subs


# ---- the operations, on one image (C, H, W) with values in [0, 1], after PIL's definitions ------------------------
def _grey(img: Tensor) -> Tensor:
    """PIL's L conversion (ITU-R 601-2 luma), (1, H, W); a one-channel image is its own grey."""
    if img.shape[0] == 3:
        return (0.299 * img[0] + 0.587 * img[1] + 0.114 * img[2]).unsqueeze(0)
    return img[:1]


def _blend(degenerate: Tensor, img: Tensor, factor: float) -> Tensor:
    """PIL's ImageEnhance: degenerate + factor (img - degenerate), clipped to the pixel range."""
    return (degenerate + factor * (img - degenerate)).clamp(0, 1)


def _shift(img: Tensor, dx: int, dy: int) -> Tensor:
    """out[y, x] = img[y + dy, x + dx], black outside (PIL's AFFINE translate with nearest sampling)."""
    _, h, w = img.shape
    out = torch.zeros_like(img)
    xs, xd = (slice(dx, w), slice(0, w - dx)) if dx >= 0 else (slice(0, w + dx), slice(-dx, w))
    ys, yd = (slice(dy, h), slice(0, h - dy)) if dy >= 0 else (slice(0, h + dy), slice(-dy, h))
    if abs(dx) < w and abs(dy) < h:
        out[:, yd, xd] = img[:, ys, xs]
    return out


def _affine(img: Tensor, matrix: tuple[float, ...], mode: str, fill: float) -> Tensor:
    """PIL's Image.transform(AFFINE, (a, b, c, d, e, f)): out(x, y) = img(a x + b y + c, d x + e y + f), pixel
    centres at +0.5, `fill` outside, by grid_sample (`mode` 'nearest' or 'bicubic')."""
    c, h, w = img.shape
    a, b, c0, d, e, f = matrix
    ys, xs = torch.meshgrid(torch.arange(h, dtype=img.dtype) + 0.5, torch.arange(w, dtype=img.dtype) + 0.5, indexing="ij")
    sx, sy = a * xs + b * ys + c0, d * xs + e * ys + f
    grid = torch.stack([2 * sx / w - 1, 2 * sy / h - 1], dim=-1).unsqueeze(0)
    ones = torch.ones(1, 1, h, w, dtype=img.dtype)
    src = torch.cat([img.unsqueeze(0), ones], dim=1)  # the last channel says where the sample fell inside
    out = F.grid_sample(src, grid, mode=mode, padding_mode="zeros", align_corners=False)[0]
    inside = out[-1:] > 0.5 if mode == "nearest" else out[-1:].clamp(0, 1)
    return (out[:-1] * inside + fill * (1 - inside.to(img.dtype))).clamp(0, 1)


def _smooth(img: Tensor) -> Tensor:
    """PIL's ImageFilter.SMOOTH (3x3 kernel 1 1 1 / 1 5 1 / 1 1 1, divided by 13); border pixels unchanged."""
    k = torch.ones(3, 3, dtype=img.dtype)
    k[1, 1] = 5.0
    k = (k / 13.0).view(1, 1, 3, 3).repeat(img.shape[0], 1, 1, 1)
    out = img.clone()
    out[:, 1:-1, 1:-1] = F.conv2d(img.unsqueeze(0), k, groups=img.shape[0])[0]
    return out


def _equalize(img: Tensor) -> Tensor:
    """PIL's ImageOps.equalize per channel, on the image quantized to 8 bits."""
    q = (img * 255).round().clamp(0, 255).long()
    out = torch.empty_like(img)
    for ch in range(img.shape[0]):
        hist = torch.bincount(q[ch].reshape(-1), minlength=256)
        used = hist[hist > 0]
        step = int((used.sum() - used[-1]) // 255) if len(used) > 1 else 0
        if step == 0:
            out[ch] = q[ch].to(img.dtype) / 255
            continue
        lut = (step // 2 + torch.cat([torch.zeros(1, dtype=torch.long), hist.cumsum(0)[:-1]])) // step
        out[ch] = lut.clamp(max=255)[q[ch]].to(img.dtype) / 255
    return out


def apply_op(img: Tensor, op: str, magnitude: float, sign: int = 1) -> Tensor:
    """One operation of the authors' list on one image in [0, 1] (C, H, W), `sign` the random +-1 of signed ops."""
    _, h, w = img.shape
    if op == "translateX":
        return _shift(img, math.floor(magnitude * w * sign + 0.5), 0)
    if op == "translateY":
        return _shift(img, 0, math.floor(magnitude * h * sign + 0.5))
    if op == "shearX":
        return _affine(img, (1, magnitude * sign, 0, 0, 1, 0), "bicubic", 0.0)
    if op == "shearY":
        return _affine(img, (1, 0, 0, magnitude * sign, 1, 0), "bicubic", 0.0)
    if op == "rotate":  # PIL's rotate: counter-clockwise about the centre, nearest; the authors fill with grey 128
        t = math.radians(magnitude)
        cx, cy = w / 2, h / 2
        a, s = math.cos(t), math.sin(t)
        matrix = (a, -s, cx - a * cx + s * cy, s, a, cy - s * cx - a * cy)
        return _affine(img, matrix, "nearest", 128 / 255)
    if op == "color":
        return _blend(_grey(img).expand_as(img), img, 1 + magnitude * sign)
    if op == "contrast":  # PIL: a grey image at the rounded mean of the L channel
        mean = torch.round(_grey(img).mean() * 255) / 255
        return _blend(torch.full_like(img, float(mean)), img, 1 + magnitude * sign)
    if op == "brightness":
        return _blend(torch.zeros_like(img), img, 1 + magnitude * sign)
    if op == "sharpness":
        return _blend(_smooth(img), img, 1 + magnitude * sign)
    if op == "posterize":
        step = 2 ** (8 - int(magnitude))
        return torch.floor((img * 255).round() / step) * step / 255
    if op == "solarize":
        return torch.where(img * 255 < magnitude, img, 1 - img)
    if op == "autocontrast":
        lo = img.amin(dim=(1, 2), keepdim=True)
        hi = img.amax(dim=(1, 2), keepdim=True)
        span = hi - lo
        return torch.where(span > 0, (img - lo) / span.clamp_min(1e-12), img)
    if op == "equalize":
        return _equalize(img)
    if op == "invert":
        return 1 - img
    raise ValueError(f"unknown operation {op!r}")


def crop_padding(h: int, w: int) -> int:
    """The random crop's zero padding: the authors' 4 pixels at their 32x32 images (RandomCrop(32, padding=4)), the
    same eighth of the side at other resolutions (2 at 16x16), at least 1."""
    return max(1, round(min(h, w) / 8))


def crop_flip(img: Tensor, rng: torch.Generator) -> Tensor:
    """torchvision's RandomCrop(size of the image, padding=crop_padding, black fill) then RandomHorizontalFlip(0.5)
    on one image (C, H, W) in [0, 1]: the top and left offsets, then the flip, drawn from `rng`."""
    _, h, w = img.shape
    pad = crop_padding(h, w)
    top = int(torch.randint(2 * pad + 1, (), generator=rng))
    left = int(torch.randint(2 * pad + 1, (), generator=rng))
    flip = bool(torch.randint(2, (), generator=rng))
    out = F.pad(img, (pad, pad, pad, pad))[:, top : top + h, left : left + w]
    return out.flip(-1) if flip else out


def transform_images(images: Tensor, policy: list[list[int]], rng: torch.Generator, augment: str = "none") -> Tensor:
    """Each image (B, C, H, W in [0, 1]) through the authors' crop and flip first when augment is "crop-flip"
    (`crop_flip`), then one sub-policy chosen uniformly from `policy` (as the authors' sub_transform), its
    operations in order; the crop, the flip, the sub-policy and each signed operation's sign drawn from `rng`."""
    out = []
    for img in images:
        if augment == "crop-flip":
            img = crop_flip(img, rng)
        sub = policy[int(torch.randint(len(policy), (), generator=rng))]
        for idx in sub:
            op, m = TRANSFORMS[idx]
            sign = 1
            if op in SIGNED:
                sign = 1 if int(torch.randint(2, (), generator=rng)) else -1
            img = apply_op(img, op, RANGES[op][m], sign)
        out.append(img)
    return torch.stack(out)


def pixel_map(x: Tensor, mean: list[float] | None, std: list[float] | None) -> tuple[Tensor, Tensor]:
    """(scale, shift) per channel with pixels = x * scale + shift: the given normalisation, or, when none is given,
    the map that sends the batch's per-channel minimum to 0 and maximum to 1."""
    c = x.shape[1]
    if mean is not None:
        m = torch.tensor(mean, dtype=x.dtype).expand(c) if len(mean) == 1 else torch.tensor(mean, dtype=x.dtype)
        s = torch.tensor(std, dtype=x.dtype).expand(c) if len(std) == 1 else torch.tensor(std, dtype=x.dtype)
        return s.view(1, c, 1, 1), m.view(1, c, 1, 1)
    lo = x.amin(dim=(0, 2, 3), keepdim=True)
    span = (x.amax(dim=(0, 2, 3), keepdim=True) - lo).clamp_min(1e-12)
    return 1 / span, -lo / span


@register_defense("ats")
class ATS(Defense):
    """ATS: the client computes its gradient on its batch transformed by a published searched policy.

    Inside the client's computation, every image of the batch goes through one sub-policy of `policy` (chosen
    uniformly per image) and the gradient is the plain mean-loss gradient of the transformed batch, so the observer
    only ever sees gradients of transformed images. The transform is declared (`gradient_batch`): a trial scores the
    reconstruction against the transformed batch, what was sent, as the authors score their attacks (their
    benchmark/cifar100_attack.py attacks and scores the transformed validation image), and against the original
    image beside it (psnr_original, mse_original, ssim_original in the row's extra). The transformations are the authors' list of 50 (ATSPrivacy
    policy.py: AutoAugment operations at fixed magnitudes), written with torch operations after PIL's definitions
    and drawn from the client's generator (the random sign of the signed ones, the sub-policy).

    Parameters
    ----------
    policy: indices into the authors' list, '-' within a sub-policy, '+' between sub-policies. Default
        "3-1-7+43-18-18", the authors' hybrid of their two searched CIFAR-100 policies for ResNet20-4 (3-1-7:
        translateX 0.41, contrast 0.33, translateY 0.10; 43-18-18: translateY 0.14, contrast 0.39 twice).
    augment: "crop-flip" (default): every image is first randomly cropped back to its size from a copy padded with
        black (4 pixels at the authors' 32x32, an eighth of the side at other resolutions) and flipped horizontally
        with probability 1/2, as the authors' CIFAR pipeline applies RandomCrop(32, padding=4) and
        RandomHorizontalFlip before the policy (benchmark/comm.py, build_transform, mode 'aug'), to the images they
        train on and to those they attack. "none": the policy alone (gleak's first reading).
    pixels: how the client turns its normalised batch back into images in [0, 1] before transforming it (the
        authors transform PIL images, before normalisation). "data-stats" (default): with its data's own per-channel
        mean and std (pixels = x std + mean), which the client knows (the runner passes them, `bind_data`); each
        image's transformation then depends on that image alone. "batch-range": the batch's per-channel minimum is
        black and its maximum white (exact for batches that contain both, approximate otherwise; every image's
        result then depends on the others): gleak's first reading, kept as an option (stored with its name: its
        earliest trials, stored before the parameter existed, were re-keyed).
    mean, std: an explicit per-channel normalisation (pixels = x std + mean), used instead of either reading.

    The tests check every operation against PIL (the authors' implementation) at each magnitude the list uses.
    Left out: the policy search itself (the authors' privacy score S_pri and accuracy score S_acc over candidate
    policies on a half-trained model), which is an offline procedure; only its published results are offered.
    Known deviations: the operations act on floating-point pixels (PIL works on 8-bit integers, so blends and
    shifts here skip PIL's rounding; equalize and posterize quantize to 8 bits as PIL does); rotate and shear
    resample with torch's grid_sample (nearest / bicubic) rather than PIL's own kernels.
    """

    conformance_params = {"pixels": "batch-range"}  # its probes call the hooks without a runner's bind_data

    def __init__(
        self,
        policy: str = "3-1-7+43-18-18",
        mean: list[float] | None = None,
        std: list[float] | None = None,
        pixels: Literal["data-stats", "batch-range"] = "data-stats",
        augment: Literal["crop-flip", "none"] = "crop-flip",
    ):
        check_choice("pixels", pixels, ("data-stats", "batch-range"))
        check_choice("augment", augment, ("crop-flip", "none"))
        self.policy, self.mean, self.std, self.pixels, self.augment = policy, mean, std, pixels, augment
        self._subs = parse_policy(policy)
        self._data: tuple[list[float], list[float]] | None = None
        if (mean is None) != (std is None):
            raise ValueError("mean and std must be given together")
        if std is not None and (len(std) != len(mean) or any(s <= 0 for s in std)):
            raise ValueError(f"std must be positive and as long as mean, got mean={mean}, std={std}")

    def bind_data(self, mean: Tensor | list[float], std: Tensor | list[float]) -> None:
        self._data = ([float(v) for v in mean], [float(v) for v in std])

    def stats(self) -> tuple[list[float] | None, list[float] | None]:
        """The normalisation the batch is read with: explicit, the data's, or (None, None) for the batch range."""
        if self.mean is not None:
            return self.mean, self.std
        if self.pixels == "batch-range":
            return None, None
        if self._data is None:
            raise RuntimeError("ats: pixels = 'data-stats' but no data normalisation was given (Defense.bind_data); "
                               "give mean/std or pixels = 'batch-range'")  # fmt: skip
        return self._data

    def transform_batch(self, x: Tensor, rng: torch.Generator) -> Tensor:
        """The client's normalised batch after the policy (same normalisation as `x`)."""
        if not x.is_floating_point():  # token ids: there is no image to transform
            raise UnsupportedCase("ats transforms images; this case's inputs are token ids")
        mean, std = self.stats()
        if mean is not None and len(mean) not in (1, x.shape[1]):
            raise ValueError(f"ats: mean has {len(mean)} entries, the input has {x.shape[1]} channels")
        scale, shift = pixel_map(x.detach(), mean, std)
        images = (x.detach() * scale + shift).clamp(0, 1)
        return (transform_images(images, self._subs, rng, self.augment) - shift) / scale

    def gradient_batch(self, x: Tensor, y: Tensor, rng: torch.Generator) -> tuple[Tensor, Tensor]:
        return self.transform_batch(x, rng), y

    def client_gradient(self, model: nn.Module, x: Tensor, y: Tensor, rng: torch.Generator) -> dict[str, Tensor]:
        # Written out (the base class's computation) so that code that refuses defenses computing their own gradients
        # (a vertical CGD block) still refuses this one.
        return batch_gradient(model, *self.training_batch(x, y, rng))

