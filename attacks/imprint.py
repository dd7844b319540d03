"""Robbing the Fed: the imprint attack (Fowl, Geiping, Czaja, Goldblum, Goldstein, ICLR 2022, arXiv:2110.13057)."""
from __future__ import annotations

import copy
import math
from typing import Literal

import torch
from torch import Tensor, nn

from gleak.errors import UnsupportedCase
from gleak.plugin import Attack, check_choice
from gleak.registry import register_attack
from gleak.threat import Knowledge, Observation, Reconstruction

ENCODER = "imprint.encoder"  # parameter prefix of the imprint layer in the model the server sends


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
    mu = v.median()
    b = (v - mu).abs().mean()
    return mu - b * torch.sign(p - 0.5) * torch.log1p(-2 * (p - 0.5).abs())


@register_attack("imprint")
class Imprint(Attack):
    """Robbing the Fed (Fowl et al., ICLR 2022): an imprint block in front of the model, inputs read from bin differences.

    Active: `prepare` returns a new model, Imprinted(imprint, model). The imprint layer is Linear(d -> k) whose k rows
    all equal one measurement vector m (times 1/gain), with biases -q_i/gain, where q_1 < ... < q_k are the
    i/(k+1) quantiles of a Gaussian or Laplace fitted to <m, x> over the attacker's public data; then ReLU; then a
    Linear(k -> d) whose columns all equal gain/k, added to the input, so that the original model runs unchanged
    on a (slightly shifted) image. Bin i fires for every sample with <m, x> > q_i, and since every bin has the same
    weights into the rest of the network, all firing bins of one sample get the same dL/dz; so
    dW_i - dW_{i+1} = sum of s_j x_j and db_i - db_{i+1} = sum of s_j over the samples whose measurement falls in
    (q_i, q_{i+1}]; when exactly one does, x = (dW_i - dW_{i+1}) / (db_i - db_{i+1}) exactly (the top bin alone:
    x = dW_k / db_k). The attack keeps the batch-size bins with the largest |db difference|; when fewer bins have a
    non-zero difference (collisions, pruning) it fills the batch with the blind guess, the mean image. Samples below
    q_1 fire no bin and are lost; two samples in one interval give their mixture.

    Parameters
    ----------
    bins: k, the number of bins (default 64; the paper shows recovery grows with k / batch size).
    measurement: "brightness" (m = 1/d on every input entry: the mean of the normalised image, default) or
        "random" (a fixed random unit direction drawn from the attack's generator).
    distribution: "gaussian" (default) or "laplace", fitted to <m, x> over the public data (Knowledge.public_x).
    gain: scales the decoder by gain and the imprint layer by 1/gain. ReLU is positively homogeneous, so which bins
        fire and the input shift are unchanged, while the imprint gradients scale with gain: a server's free choice
        of how loud its bins are. Default 1.
    Reports the share of the batch recovered exactly (PSNR > 40 dB, after matching) as the diagnostic
    `share_psnr40` (every trial gets it); `bins_usable` counts the candidate bins with a non-zero bias difference.
    Deviations: the paper's released code (breaching) places the first threshold differently and offers further
    variants (sparse/one-shot blocks, placement deeper in the network); this is the paper's basic block at the input.
    """

    needs = frozenset({"batch_size", "public_data"})  # the server built the model it sent: it needs no copy of it
    active = True

    def __init__(
        self,
        bins: int = 64,
        measurement: Literal["brightness", "random"] = "brightness",
        distribution: Literal["gaussian", "laplace"] = "gaussian",
        gain: float = 1.0,
    ):
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        check_choice("measurement", measurement, ("brightness", "random"))
        check_choice("distribution", distribution, ("gaussian", "laplace"))
        if not gain > 0:
            raise ValueError(f"gain must be > 0, got {gain}")
        self.bins, self.measurement, self.distribution, self.gain = bins, measurement, distribution, gain

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
        probs = torch.arange(1, self.bins + 1, dtype=torch.float64) / (self.bins + 1)
        q = quantiles(values, probs, self.distribution)
        dtype = next(model.parameters()).dtype
        block = ImprintBlock(knowledge.input_shape, self.bins).to(dtype)
        with torch.no_grad():
            block.encoder.weight.copy_((m / self.gain).expand(self.bins, d))
            block.encoder.bias.copy_(-q / self.gain)
            block.decoder.weight.fill_(self.gain / self.bins)
            block.decoder.bias.zero_()
        return Imprinted(block, copy.deepcopy(model))

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        update, k = observation.update, observation.knowledge
        if f"{ENCODER}.weight" not in update.tensors:
            raise UnsupportedCase("imprint reads the gradient of the imprint layer that its own prepare step inserted")
        dw, db = update[f"{ENCODER}.weight"].double(), update[f"{ENCODER}.bias"].double()
        # Bins are in increasing threshold order: interval i lies between bin i and bin i+1; the top bin stands alone.
        ddw = torch.cat([dw[:-1] - dw[1:], dw[-1:]])
        ddb = torch.cat([db[:-1] - db[1:], db[-1:]])
        usable = torch.nonzero(ddb != 0).flatten()
        batch = k.batch_size or 1
        rows = usable[torch.argsort(ddb[usable].abs(), descending=True, stable=True)][:batch]
        # One image per sample: where fewer bins can be read (collisions, pruning) the rest is the blind guess, the
        # mean image (zero in normalised input space), so that scores average over the whole batch.
        x = torch.zeros((batch, dw.shape[1]), dtype=torch.float64)
        x[: len(rows)] = ddw[rows] / ddb[rows].unsqueeze(1)
        dtype = update[f"{ENCODER}.weight"].dtype
        extra = {"bins_usable": int(len(usable))}
        return Reconstruction(x=x.to(dtype).reshape(batch, *k.input_shape), extra=extra)
