"""Confined Gradient Descent training, vectorised across participants (Zhang, Bai, Li, Nepal and Ko, Algorithms 1 and 2): the engine of
the cgd protocol (protocols/cgd.py), its fast path for utility runs.

A fully connected ReLU network (sizes D -> H_1 -> ... -> C, biases included, softmax cross-entropy) is trained by
m = rows x cols participants at once. Participant (i, j) holds sample block i and feature block j of the training
set (Algorithm 2; cols = 1 is Algorithm 1) and a confined model initialised w_1 = delta^l * Rand^l (equation 11,
every weight and bias, from its own generator; Rand is N(0, 1) truncated to [-1, 1] by default, see init_unit): a
first layer on its own d_j features and its own upper layers.
Each iteration every participant computes its gradient on all of its local data at its own model; first-layer
gradients (weight and bias: both are w^(1)) are summed within the feature group l_j = {(1, j), ..., (rows, j)},
every other layer across all participants (lines 23-29), by the secure sum; every participant steps its own model
with alpha_k times the sums (lines 30-37).

Two readings of Algorithm 2 (`vertical`: "vfl", the default, and "literal"; they coincide when cols = 1), with the
extra wire the vfl reading puts in the open, are described in protocols/cgd_vertical.py.

Why it is cheap: every participant steps with the same public sums, so w^l_k = w^l_1 + O_k with one offset O_k per
group, shared by all. The first layer's pre-activation splits into X_l w^l_1 (fixed: computed once) plus X_l O_k
(one matmul over all samples, as in centralized training); only the small upper layers are held per participant.
In the vfl reading the cols partials of a sample are then summed (one more pass over the (cols, n, H_1) partials).
Local training (no sharing) uses the same trick per participant: its own offset lies in the row space of its data,
O_l = X_l^T C_l, so it costs O(samples^2) per participant instead of O(samples x features); where a participant
holds fewer features than samples (vertical partitions) the offset itself is kept instead, which is cheaper.
Local training has one reading: nothing is shared, so each participant learns from its own feature block.
`reference_train` (protocols/cgd_reference.py) is Algorithms 1 and 2 written out participant by participant (a plain
loop with autograd): the engine is tested equal to it.

Secure sum. "protocol": each participant's gradient (and, in the vfl reading, its partial pre-activation, with
`preact_frac_bits` = 16 fractional bits: pre-activations need the range) is encoded in fixed point
(gleak.mechanics.secret_sharing, Z_2^32, `frac_bits`), the encodings are summed exactly and decoded:
bit for bit what the share protocol reconstructs (tested), with the encoding-overflow check; it materialises every
participant's gradient. "float": the plain floating-point sum (one matmul per layer), which ignores the protocol's
rounding (at most m * 2^-(frac_bits+1) per entry).

Gradient scale. "data" (default): participant l sums its per-sample gradients and divides by the number of
(sample, participant) pairs entering that sum (n for first-layer group sums, n x cols for the other layers), so that
with identical models the secure sum is the full-batch gradient of the whole data set, as the proof of Claim 1
uses it; then CGD, local and centralized training share one step size. In the vfl reading a sample's summed
pre-activation carries the first-layer biases of its cols participants, so their bias gradients are divided by cols
as well (with identical models the block's effective bias, the sum of the cols biases, then steps by the full-batch
gradient). "local": equation 5 literally, each participant's mean gradient over its own samples; the sum is then m
times larger (for equal horizontal blocks the same as "data" with alpha / m).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from gleak.contracts.plugin import check_choice
from gleak.contracts.seeds import derive_seed
from gleak.mechanics.allocator import retain_freed_memory
from gleak.mechanics.secret_sharing import FixedPoint


@dataclass(frozen=True)
class Partition:
    """m = rows x cols participants: `rows` sample blocks (horizontal) times `cols` feature blocks (vertical)."""

    rows: int
    cols: int = 1

    @staticmethod
    def parse(text: str) -> "Partition":
        parts = str(text).lower().replace(" ", "").split("x")
        try:
            rows, cols = (int(parts[0]), int(parts[1])) if len(parts) == 2 else (int(parts[0]), 1)
        except ValueError:
            raise ValueError(f"partition must look like '10x7' (sample blocks x feature blocks), got {text!r}") from None
        if rows < 1 or cols < 1 or len(parts) > 2:
            raise ValueError(f"partition must look like '10x7' with both numbers >= 1, got {text!r}")
        return Partition(rows, cols)

    @property
    def m(self) -> int:
        return self.rows * self.cols

    def __str__(self) -> str:
        return f"{self.rows}x{self.cols}"


def step_size(k: int, alpha: float, mu: float = 0.0, total: int = 1, normalize: bool = False) -> float:
    """alpha_k for iteration k = 1, 2, ...

    mu = 0: the fixed alpha of the paper's experiments (section 7.1: "mu = 0, leading to a fixed learning rate"; the
    formula itself would give alpha / k^2 there). mu > 0: Theorem 1's alpha / (k + mu T)^2; with `normalize` that
    schedule rescaled so that alpha_1 = alpha (section 7.2.2 continues "with alpha_1 = alpha")."""
    if k < 1:
        raise ValueError(f"iterations count from 1, got {k}")
    if mu == 0:
        return alpha
    a = alpha / (k + mu * total) ** 2
    return a * (1 + mu * total) ** 2 if normalize else a


def blocks(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges splitting n items into `parts` blocks whose sizes differ by at most one."""
    if parts > n:
        raise ValueError(f"cannot split {n} items into {parts} non-empty blocks")
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


