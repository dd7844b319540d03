"""Robbing the Fed: the imprint attack (Fowl, Geiping, Czaja, Goldblum, Goldstein, ICLR 2022, arXiv:2110.13057)."""
from __future__ import annotations

import copy
import math
from typing import Literal

import torch
from torch import Tensor, nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, DefenseAware, check_choice
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Knowledge, Observation, Reconstruction

ENCODER = "imprint.encoder"  # parameter prefix of the imprint layer in the model the server sends
BELOW_DATA = 10.0  # standard deviations below the centre: the reference's first threshold (-10 on a unit normal)
REFERENCE_DECODER = 1e3  # the reference block's decoder entries (1 / its default gain 1e-3)
MAX_BINS = 65_536  # each bin is a row of input size: 10^8 bins of a 32x32x3 image would be 1.2 TB of weights
# Shaped imprint (defense_aware): the loud padding rows' decoder entries, this many times the bins' (gain / bins), so
# that their gradients outrank every image-carrying entry; their bias, positive (they always fire) and so small
# that their output (decoder x bias) is nothing beside a pixel.
LOUDER = 1e6
LOUD_BIAS = 1e-20


class ImprintBlock(nn.Module):
    """x -> x + reshape(decoder(ReLU(encoder(flatten(x))))): k bins that all measure <m, x> against thresholds."""

    def __init__(self, input_shape: tuple[int, ...], bins: int):
        super().__init__()
        d = math.prod(input_shape)
        self.encoder = nn.Linear(d, bins)
        self.decoder = nn.Linear(bins, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.decoder(torch.relu(self.encoder(x.flatten(1)))).view_as(x)


class Imprinted(nn.Module):
    """The model the malicious server sends: the imprint block in front of the unchanged original model."""

    def __init__(self, imprint: ImprintBlock, body: nn.Module):
        super().__init__()
        self.imprint, self.body = imprint, body

    def forward(self, x: Tensor) -> Tensor:
        return self.body(self.imprint(x))


def quantiles(values: Tensor, probs: Tensor, distribution: str) -> Tensor:
    """Quantiles `probs` of a Gaussian (mean, std) or a Laplace (median, mean absolute deviation: its maximum
    likelihood fit) fitted to `values`."""
    v = values.double()
    p = probs.double()
    if distribution == "gaussian":
        return v.mean() + v.std() * math.sqrt(2.0) * torch.erfinv(2 * p - 1)
    mu, b = _laplace_fit(v)
    return mu - b * torch.sign(p - 0.5) * torch.log1p(-2 * (p - 0.5).abs())


def _laplace_fit(v: Tensor) -> tuple[Tensor, Tensor]:
    mu = v.median()
    return mu, (v - mu).abs().mean()


def below_data(values: Tensor, distribution: str) -> Tensor:
    """A threshold far below every measurement: the fitted distribution's centre minus BELOW_DATA of its standard
    deviations (the reference's -10 for its unit-variance Gaussian or Laplace, where -inf would be its 0 quantile)."""
    v = values.double()
    if distribution == "gaussian":
        return v.mean() - BELOW_DATA * v.std()
    mu, b = _laplace_fit(v)
    return mu - BELOW_DATA * math.sqrt(2.0) * b  # a Laplace of scale b has standard deviation sqrt(2) b


def thresholds(values: Tensor, bins: int, distribution: str, lowest_bin: str) -> Tensor:
    """The k increasing thresholds q_1 < ... < q_k of the bins, placed on the distribution fitted to `values`.

    "below-data" (the reference's layout): q_1 far below the data, q_{i+1} at the i/k quantile (i = 1..k-1), so
    every sample fires the first bin and each of the k intervals holds 1/k of the distribution.
    "quantile": q_i at the i/(k+1) quantile (i = 1..k); the 1/(k+1) below q_1 fire no bin.
    """
    if lowest_bin == "quantile":
        return quantiles(values, torch.arange(1, bins + 1, dtype=torch.float64) / (bins + 1), distribution)
    inner = quantiles(values, torch.arange(1, bins, dtype=torch.float64) / bins, distribution)
    return torch.cat([below_data(values, distribution).reshape(1), inner])


@register_attack("imprint")
class Imprint(DefenseAware, Attack):
    """Robbing the Fed (Fowl et al., ICLR 2022): an imprint block in front of the model, inputs read from bin differences.

    Active: `prepare` returns a new model, Imprinted(imprint, model). The imprint layer is Linear(d -> k) whose k rows
    all equal one measurement vector m (times 1/gain), with biases -q_i/gain at increasing thresholds q_1 < ... < q_k
    placed on a Gaussian or Laplace fitted to <m, x> over the attacker's public data; then ReLU; then a
    Linear(k -> d) whose entries all equal gain/k, added to the input, so that the original model runs unchanged on
    a slightly shifted image (by the mean over bins of ReLU(<m, x> - q_i), whatever the gain). Bin i fires for every
    sample with <m, x> > q_i, and since every bin has the same weights into the rest of the network, all firing bins
    of one sample get the same dL/dz; so dW_i - dW_{i+1} = sum of s_j x_j and db_i - db_{i+1} = sum of s_j over the
    samples whose measurement falls in (q_i, q_{i+1}]; when exactly one does, x = (dW_i - dW_{i+1}) / (db_i -
    db_{i+1}) exactly (the top interval alone: x = dW_k / db_k). Two samples in one interval give their mixture.
    Where fewer intervals can be read than the batch has samples (collisions, pruning) the batch is filled with the
    blind guess, the mean image.

    Parameters (lowest_bin, selection and gain default to the reference implementation, the authors'
    lhfowl/robbing_the_fed at 91c4939, modifications/imprint.py ImprintBlock (lines 11-34, 61-70) and
    attacks/analytic_attack.py ImprintAttacker.reconstruct (lines 73-106), the same code as JonasGeiping/breaching's
    ImprintBlock and ImprintAttacker; the paper's text beyond its abstract and introduction could not be read here)
    ----------
    bins: k, the number of bins (default 64; the paper shows recovery grows with k / batch size).
    measurement: "brightness" (m = 1/d on every input entry: the mean of the normalised image, default; the
        reference's linfunc "avg") or "random" (a fixed random unit direction drawn from the attack's generator).
    distribution: "gaussian" (default) or "laplace", fitted to <m, x> over the public data (Knowledge.public_x).
    lowest_bin: where the first threshold goes.
        "below-data" (default, the reference's ImprintBlock._get_bins: bins[0] = -10 on its unit-variance model, the
        others at the i/k quantiles, i = 1..k-1): q_1 = centre - 10 standard deviations of the fitted distribution,
        so every sample fires bin 1 and none is lost below it; the k intervals hold 1/k of the distribution each.
        "quantile" (gleak's earlier default): q_i at the i/(k+1) quantiles, i = 1..k; the samples below q_1 fire no bin
        and are lost: 1/(k+1) of them where the fitted law fits (Gaussian images: 3 of 8 x 32 at 64 bins,
        tests/test_imprint.py), none measured on the skimage (20 batches of 32) and Fashion-MNIST (10) images, whose
        brightness has a lighter lower tail than the fitted Gaussian.
    selection: which intervals become the batch's images when more have a non-zero bias difference than the batch
        has samples (only under noise or other perturbation: clean, at most one per sample is non-zero).
        "weight" (default, the reference's ImprintAttacker.reconstruct rule, "best when faced with differential
        privacy"): the largest |mean of the weight difference row|. "bias" (gleak's earlier default): the largest
        |bias difference|. (The reference's comment names a third, the smallest |bias difference|, "optimal for
        clean data with few bins".)
    gain: scales the decoder by gain and the imprint layer by 1/gain. ReLU is positively homogeneous, so which bins
        fire and the input shift are unchanged, while the imprint gradients scale with gain: a server's free choice
        of how loud its bins are, and what decides how much noise it survives. Default None: the reference block's
        loudness, decoder entries 1e3 (its gain 1e-3 multiplies the imprint layer and divides the decoder, whose
        entries are 1 / gain), i.e. gain = 1e3 * bins here (64,000 at 64 bins). gain = 1 is the block of gleak before
        the earlier default, 1e3 * bins times quieter: on the skimage MLP at batch 32 and 64 bins its bias gradients measured
        1.5e5 to 7e5 times smaller than a block of the reference's form (3 seeds), the rest of that ratio coming from
        the reference's decoder replacing the image by its output (here it is added to the image).
    Suites: dgp-table1 (the only shipped suite with this attack) uses the defaults for lowest_bin and selection and
    sets gain to 1 and 1e6 (the quiet block and one about 15 times louder than the reference's).
    defense_aware: the server knows the client's pruning rule and its parameters (adds "knows_defense" to `needs`;
        Kerckhoffs) and shapes its imprint layer so that every entry that carries an image falls where the rule keeps
        it (ours). The layer gets extra rows after the k bins: "dead" rows (weight 0,
        bias -1, decoder column 0: they never fire, their gradient is exactly zero) and, against DGP, "loud" rows
        (weight 0, bias LOUD_BIAS > 0 so they always fire, decoder entries LOUDER x gain / k: their gradient is the
        batch's mixture of images, a million times louder than any bin's). Neither changes what the body sees
        beyond LOUD_BIAS x LOUDER x gain / k per pixel (1e-11 at the default gain). Row counts are the fewest that
        fit the rule exactly (the counts of defenses/topk.py and defenses/dgp.py, for the weight and the bias):
        - topk scope "layer": dead rows make up the pruned share of each imprint tensor, so the k bins are all kept.
        - topk scope "global": dead rows grow the update until its kept share holds the k bins' k (d + 1) entries;
          the bins must then also be louder than the body's gradients, which `gain` decides (not changed here).
        - dgp (per layer, drops the top k1 and the bottom k2 share): loud rows fill the dropped top (one row more
          than needed, for the rare pixel where the mixture is near zero), dead rows the dropped bottom, and the k
          bins sit in the kept middle band. With error feedback (Algorithm 2) nothing changes: the imprint layer is
          new in the attacked round, so the client holds no residual for it.
        Any other defense, or a rule that keeps too little for the padding to fit: the plain block. Reconstruction reads the first k rows (the bins) only.
        extra['shaped_rows']: how many padding rows the layer has.
    Reports the share of the batch recovered exactly (PSNR > 40 dB, after matching) as the diagnostic
    `share_psnr40` (every trial gets it); `bins_usable` counts the candidate intervals with a non-zero bias difference.
    Deviations from the reference: the thresholds are placed on the distribution fitted to public data (the reference
    assumes a unit normal, or a unit-variance Laplace for its Fourier measurement); the reference's default query is
    its "fourier" mode 0, the brightness times 1.32 with Laplace-placed bins, here the brightness with a Gaussian
    (distribution = "laplace" is the reference's placement; mean share exact over seeds 0-9 at batch 32, 64 bins:
    skimage 0.541 Gaussian / 0.572 Laplace, Fashion-MNIST 0.578 / 0.541); the decoder adds its output to
    the image (the reference's "linear" connection replaces the image by it); the top interval is read alone (the
    reference differences downwards and keeps the sum over all samples in place of it); the sparse and one-shot
    blocks, the Fourier measurement and placement deeper in the network are not implemented.
    """

    needs = frozenset({"batch_size", "public_data"})  # the server built the model it sent: it needs no copy of it
    active = True

    def __init__(
        self,
        bins: int = 64,
        measurement: Literal["brightness", "random"] = "brightness",
        distribution: Literal["gaussian", "laplace"] = "gaussian",
        lowest_bin: Literal["below-data", "quantile"] = "below-data",
        selection: Literal["weight", "bias"] = "weight",
        gain: float | None = None,
        defense_aware: bool = False,
    ):
        if not 1 <= bins <= MAX_BINS:  # each bin is a row of the imprint layer: input size x bins weights
            raise ValueError(f"bins must be in [1, {MAX_BINS}], got {bins}")
        check_choice("measurement", measurement, ("brightness", "random"))
        check_choice("distribution", distribution, ("gaussian", "laplace"))
        check_choice("lowest_bin", lowest_bin, ("below-data", "quantile"))
        check_choice("selection", selection, ("weight", "bias"))
        if gain is not None and not gain > 0:
            raise ValueError(f"gain must be > 0, got {gain}")
        self.bins, self.measurement, self.distribution = bins, measurement, distribution
        self.lowest_bin, self.selection = lowest_bin, selection
        self.gain = REFERENCE_DECODER * bins if gain is None else float(gain)
        self.use_defense_knowledge(defense_aware)

    def prepare(self, model: nn.Module, knowledge: Knowledge, rng: torch.Generator) -> nn.Module:
        if knowledge.public_x is None or len(knowledge.public_x) < 2:
            raise UnsupportedCase("imprint needs public data (at least two samples) to place its bins")
        d = math.prod(knowledge.input_shape)
        if self.measurement == "brightness":
            m = torch.full((d,), 1.0 / d, dtype=torch.float64)
        else:
            m = torch.randn(d, generator=rng, dtype=torch.float64)
            m = m / m.norm()
        values = knowledge.public_x.reshape(len(knowledge.public_x), -1).double() @ m
        q = thresholds(values, self.bins, self.distribution, self.lowest_bin)
        dtype = next(model.parameters()).dtype
        loud, dead = shaped_rows(knowledge, self.bins, d, model) if self.defense_aware else (0, 0)
        k = self.bins
        block = ImprintBlock(knowledge.input_shape, k + loud + dead).to(dtype)
        with torch.no_grad():
            block.encoder.weight.zero_()
            block.encoder.weight[:k] = (m / self.gain).expand(k, d)
            block.encoder.bias[:k] = -q / self.gain
            block.encoder.bias[k : k + loud] = LOUD_BIAS
            block.encoder.bias[k + loud :] = -1.0
            block.decoder.weight.zero_()
            block.decoder.weight[:, :k] = self.gain / k
            block.decoder.weight[:, k : k + loud] = LOUDER * self.gain / k
            block.decoder.bias.zero_()
        return Imprinted(block, copy.deepcopy(model))

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        update, k = observation.update, observation.knowledge
        if f"{ENCODER}.weight" not in update.tensors:
            raise UnsupportedCase("imprint reads the gradient of the imprint layer that its own prepare step inserted")
        # The first `bins` rows are the bins; a shaped layer's padding rows follow them.
        dw, db = update[f"{ENCODER}.weight"][: self.bins].double(), update[f"{ENCODER}.bias"][: self.bins].double()
        # Bins are in increasing threshold order: interval i lies between bin i and bin i+1; the top bin stands alone.
        ddw = torch.cat([dw[:-1] - dw[1:], dw[-1:]])
        ddb = torch.cat([db[:-1] - db[1:], db[-1:]])
        usable = torch.nonzero(ddb != 0).flatten()
        # One row per sample behind the observed update (summed over clients through a secure sum): the same
        # allowance as every attack (gleak.mechanics.modality), read from the wire where "batch_size" grants it.
        batch = int(update.num_samples) if update.num_samples is not None else (k.batch_size or 1)
        score = ddw[usable].mean(dim=1) if self.selection == "weight" else ddb[usable]
        rows = usable[torch.argsort(score.abs(), descending=True, stable=True)][:batch]
        # One image per sample: where fewer bins can be read (collisions, pruning) the rest is the blind guess, the
        # mean image (zero in normalised input space), so that scores average over the whole batch.
        x = torch.zeros((batch, dw.shape[1]), dtype=torch.float64)
        x[: len(rows)] = ddw[rows] / ddb[rows].unsqueeze(1)
        dtype = update[f"{ENCODER}.weight"].dtype
        extra = {"bins_usable": int(len(usable))}
        if self.defense_aware:
            extra["shaped_rows"] = update[f"{ENCODER}.weight"].shape[0] - self.bins
        return Reconstruction(x=x.to(dtype).reshape(batch, *k.input_shape), extra=extra)


def shaped_rows(knowledge: Knowledge, bins: int, d: int, model: nn.Module) -> tuple[int, int]:
    """(loud, dead) padding rows that put all of the k = `bins` image-carrying rows of the imprint layer where the
    described pruning rule keeps them (see Imprint, defense_aware); (0, 0), the plain block, for a rule this has
    no answer to, or one that keeps too little for any padding to fit (within 1,000 / 10,000 times the bins)."""
    desc = knowledge.defense
    if desc is None or desc.defense not in ("topk", "dgp"):
        return 0, 0
    if desc.defense == "dgp":
        from gleak.defenses.dgp import dgp_counts

        k1, k2 = float(desc.param("k1", 0.05)), float(desc.param("k2", 0.75))
        for rows in range(bins, 1_000 * bins + 2):
            (top_w, bottom_w), (top_b, bottom_b) = dgp_counts(rows * d, k1, k2), dgp_counts(rows, k1, k2)
            loud = max(-(-top_w // d) + (1 if top_w else 0), top_b)
            dead = max(-(-bottom_w // d), bottom_b)
            if bins + loud + dead <= rows:
                return loud, rows - bins - loud
        return 0, 0
    ratio = float(desc.param("ratio", 0.9))
    if ratio >= 1.0:
        return 0, 0  # nothing is sent: no layout helps
    if desc.param("scope", "global") == "layer":
        for rows in range(bins, 10_000 * bins + 2):
            if rows - bins >= max(-(-round(ratio * rows * d) // d), round(ratio * rows)):
                return 0, rows - bins
    else:
        body = sum(p.numel() for p in model.parameters() if p.requires_grad)
        for rows in range(bins, 10_000 * bins + 2):
            total = body + rows * (2 * d + 1) + d  # encoder weight and bias, decoder weight and bias
            if total - round(ratio * total) >= bins * (d + 1):
                return 0, rows - bins
    return 0, 0
