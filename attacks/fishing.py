"""Fishing for user data: class and feature fishing, which magnify a few samples' share of an aggregated gradient
(Wen, Geiping, Fowl, Goldblum, Goldstein, ICML 2022, "Fishing for User Data in Large-Batch Federated Learning via
Gradient Magnification"), then the closed form on the first linear layer."""
from __future__ import annotations

import copy
import math
from typing import Literal

import torch
from torch import Tensor, nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, check_choice
from gleak.contracts.registry import create, register_attack
from gleak.contracts.wire import Knowledge, Observation, Reconstruction

LADDER = 128.0  # feature mode without fire_rate: unit cut-offs from 1/2 of the inputs down to 1 / (2 LADDER)
COUNT_TOL = 0.25  # a row counts one sample where its read count is within this of 1
SAME_SAMPLE = 1e-3  # rows whose inversions lie this close (relative) are one sample caught by several units


def hidden_mlp(model: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
    """(first, classifier) where the model is one hidden linear layer, ReLU, one linear classifier, else None."""
    layers = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    relu = any(isinstance(m, nn.ReLU) for m in model.modules())
    if len(layers) != 2 or not all(isinstance(m, nn.Linear) and m.bias is not None for m in layers) or not relu:
        return None
    first, last = layers
    return (first, last) if first.out_features == last.in_features else None


def target_class(fixed: int | None, knowledge: Knowledge) -> int:
    """The class fished: `fixed`, else the rarest class behind the observed update (ties: the smallest class), read
    from the server's first query (knowledge.label_counts, gleak.mechanics.label_query): as the reference's server
    picks a class from its first query and prefers one without collisions. Through a secure sum the counts are the
    sum's, so the class singles out some client's sample, the victim's only where the class is the victim's."""
    if fixed is not None:
        if not 0 <= fixed < knowledge.num_classes:
            raise UnsupportedCase(f"target_class {fixed} is not a class of this data set ({knowledge.num_classes})")
        return fixed
    if knowledge.label_counts is None:
        raise UnsupportedCase("fishing without target_class reads the label counts of a first query round")
    counts = knowledge.label_counts.to(torch.long)
    counts = torch.where(counts > 0, counts, torch.full_like(counts, 1 << 30))
    return int(torch.argmin(counts))


def fire_rates(units: int, fire_rate: float | None) -> Tensor:
    """The share of inputs each fishing unit fires for: `fire_rate` for all, else log-spaced from 1/2 to 1/(2 LADDER)."""
    if fire_rate is not None:
        return torch.full((units,), float(fire_rate), dtype=torch.float64)
    steps = torch.arange(units, dtype=torch.float64) / max(units - 1, 1)
    return 0.5 * LADDER ** (-steps)


@register_attack("fishing")
class Fishing(Attack):
    """Fishing (Wen et al., ICML 2022): only the target class reaches the gradient, then only samples a unit singles out.

    Active. `prepare` edits the parameters only (the architecture is unchanged, as in the paper). Class fishing, the
    reference's MaliciousClassParameterServer.reconfigure_for_class_attack (JonasGeiping/breaching, cases/servers.py;
    its class_multiplier 0.5 and bias_multiplier 1000, config case/server/malicious-fishing.yaml): the classifier's
    weights are zero but the target class's row, class_multiplier on every feature; every other class's bias is
    bias_multiplier, the target's kept. Every other logit is then a constant far above the target's, so p_target is
    0 to machine precision: a sample of another class sends no error back through the network (only the classifier's
    own gradient, (p - e_y) h^T, depends on it), and a sample of the target class sends exactly -class_multiplier to
    each feature it activates. On one hidden ReLU layer, unit k's gradient row is then -class_multiplier / B times
    the sum [x_j, 1] over the target-class samples j that activate it: the bias entry counts them, and a row that
    counts one is that sample exactly, x = dW_k / db_k (the closed form). Feature fishing narrows further: the
    target row reads only the `features` first units, each cut at a quantile of its pre-activation (a Gaussian
    fitted on public data; the reference's stats.norm.ppf at the expected share 1 / expected samples) so that it
    fires for a small share of the inputs: more rows hold a single sample of a class that the batch holds often.

    Parameters
    ----------
    mode: "feature" (default) or "class".
    target_class: the class fished; None (default): the rarest class behind the observed update, read from a first
        query round (needs "label_counts"; the reference's server reads the user's labels from its first query,
        query_once_for_labels: here the query's update is read, so through a secure sum the counts are the sum's).
    class_multiplier, bias_multiplier: the reference's 0.5 and 1000.
    features: feature mode: how many units are cut (None: every unit of the hidden layer).
    fire_rate: feature mode: the share of inputs each cut unit fires for; None (default): log-spaced from 1/2 to
        1/256 across the units, so that some fit whatever number of target-class samples the sum holds.
    recovery: "count" (default): the rows whose bias entry counts one sample, read by the closed form, one image each
        (rows of one sample merged); needs one hidden ReLU layer. "closed-form": the closed-form plugin on the
        fished gradient (its row rule for the sum's sample count), for other models with a first linear layer.
    Deviations, named: the reference reaches one sample by a binary search over a feature's cut-off across
    repeated queries of the same user, with an optimisation attack on the final gradient; one round is observed
    here, so the cut-offs sit on the hidden units' ReLUs (their biases), where the gradient of a sample beyond the cut
    is exactly zero, and the closed form reads the rows. Under FedAvg the count divides by the public local step.
    """

    active = True

    def __init__(self, mode: Literal["feature", "class"] = "feature", target_class: int | None = None,
                 class_multiplier: float = 0.5, bias_multiplier: float = 1000.0, features: int | None = None,
                 fire_rate: float | None = None, recovery: Literal["count", "closed-form"] = "count"):  # fmt: skip
        check_choice("mode", mode, ("feature", "class"))
        check_choice("recovery", recovery, ("count", "closed-form"))
        if target_class is not None and target_class < 0:
            raise ValueError(f"target_class must be >= 0, got {target_class}")
        if not class_multiplier > 0 or not bias_multiplier > 0:
            raise ValueError("class_multiplier and bias_multiplier must be > 0")
        if features is not None and features < 1:
            raise ValueError(f"features must be >= 1, got {features}")
        if fire_rate is not None and not 0 < fire_rate < 1:
            raise ValueError(f"fire_rate must be in (0, 1), got {fire_rate}")
        self.mode, self.target_class, self.recovery = mode, target_class, recovery
        self.class_multiplier, self.bias_multiplier = float(class_multiplier), float(bias_multiplier)
        self.features, self.fire_rate = features, fire_rate
        needs = {"architecture", "batch_size"} | ({"label_counts"} if target_class is None else set())
        self.needs = frozenset(needs | ({"public_data"} if mode == "feature" else set()))
        self._reader = create("attack", "closed-form") if recovery == "closed-form" else None

    def prepare(self, model: nn.Module, knowledge: Knowledge, rng: torch.Generator) -> nn.Module:
        t = target_class(self.target_class, knowledge)
        out = copy.deepcopy(model)
        layers = [m for m in out.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        last = layers[-1] if layers else None
        if not isinstance(last, nn.Linear) or last.bias is None or last.out_features != knowledge.num_classes:
            raise UnsupportedCase("fishing edits a last layer that is a linear classifier with bias")
        pair = hidden_mlp(out)
        if (self.mode == "feature" or self.recovery == "count") and pair is None:
            raise UnsupportedCase(f"fishing with mode {self.mode!r} and recovery {self.recovery!r} needs one hidden "
                                  "ReLU layer between linear layers (the MLP)")  # fmt: skip
        with torch.no_grad():
            kept = last.bias[t].clone()
            last.weight.zero_()
            last.bias.fill_(self.bias_multiplier)
            last.bias[t] = kept
            if self.mode == "class":
                last.weight[t] = self.class_multiplier
            else:
                self._cut(pair[0], knowledge)
                last.weight[t, : self._units(pair[0])] = self.class_multiplier
        return out

    def _units(self, first: nn.Linear) -> int:
        return first.out_features if self.features is None else min(self.features, first.out_features)

    def _cut(self, first: nn.Linear, knowledge: Knowledge) -> None:
        """Move the cut units' biases so that each fires for its share of inputs (a Gaussian fitted on public data)."""
        if knowledge.public_x is None or len(knowledge.public_x) < 2:
            raise UnsupportedCase("feature fishing needs public data (at least two samples) to place its cut-offs")
        n = self._units(first)
        pre = knowledge.public_x.flatten(1).double() @ first.weight[:n].double().T + first.bias[:n].double()
        q = fire_rates(n, self.fire_rate)
        cut = pre.mean(0) + pre.std(0) * math.sqrt(2.0) * torch.erfinv(1 - 2 * q)
        first.bias[:n] -= cut.to(first.bias.dtype)

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        k = observation.knowledge
        t = target_class(self.target_class, k)
        if self._reader is not None:
            rec = self._reader.reconstruct(observation, rng)
            rec.y = torch.full((len(rec.x),), t, dtype=torch.long)
            return rec
        pair = hidden_mlp(observation.model) if observation.model is not None else None
        if pair is None:
            raise UnsupportedCase("fishing's count recovery reads one hidden ReLU layer (the MLP)")
        name = next(n for n, m in observation.model.named_modules() if m is pair[0])
        u = observation.update
        dw, db = u[f"{name}.weight"].double(), u[f"{name}.bias"].double()
        step = 1.0 if u.kind == "gradient" else float(u.meta.get("lr", 1.0)) * float(u.meta.get("local_steps", 1))
        # Every client sends the mean over its batch, so each sample weighs 1 / its client's batch size in a sum
        # too: the target's (every client of a case holds as many samples).
        counts = -db * float(k.batch_size) / (self.class_multiplier * step)
        x, extra = single_samples(dw, db, counts)
        # At most one image per sample behind the update (the allowance of every attack): the rows closest to
        # counting one sample first, so that noise that makes many rows look single keeps the likeliest.
        x = x[: int(u.num_samples)] if u.num_samples is not None else x
        extra["target_class"] = t
        return Reconstruction(x=x.to(u[f"{name}.weight"].dtype).reshape(len(x), *k.input_shape),
                              y=torch.full((len(x),), t, dtype=torch.long), extra=extra)  # fmt: skip


def single_samples(dw: Tensor, db: Tensor, counts: Tensor) -> tuple[Tensor, dict]:
    """One image per sample found alone in a row (count within COUNT_TOL of 1), rows of one sample merged; where no
    row counts one, the row whose count is nearest 1 (a small mixture). Returns the images and the diagnostics."""
    live = torch.nonzero(db != 0).flatten()
    if len(live) == 0:
        return torch.zeros(1, dw.shape[1], dtype=dw.dtype), {"rows_single": 0, "samples_single": 0}
    off = (counts[live] - 1).abs()
    single = live[off < COUNT_TOL]
    rows = single[torch.argsort((counts[single] - 1).abs())] if len(single) else live[torch.argmin(off)].reshape(1)
    cand = dw[rows] / db[rows].unsqueeze(1)
    images: list[Tensor] = []
    for c in cand:  # closest to one count first: a later row of the same sample is merged into the first
        if not any(float((c - im).norm() / im.norm().clamp_min(1e-30)) < SAME_SAMPLE for im in images):
            images.append(c)
    return torch.stack(images), {"rows_single": int(len(single)), "samples_single": len(images) if len(single) else 0}
