"""FedLeak (Fan, Wang, Chen, Zhou, "Boosting Gradient Leakage Attacks: Data Reconstruction in Realistic FL
Settings", USENIX Security 2025, arXiv:2506.08435; the authors' release on Zenodo, doi 10.5281/zenodo.15532455, read
through its integration copy KaimingZhu/FedLeak_transfer_test: attack.py, generator.py).

Optimisation-based gradient matching in which, as in the released code, the images are not optimised directly: they
are drawn by an untrained convolutional generator from fixed Gaussian codes, and the generator's weights are
optimised (signed AdamW, cosine annealing, TV; UntrainedGenerator below). parameterization = "pixels" optimises the
images instead (inverting-gradients style: signed AdamW on the normalised pixels, boxed). The paper's two techniques
act on whichever is optimised:

* Partial gradient matching. Per parameter tensor l only the entries where the candidate's gradient g'_l is large
  are matched: the mask m_l = [|g'_l| >= q-quantile of |g'_l|] (q = 1 - keep, keep 0.5 in the released code's
  combine_loss), and the tensor's distance is

      D_l = mean(|m_l * (g_l - g'_l)|)  +  1 - cos(m_l * g_l, m_l * g'_l)

  (the code's l1_loss, a mean over all entries of the tensor, plus its cos_loss), summed over tensors, + tv * TV.
  The mask is a selection (no gradient flows through it), recomputed at every evaluation.

* Gradient regularization. Each iteration takes the signed gradient s0 = sign(dL/dx) at the optimised x (generator
  weights or pixels), an optimizer step to the
  look-ahead point x1, the signed gradient s1 there, and then steps from x (restored) along (1 - a) s0 + a s1,
  a = 0.3: a finite-difference form of regularizing the objective by its own gradient's change along the step
  (the code's "forward gradient", 0.7 / 0.3). The optimizer's state advances on both steps, as in the code.

Sources of the defaults are named in the class docstring; the paper's own text (beyond its abstract) could not be
read here, so every default is the released code's.
"""
from __future__ import annotations

import math
from typing import Callable, Literal

import torch
from torch import Tensor, nn

from gleak.attacks._gradmatch import FIXED_LABELS, attack_model, fixed_labels, observed_gradient, param_gradients
from gleak.attacks.inverting_gradients import total_variation
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, check_choice, loss_fn
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Observation, Reconstruction
from gleak.mechanics.progress import report as report_progress

MASK_BY = ("candidate", "observed")
REGULARIZATION = ("lookahead", "ascent", "none")
FEDAVG = ("simulate", "one-gradient")
PARAMETERIZATION = ("generator", "pixels")
# The code's median filter: 5x5 on its 128 px images; "auto" applies it from that size on.
MEDIAN_FROM = 128


def partial_mask(g: Tensor, keep: float) -> Tensor:
    """The entries of g kept by partial matching: |g| at or above the (1 - keep)-quantile of |g| (the code's
    torch.quantile, linear interpolation; computed by kthvalue so that tensors over 16M entries work). keep 1 keeps
    every entry. A boolean tensor shaped like g, carrying no gradient."""
    a = g.detach().abs().flatten()
    if keep >= 1.0 or a.numel() == 0:
        return torch.ones_like(g, dtype=torch.bool)
    pos = (1.0 - keep) * (a.numel() - 1)
    lo, frac = int(math.floor(pos)), pos - math.floor(pos)
    s_lo = a.kthvalue(lo + 1).values
    s_hi = a.kthvalue(min(lo + 2, a.numel())).values if frac > 0 else s_lo
    return g.detach().abs() >= s_lo + frac * (s_hi - s_lo)


def partial_distance(grads, target: list[Tensor], keep: float, mask_by: str = "candidate") -> Tensor:
    """sum_l mean|m_l (t_l - g_l)| + 1 - cos(m_l t_l, m_l g_l), m_l = partial_mask of the candidate's g_l (mask_by
    "candidate", the released code) or of the observed t_l ("observed")."""
    terms = []
    for g, t in zip(grads, target):
        m = partial_mask(g if mask_by == "candidate" else t, keep).to(g.dtype)
        gm, tm = g * m, t * m
        l1 = (tm - gm).abs().mean()
        cos = (gm * tm).sum() / ((gm.pow(2).sum().sqrt() + 1e-8) * (tm.pow(2).sum().sqrt() + 1e-8))
        terms.append(l1 + 1 - cos)
    return torch.stack(terms).sum()


