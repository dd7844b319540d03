"""Pre-activation inversion: every sample of a CGD sample block, from the vfl reading's extra wire alone.

Seed 000's Algorithm 2 read as vertical federated learning (protocols/cgd.py, vertical = "vfl") sums the partial
first-layer pre-activations of each sample across the feature groups of its sample block by the secure sum, every
iteration; the aggregator running that sum sees, for every sample x of the block, z_k = x (W_1 + O_k) + b_1 + o_k.
The block's confined init W_1, b_1 is secret but fixed, and the offsets O_k, o_k are public (minus the sum of the
step sizes times the revealed first-layer sums: every participant steps with them). Differences cancel the init:
z_k - z_1 - (o_k - o_1) = x (O_k - O_1), linear in x with known coefficients. The offsets are sums of gradients,
whose columns lie in the span of the training samples (per feature block), and so does x: the minimum-norm
least-squares solution over the observed iterations is x itself once the offsets span that space
(cgd_vertical.invert_preactivation_wire). With few training samples against H_1 units that is the second iteration.

Our attack (the paper does not discuss this wire); it needs no model, no colluder and no batch size (the wire has
one row per sample). It applies only where the observer sees the wire: CGD attack trials with split_features on a
partition with feature blocks (meta "preactivations" and "first_offset" of every observed iteration).
"""
from __future__ import annotations

import torch

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Observation, Reconstruction
from gleak.protocols.cgd_vertical import invert_preactivation_wire


@register_attack("preactivation-inversion")
class PreactivationInversion(Attack):
    """Solve the vfl reading's pre-activation wire for every sample of the victim's sample block (Confined Gradient Descent's vertical reading; ours).

    Parameters
    ----------
    rtol: singular values of the stacked offset differences below rtol times the largest are treated as zero (the
        pseudo-inverse's cut-off). Default 1e-4: directions the offsets do not span show up as singular values at
        rounding level, and inverting them amplifies the rounding; too high a cut-off drops directions the offsets
        do span. Measured on (10x7), one sample per block, t = 0, seeds 0-2, PSNR in dB (`python -m gleak run
        benchmarks/preactivation_cutoff.toml`): two observed iterations, init_law "interval": 3.9-4.5 at
        1e-8; 88.0 / 17.0 / 96.2 at 1e-6; 88.0 / 97.8 / 96.2 at 1e-4 and 1e-3; 55.6 / 97.8 / 96.2 at 1e-2; init_law
        "gaussian": 80.2 / 102.5 / 96.2 from 1e-6 to 1e-3. So 1e-4, inside both plateaus (the default was 1e-6
        before the truncated init law, whose seed 1 it misses).
    Needs nothing beyond what the observer sees: the wire and the public offsets of at least two observed
    iterations (CGD's `iterations` >= 2). With one iteration the secret init cannot be cancelled: unsupported.
    """

    needs = frozenset()
    conformance_params: dict = {}
    # A case whose observer sees the wire: CGD over 2 sample blocks of 2 feature blocks each, 2 observed iterations.
    conformance_protocol = ("cgd", {"partition": "2x2", "split_features": True, "iterations": 2})

    def __init__(self, rtol: float = 1e-4):
        if not 0 < rtol < 1:
            raise ValueError(f"rtol must be in (0, 1), got {rtol}")
        self.rtol = rtol

    @classmethod
    def estimated_cost(cls, params, case) -> float:
        return 1.0  # one pseudo-inverse

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        seen = [*observation.rounds, observation]
        metas = [o.update.meta for o in seen]
        if any("preactivations" not in m or "first_offset" not in m for m in metas):
            raise UnsupportedCase("no pre-activation wire in the observed rounds: only CGD's vfl reading on a "
                                  "partition with feature blocks (split_features) puts one there")  # fmt: skip
        if len(seen) < 2:
            raise UnsupportedCase("the wire of at least two observed iterations is needed (CGD iterations >= 2)")
        wire = [m["preactivations"] for m in metas]
        offsets = [(m["first_offset"][0].T, m["first_offset"][1]) for m in metas]  # nn.Linear's (out, in) -> (D, H_1)
        x = invert_preactivation_wire(wire, offsets, rtol=self.rtol)
        shape = observation.knowledge.input_shape
        dtype = wire[-1].dtype
        return Reconstruction(x.reshape(-1, *shape).to(dtype), None, {"iterations_used": len(seen)})
