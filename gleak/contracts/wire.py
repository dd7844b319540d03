"""Threat-model types: the client's batch, the update on the wire, what the observer knows, the reconstruction.

One trial moves these objects along a single chain (see gleak.orchestration.trial)::

    ClientBatch -> Update (client) -> Update (after the defense, on the wire) -> Observation -> Reconstruction
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

# What an attack may declare in `needs`. The trial builds the observation from exactly these, so an attack cannot
# read what its threat model does not grant it.
KNOWLEDGE = {
    "architecture": "the model's structure (a copy of the module)",
    "parameters": "the model's weights at the round the update was computed",
    "batch_size": "how many samples produced the update",
    "labels": "the true labels of the batch",
    "data_stats": "the per-channel mean and std used to normalise inputs",
    "public_data": "samples from the same distribution that are not the client's (another split)",
    # Kerckhoffs: the attacker knows the algorithm and its public parameters, never its randomness or client state.
    "knows_defense": "the defense's and the protocol's names and parameters (not their random state or residuals)",
    # An active server's capability, not knowledge: it sends each client a model of its own choosing (Attack.
    # prepare_clients). Granted only where the protocol lets the server choose the clients' models (gleak.mechanics.gate).
    "per_client_models": "the server may send each client its own model (model inconsistency), where the protocol "
                         "lets it choose the models its clients compute at",
    # Read, not given: one query round at a model whose classifier the server zeroed (gleak.mechanics.label_query).
    "label_counts": "how many samples of each class are behind the observed update, read from the update of one "
                    "query round at a model the server prepared (an active server's capability)",
    # A capability outside every honest-but-curious model: the aggregator returns a sum of its choosing, and every
    # participant steps its own model by it (Attack.forge, Protocol.forged_step).
    "forged_aggregate": "the aggregator may return an aggregate of its choosing, by which every participant steps "
                        "its own model (one forged round before the observed ones)",
}

# Fields a protocol may put in an update's `meta`, and the knowledge an attack needs to read each ("": a public
# setting of the protocol, known to everyone taking part). The gate (gleak.mechanics.gate) drops every other field.
WIRE_META = {
    "lr": "", "local_steps": "", "protocol": "", "participants": "", "colluders": "",
    "local_batch_size": "batch_size",  # FedAvg's mini-batch size is the batch size when local steps use the whole batch
    # CGD's vfl reading on feature blocks (split_features): the victim block's summed first-layer pre-activations,
    # which the aggregator running that secure sum sees (one row per sample: the wire itself shows the count), and
    # the public first-layer offset they were computed at.
    "preactivations": "", "first_offset": "",
}  # fmt: skip


@dataclass(frozen=True)
class ClientBatch:
    """A client's private batch. `x` is normalised model input (B, C, H, W); `y` are class indices (B,)."""

    x: Tensor
    y: Tensor
    mean: Tensor  # (C,) per-channel mean used to normalise
    std: Tensor  # (C,)

    @property
    def size(self) -> int:
        return int(self.x.shape[0])

    def images(self) -> Tensor:
        """The batch as images in [0, 1]."""
        return denormalize(self.x, self.mean, self.std)


def denormalize(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    shape = (1, -1, 1, 1) if x.dim() == 4 else (-1, 1, 1)
    return (x * std.to(x).view(shape) + mean.to(x).view(shape)).clamp(0, 1)


def normalize(images: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    shape = (1, -1, 1, 1) if images.dim() == 4 else (-1, 1, 1)
    return (images - mean.to(images).view(shape)) / std.to(images).view(shape)


@dataclass(frozen=True)
class Update:
    """What a client sends: one tensor per model parameter, keyed by parameter name in model order.

    kind: "gradient" (FedSGD: the gradient of the mean loss over the batch) or "delta" (FedAvg: w_before - w_after
    after local steps). num_samples: how many samples produced it (per client; summed by aggregation); None in what
    an attack receives unless its `needs` grant "batch_size" (gleak.mechanics.gate). meta: protocol fields (WIRE_META).
    """

    tensors: dict[str, Tensor]
    kind: str = "gradient"
    num_samples: int | None = 1
    meta: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def names(self) -> list[str]:
        return list(self.tensors)

    def map(self, fn: Callable[[str, Tensor], Tensor]) -> "Update":
        """A new update with `fn(name, tensor)` applied to every tensor (inputs untouched)."""
        return replace(self, tensors={k: fn(k, v) for k, v in self.tensors.items()})

    def flat(self) -> Tensor:
        return torch.cat([t.reshape(-1) for t in self.tensors.values()])

    def with_flat(self, flat: Tensor) -> "Update":
        """An update of the same layout whose values come from the 1-D tensor `flat`."""
        out, i = {}, 0
        for k, t in self.tensors.items():
            out[k] = flat[i : i + t.numel()].view_as(t).clone()
            i += t.numel()
        return replace(self, tensors=out)

    def clone(self) -> "Update":
        return self.map(lambda _, t: t.detach().clone())

    def is_finite(self) -> tuple[bool, str | None]:
        for k, t in self.tensors.items():
            if not torch.isfinite(t).all():
                return False, k
        return True, None

    @staticmethod
    def sum(updates: list["Update"]) -> "Update":
        first = updates[0]
        tensors = {k: torch.stack([u.tensors[k] for u in updates]).sum(0) for k in first.tensors}
        counts = [u.num_samples for u in updates]
        return replace(first, tensors=tensors, num_samples=None if None in counts else sum(counts))


@dataclass(frozen=True)
class Knowledge:
    """What the observer knows before and besides the update. Fields it was not granted are None."""

    input_shape: tuple[int, ...]  # (C, H, W): always known, it is part of the protocol
    num_classes: int
    batch_size: int | None = None
    mean: Tensor | None = None
    std: Tensor | None = None
    labels: Tensor | None = None
    public_x: Tensor | None = None  # normalised public samples
    public_y: Tensor | None = None
    defense: "DefenseDescription | None" = None  # with "knows_defense" only
    label_counts: Tensor | None = None  # (num_classes,) with "label_counts" only: read from a query round


@dataclass(frozen=True)
class DefenseDescription:
    """The public description of what protects the update (granted by "knows_defense"): the client defense and the
    round protocol, each by its canonical name and its full parameters (defaults filled). Nothing else: no random
    state, no error-feedback residual, no noise drawn."""

    defense: str
    defense_params: dict[str, Any]
    protocol: str = "fedsgd"
    protocol_params: dict[str, Any] = field(default_factory=dict)

    def param(self, name: str, default: Any = None) -> Any:
        """A parameter of the client defense (or `default` where it has none)."""
        return self.defense_params.get(name, default)


@dataclass(frozen=True)
class Observation:
    """What the attacker holds when it reconstructs: the update on the wire, the model (if granted) and knowledge.

    `model` is the observer's own copy, with the parameters at which the update was computed; attacks may use it
    freely (it is not the client's). `rounds` holds earlier observations when a case has several rounds.
    """

    update: Update
    knowledge: Knowledge
    model: nn.Module | None = None
    rounds: tuple["Observation", ...] = ()


@dataclass
class Reconstruction:
    """An attack's output. `x`: (n, C, H, W) in normalised model-input space, or None for label-only attacks;
    `y`: (n,) class indices or None. `extra`: scalar diagnostics stored with the trial (JSON column 'extra')."""

    x: Tensor | None = None
    y: Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