@dataclass
class Layout:
    """The participants' local data, zero padded to common sizes. Participant l = j * rows + i holds sample block i
    and feature block j (group-major, so a feature group is a contiguous range of participants)."""

    partition: Partition
    x: Tensor  # (m, s, d): local samples (rows of block i) restricted to feature block j, zero padded
    y: Tensor  # (m, s)
    mask: Tensor  # (m, s): 1 for real samples, 0 for padding
    features: list[Tensor]  # feature indices of group j
    n: int  # training samples in all

    @property
    def counts(self) -> Tensor:
        return self.mask.sum(1)


def make_layout(x: Tensor, y: Tensor, partition: Partition) -> Layout:
    """Split (n, D) samples into sample blocks (in the given order) and contiguous feature blocks."""
    n, d_all = x.shape
    rows, cols = partition.rows, partition.cols
    sb, fb = blocks(n, rows), blocks(d_all, cols)
    s, d = max(hi - lo for lo, hi in sb), max(hi - lo for lo, hi in fb)
    xs = torch.zeros(cols, rows, s, d, dtype=x.dtype)
    ys = torch.zeros(cols, rows, s, dtype=torch.long)
    mask = torch.zeros(cols, rows, s, dtype=x.dtype)
    for j, (flo, fhi) in enumerate(fb):
        for i, (lo, hi) in enumerate(sb):
            xs[j, i, : hi - lo, : fhi - flo] = x[lo:hi, flo:fhi]
            ys[j, i, : hi - lo] = y[lo:hi]
            mask[j, i, : hi - lo] = 1
    m = partition.m
    return Layout(partition, xs.view(m, s, d), ys.view(m, s), mask.view(m, s), [torch.arange(lo, hi) for lo, hi in fb], n)


def init_deltas(m: int, delta: float, delta_high: float | None, seed: int) -> Tensor:
    """delta^l of every participant: one delta for all, or each drawn uniformly from [delta, delta_high]."""
    if delta_high is None:
        return torch.full((m,), float(delta), dtype=torch.float64)
    g = torch.Generator().manual_seed(derive_seed(seed, "cgd/deltas"))
    return delta + (delta_high - delta) * torch.rand(m, generator=g, dtype=torch.float64)


InitLaw = Literal["interval", "gaussian"]
INIT_LAWS = ("interval", "gaussian")


