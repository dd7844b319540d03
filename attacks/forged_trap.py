"""Trap weights planted through a forged aggregate: where the server cannot choose the model its clients compute
at, an aggregator that returns a sum of its choosing still moves every client's model (ours, built on the trap of
Boenisch, Dziedzic, Schuster, Shamsabadi, Shumailov, Papernot, EuroS&P 2023)."""
from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from gleak.attacks.trap_weights import TrapWeights
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Knowledge
from gleak.mechanics.models import first_linear


@register_attack("forged-trap")
class ForgedTrap(TrapWeights):
    """A trap-weights first layer planted by one forged aggregate, then read row by row as trap weights reads it.

    In Confined Gradient Descent (Zhang et al. 2021) every participant draws its own confined model and steps it by
    alpha_k times the sum the aggregator returns; the aggregator never sends a model, so an active attack cannot
    apply. An aggregator that returns a forged sum S* = -D / alpha_k instead moves every participant's model by D
    (gleak.mechanics.protocol.Protocol.forged_step). `forge` picks D so that the model the adversary holds (a
    colluder's confined model, or its own draw) lands on gain x the trap-weights model of its first linear layer
    (TrapWeights.prepare): the honest participants land on that plus their own confined offset (at most delta per
    weight), which a large gain makes small beside the trap. Through a protocol whose server sends one model
    (FedSGD, secure aggregation) the forged round is the server sending that model. The observed rounds follow
    honestly; `reconstruct` is trap weights' (a row that one sample alone activates gives that sample exactly).

    This lies outside the honest-but-curious adversary of CGD and of secure aggregation: it needs the capability
    "forges the aggregate" (`needs` "forged_aggregate", threat model "+forges"), which a suite grants by name.

    Parameters
    ----------
    gain: the trap's scale relative to trap weights' own (5). Larger is sharper (at 1 the confined offsets, up to
        delta = 0.1 per weight, blur the trap's firing pattern), but the upper layers' gradients grow with it and
        must stay inside CGD's fixed-point encoding (24 fractional bits: at most 8 per addend with 16
        participants), which a forged aggregate cannot widen: measured on the malicious-server case (16 participants
        of one 32x32 photograph, the MLP, no colluders, seeds 0-4), the victim came back above 40 dB on 1 of 5
        seeds at gain 1, 2 at gain 3, 4 at gain 5; gain 6 overflowed the encoding on 1 seed, 7 on 4, 100 on all 5
        (the trial then fails, named).
    scale_factor, sigma, mu, inputs, rows: trap weights' (attacks/trap_weights.py).
    Not a published attack: our construction of the forged-aggregate threat for protocols that confine the models.
    """

    active = False  # the server sends no model: it forges the aggregate (forge), not the model (prepare)

    def __init__(self, gain: float = 5.0, scale_factor: float = 0.95, sigma: float = 0.5, mu: float = 0.0,
                 inputs: Literal["pixels", "model"] = "pixels", rows: Literal["consistent", "closed-form"] = "consistent"):  # fmt: skip
        super().__init__(scale_factor=scale_factor, sigma=sigma, mu=mu, inputs=inputs, rows=rows)
        if not gain > 0:
            raise ValueError(f"gain must be > 0, got {gain}")
        self.gain = float(gain)
        self.needs = self.needs | {"forged_aggregate", "parameters"}  # the displacement is taken from the held model

    def forge(self, held: nn.Module | None, knowledge: Knowledge, rng: torch.Generator) -> dict[str, torch.Tensor]:
        if held is None or first_linear(held) is None:
            raise UnsupportedCase("forged-trap moves a first linear layer of the model the adversary holds")
        name, own = first_linear(held)
        _, trap = first_linear(self.prepare(held, knowledge, rng))
        with torch.no_grad():
            return {f"{name}.weight": self.gain * trap.weight - own.weight, f"{name}.bias": self.gain * trap.bias - own.bias}
