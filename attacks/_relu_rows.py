"""What the attacks on a first linear layer's rows share (subspace-demix, SPEAR).

For z = W x + b followed by ReLU, the augmented gradient rows [dW | db] of a batch are r_i = sum_s dz_{s,i} [x_s, 1]:
they lie in the span of the samples, and sample s contributes nothing to the rows of the units it leaves inactive.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.wire import Observation
from gleak.mechanics.models import first_linear


def input_layer(observation: Observation, attack: str) -> tuple[str, nn.Linear]:
    """The parameter-name prefix and module of the observed model's first linear layer, which must have a bias and
    read the raw input; UnsupportedCase (one line naming the attack) otherwise."""
    model = observation.model
    found = first_linear(model) if model is not None else None
    if found is None or found[1].bias is None:
        raise UnsupportedCase(f"{attack} needs a model whose first trainable layer is nn.Linear with bias")
    name, layer = found
    if layer.in_features != torch.Size(observation.knowledge.input_shape).numel():
        raise UnsupportedCase(f"first linear layer {name!r} does not read the raw input")
    return (f"{name}." if name else ""), layer


def span_coordinates(r: Tensor, vh: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows r (m, d + 1) in the basis of their top `dim` right singular vectors (vh from their SVD): the
    coordinates y (m, dim), the basis v (dim, d + 1) and each row's noise along one direction of the span, its part
    outside the span (rounding in the protocol and in float arithmetic) divided by sqrt(remaining dimensions)."""
    v = vh[:dim]
    y = r @ v.T
    noise = (r - y @ v).norm(dim=1) / max(1, r.shape[1] - dim) ** 0.5
    return y, v, noise


def unit_bias(cand: Tensor) -> Tensor:
    """Rows [x, c] scaled to [x / c, 1]; rows whose last coordinate vanishes are dropped."""
    if cand.numel() == 0:
        return cand
    last = cand[:, -1:]
    ok = last.abs().squeeze(1) > 1e-12 * cand.abs().amax(1)
    return cand[ok] / last[ok]


class one_thread:
    """Torch on one thread inside the block: batched eigh and SVD of small matrices are slow with several."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)