def init_unit(shape: tuple[int, ...] | torch.Size, generator: torch.Generator, law: InitLaw = "interval") -> Tensor:
    """Draws of Rand^l, the unit init law that delta^l scales (equation 11), in float64.

    The paper is ambiguous here. Section 4 says the weights are drawn from a Gaussian of mean 0 and variance 1 with
    delta^l controlling "the interval range of initial weights, i.e., w_1^l ~ N[-delta^l, delta^l]"; equation 11
    writes w_1^l = delta^l Rand^l with Rand the standard Gaussian. "interval" (default) reads N[-delta, delta] as the
    Gaussian restricted to that interval: N(0, 1) truncated to [-1, 1] (std 0.54), so every initial weight lies in
    [-delta, delta]. It is the default because it comes closer to the paper's results: on Fashion-MNIST (results/cgd,
    seeds 0-2, delta 0.1) the worst (10x1) model is 3.70 points below centralized and (10x7) 2.67 below (10x1), against
    4.89 and 3.47 with "gaussian" (benchmarks/cgd_init_law.py trains both). "gaussian": N(0, 1) untruncated (std 1),
    what every CGD run stored before this option existed computed."""
    check_choice("init_law", law, INIT_LAWS)
    if law == "gaussian":
        return torch.randn(tuple(shape), generator=generator, dtype=torch.float64)
    out = torch.empty(tuple(shape), dtype=torch.float64)
    return torch.nn.init.trunc_normal_(out, 0.0, 1.0, -1.0, 1.0, generator=generator)


def participant_init(
    l: int, d_j: int, d_pad: int, sizes: list[int], delta: float, seed: int, dtype, law: InitLaw = "interval",
) -> list[Tensor]:  # fmt: skip
    """Participant l's initial model: [W1 (d_pad, H1), b1, W2, b2, ...], every entry delta * Rand (init_unit's law)
    from its own generator (padded feature rows are zero: they never meet a non-zero input)."""
    g = torch.Generator().manual_seed(derive_seed(seed, f"cgd/participant/{l}"))
    out = []
    ins = [d_j] + sizes[1:-1]
    for r, (fan_in, fan_out) in enumerate(zip(ins, sizes[1:])):
        w = init_unit((fan_in, fan_out), g, law) * delta
        if r == 0 and d_pad > d_j:
            w = torch.cat([w, torch.zeros(d_pad - d_j, fan_out, dtype=w.dtype)])
        out += [w.to(dtype), (init_unit((fan_out,), g, law) * delta).to(dtype)]
    return out


@dataclass
class TrainResult:
    accuracy: float  # worst over the evaluated participants (the paper reports the worst confined model)
    mean_accuracy: float
    best_accuracy: float
    loss: float  # validation loss of the worst participant
    mean_loss: float
    evaluated: int  # participants evaluated
    participants: int
    seconds: float
    seconds_per_iteration: float
    iterations: int
    history: list[tuple[int, float]] = field(default_factory=list)  # (iteration, worst accuracy) when asked

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


Vertical = Literal["vfl", "literal"]
VERTICAL_READINGS = ("vfl", "literal")
# Fractional bits of the pre-activation wire (vfl reading): pre-activations reach tens where gradients stay below
# one, so they get 8 bits less resolution (2^-16) and 2^8 times more range than the gradients' default 24.
PREACT_FRAC_BITS = 16


