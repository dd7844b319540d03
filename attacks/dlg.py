"""Deep Leakage from Gradients (Zhu, Liu, Han, NeurIPS 2019, arXiv:1906.08935; code mit-han-lab/dlg).

The attacker draws dummy inputs and dummy label logits from N(0, 1) and moves both with L-BFGS until the gradient
they produce matches the observed one in squared Euclidean distance, summed over every parameter tensor:

    min_{x', y'}  sum_l || d loss(F(x'), softmax(y')) / d w_l  -  g_l ||^2

with the soft-label cross entropy loss(p, q) = mean over the batch of sum_c -q_c log softmax(p)_c.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from gleak.attacks._gradmatch import (
    FIXED_LABELS,
    attack_model,
    box_squared_distance,
    fixed_labels,
    observed_gradient,
    param_gradients,
    squared_distance,
    wire_box,
)
from gleak.errors import UnsupportedCase
from gleak.plugin import Attack, DefenseAware
from gleak.registry import register_attack
from gleak.threat import Observation, Reconstruction
from gleak.progress import report as report_progress

DLGLabels = Literal["soft", "idlg", "bias-sign", "row-sign", "count-aware", "given"]


def soft_cross_entropy(logits: Tensor, label_logits: Tensor) -> Tensor:
    """DLG's loss with a dummy soft label: mean over the batch of sum_c -softmax(label_logits)_c log softmax(logits)_c."""
    return torch.sum(-torch.softmax(label_logits, -1) * torch.log_softmax(logits, -1), dim=-1).mean()


def _gradient_distance(grads, target: list[Tensor], box=None) -> Tensor:
    """DLG's squared distance to the wire, or to the set the wire allows (defense_aware)."""
    return squared_distance(grads, target) if box is None else box_squared_distance(grads, box)


