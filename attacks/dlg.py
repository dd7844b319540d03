"""Deep Leakage from Gradients (Zhu, Liu, Han, NeurIPS 2019, arXiv:1906.08935; code mit-han-lab/dlg).

The attacker draws dummy inputs and dummy label logits from N(0, 1) and moves both with L-BFGS until the gradient
they produce matches the observed one in squared Euclidean distance, summed over every parameter tensor:

    min_{x', y'}  sum_l || d loss(F(x'), softmax(y')) / d w_l  -  g_l ||^2

with the soft-label cross entropy loss(p, q) = mean over the batch of sum_c -q_c log softmax(p)_c.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gleak.attacks._gradmatch import (
    BATCH_RESTARTS,
    FIXED_LABELS,
    attack_model,
    box_squared_distance,
    fixed_labels,
    observed_gradient,
    param_gradients,
    restarts_cost,
    row_gradients,
    squared_distance,
    vmap_restarts,
    wire_box,
)
from gleak.attacks._lbfgs import BatchedLBFGS
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, DefenseAware, check_choice, hard_labels
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Observation, Reconstruction
from gleak.mechanics.progress import report as report_progress

DLGLabels = Literal["soft", "idlg", "bias-sign", "row-sign", "count-aware", "given"]


def soft_cross_entropy(logits: Tensor, label_logits: Tensor) -> Tensor:
    """DLG's loss with a dummy soft label: mean over the batch of sum_c -softmax(label_logits)_c log softmax(logits)_c."""
    return torch.sum(-torch.softmax(label_logits, -1) * torch.log_softmax(logits, -1), dim=-1).mean()


def _gradient_distance(grads, target: list[Tensor], box=None) -> Tensor:
    """DLG's squared distance to the wire, or to the set the wire allows (defense_aware)."""
    return squared_distance(grads, target) if box is None else box_squared_distance(grads, box)


