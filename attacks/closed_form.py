"""Closed-form inversion of a linear layer with bias (Phong et al. 2017; seed 002; breaching's `analytic`).

For z = W x + b, dL/dW = (dL/dz) x^T and dL/db = dL/dz, so every row i with dL/db_i != 0 gives x = dW[i] / db[i].
At batch size 1 this is exact to machine precision. At batch size B each row is exact for the (dL/dz_i)-weighted
mixture of the batch. Two ways to pick B reconstructions from the rows:
- per-class: when the layer is the classifier (rows are classes), the rows of the classes present (negative bias
  gradient) are each dominated by their own class;
- agreement: in a hidden layer, a unit that only one sample of the batch activates (ReLU) yields that sample
  exactly, and several such units yield the same vector; rows whose inversions agree are grouped and the largest
  groups win (the observation behind Fowl et al.'s imprint attack, applied to the units the model already has).
"""
from __future__ import annotations

from typing import Literal

import torch

from gleak.errors import UnsupportedCase
from gleak.models import first_linear
from gleak.plugin import Attack, check_choice
from gleak.registry import register_attack
from gleak.threat import Observation, Reconstruction


@register_attack("closed-form")
class ClosedForm(Attack):
    """Exact input recovery from the first linear layer's gradient: x = dW[i] / db[i] (seed 002).

    Parameters
    ----------
    rows: "auto" (default): the row with the largest |db| at batch size 1; for batches "per-class" when the first
        linear layer is also the classifier, else "agreement".
        "largest": always the single row with the largest |db| (one reconstruction, the batch's mixture).
        "per-class": rows with negative db (one per class present), most negative first, then the remaining rows by
        |db|, up to the batch size.
        "agreement": group rows whose inversions agree (relative distance below `tol`), largest groups first, then
        the remaining rows by |db|, up to the batch size.
    tol: relative distance under which two row inversions count as the same sample (agreement only).
    Needs a model whose first trainable layer is nn.Linear with bias (an MLP on flattened images); other models
    raise UnsupportedCase. Where no row has a non-zero bias gradient (for example everything pruned) the attacker
    falls back to the mean image and says so in extra['usable_rows'] = 0.
    """

    needs = frozenset({"architecture", "batch_size"})

    def __init__(self, rows: Literal["auto", "largest", "per-class", "agreement"] = "auto", tol: float = 1e-3):
        check_choice("rows", rows, ("auto", "largest", "per-class", "agreement"))
        if not tol > 0:
            raise ValueError(f"tol must be > 0, got {tol}")
        self.rows, self.tol = rows, tol

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        model, k = observation.model, observation.knowledge
        found = first_linear(model) if model is not None else None
        if found is None:
            raise UnsupportedCase("closed-form needs a model whose first trainable layer is nn.Linear with bias")
        name, layer = found
        if layer.bias is None:
            raise UnsupportedCase(f"closed-form needs a bias on the first linear layer {name!r}")
        prefix = f"{name}." if name else ""
        dw = observation.update[f"{prefix}weight"]
        db = observation.update[f"{prefix}bias"]
        if dw.shape[1] != torch.Size(k.input_shape).numel():
            raise UnsupportedCase(f"first linear layer {name!r} does not read the raw input (in_features {dw.shape[1]})")

        usable = torch.nonzero(db != 0).flatten()
        batch = k.batch_size or 1
        mode = self.rows
        if mode == "auto":
            is_classifier = dw.shape[0] == k.num_classes and name == _last_linear_name(model)
            mode = "largest" if batch == 1 else ("per-class" if is_classifier else "agreement")
        extra: dict = {"usable_rows": int(len(usable))}
        if len(usable) == 0:
            x = torch.zeros((1, *k.input_shape), dtype=dw.dtype)
            return Reconstruction(x=x, extra=extra)
        by_size = usable[torch.argsort(db[usable].abs(), descending=True)]
        if mode == "largest":
            rows = by_size[:1]
        elif mode == "agreement":
            rows = self._agreeing_rows(dw, db, by_size, batch)
        else:
            negative = usable[db[usable] < 0]
            negative = negative[torch.argsort(db[negative])]
            rest = by_size[~torch.isin(by_size, negative)]
            rows = torch.cat([negative, rest])[:batch]
        x = dw[rows] / db[rows].unsqueeze(1)
        best = int(rows[0])
        # row_kept: the share of the attacker's main row that reached it (seed 002 section 6, under pruning).
        extra.update(row_kept=float((dw[best] != 0).double().mean()), rows_used=int(len(rows)))
        return Reconstruction(x=x.reshape(len(rows), *k.input_shape), extra=extra)

    def _agreeing_rows(self, dw: torch.Tensor, db: torch.Tensor, by_size: torch.Tensor, batch: int) -> torch.Tensor:
        """One representative row per group of rows whose inversions agree, largest groups first."""
        cand = (dw[by_size] / db[by_size].unsqueeze(1)).double()
        norms = cand.norm(dim=1).clamp_min(1e-30)
        dist = torch.cdist(cand, cand) / norms.unsqueeze(1)
        unassigned = torch.ones(len(by_size), dtype=torch.bool)
        groups: list[tuple[int, int]] = []  # (size, position in by_size of the representative)
        for i in range(len(by_size)):  # by_size order: the representative is the row with the largest |db|
            if not unassigned[i]:
                continue
            members = unassigned & (dist[i] < self.tol)
            groups.append((int(members.sum()), i))
            unassigned &= ~members
        groups.sort(key=lambda g: (-g[0], g[1]))
        return by_size[torch.tensor([i for _, i in groups[:batch]])]


def _last_linear_name(model) -> str | None:
    from gleak.models import last_linear

    found = last_linear(model)
    return found[0] if found else None