@register_attack("dlg")
class DLG(DefenseAware, Attack):
    """DLG (Zhu et al., NeurIPS 2019): L-BFGS on dummy images and soft labels, Euclidean gradient distance.

    Parameters
    ----------
    iterations: L-BFGS steps (calls of `optimizer.step`). 300 as the released code (default); the paper runs 1200.
    labels: "soft" (default, DLG: dummy label logits ~ N(0, 1) optimised jointly, the label read as their argmax),
        "idlg" (the iDLG attack, Zhao et al. 2020: the label is fixed first by attacks/idlg.py's rule and only the
        image is optimised), "bias-sign", "row-sign", "count-aware" (idlg.py's batch strategies), or "given" (the
        attacker is told the true labels; adds "labels" to `needs`).
    lr, history_size, max_iter: torch.optim.LBFGS settings; the released code's are PyTorch's defaults (1, 100, 20),
        without line search.
    restarts: independent starts (dummies drawn afresh from the trial's generator), the one with the lowest final
        gradient distance returned. 16 (default): Geiping et al. 2020's DLG baseline ("Euclidean + L-BFGS", Table 1)
        ran 16 restarts; DLG from one start is all-or-nothing per image. The released DLG code runs 1.
    stop_below: stop restarting once a start's final distance is below stop_below x ||g||^2 (an exact match: no
        later start could return a visibly different image), 0 runs them all. gleak's cost saving, default 1e-9.
    defense_aware: the attacker knows the defense (adds "knows_defense" to `needs`; Kerckhoffs) and matches the
        candidate gradient to the set of gradients the wire allows instead of to the wire itself: the squared
        distance to its projection on that box (attacks/_gradmatch.wire_box): Top-k / DGP / Soteria (sparsification):
        sent entries matched, pruned ones free (Top-k: bounded by the smallest sent magnitude); quantization of 8
        bits or more (fp16, bf16, int-8..16): zero inside each entry's rounding cell; coarser integer formats,
        Outpost and any other defense: exactly the plain attack (_gradmatch.QUANT_MIN_BITS). Default False (DLG).
        Ours (the reading of each defense is in wire_box). extra['wire_reading'] names the rule used.
    cells: how the defense-aware attack uses quantization's rounding cells. "polish" (default): each start first
        runs the plain objective (the cells' centres are the wire's best point reading), then matches the cells from
        that solution, and keeps whichever of the two is closer to the cells: never further from the data than the
        plain attack's solution in the cells' distance, and exactly it where the cells add nothing. "scratch": match
        the cells from the random start. Inside the cells the distance is zero, and on a sigmoid LeNet int-8's cells
        hold many wrong images: from scratch L-BFGS stops at one of them (adaptive suite, LeNet 32 px, 300 steps,
        seeds 0 / 2: 19.9 / 22.4 dB against 27.2 / 29.0 plain; polished 27.2 / 29.0; 16 px, 30 steps, seeds 0-2:
        39.4 / 41.8 / 39.8 from scratch, 45.8 / 51.5 / 48.2 plain, 46.1 / 51.9 / 48.4 polished). On the 8 px MLP
        both gain on plain (tests/test_adaptive_match.py). Polishing costs one more start's evaluations at most.
        Defense-aware DLG's trial ids carry it (and only theirs), so rows stored before it ("scratch") are not reused.

    Defaults and known deviations:
    - Dummy inputs are drawn N(0, 1) in gleak's normalised model-input space (the released code draws them in raw
      [0, 1] pixel space of an unnormalised model); the model sees N(0, 1) inputs either way.
    - L-BFGS on this objective can diverge to NaN (DLG's code then returns garbage). Here the attack stops at the
      first non-finite step and returns the last finite iterate; extra['stopped_at'] records the step (-1: ran all).
    - FedSGD gradients are matched as sent. A FedAvg delta (kind "delta") is read as delta / (lr * local_steps),
      exact for one local step and an approximation for more (see attacks/_gradmatch.observed_gradient).
    - Restarts run one after another: each L-BFGS keeps its own history and step sizes, so batching them into one
      optimiser would couple them (unlike Adam in inverting_gradients.py, which is element-wise).
    - Needs the batch size to size the dummy batch (DLG assumes it is known). Models must be twice differentiable
      for the attack to work well (DLG uses sigmoid LeNet); ReLU models run but the paper's guarantees do not hold.
    extra: match_loss (the gradient distance at the returned images), evaluations (closure calls, all starts),
    stopped_at (of the chosen start), restart (its index), restarts_run.
    """

    aware_options = ("cells",)
    needs = frozenset({"architecture", "parameters", "batch_size"})
    conformance_params = {"iterations": 2, "max_iter": 5, "restarts": 2}

    def __init__(
        self,
        iterations: int = 300,
        labels: DLGLabels = "soft",
        lr: float = 1.0,
        history_size: int = 100,
        max_iter: int = 20,
        restarts: int = 16,
        stop_below: float = 1e-9,
        defense_aware: bool = False,
        cells: Literal["polish", "scratch"] = "polish",
    ):
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        if labels != "soft" and labels not in FIXED_LABELS:
            raise ValueError(f"labels must be 'soft' or one of {FIXED_LABELS}, got {labels!r}")
        if lr <= 0 or history_size < 1 or max_iter < 1:
            raise ValueError("lr must be > 0, history_size and max_iter >= 1")
        if restarts < 1:
            raise ValueError(f"restarts must be >= 1, got {restarts}")
        if not stop_below >= 0:
            raise ValueError(f"stop_below must be >= 0, got {stop_below}")
        if cells not in ("polish", "scratch"):
            raise ValueError(f"cells must be 'polish' or 'scratch', got {cells!r}")
        self.restarts, self.stop_below, self.cells = restarts, stop_below, cells
        self.iterations = iterations
        self.labels = labels
        self.lr = lr
        self.history_size = history_size
        self.max_iter = max_iter
        if labels == "given":
            self.needs = self.needs | {"labels"}
        self.use_defense_knowledge(defense_aware)

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        model, names, params = attack_model(observation)
        k = observation.knowledge
        if k.batch_size is None:
            raise UnsupportedCase("DLG needs the batch size")
        dtype = params[0].dtype
        gradient, extra = observed_gradient(observation.update, names, dtype)
        target = list(gradient)
        box = wire_box(k, target, names, model) if self.defense_aware else None
        if box is not None:
            extra["wire_reading"] = box.reading

        y = None if self.labels == "soft" else fixed_labels(self.labels, gradient, model, k, k.batch_size, rng)
        scale = float(sum(t.double().pow(2).sum() for t in target))
        best: tuple | None = None
        evaluations = 0
        # Quantization: the plain objective first (the cells' centres are the best point reading of the wire), then
        # the cells polish that solution (see the docstring, cells).
        polish = box is not None and box.reading.startswith("dequantized") and self.cells == "polish"
        for r in range(self.restarts):
            if polish:
                x_r, y_r, _, evals, stopped_at = self._one_start(model, params, target, k, dtype, y, rng)
                x_p, y_p, match, more, _ = self._one_start(model, params, target, k, dtype, y, rng, box, start=(x_r, y_r))
                evals += more
                plain_match = self._distance_at(model, params, x_r, y_r, target, box)
                if plain_match <= match:  # L-BFGS without line search need not descend: keep the better one
                    match = plain_match
                else:
                    x_r, y_r = x_p, y_p
            else:
                x_r, y_r, match, evals, stopped_at = self._one_start(model, params, target, k, dtype, y, rng, box)
            evaluations += evals
            if best is None or match < best[2]:
                best = (x_r, y_r, match, stopped_at, r)
            if match <= self.stop_below * scale:
                break
        x_final, y_final, match, stopped_at, chosen = best
        if self.labels == "soft":
            y_final = y_final.argmax(-1)
        extra.update(match_loss=match, evaluations=evaluations, stopped_at=stopped_at, restart=chosen, restarts_run=r + 1)
        return Reconstruction(x=x_final, y=y_final.long(), extra=extra)

    def _one_start(self, model, params, target, k, dtype, y, rng, box=None, start=None) -> tuple[Tensor, Tensor, float, int, int]:
        """One L-BFGS run from fresh dummies, or from `start` (images, label logits or labels) without drawing:
        (images, label logits (soft) or labels, final gradient distance, evaluations, stopped_at)."""
        if start is None:
            x = torch.randn((k.batch_size, *k.input_shape), generator=rng, dtype=dtype).requires_grad_(True)
        else:
            x = start[0].clone().requires_grad_(True)
        if self.labels == "soft":
            label_var = (torch.randn((k.batch_size, k.num_classes), generator=rng, dtype=dtype) if start is None
                         else start[1].clone()).requires_grad_(True)  # fmt: skip
            variables, loss_fn, label_arg = [x, label_var], soft_cross_entropy, label_var
        else:
            variables, loss_fn, label_arg = [x], F.cross_entropy, y

        opt = torch.optim.LBFGS(variables, lr=self.lr, history_size=self.history_size, max_iter=self.max_iter)
        evaluations = 0

        def closure() -> Tensor:
            nonlocal evaluations
            evaluations += 1
            dist = _gradient_distance(param_gradients(model, params, x, loss_fn, label_arg), target, box)
            # Gradients for the dummies only: .backward() would also fill every parameter's .grad, for nothing.
            for v, g in zip(variables, torch.autograd.grad(dist, variables)):
                v.grad = g
            return dist

        last = [v.detach().clone() for v in variables]
        stopped_at = -1
        for step in range(self.iterations):
            loss = opt.step(closure)
            report_progress(step + 1, self.iterations, loss)
            if not (math.isfinite(float(loss.detach())) and all(bool(torch.isfinite(v).all()) for v in variables)):
                stopped_at = step
                break
            last = [v.detach().clone() for v in variables]
        x_final = last[0]
        y_final = last[1] if self.labels == "soft" else label_arg
        return x_final, y_final, self._distance_at(model, params, x_final, y_final, target, box), evaluations, stopped_at

    def _distance_at(self, model, params, x, label_arg, target, box=None) -> float:
        """The gradient distance (to the wire, or to its box) at images x with label logits (soft) or labels."""
        loss_fn = soft_cross_entropy if self.labels == "soft" else F.cross_entropy
        with torch.enable_grad():
            grads = param_gradients(model, params, x.clone().requires_grad_(True), loss_fn, label_arg)
        return float(_gradient_distance(grads, target, box).detach())

    @classmethod
    def estimated_cost(cls, params: dict, case) -> float:
        """L-BFGS evaluates the objective up to max_iter times per step (each a forward-backward-backward pass):
        iterations x max_iter x restarts (an upper bound; a start that matches exactly ends the restarts)."""
        p = {"iterations": 300, "max_iter": 20, "restarts": 16, **params}
        return float(p["iterations"]) * float(p["max_iter"]) * float(p["restarts"])