@dataclass(frozen=True)
class _Problem:
    """What every start of one trial matches: the model, the observed gradient, the knowledge, fixed labels (None:
    soft labels, optimised) and the wire's box (defense-aware)."""

    model: nn.Module
    names: list[str]
    params: list
    target: list[Tensor]
    k: object
    dtype: torch.dtype
    y: Tensor | None
    box: object

    @property
    def image_size(self) -> int:
        return self.k.batch_size * math.prod(self.k.input_shape)

    def split(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """One start's flat variables -> (images, label logits (soft labels) or the fixed labels)."""
        x = flat[: self.image_size].reshape(self.k.batch_size, *self.k.input_shape)
        if self.y is not None:
            return x, self.y
        return x, flat[self.image_size :].reshape(self.k.batch_size, self.k.num_classes)


def _batched_closure(p: _Problem, box, soft: bool):
    """(rows, flat variables (n, P)) -> (gradient distance per row, its gradient (n, P)): every row's parameter
    gradient by one torch.func.vmap pass, the derivative of the summed distances by one backward pass."""
    from torch.func import vmap

    gradients = row_gradients(p.model, p.names, p.params, soft_cross_entropy if soft else F.cross_entropy, soft)
    distance = vmap(lambda grads: _gradient_distance(grads, p.target, box))
    n_x, B = p.image_size, p.k.batch_size

    def closure(rows: Tensor, flat: Tensor) -> tuple[Tensor, Tensor]:
        with torch.enable_grad():
            v = flat.detach().requires_grad_(True)
            x = v[:, :n_x].reshape(-1, B, *p.k.input_shape)
            label = v[:, n_x:].reshape(-1, B, p.k.num_classes) if soft else p.y
            dist = distance(gradients(x, label))
            (dv,) = torch.autograd.grad(dist.sum(), v)
        return dist.detach(), dv

    return closure


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
    stop_below: an exact match: a start whose gradient distance is below stop_below x ||g||^2 ends the restarts
        (no other start could return a visibly different image); 0 runs them all. gleak's cost saving, default 1e-9.
        Batched (below), the distance is read at the start of every step and the whole run ends at the first step
        that begins with a match, which is that start's result; one after another ("loop"), a start runs all its
        steps and the restarts end after the first whose final distance matches.
    batch_restarts: "auto" (default) runs the starts as one computation where there are several and the model has
        fewer than 1M parameters and no BatchNorm in train mode, else one after another; "vmap" / "loop" force it.
        Batched, every start keeps its own L-BFGS (attacks/_lbfgs.py: torch.optim.LBFGS's step, history, step
        sizes and stopping tests, row by row) and all advance together, each objective evaluation one
        torch.func.vmap pass over the starts still iterating. The same algorithm to rounding (float64, LeNet:
        images within 1e-10 of the loop's after 3 steps, tests/test_batched_restarts.py); in float32 the chaotic
        L-BFGS trajectories part after a few hundred evaluations, and with stop_below the batched run may stop
        mid-run (see above), so trials differ from the loop's in their numbers but not in how often they recover
        (benchmarks/attack_speed.py). The loop is the computation behind results stored before the option.
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
    - Needs the batch size to size the dummy batch (DLG assumes it is known). Models must be twice differentiable
      for the attack to work well (DLG uses sigmoid LeNet); ReLU models run but the paper's guarantees do not hold.
    extra: match_loss (the gradient distance at the returned images), evaluations (closure calls, all starts),
    stopped_at (of the chosen start), restart (its index), restarts_run; steps_run (batched: the steps the run made).
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
        batch_restarts: Literal["auto", "vmap", "loop"] = "auto",
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
        check_choice("batch_restarts", batch_restarts, BATCH_RESTARTS)
        self.restarts, self.stop_below, self.cells, self.batch_restarts = restarts, stop_below, cells, batch_restarts
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
        problem = _Problem(model, names, params, target, k, dtype, y, box)
        if vmap_restarts(self.batch_restarts, self.restarts, model, params, "dlg"):
            x_final, y_final, run = self._restarts_batched(problem, rng)
        else:
            x_final, y_final, run = self._restarts_loop(problem, rng)
        extra.update(run)
        # class indices: optimised label logits and given soft labels (MixUp) by their largest entry
        return Reconstruction(x=x_final, y=hard_labels(y_final).long(), extra=extra)

    def _polish(self, box) -> bool:
        """Quantization: the plain objective first (the cells' centres are the best point reading of the wire),
        then the cells polish that solution (see the docstring, cells)."""
        return box is not None and box.reading.startswith("dequantized") and self.cells == "polish"

    def _restarts_loop(self, p: "_Problem", rng: torch.Generator) -> tuple[Tensor, Tensor, dict]:
        """One start after another, each run to `iterations` steps; the restarts stop at the first whose final
        distance is below stop_below x ||g||^2."""
        model, params, target, k, dtype, y, box = p.model, p.params, p.target, p.k, p.dtype, p.y, p.box
        scale = float(sum(t.double().pow(2).sum() for t in target))
        best: tuple | None = None
        evaluations = 0
        for r in range(self.restarts):
            if self._polish(box):
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
        run = dict(match_loss=match, evaluations=evaluations, stopped_at=stopped_at, restart=chosen, restarts_run=r + 1)
        return x_final, y_final, run

    def _restarts_batched(self, p: "_Problem", rng: torch.Generator) -> tuple[Tensor, Tensor, dict]:
        """Every start at once (attacks/_lbfgs.py: each its own L-BFGS); the run stops at the first step that
        begins with a start below stop_below x ||g||^2, and the start with the lowest final distance is returned."""
        starts = torch.stack([self._draw(p.k, p.dtype, rng) for _ in range(self.restarts)])
        if self._polish(p.box):
            plain, _, evals, stopped_at, steps = self._batched_run(p, starts, None)
            polished, match, more, _, more_steps = self._batched_run(p, plain, p.box)
            plain_at = torch.tensor([self._distance_at_flat(p, row, p.box) for row in plain], dtype=torch.float64,
                                    device=plain.device)  # fmt: skip
            keep = plain_at <= match  # L-BFGS without line search need not descend: keep the better one per start
            flat = torch.where(keep[:, None], plain, polished)
            match = torch.where(keep, plain_at, match)
            evals, steps = evals + more, steps + more_steps
        else:
            flat, match, evals, stopped_at, steps = self._batched_run(p, starts, p.box)
        chosen = int(torch.argmin(match))
        x_final, y_final = p.split(flat[chosen])
        run = dict(match_loss=float(match[chosen]), evaluations=int(evals.sum()), stopped_at=int(stopped_at[chosen]),
                   restart=chosen, restarts_run=self.restarts, steps_run=steps)  # fmt: skip
        return x_final, y_final, run

    def _draw(self, k, dtype, rng: torch.Generator) -> Tensor:
        """One start's dummies, flat: images ~ N(0, 1), then (soft labels) label logits ~ N(0, 1), drawn in the
        order the loop draws them, so that start r begins where the loop's start r does."""
        x = torch.randn((k.batch_size, *k.input_shape), generator=rng, dtype=dtype).flatten()
        if self.labels != "soft":
            return x
        return torch.cat([x, torch.randn((k.batch_size, k.num_classes), generator=rng, dtype=dtype).flatten()])

    def _batched_run(self, p: "_Problem", starts: Tensor, box) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """All starts' L-BFGS runs advanced together: (final variables (R, P), final distances (R,), evaluations
        per start, stopped_at per start (-1: no non-finite step), steps run). A start whose loss or variables turn
        non-finite stops there with its last finite iterate, as in the loop."""
        opt = BatchedLBFGS(starts, _batched_closure(p, box, self.labels == "soft"), lr=self.lr, max_iter=self.max_iter,
                           history_size=self.history_size)  # fmt: skip
        threshold = self.stop_below * float(sum(t.double().pow(2).sum() for t in p.target))
        active = torch.ones(starts.shape[0], dtype=torch.bool, device=starts.device)
        stopped_at = torch.full((starts.shape[0],), -1, dtype=torch.long, device=starts.device)
        last, steps = starts.clone(), 0
        for step in range(self.iterations):
            if bool((active & (opt.evaluate(active) <= threshold)).any()):
                break  # a start matches exactly: no other could return a visibly different image
            loss = opt.step(active)
            steps += 1
            report_progress(step + 1, self.iterations, loss[active])
            bad = active & ~(torch.isfinite(loss) & torch.isfinite(opt.x).all(-1))
            stopped_at[bad] = step
            active &= ~bad
            last = torch.where(active[:, None], opt.x, last)
            if not bool(active.any()):
                break
        final = torch.tensor([self._distance_at_flat(p, row, box) for row in last], dtype=torch.float64, device=last.device)
        return last, final, opt.evaluations.clone(), stopped_at, steps

    def _distance_at_flat(self, p: "_Problem", flat: Tensor, box) -> float:
        x, label = p.split(flat)
        return self._distance_at(p.model, p.params, x, label, p.target, box)

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
        iterations x max_iter x the restarts' cost (an upper bound; a start that matches exactly ends the restarts),
        the restarts counted as _gradmatch.restarts_cost does where they run batched."""
        p = {"iterations": 300, "max_iter": 20, "restarts": 16, "batch_restarts": "auto", **params}
        restarts = restarts_cost(int(p["restarts"]), p["batch_restarts"], case)
        return float(p["iterations"]) * float(p["max_iter"]) * restarts

    @classmethod
    def identity_params(cls, params: dict) -> dict:
        """As DefenseAware's, and batch_restarts only where several restarts run (one start computes the same either
        way, so those trial ids stay as they were; batched restarts compute other numbers than the loop did, so
        their trials have new ids)."""
        out = super().identity_params(params)
        if out.get("batch_restarts") == "auto" and int(out.get("restarts", 1)) == 1:
            out.pop("batch_restarts")
        return out