def regularized_step(x: Tensor | list[Tensor], opt: torch.optim.Optimizer, direction: Callable, alpha: float,
                     mode: str, project: Callable[[Tensor], None] | None = None) -> None:  # fmt: skip
    """One FedLeak iteration on the optimised leaf x (the pixels) or leaves [x_1, ...] (a generator's weights), in
    place. direction(values) -> the (signed) descent direction at `values` (same structure as x: a tensor or a list
    of tensors); project(t) puts a tensor back in the box (in place), after every step (pixels only).

    "lookahead" (the code): s0 at x; an optimizer step along s0 to x1; s1 at x1; x restored; a second optimizer step
    along (1 - alpha) s0 + alpha s1 (the optimizer's state advances on both steps, as the code's). "ascent" (the
    other reading of "gradient regularization": penalising the objective's gradient norm, Zhao et al. ICML 2022,
    whose finite-difference form probes uphill): the same with s1 taken at the reflected point x - (x1 - x).
    "none" (the ablation): one plain step along s0."""
    single = isinstance(x, Tensor)
    xs = [x] if single else list(x)

    def d(values: list[Tensor]) -> list[Tensor]:
        out = direction(values[0] if single else values)
        return [out] if single else list(out)

    def proj(ts) -> None:
        if project is not None:
            for t in ts:
                project(t)

    x0 = [t.detach().clone() for t in xs]
    s0 = d(x0)
    for t, g in zip(xs, s0):
        t.grad = g.clone()
    opt.step()
    proj(xs)
    if mode == "none":
        return
    probe = [t.detach().clone() if mode == "lookahead" else 2 * t0 - t.detach() for t, t0 in zip(xs, x0)]
    proj(probe)
    s1 = d(probe)
    with torch.no_grad():
        for t, t0 in zip(xs, x0):
            t.copy_(t0)
    for t, a, b in zip(xs, s0, s1):
        t.grad = (1 - alpha) * a + alpha * b
    opt.step()
    proj(xs)


def median_filter(x: Tensor, k: int) -> Tensor:
    """The code's MedianPool2d(k, stride 1, padding k // 2, reflect) on images (..., H, W); k 0 or 1: x."""
    if k <= 1:
        return x
    p = k // 2
    shape = x.shape
    flat = x.reshape(-1, 1, *shape[-2:])
    flat = torch.nn.functional.pad(flat, (p, p, p, p), mode="reflect" if min(shape[-2:]) > p else "replicate")
    patches = flat.unfold(2, k, 1).unfold(3, k, 1)
    return patches.reshape(*patches.shape[:4], -1).median(-1).values.reshape(shape)


def generated_side(height: int, width: int) -> int:
    """The side the generator draws at: the next power of two >= the image's larger side, at least 4 (its first
    layer's 4x4 map); the image is its centre crop."""
    return max(4, 1 << (max(int(height), int(width)) - 1).bit_length())