class ConfinedMLP:
    """The state of m participants' confined MLPs during CGD (or local) training; see the module docstring.

    mode "cgd": offsets shared (first layer per feature group), updated by the secure sums.
    mode "local": every participant steps with its own gradient only (the paper's local-training baseline).
    vertical: the reading of Algorithm 2 for cols > 1, "vfl" (default) or "literal" (mode "cgd" only).
    """

    def __init__(
        self, layout: Layout, sizes: list[int], deltas: Tensor, seed: int, *,
        mode: Literal["cgd", "local"] = "cgd", grad_scale: Literal["data", "local"] = "data",
        secure_sum: Literal["protocol", "float"] = "protocol", frac_bits: int = 24, dtype=torch.float32,
        vertical: Vertical = "vfl", preact_frac_bits: int = PREACT_FRAC_BITS, init_law: InitLaw = "interval",
    ):  # fmt: skip
        check_choice("vertical", vertical, VERTICAL_READINGS)
        check_choice("init_law", init_law, INIT_LAWS)
        self.init_law = init_law
        retain_freed_memory()  # every iteration allocates (m, s, H_1) temporaries: reuse them, do not re-fault them
        self.layout, self.sizes, self.deltas, self.seed = layout, list(sizes), deltas, seed
        self.mode, self.secure_sum, self.dtype, self.vertical = mode, secure_sum, dtype, vertical
        self.fp = FixedPoint(frac_bits)
        self.fp_preact = FixedPoint(preact_frac_bits)
        p = layout.partition
        m, s, d = layout.x.shape
        self.m, self.s, self.d = m, s, d
        self.group = torch.arange(m) // p.rows  # feature group j of participant l
        self.block = torch.arange(m) % p.rows  # sample block i of participant l
        # The pre-activation exchange exists only where there is more than one feature group to combine.
        self.vfl = mode == "cgd" and vertical == "vfl" and p.cols > 1
        h1 = sizes[1]
        x = layout.x.to(dtype)
        self.x = x
        self._loss_weights(mode, grad_scale)
        self._draw_initial_models(h1)
        self._zero_offsets(mode, h1)
        self.iteration = 0

    def _loss_weights(self, mode: str, grad_scale: str) -> None:
        """Per-sample weights of the loss: rows of the first-layer sums; upper layers get an extra 1/cols ("data")."""
        layout, dtype, p = self.layout, self.dtype, self.layout.partition
        counts = layout.counts.clamp_min(1).to(dtype)
        if mode == "local" or grad_scale == "local":
            self.w = layout.mask.to(dtype) / counts.unsqueeze(1)
            self.upper_scale = 1.0
            self.bias_scale = 1.0
        else:
            self.w = layout.mask.to(dtype) / layout.n
            self.upper_scale = 1.0 / p.cols
            self.bias_scale = 1.0 / p.cols if self.vfl else 1.0  # a summed pre-activation carries cols biases

    def _draw_initial_models(self, h1: int) -> None:
        """Fixed part of the first layer: X_l w^l_1 + b^l_1, and the participants' initial upper layers."""
        m, s, x, dtype, sizes = self.m, self.s, self.x, self.dtype, self.sizes
        self.z0 = torch.empty(m, s, h1, dtype=dtype)
        n_upper = len(sizes) - 2
        self.upper_w = [torch.empty(m, sizes[r + 1], sizes[r + 2], dtype=dtype) for r in range(n_upper)]
        self.upper_b = [torch.empty(m, sizes[r + 2], dtype=dtype) for r in range(n_upper)]
        for l in range(m):
            params = self._init(l)
            self.z0[l] = x[l] @ params[0] + params[1]
            for r in range(n_upper):
                self.upper_w[r][l], self.upper_b[r][l] = params[2 + 2 * r], params[3 + 2 * r]

    def _zero_offsets(self, mode: str, h1: int) -> None:
        """The offsets every step adds to: shared ones (cgd), or each participant's own (local training)."""
        m, s, d, x, dtype, p = self.m, self.s, self.d, self.x, self.dtype, self.layout.partition
        # Local training keeps its own first-layer offset O_l directly where that is cheaper than O_l = X_l^T C_l
        # (the direct form costs 2 s d per unit and iteration, the row-space form s^2).
        self.direct = mode == "local" and 2 * d < s
        if mode == "cgd":
            # Shared offsets: first layer per feature group, upper layers for everyone.
            self.off1 = torch.zeros(p.cols, d, h1, dtype=dtype)
            self.offb1 = torch.zeros(p.cols, h1, dtype=dtype)
            self.off_w = [torch.zeros(w.shape[1:], dtype=dtype) for w in self.upper_w]
            self.off_b = [torch.zeros(b.shape[1:], dtype=dtype) for b in self.upper_b]
            self.xg = x.view(p.cols, p.rows * s, d)  # all samples of a feature group
        elif self.direct:
            self.off1 = torch.zeros(m, d, h1, dtype=dtype)
            self.offb1 = torch.zeros(m, h1, dtype=dtype)
        else:
            self.coef = torch.zeros(m, s, h1, dtype=dtype)  # O_l = X_l^T C_l
            self.offb1 = torch.zeros(m, h1, dtype=dtype)
            self.gram = torch.bmm(x, x.transpose(1, 2))  # (m, s, s)

    def _init(self, l: int) -> list[Tensor]:
        j = int(self.group[l])
        d_j = len(self.layout.features[j])
        return participant_init(l, d_j, self.d, self.sizes, float(self.deltas[l]), self.seed, self.dtype, self.init_law)

    # -- one iteration -------------------------------------------------------------------------------------------
    def _upper(self, r: int) -> tuple[Tensor, Tensor]:
        """Layer r + 2's weights and biases of every participant, (m, in, out) and (m, out)."""
        if self.mode == "cgd":
            return self.upper_w[r] + self.off_w[r], self.upper_b[r] + self.off_b[r]
        return self.upper_w[r], self.upper_b[r]

    def partial_preactivations(self) -> Tensor:
        """Every participant's first-layer pre-activation of its local samples on its own features, (m, s, H_1):
        what it puts on the pre-activation wire in the vfl reading."""
        if self.mode == "cgd":
            z = torch.baddbmm(self.offb1.unsqueeze(1), self.xg, self.off1)  # (cols, rows * s, h1)
            return z.view(self.m, self.s, -1).add_(self.z0)
        if self.direct:
            return torch.baddbmm(self.offb1.unsqueeze(1), self.x, self.off1).add_(self.z0)
        return torch.baddbmm(self.offb1.unsqueeze(1), self.gram, self.coef).add_(self.z0)

    def summed_preactivations(self, partials: Tensor) -> Tensor:
        """The secure sum of each sample block's cols partial pre-activations, (rows, s, H_1)."""
        p = self.layout.partition
        zc = partials.view(p.cols, p.rows, self.s, -1)
        if self.secure_sum == "float":
            return zc.sum(0)
        return (self.fp_preact.to_integers(zc, p.cols).sum(0) / self.fp_preact.scale).to(self.dtype)

    def _first_pre(self) -> Tensor:
        """The first-layer pre-activations the upper layers continue from: (m, s, H_1), one per participant; in the
        vfl reading (rows, s, H_1), one per sample block, shared by the block's cols participants."""
        z = self.partial_preactivations()
        return self.summed_preactivations(z) if self.vfl else z

    # In the vfl reading the first hidden activation is one per sample block, (rows, s, k), and the participants
    # (j, i), j = 0..cols-1, continue from block i's. These two lay the participants' per-layer tensors (m, ..., n)
    # out block by block, (rows, ..., cols * n), so that one bmm serves a whole block (no (m, s, H_1) copy).
    def _by_block(self, t: Tensor) -> Tensor:
        p = self.layout.partition
        return t.view(p.cols, p.rows, t.shape[1], -1).permute(1, 2, 0, 3).reshape(p.rows, t.shape[1], -1)

    def _by_participant(self, t: Tensor, n: int) -> Tensor:
        p = self.layout.partition
        return t.view(p.rows, t.shape[1], p.cols, n).permute(2, 0, 1, 3).reshape(self.m, t.shape[1], n)

    def _forward(self, a: Tensor, w: Tensor, b: Tensor) -> Tensor:
        """Every participant's a_l @ W_l + b_l, (m, s, n); a is (rows, s, k) per sample block where a.shape[0] is
        not m (vfl first layer)."""
        if a.shape[0] == self.m:
            return torch.baddbmm(b.unsqueeze(1), a, w)
        n = w.shape[-1]
        return self._by_participant(torch.bmm(a, self._by_block(w)), n).add_(b.unsqueeze(1))

    def gradients(self) -> tuple[Tensor, list[Tensor], list[Tensor], float]:
        """Every participant's backward pass. Returns dZ1 (m, s, h1) (first-layer gradients are X_l^T dZ1_l and
        the column sums), the upper layers' input activations and dZ per layer, and the mean training loss. The
        first upper layer's input activation is per sample block in the vfl reading (see _first_pre)."""
        acts = [torch.relu_(self._first_pre())]  # in place: the pre-activation itself is not needed again
        weights = [self._upper(r) for r in range(len(self.upper_w))]
        for r, (w, b) in enumerate(weights):
            z = self._forward(acts[-1], w, b)
            acts.append(torch.relu_(z) if r < len(weights) - 1 else z)
        logp = F.log_softmax(acts.pop(), -1)
        y = self.layout.y.unsqueeze(-1)
        loss = float(-(logp.gather(-1, y).squeeze(-1) * self.layout.mask).sum() / self.layout.mask.sum())
        dz = logp.exp_()
        dz.scatter_add_(-1, y, -torch.ones_like(dz[..., :1]))
        dz.mul_(self.w.unsqueeze(-1))
        dzs = [dz]
        for r in range(len(weights) - 1, -1, -1):
            da = torch.bmm(dzs[0], weights[r][0].transpose(1, 2))
            a = acts[r]
            if a.shape[0] != self.m:  # a block's activation, broadcast over its cols participants
                a = a.unsqueeze(0)
                da = da.view(-1, *a.shape[1:])
            # ReLU': a > 0 exactly where z > 0; written into da (the fused form of masked_fill(a <= 0, 0)).
            torch.ops.aten.threshold_backward.grad_input(da, a, 0, grad_input=da)
            dzs.insert(0, da.view(self.m, self.s, -1))
        return dzs[0], dzs[1:], acts, loss

    def _sum_upper(self, acts: list[Tensor], dzs: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        sw, sb = [], []
        for r, dz in enumerate(dzs):
            a = acts[r]
            per_block = a.shape[0] != self.m
            if self.secure_sum == "float" and per_block:
                # sum_l a_block(l)^T dz_l = sum_i a_i^T (the sum of dz over block i's participants), computed as
                # (dz^T a)^T: a^T dz with a tall a is an order of magnitude slower in this BLAS.
                dzb = dz.view(self.layout.partition.cols, -1, dz.shape[-1]).sum(0)
                sw.append((dzb.T @ a.reshape(-1, a.shape[-1])).T * self.upper_scale)
                sb.append(dzb.sum(0) * self.upper_scale)
            elif self.secure_sum == "float":
                sw.append(a.reshape(-1, a.shape[-1]).T @ dz.reshape(-1, dz.shape[-1]) * self.upper_scale)
                sb.append(dz.sum((0, 1)) * self.upper_scale)
            else:
                if per_block:
                    n = dz.shape[-1]
                    gw = self._by_participant(torch.bmm(a.transpose(1, 2), self._by_block(dz)), n) * self.upper_scale
                else:
                    gw = torch.bmm(a.transpose(1, 2), dz) * self.upper_scale
                gb = dz.sum(1) * self.upper_scale
                sw.append(self._encoded_sum(gw, self.m).to(self.dtype))
                sb.append(self._encoded_sum(gb, self.m).to(self.dtype))
        return sw, sb

    def _encoded_sum(self, g: Tensor, addends: int) -> Tensor:
        """Decode(sum of the fixed-point encodings) over the leading (participant) axis; float64."""
        return self.fp.to_integers(g, addends).sum(0) / self.fp.scale

    def _sum_first(self, dz1: Tensor) -> tuple[Tensor, Tensor]:
        """First-layer sums within each feature group: (cols, d, h1) and (cols, h1)."""
        p = self.layout.partition
        if self.secure_sum == "float":
            dzg = dz1.view(p.cols, p.rows * self.s, -1)
            return torch.bmm(self.xg.transpose(1, 2), dzg), dzg.sum(1) * self.bias_scale
        acc_w = torch.zeros(p.cols, self.d, dz1.shape[-1], dtype=torch.float64)
        acc_b = torch.zeros(p.cols, dz1.shape[-1], dtype=torch.float64)
        chunk = max(1, (1 << 23) // (self.d * dz1.shape[-1]))
        for lo in range(0, self.m, chunk):
            hi = min(self.m, lo + chunk)
            g = torch.bmm(self.x[lo:hi].transpose(1, 2), dz1[lo:hi])
            gb = dz1[lo:hi].sum(1) * self.bias_scale
            acc_w.index_add_(0, self.group[lo:hi], self.fp.to_integers(g, p.rows))
            acc_b.index_add_(0, self.group[lo:hi], self.fp.to_integers(gb, p.rows))
        return (acc_w / self.fp.scale).to(self.dtype), (acc_b / self.fp.scale).to(self.dtype)

    def secure_sums(self) -> tuple[float, tuple[Tensor, Tensor], tuple[list[Tensor], list[Tensor]]]:
        """One iteration's gradient computation and secure sums (mode "cgd"), without the step: (mean training
        loss, (first-layer weight sums (cols, d, h1), bias sums (cols, h1)), (upper weight sums, upper bias sums)).
        The step is w^l_{k+1} = w^l_k - alpha_k times these (the first-layer sums of participant l's group)."""
        dz1, dzs, acts, loss = self.gradients()
        first = self._sum_first(dz1) if self.m > 1 or self.secure_sum == "float" else self._plain_first(dz1)
        upper = self._sum_upper(acts, dzs) if self.m > 1 else self._plain_upper(acts, dzs)
        return loss, first, upper

    def step(self, alpha_k: float) -> float:
        """One iteration at step size alpha_k; returns the mean training loss before the step."""
        if self.mode == "cgd":
            loss, (s1, sb1), (sw, sb) = self.secure_sums()
            self.off1 -= alpha_k * s1
            self.offb1 -= alpha_k * sb1
            for r in range(len(sw)):
                self.off_w[r] -= alpha_k * sw[r]
                self.off_b[r] -= alpha_k * sb[r]
        else:
            dz1, dzs, acts, loss = self.gradients()
            if self.direct:
                self.off1 -= alpha_k * torch.bmm(self.x.transpose(1, 2), dz1)
            else:
                self.coef -= alpha_k * dz1
            self.offb1 -= alpha_k * dz1.sum(1)
            for r, dz in enumerate(dzs):
                self.upper_w[r] -= alpha_k * torch.bmm(acts[r].transpose(1, 2), dz)
                self.upper_b[r] -= alpha_k * dz.sum(1)
        self.iteration += 1
        return loss

    def _plain_first(self, dz1: Tensor) -> tuple[Tensor, Tensor]:
        # One participant (centralized training): nothing to share, so no encoding.
        return torch.bmm(self.xg.transpose(1, 2), dz1.view(1, self.s, -1)), dz1.sum(1)

    def _plain_upper(self, acts: list[Tensor], dzs: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        return [(acts[r][0].T @ dz[0]) * self.upper_scale for r, dz in enumerate(dzs)], [dz[0].sum(0) * self.upper_scale for dz in dzs]

    # -- evaluation ----------------------------------------------------------------------------------------------
    def _own_first(self, l: int) -> tuple[Tensor, Tensor]:
        """Participant l's own first layer (d_j, h1) and (h1,) (feature padding removed)."""
        j = int(self.group[l])
        d_j = len(self.layout.features[j])
        w1, b1 = participant_init(l, d_j, self.d, self.sizes[:2], float(self.deltas[l]), self.seed, self.dtype,
                                  self.init_law)  # fmt: skip
        if self.mode == "cgd":
            w1, b1 = w1 + self.off1[j], b1 + self.offb1[j]
        elif self.direct:
            w1, b1 = w1 + self.off1[l], b1 + self.offb1[l]
        else:
            w1, b1 = w1 + self.x[l].T @ self.coef[l], b1 + self.offb1[l]
        return w1[:d_j], b1

    def _own_upper(self, l: int) -> list[Tensor]:
        out = []
        for r in range(len(self.upper_w)):
            w, b = self.upper_w[r][l], self.upper_b[r][l]
            out += [w + self.off_w[r], b + self.off_b[r]] if self.mode == "cgd" else [w, b]
        return out

    def participant_params(self, l: int) -> list[Tensor]:
        """Participant l's current confined model [W1 (d_j, h1), b1, W2, b2, ...] (feature padding removed)."""
        return [*self._own_first(l), *self._own_upper(l)]

    def model_features(self, l: int) -> Tensor:
        """The feature indices participant l's model predicts from: all of them in the vfl reading, else its own."""
        if self.vfl:
            return torch.arange(sum(len(f) for f in self.layout.features))
        return self.layout.features[int(self.group[l])]

    def first_layer(self, l: int) -> tuple[Tensor, Tensor]:
        """The first layer participant l's model predicts with, (len(model_features(l)), h1) and (h1,): its own in
        the literal reading; in the vfl reading its sample block's cols first layers side by side (feature blocks
        are contiguous and in order), their biases summed."""
        if not self.vfl:
            return self._own_first(l)
        p, i = self.layout.partition, int(self.block[l])
        parts = [self._own_first(j * p.rows + i) for j in range(p.cols)]
        return torch.cat([w for w, _ in parts]), torch.stack([b for _, b in parts]).sum(0)

    def model_params(self, l: int) -> list[Tensor]:
        """The model participant l predicts with (and is evaluated as): [W1, b1, W2, b2, ...] on model_features(l)."""
        w1, b1 = self.first_layer(l)
        return [w1, b1, *self._own_upper(l)]

    def public_first_offset(self) -> tuple[Tensor, Tensor]:
        """(D, H_1) and (H_1,): the first layer's shared offset on all features (the feature groups' offsets stacked,
        padding removed) and the sum of the groups' bias offsets. Public: it is minus the sum of alpha_k times the
        revealed group sums, which the aggregator reconstructs every iteration (mode "cgd")."""
        w = torch.cat([self.off1[j, : len(f)] for j, f in enumerate(self.layout.features)])
        return w, self.offb1.sum(0)

    def evaluate(self, x_test: Tensor, y_test: Tensor, participants: Tensor) -> tuple[Tensor, Tensor]:
        """Test accuracy and loss of each listed participant's model (model_params) on its features of the test set
        (all of them in the vfl reading: a sample block's hidden layer is computed once for its participants)."""
        who = participants.tolist()
        # Participants of one sample block share their vfl first layer: evaluate them together, one block at a time.
        order = sorted(range(len(who)), key=lambda k: (int(self.block[who[k]]), who[k])) if self.vfl else range(len(who))
        accs, losses = torch.empty(len(who)), torch.empty(len(who))
        key, h1 = None, None
        for k in order:
            l = who[k]
            if key is None or not self.vfl or int(self.block[l]) != key:
                key = int(self.block[l])
                w1, b1 = self.first_layer(l)
                h1 = torch.relu(x_test[:, self.model_features(l)].to(self.dtype) @ w1 + b1)
            h = h1
            params = self._own_upper(l)
            for r in range(0, len(params), 2):
                h = h @ params[r] + params[r + 1]
                if r < len(params) - 2:
                    h = torch.relu(h)
            accs[k] = float((h.argmax(1) == y_test).double().mean())
            losses[k] = float(F.cross_entropy(h, y_test))
        return accs, losses


def train(
    x: Tensor, y: Tensor, x_test: Tensor, y_test: Tensor, *, partition: Partition, sizes: list[int], iterations: int,
    alpha: float, mu: float = 0.0, normalize_schedule: bool = False, delta: float = 0.1, delta_high: float | None = None,
    mode: Literal["cgd", "local"] = "cgd", grad_scale: Literal["data", "local"] = "data",
    secure_sum: Literal["protocol", "float"] = "protocol", frac_bits: int = 24, eval_participants: int = 100,
    eval_every: int = 0, seed: int = 0, progress: bool = False, vertical: Vertical = "vfl",
    preact_frac_bits: int = PREACT_FRAC_BITS, init_law: InitLaw = "interval",
) -> TrainResult:  # fmt: skip
    """Train m confined models (or m local ones) on (x, y) (flattened, normalised) and evaluate on the test set.

    vertical: the reading of Algorithm 2 for cols > 1 ("vfl", the default, or "literal"; see the module docstring).
    Evaluated: every participant when m <= eval_participants, else that many drawn at random (seeded); the result's
    accuracy is the worst of them, as the paper reports the worst confined model."""
    t0 = time.perf_counter()
    layout = make_layout(x, y, partition)
    deltas = init_deltas(partition.m, delta, delta_high, seed)
    net = ConfinedMLP(layout, sizes, deltas, seed, mode=mode, grad_scale=grad_scale, secure_sum=secure_sum,
                      frac_bits=frac_bits, vertical=vertical, preact_frac_bits=preact_frac_bits,
                      init_law=init_law)  # fmt: skip
    if partition.m <= eval_participants:
        who = torch.arange(partition.m)
    else:
        g = torch.Generator().manual_seed(derive_seed(seed, "cgd/evaluated"))
        who = torch.randperm(partition.m, generator=g)[:eval_participants].sort().values
    history = []
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=iterations, desc=f"{mode} {partition}", file=sys.stderr, leave=False, dynamic_ncols=True)
    t_iter = time.perf_counter()
    for k in range(1, iterations + 1):
        loss = net.step(step_size(k, alpha, mu, iterations, normalize_schedule))
        if not math.isfinite(loss):
            raise FloatingPointError(f"training diverged at iteration {k} (loss {loss}); lower alpha")
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if eval_every and (k % eval_every == 0 or k == iterations):
            history.append((k, float(net.evaluate(x_test, y_test, who[:1])[0].min())))
    per_iter = (time.perf_counter() - t_iter) / max(1, iterations)
    if bar is not None:
        bar.close()
    accs, losses = net.evaluate(x_test, y_test, who)
    worst = int(accs.argmin())
    return TrainResult(
        accuracy=float(accs[worst]), mean_accuracy=float(accs.mean()), best_accuracy=float(accs.max()),
        loss=float(losses[worst]), mean_loss=float(losses.mean()), evaluated=len(who), participants=partition.m,
        seconds=time.perf_counter() - t0, seconds_per_iteration=per_iter, iterations=iterations, history=history,
    )  # fmt: skip
