"""Model inconsistency: a malicious server that sends the target its real model and every other client one whose
gradient is zero, so that a secure sum carries the target's gradient alone (Pasquini, Francati, Ateniese, CCS 2022,
"Eluding Secure Aggregation in Federated Learning via Model Inconsistency"), then a passive attack on that sum."""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, check_choice
from gleak.contracts.registry import create, register_attack
from gleak.contracts.wire import Knowledge, Observation, Reconstruction


def parametrised_layers(model: nn.Module) -> list[nn.Module]:
    """The modules that hold trainable parameters of their own, in model order (the layers a gradient has)."""
    return [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


def suppressed(model: nn.Module, layers: int | None) -> nn.Module:
    """A copy of `model` with every parameter of its last `layers` parametrised layers (None: of all) set to zero."""
    out = copy.deepcopy(model)
    found = parametrised_layers(out)
    with torch.no_grad():
        for m in found if layers is None else found[-layers:]:
            for p in m.parameters(recurse=False):
                p.zero_()
    return out


@register_attack("model-inconsistency")
class ModelInconsistency(Attack):
    """Model inconsistency (Pasquini et al., CCS 2022): the target alone gets the real model, the others a dead one.

    Active, with per-client models: `prepare` builds the target's model (the server's model as it is, or the one an
    active inner attack prepares), `prepare_clients` sends it to the target (client 0) and to every other client a
    copy whose attacked layers are zero ("gradient suppression", the paper's section 4; the reference
    pasquini-dario/EludingSecureAggregation, GradientSuppression_POC.ipynb with suppressing_nets.py, zeroes the
    kernels and biases of the last two layers). With ReLU between them every non-target's activations after the
    zeroed layers are zero and no error flows back through zero weights, so each of its gradients is exactly zero
    but the classifier's bias (p - e_y: its label counts, nothing of its inputs). The secure sum is then the target's
    gradient plus those bias terms, and the inner attack reads it as the target's own update, told the target's
    batch size (its `batch_size` knowledge) in place of the sum's sample count.

    Parameters
    ----------
    inner: the passive (or active) attack run on the recovered gradient, created through the registry (default
        "closed-form": exact on a model whose first layer is linear, the MLP; the paper runs an optimisation
        attack, its notebook inverting gradients on a ConvNet, which `inner = "inverting-gradients"` gives).
    inner_params: that attack's parameters (a table).
    suppress: "last-two" (default, the reference's kill_last_two_layers): the last two parametrised layers; "all"
        (its zero_all_network): every layer. On a sigmoid network (DLG's LeNet) act(0) = 1/2, so the zeroed
        classifier's weight gradient keeps a label-only term as well.
    Needs "per_client_models" (through CGD, whose participants hold their own models, the trial is not
    applicable), "batch_size" and whatever the inner attack needs. Deviation: the paper's other variant, the
    canary gradient on one unit of a shared model, is not built.
    """

    active = True

    def __init__(self, inner: str = "closed-form", inner_params: dict[str, Any] | None = None,
                 suppress: Literal["last-two", "all"] = "last-two"):  # fmt: skip
        check_choice("suppress", suppress, ("last-two", "all"))
        if inner == "model-inconsistency":
            raise ValueError("inner must be another attack, not model-inconsistency itself")
        self.inner, self.inner_params, self.suppress = inner, dict(inner_params or {}), suppress
        self._inner = create("attack", inner, **self.inner_params)
        self.needs = frozenset({"per_client_models", "batch_size"}) | self._inner.needs

    def prepare(self, model: nn.Module, knowledge: Knowledge, rng: torch.Generator) -> nn.Module:
        if self._inner.active:
            return self._inner.prepare(model, knowledge, rng)
        return copy.deepcopy(model)

    def prepare_clients(self, prepared: nn.Module, clients: int, knowledge: Knowledge, rng: torch.Generator) -> list[nn.Module]:
        if clients == 1:
            return [prepared]
        layers = parametrised_layers(prepared)
        if self.suppress == "last-two" and len(layers) < 2:
            raise UnsupportedCase("model-inconsistency zeroes the last two layers: the model has fewer")
        dead = suppressed(prepared, 2 if self.suppress == "last-two" else None)
        return [prepared] + [dead] * (clients - 1)  # every non-target computes at the same dead model

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        k = observation.knowledge
        # The sum holds the target's gradient alone: the inner attack is told the target's own sample count.
        update = replace(observation.update, num_samples=k.batch_size) if k.batch_size is not None else observation.update
        return self._inner.reconstruct(replace(observation, update=update), rng)