def _block_width(channels: int, res: int) -> int:
    """The code's widths: `channels` up to 32 px, half at 64, a quarter at 128 and above (at least 1)."""
    return max(1, channels // (1 if res <= 32 else 2 if res == 64 else 4))


class ConvBlock(nn.Module):
    """Two spectrally normalised 3x3 convolutions (torch's spectral_norm parametrization, one power iteration per
    forward in train mode), each followed by BatchNorm and LeakyReLU(0.1)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.body = nn.Sequential(
            sn(nn.Conv2d(c_in, c_out, 3, padding=1)), nn.BatchNorm2d(c_out), nn.LeakyReLU(0.1),
            sn(nn.Conv2d(c_out, c_out, 3, padding=1)), nn.BatchNorm2d(c_out), nn.LeakyReLU(0.1),
        )

    def forward(self, h: Tensor) -> Tensor:
        return self.body(h)


class UntrainedGenerator(nn.Module):
    """FedLeak's image parameterisation (the released code's generator, rewritten): a fixed code z (B, code_dim) ->
    ConvTranspose2d to a 4x4 map of `channels` -> BatchNorm -> LeakyReLU(0.1) -> a ConvBlock at 4 px, then for
    each doubling up to `side` a nearest x2 upsampling and a ConvBlock (widths as the code's: halved at 64 px,
    quartered from 128 px) -> a 1x1 convolution to `out_channels` -> sigmoid. Output (B, out_channels, side, side)
    in [0, 1]. Never trained beforehand; its BatchNorms stay in train mode (statistics over the batch of codes), as
    in the code, which never calls eval()."""

    def __init__(self, out_channels: int, side: int, channels: int = 256, code_dim: int = 128):
        super().__init__()
        if side < 4 or side & (side - 1):
            raise ValueError(f"side must be a power of two >= 4, got {side!r}")
        self.code_dim, self.side = code_dim, side
        self.stem = nn.Sequential(nn.ConvTranspose2d(code_dim, channels, 4), nn.BatchNorm2d(channels), nn.LeakyReLU(0.1))
        blocks, c, res = [ConvBlock(channels, channels)], channels, 4
        while res < side:
            res *= 2
            blocks.append(ConvBlock(c, _block_width(channels, res)))
            c = _block_width(channels, res)
        self.blocks = nn.ModuleList(blocks)
        self.to_image = nn.Conv2d(c, out_channels, 1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.blocks[0](self.stem(z.reshape(-1, self.code_dim, 1, 1)))
        for block in self.blocks[1:]:
            h = block(nn.functional.interpolate(h, scale_factor=2, mode="nearest"))
        return torch.sigmoid(self.to_image(h))


def centre_crop(img: Tensor, height: int, width: int) -> Tensor:
    """The central height x width window of img (..., S, S)."""
    top, left = (img.shape[-2] - height) // 2, (img.shape[-1] - width) // 2
    return img[..., top: top + height, left: left + width]


def seeded_generator(shape: tuple[int, ...], batch: int, rng: torch.Generator, channels: int = 256,
                     code_dim: int = 128, dtype: torch.dtype = torch.float32) -> tuple[UntrainedGenerator, Tensor]:  # fmt: skip
    """A fresh generator for images of `shape` (C, H, W) and its fixed codes z ~ N(0, 1) (batch, code_dim), both
    drawn from rng alone (the weights' init under a forked global RNG seeded from rng): the same rng state gives the
    same generator and codes."""
    seed = int(torch.randint(0, 2**62, (1,), generator=rng))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = UntrainedGenerator(int(shape[0]), generated_side(shape[1], shape[2]), channels, code_dim).to(dtype)
    z = torch.randn((batch, code_dim), generator=rng, dtype=dtype)
    return net, z



@register_attack("fedleak")
class FedLeak(Attack):
    """FedLeak (Fan, Wang, Chen, Zhou, USENIX Security 2025): a generator prior, partial gradient matching, gradient
    regularization.

    Fan, Wang, Chen, Zhou, "Boosting Gradient Leakage Attacks: Data Reconstruction in Realistic FL Settings", USENIX
    Security 2025 (arXiv:2506.08435). The images x = (G_w(z) - mean) / std (labels fixed first) are drawn by an
    untrained generator G_w from fixed codes z, and its weights w are optimised by signed AdamW on

        sum_l [ mean|m_l (g_l - g'_l)| + 1 - cos(m_l g_l, m_l g'_l) ]  +  tv * TV(G_w(z))

    (module docstring: m_l keeps the largest entries of the candidate gradient g'_l), with the look-ahead gradient
    regularization (regularized_step). Every default below is the authors' released code's (Zenodo v1, attack.py and
    generator.py): the paper's method section could not be read here (only its abstract), so where the code and a
    plain reading of the technique names could differ, the code is the default and the other reading an option.

    Parameters
    ----------
    iterations: 10,000 (the code's num_iters).
    parameterization: "generator" (default, the code): the weights of UntrainedGenerator are optimised; "pixels" (the
        option): the normalised images themselves, from N(0, 1), clamped to the valid range after every step, the
        TV on them (inverting-gradients').
    channels: the generator's width, 256 (the code's; 64 px and up use half, 128 px and up a quarter, as the code).
        Its cost grows with its square: smaller widths suit CPU budgets. code_dim: each image's code, 128 (the
        code's latent_vec), z ~ N(0, 1), fixed. The generator's weights (torch's default init) and codes are drawn
        from the trial's generator, so a trial is deterministic.
    lr: None (default): 1e-2 under the generator (the code's, on its weights), 0.1 under pixels (inverting-
        gradients', on pixels); the step size follows a cosine annealing to 0 over iterations + 1 (the code's
        CosineAnnealingLR(T_max 10001) over 10,000 iterations). weight_decay: AdamW's, 0.01 (torch's default,
        which the code leaves on; on every generator weight, BatchNorm's included, as the code).
    keep: the share of each tensor's entries matched, 0.5 (the code's combine_loss: quantile 0.5); 1 matches every
        entry (the ablation: no partial matching).
    mask_by: whose magnitudes pick the entries: "candidate" (default, the code: the dummy gradient's) or "observed"
        (the client's gradient's, the other reading).
    regularization: "lookahead" (default, the code's "forward gradient": the signed gradient at the point one
        optimizer step ahead, mixed in with weight `alpha` = 0.3, 0.7 on the current one), "ascent" (the probe one
        step uphill instead: the gradient-norm penalty reading), or "none" (the ablation). alpha: the mixing weight.
    tv: 1e-5 (the code's, on its TV: inverting_gradients.total_variation, the same formula; on the generator's
        [0, 1] images, as the code, or on the normalised pixels under "pixels"). signed: True (the code signs the
        gradient before AdamW). boxed: True, pixels clamped to the valid range after every step under "pixels" (the
        generator's sigmoid keeps its images in range by construction).
    median: the final median filter's kernel. "auto" (default): the code's 5x5 on images of at least 128 px a side
        (the code's size), off below: at gleak's 8-32 px a 5x5 window spans a sixth to over half of the image and
        blurs it (at 128 px it spans 4%). 0: off; an odd k: a k x k filter whatever the size.
    restarts: independent runs (a fresh generator and codes, or a fresh N(0, 1) init, each; default 1, the code's
        loop runs 1); the lowest final matching distance wins (the code picks by PSNR to the true images, which an
        attacker does not have).
    labels: "count-aware" (default: the batch's label counts read from the gradient, attacks/idlg.py), "idlg",
        "bias-sign", "row-sign", or "given" (the true labels, as the code feeds them; adds "labels" to `needs`).
    fedavg: how a FedAvg delta (kind "delta") is matched: "simulate" (default: the client's local SGD simulated on the
        images, fedavg_leakage.simulated_delta, with the local lr, steps and batch size from the update's meta, one
        set of images for every epoch, and matched to delta / lr) or "one-gradient" (delta / (lr x local_steps) matched
        as a gradient). A FedSGD gradient is matched as sent. The paper's evaluation protocol includes local training;
        the released code attacks a gradient.

    Sizes. The code draws 128 px images (blocks at 4, 8, ..., 128 px). Here the generator draws at the next power of
    two >= the image's larger side, at least 4 (its first 4x4 map): 8 px images at 8 (blocks at 4 and 8), 14 px at
    16, 32 px at 32, with the case's channel count (1 for grey images), and the image is the centre crop of the
    drawn one (no resampling: each pixel is one of the generator's, and the range stays [0, 1]; for 14 px the outer
    ring of the 16 px drawing is unused). Then x = (crop - mean) / std, the normalised space the model expects, as
    the pixel path's box.

    Deviations (named): the code's own spectral-norm layer (BigGAN's, one power iteration per forward) is torch's
    spectral_norm parametrization here (also one power iteration per forward in train mode); its generator, always
    in train mode, keeps BatchNorm over the batch of codes, as here. The generator's depth follows the image size
    (fewer blocks for small images than the code's 128 px), and its images are cropped (above). The median filter
    is off below 128 px (above). The code's cosine term carries a second mask (entries of the masked client
    gradient above its 20% quantile) that is empty at keep 0.5 (over half the masked entries are zero, so the
    quantile is 0); it is not implemented. Cross entropy with hard labels, mean over the batch; the gradient is
    taken with the observer's model in whatever mode it was sent. The paper's claims at 10,000 iterations on GPUs
    are not reproduced at CPU budgets. extra: grad_loss (the chosen restart's final matching distance, TV
    excluded), restart, iterations, matched ("gradient", "simulated-delta" or "delta-as-gradient"),
    parameterization.
    """

    needs = frozenset({"architecture", "parameters", "batch_size", "data_stats"})
    conformance_params = {"iterations": 3, "channels": 16}

    def __init__(
        self,
        iterations: int = 10_000,
        parameterization: Literal["generator", "pixels"] = "generator",
        channels: int = 256,
        code_dim: int = 128,
        lr: float | None = None,
        keep: float = 0.5,
        mask_by: Literal["candidate", "observed"] = "candidate",
        regularization: Literal["lookahead", "ascent", "none"] = "lookahead",
        alpha: float = 0.3,
        tv: float = 1e-5,
        weight_decay: float = 0.01,
        signed: bool = True,
        boxed: bool = True,
        median: int | Literal["auto"] = "auto",
        restarts: int = 1,
        labels: Literal["count-aware", "idlg", "bias-sign", "row-sign", "given"] = "count-aware",
        fedavg: Literal["simulate", "one-gradient"] = "simulate",
    ):
        self.iterations, self.lr, self.keep, self.mask_by = iterations, lr, keep, mask_by
        self.parameterization, self.channels, self.code_dim = parameterization, channels, code_dim
        self.regularization, self.alpha, self.tv, self.weight_decay = regularization, alpha, tv, weight_decay
        self.signed, self.boxed, self.median, self.restarts = signed, boxed, median, restarts
        self.labels, self.fedavg = labels, fedavg
        if labels == "given":
            self.needs = self.needs | {"labels"}
        self._validate()

    def _validate(self) -> None:
        """Every parameter checked, one ValueError naming the first that is out of range."""
        check_choice("mask_by", self.mask_by, MASK_BY)
        check_choice("regularization", self.regularization, REGULARIZATION)
        check_choice("labels", self.labels, FIXED_LABELS)
        check_choice("fedavg", self.fedavg, FEDAVG)
        check_choice("parameterization", self.parameterization, PARAMETERIZATION)
        for name in ("channels", "code_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(f"iterations must be an integer >= 1, got {self.iterations!r}")
        if isinstance(self.restarts, bool) or not isinstance(self.restarts, int) or self.restarts < 1:
            raise ValueError(f"restarts must be an integer >= 1, got {self.restarts!r}")
        m = self.median
        if m != "auto" and (isinstance(m, bool) or not isinstance(m, int) or m < 0 or (m > 1 and m % 2 == 0)):
            raise ValueError(f"median must be \"auto\", 0 (off) or an odd kernel size >= 1, got {m!r}")
        if not (isinstance(self.keep, (int, float)) and 0.0 < self.keep <= 1.0):
            raise ValueError(f"keep must be in (0, 1], got {self.keep!r}")
        if not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        v = self.lr
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
            raise ValueError(f"lr must be > 0 (or None: the parameterisation's default), got {v!r}")
        for name in ("tv", "weight_decay"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be >= 0, got {v!r}")

    def step_size(self) -> float:
        """lr as given, else the parameterisation's default: 1e-2 on generator weights (the code's), 0.1 on pixels
        (inverting-gradients')."""
        return float(self.lr) if self.lr is not None else (1e-2 if self.parameterization == "generator" else 0.1)

    def median_kernel(self, height: int, width: int) -> int:
        """median as given, or under "auto" the code's 5 for images of at least 128 px a side, else 0 (off)."""
        if self.median != "auto":
            return int(self.median)
        return 5 if min(height, width) >= MEDIAN_FROM else 0

    @classmethod
    def estimated_cost(cls, params: dict, case) -> float:
        """One gradient-matching evaluation per iteration, two with the regularization's look-ahead, per restart and
        per simulated local step of a FedAvg case; under the generator each evaluation also runs the generator
        forward and backward, taken as 2 x (channels / 64)^2 x (drawn side / 16)^2 model passes (rough: measured
        ~3 pixel-path evaluations at width 64, 14 px, batch 8, on the MLP of 64 units)."""
        p = {"iterations": 10_000, "regularization": "lookahead", "restarts": 1, "fedavg": "simulate",
             "parameterization": "generator", "channels": 256, **params}  # fmt: skip
        steps = 1
        if p["fedavg"] == "simulate":
            steps = int((getattr(case, "protocol_params", None) or {}).get("local_steps") or getattr(case, "local_steps", 1) or 1)
        per = 1 if p["regularization"] == "none" else 2
        each = float(steps)
        if p["parameterization"] == "generator":
            res = getattr(case, "resolution", None) or 32
            side = generated_side(res, res)
            each += 2.0 * (float(p["channels"]) / 64) ** 2 * (side / 16) ** 2
        return float(p["iterations"]) * per * int(p["restarts"]) * each

    def _matching(self, observation: Observation, model: nn.Module, names: list[str], params: list[nn.Parameter],
                  rng: torch.Generator):  # fmt: skip
        """(labels, target tensors, candidate(x) -> tensors to match, what is matched)."""
        k = observation.knowledge
        B, dtype, update = int(k.batch_size), params[0].dtype, observation.update
        gradient, _ = observed_gradient(update, names, dtype)
        y = fixed_labels(self.labels, gradient, model, k, B, rng)
        if update.kind == "delta" and self.fedavg == "simulate":
            from gleak.attacks.fedavg_leakage import FedAvgLeakage, simulated_delta

            lr, steps, bs = FedAvgLeakage.local_training(update, B)
            target = [update.tensors[n].detach().to(dtype) / lr for n in names]

            def candidate(x: Tensor) -> list[Tensor]:
                return [s / lr for s in simulated_delta(model, names, [x], y, lr, steps, bs)]

            return y, target, candidate, "simulated-delta"

        def plain(x: Tensor) -> list[Tensor]:
            return list(param_gradients(model, params, x, loss_fn, y))

        return y, [gradient.tensors[n] for n in names], plain, "gradient" if update.kind == "gradient" else "delta-as-gradient"

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        self._validate()  # parameters are stored as given; checked again at use
        model, names, params = attack_model(observation)
        k = observation.knowledge
        if k.batch_size is None or k.mean is None or k.std is None:
            raise UnsupportedCase("fedleak needs the batch size and the data mean/std")
        if len(k.input_shape) != 3:
            raise UnsupportedCase("fedleak reconstructs images (C, H, W)")
        dtype, B = params[0].dtype, int(k.batch_size)
        C, H, W = (int(v) for v in k.input_shape)
        y, target, candidate, matched = self._matching(observation, model, names, params, rng)
        mean = k.mean.to(dtype).view(-1, 1, 1)
        std = k.std.to(dtype).view(-1, 1, 1)
        lo, hi = (0 - mean) / std, (1 - mean) / std
        generator = self.parameterization == "generator"

        def objective(x: Tensor) -> tuple[Tensor, Tensor]:
            """(distance + tv * TV, distance) at the normalised images x; the TV on the [0, 1] images under the
            generator (the code's: on its sigmoid output), on x itself under pixels (inverting-gradients')."""
            rec = partial_distance(candidate(x), target, self.keep, self.mask_by)
            if self.tv <= 0:
                return rec, rec
            return rec + self.tv * total_variation(x * std + mean if generator else x), rec

        last = {"rec": torch.zeros(())}
        results = []
        total = self.iterations * self.restarts
        for r in range(self.restarts):
            if generator:
                net, z = seeded_generator((C, H, W), B, rng, self.channels, self.code_dim, dtype)
                net.train()  # BatchNorm over the batch of codes, as the code (never eval())
                leaves = list(net.parameters())

                def render() -> Tensor:
                    return (centre_crop(net(z), H, W) - mean) / std

                def direction(values: list[Tensor]) -> list[Tensor]:
                    with torch.no_grad():
                        for p_, v in zip(leaves, values):
                            if v is not p_:
                                p_.copy_(v)
                    with torch.enable_grad():
                        obj, rec = objective(render())
                        gs = torch.autograd.grad(obj, leaves)
                    last["rec"] = rec.detach()
                    return [g.sign() for g in gs] if self.signed else list(gs)

                project = None
            else:
                x = torch.randn((B, C, H, W), generator=rng, dtype=dtype).requires_grad_(True)
                leaves = [x]

                def direction(values: list[Tensor]) -> list[Tensor]:
                    with torch.enable_grad():
                        v = values[0].detach().requires_grad_(True)
                        obj, rec = objective(v)
                        (g,) = torch.autograd.grad(obj, v)
                    last["rec"] = rec.detach()
                    return [g.sign() if self.signed else g]

                def project(t: Tensor) -> None:
                    if self.boxed:
                        with torch.no_grad():
                            t.copy_(torch.max(torch.min(t, hi), lo))

            lr = self.step_size()
            opt = torch.optim.AdamW(leaves, lr=lr, weight_decay=self.weight_decay)
            for i in range(self.iterations):
                for group in opt.param_groups:  # CosineAnnealingLR's closed form, T_max = iterations + 1
                    group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * i / (self.iterations + 1)))
                regularized_step(leaves, opt, direction, self.alpha, self.regularization, project)
                report_progress(r * self.iterations + i + 1, total, last["rec"])
            if generator:
                with torch.no_grad():
                    final = render().detach()
            else:
                final = x.detach()
            xf = median_filter(final, self.median_kernel(H, W))
            with torch.enable_grad():
                _, rec = objective(xf.clone().requires_grad_(True))
            results.append((float(rec.detach()), xf))
        best = min(range(len(results)), key=lambda j: results[j][0])
        extra = {"grad_loss": results[best][0], "restart": best, "iterations": self.iterations, "matched": matched,
                 "parameterization": self.parameterization}  # fmt: skip
        return Reconstruction(x=results[best][1], y=y, extra=extra)
