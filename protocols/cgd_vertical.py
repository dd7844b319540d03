"""CGD's vertical partitions in rounds (Algorithm 2, the vfl reading): one sample block as one client of the loop.

A sample block i of a (rows x cols) partition is cols participants (i, j), each holding feature block j of the
block's samples, its own first-layer block W^(i,j), b^(i,j) and its own upper layers (the readings
below). In gleak's round loop (gleak.mechanics.rounds.run_rounds) the block is one client: its model
is a `VerticalBlock` and its update (`block_update`) is the block's share of every secure sum, laid out as the plain
MLP's gradient:

- first-layer weight: the columns of feature block j are participant (i, j)'s own gradient x_(i,j)^T dz_(i,j), dz
  taken through its own upper layers from its own loss. Summed over blocks, column block j is the paper's sum within
  the feature group l_j; stepping the block's first layer with it steps every participant's own block.
- first-layer bias and upper layers: the sum over the block's cols participants, divided by cols (the engine's
  "data" scale: with identical models the secure sum is then the full-batch gradient). The block's first-layer bias
  is the sum of its participants' biases, which is what every prediction of the block adds.
- meta "preactivations": the extra wire of this reading, the secure sum of the cols partial pre-activations of
  every sample of the block, (s, H_1), in fixed point with PREACT_FRAC_BITS fractional bits (float with
  secure_sum = "float"), as the aggregator running that sum sees it every iteration.

Deviations, named: the upper-layer and bias gradients of a block's cols participants are summed in floating point
before the round's secure sum encodes them (one rounding to 2^-frac_bits per block instead of one per participant),
and the block keeps one first-layer bias, the sum of its participants' (all that any prediction or sum uses), so the
wire's partials carry it in the first partial rather than split among them: the fixed-point wire then rounds
differently from the engine's at 2^-17 per entry. The first-layer weight columns and every sum across blocks are
encoded as the protocol does.

`initial_blocks` draws the engine's initial models (cgd_training.participant_init), so that these rounds and the
vectorised engine (ConfinedMLP, vertical = "vfl") train the same models: tests/test_protocols.py.
`invert_preactivation_wire` is what that extra wire gives away: every sample of a block, from the aggregator's view.

The two readings of Algorithm 2 (`vertical` of the engine, protocols/cgd_training.py; they coincide when cols = 1):
- "vfl" (default): vertical federated learning. Participant (i, j) computes the partial first-layer pre-activation
  xi_(i,j) w^(1)(i,j) + b^(1)(i,j) of every sample of its block; the cols partials of a sample are summed across
  the feature groups of its sample block by the secure sum, and every participant of the block continues from that
  summed pre-activation with its own upper layers. Its first-layer gradient (on its own features, from its own
  loss) is then summed within l_j as the paper says. The model of participant (i, j) is its block's first layer on
  ALL features (the cols participants' first-layer blocks side by side, their biases summed) followed by its own
  upper layers, and that is the model evaluated, on all features of the test set. This is the reading that can give
  the paper's vertical results, which equal its horizontal ones at the same m^h (Tables 3 and 8: (10x7) 96.5% vs
  (10x1) 95.62%, although a (1000x112) participant holds 7 pixels). Privacy cost: an extra wire. Every iteration,
  the secure sum of a sample block's partial pre-activations is revealed to the block's participants (and to the
  aggregator running it): the summed first-layer pre-activation of every sample of the block, (samples x H_1) per
  block per iteration, computed at the block's confined first layer. Colluders inside a block who subtract their
  own partials learn the honest participants' summed partial pre-activations x_(honest features) w^(1)(honest) of
  each sample; an attack on a vertical partition must be given that wire (in addition to the gradient sums).
- "literal": lines 7-8 read literally: z = xi_(i,j) w^(1)(i,j), so each participant predicts from its own feature
  block alone, in training and in evaluation (each confined model is evaluated on its own features of the test
  set). Nothing crosses the wire but the gradient sums (no pre-activation exchange), but a participant holding d_j
  of D features can only reach the accuracy of a model on those features (measured: local-training level).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from gleak.protocols.cgd_training import PREACT_FRAC_BITS, blocks, init_unit, participant_init
from torch import Tensor, nn

from gleak.contracts.wire import ClientBatch, Update
from gleak.mechanics.models import create_model, first_linear
from gleak.mechanics.secret_sharing import FixedPoint


class VerticalBlock(nn.Module):
    """Sample block i: its cols participants' models. Member j is participant (i, j)'s model, the block's first layer
    (one nn.Linear on all features, shared by every member) followed by the participant's own upper layers; its
    forward is member 0's prediction (every member predicts from the same first layer)."""

    def __init__(self, members: list[nn.Sequential], features: list[tuple[int, int]]):
        super().__init__()
        found = first_linear(members[0])
        if found is None or not isinstance(members[0], nn.Sequential):
            raise ValueError("a vertical block needs Sequential members whose first trainable layer is an nn.Linear")
        self.first_name = found[0]
        for m in members[1:]:
            m._modules[self.first_name] = found[1]  # one first layer for the whole block
        self.members = nn.ModuleList(members)
        self.features = list(features)
        self._split = list(members[0]._modules).index(self.first_name) + 1

    @property
    def first(self) -> nn.Linear:
        return self.members[0]._modules[self.first_name]

    def upper(self, j: int) -> nn.Sequential:
        """Member j's layers after the first linear one (its activation included)."""
        return nn.Sequential(*list(self.members[j])[self._split:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.members[0](x)


def draw_block(
    template: nn.Sequential, features: list[tuple[int, int]], deltas: list[float], rng: torch.Generator, law: str,
) -> VerticalBlock:  # fmt: skip
    """A block of len(features) participants, each drawing its first-layer block (its own features' columns), its
    bias and its upper layers delta * Rand from `rng` (cgd_training.init_unit's `law`), in participant order
    (equation 11)."""
    members = []
    for delta in deltas:
        m = copy.deepcopy(template)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(init_unit(p.shape, rng, law).to(p.dtype) * delta)
        members.append(m)
    first_name = first_linear(template)[0]
    first = copy.deepcopy(members[0]._modules[first_name])
    with torch.no_grad():
        first.bias.zero_()
        for (lo, hi), m in zip(features, members):
            own = m._modules[first_name]
            first.weight[:, lo:hi] = own.weight[:, lo:hi]  # participant (i, j)'s block: its own features' columns
            first.bias += own.bias  # a sample's summed pre-activation carries every participant's bias
    members[0]._modules[first_name] = first
    return VerticalBlock(members, features)


def zero_block(template: nn.Sequential, features: list[tuple[int, int]]) -> VerticalBlock:
    """The init law's mean as a block (every parameter zero): the adversary's "mean" proxy."""
    members = [copy.deepcopy(template) for _ in features]
    with torch.no_grad():
        for m in members:
            for p in m.parameters():
                p.zero_()
    return VerticalBlock(members, features)


def block_update(block: VerticalBlock, batch: ClientBatch, secure_sum: str = "protocol") -> Update:
    """The block's share of the round's secure sums (see the module docstring), gradients of mean losses over the
    block's samples, with the pre-activation wire in meta["preactivations"]."""
    x = batch.x.flatten(1)
    first, cols = block.first, len(block.features)
    with torch.no_grad():
        partials = torch.stack([x[:, lo:hi] @ first.weight[:, lo:hi].T for lo, hi in block.features])
        partials[0] += first.bias  # the bias parts sum to the block's bias: where they are added does not matter
        if secure_sum == "float":
            z = partials.sum(0)
        else:
            fp = FixedPoint(PREACT_FRAC_BITS)
            z = (fp.to_integers(partials, cols).sum(0) / fp.scale).to(x.dtype)
    grad_w = torch.zeros_like(first.weight)
    grad_b = torch.zeros_like(first.bias)
    names = [n for n, _ in block.members[0].named_parameters()]  # the MLP's layout, first layer included
    upper = {n: torch.zeros_like(p) for n, p in block.members[0].named_parameters() if not n.startswith(block.first_name + ".")}
    for j, (lo, hi) in enumerate(block.features):
        own = dict(block.members[j].named_parameters())  # upper(j) computes with these very parameters
        zj = z.detach().requires_grad_(True)
        grads = torch.autograd.grad(F.cross_entropy(block.upper(j)(zj), batch.y), [zj, *[own[n] for n in upper]])
        dz = grads[0]
        grad_w[:, lo:hi] = dz.T @ x[:, lo:hi]  # its own features, its own loss
        grad_b += dz.sum(0) / cols
        for n, g in zip(upper, grads[1:]):
            upper[n] += g / cols
    tensors = {f"{block.first_name}.weight": grad_w, f"{block.first_name}.bias": grad_b, **upper}
    tensors = {n: tensors[n].detach() for n in names}  # the member's own parameter order
    return Update(tensors, "gradient", batch.size, {"preactivations": z.detach()})


def step_block(block: VerticalBlock, total: Update, a: float) -> VerticalBlock:
    """A new block, every participant stepped by a times the round's secure sums: the first layer (its own columns
    and its bias part, shared by the block) once, each member's upper layers with the upper-layer sums."""
    new = copy.deepcopy(block)
    with torch.no_grad():
        seen = set()
        for m in new.members:
            for name, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    p.sub_(a * total[name].to(p.dtype))
    return new


def initial_blocks(
    partition, deltas_of, x: torch.Tensor, y: torch.Tensor, sizes: list[int], seed: int, dtype: torch.dtype,
    law: str = "interval",
) -> tuple[list[VerticalBlock], list[ClientBatch]]:  # fmt: skip
    """The rows sample blocks of a vertical partition from the engine's initial models (participant l = j * rows + i,
    cgd_training.participant_init with its own delta from `deltas_of`, a cgd_training.init_deltas tensor) and their
    batches (cgd_training.blocks of (x, y), in order)."""
    rows, cols = partition.rows, partition.cols
    feats = blocks(x.shape[1], cols)
    template = create_model("mlp", (sizes[0],), sizes[-1], hidden=sizes[1:-1], dtype=dtype)
    linears = [i for i, mod in enumerate(template) if isinstance(mod, nn.Linear)]
    zero = torch.zeros(1)
    out, batches = [], []
    for i, (lo, hi) in enumerate(blocks(len(y), rows)):
        members = []
        for j, (flo, fhi) in enumerate(feats):
            l = j * rows + i
            params = participant_init(l, fhi - flo, fhi - flo, sizes, float(deltas_of[l]), seed, torch.float64, law)
            m = copy.deepcopy(template)
            with torch.no_grad():
                for r, idx in enumerate(linears):
                    w = params[2 * r].T.to(dtype)
                    if r == 0:  # its own features' columns; the others are the other participants'
                        full = torch.zeros(sizes[1], sizes[0], dtype=dtype)
                        full[:, flo:fhi] = w
                        w = full
                    m[idx].weight.copy_(w)
                    m[idx].bias.copy_(params[2 * r + 1].to(dtype))
            members.append(m)
        first = copy.deepcopy(members[0][linears[0]])
        with torch.no_grad():
            first.weight.copy_(sum(m[linears[0]].weight for m in members))
            first.bias.copy_(sum(m[linears[0]].bias for m in members))
        members[0]._modules[str(linears[0])] = first
        out.append(VerticalBlock(members, feats))
        batches.append(ClientBatch(x[lo:hi].to(dtype), y[lo:hi], zero, zero + 1))
    return out, batches


def invert_preactivation_wire(wire: list[Tensor], offsets: list[tuple[Tensor, Tensor]], rtol: float = 1e-10) -> Tensor:
    """What the vfl reading's extra wire gives away: every sample of a block, from the aggregator's view alone.

    wire[k]: the summed pre-activations of a block's samples at iteration k + 1, (s, H_1), as the secure sum reveals
    them; offsets[k]: the public first-layer offset at that iteration (ConfinedMLP.public_first_offset). A sample's
    summed pre-activation is z_k = x (W_1 + O_k) + b_1 + o_k with W_1, b_1 the block's confined init (secret, fixed)
    and O_k, o_k public, so z_k - z_1 = x (O_k - O_1) + (o_k - o_1): (K - 1) H_1 linear equations in the D features
    of x with known coefficients. The offsets are sums of gradients, which lie in the span of the training samples,
    and so does x: the minimum-norm least-squares solution is x itself once the offsets span it (K - 1 >= about
    D / H_1 iterations for a block of D-dimensional samples). No colluder is needed. Returns (s, D)."""
    if len(wire) < 2:
        raise ValueError("the wire of at least two iterations is needed (differences cancel the secret init)")
    w0, b0 = offsets[0]
    a = torch.cat([(w - w0) for w, _ in offsets[1:]], dim=1).to(torch.float64)  # (D, (K - 1) H_1)
    rhs = torch.cat([(z - wire[0]) - (b - b0) for z, (_, b) in zip(wire[1:], offsets[1:])], dim=1).to(torch.float64)
    return rhs @ torch.linalg.pinv(a, rtol=rtol)
