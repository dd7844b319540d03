"""GradInversion (Yin, Mallya, Vahdat, Alvarez, Kautz, Molchanov, CVPR 2021, "See through Gradients: Image Batch
Recovery via GradInversion", arXiv:2104.07586; no released code; breaching's `see-through-gradients` config is the
public reimplementation this follows where the paper gives no number).

Batch recovery for BatchNorm networks (ResNets), batches of 8 and more:

1. Label restoration: for each class, the minimum over its row of the last (fully connected) layer's weight
   gradient; the batch-size classes with the most negative minima are the labels (distinct labels assumed).
2. Image optimisation from G random starts ("agents" of a group), labels fixed:

       min_x  L_grad(x) + a_TV TV(x) + a_l2 ||x||_2 + a_BN R_BN(x) + a_group ||x - E(x_group)||_2

   L_grad = sum over parameters of ||grad(x) - g||^2 (scaled by `grad_weight`); R_BN = sum over BatchNorm layers of
   ||mu_l(x) - running_mean_l||_2 + ||sigma^2_l(x) - running_var_l||_2 with the victim model's running statistics
   (the feature-distribution prior of DeepInversion); the group term pulls each agent toward the group's consensus.
   Adam, cosine learning-rate decay after a linear warm-up, Langevin noise (lr x noise x N(0, 1)) after each step,
   pixels clamped to the valid range.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gleak.attacks._gradmatch import (
    BATCH_RESTARTS,
    FIXED_LABELS,
    attack_model,
    fixed_labels,
    observed_gradient,
    restarts_cost,
    squared_distance,
    train_mode_batchnorm,
    vmap_restarts,
)
from gleak.attacks.dlg import soft_cross_entropy
from gleak.attacks.inverting_gradients import total_variation
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, check_choice, hard_labels
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Observation, Reconstruction
from gleak.mechanics.progress import report as report_progress

GILabels = Literal["yin", "idlg", "bias-sign", "row-sign", "count-aware", "given", "soft", "guess"]
LABELS = ("yin", *FIXED_LABELS, "soft", "guess")


class BNStatistics:
    """Forward hooks that record, for every BatchNorm layer with running statistics, the batch mean and (biased)
    variance of its input in the last forward pass; `prior()` is R_BN against the running statistics as they were
    when the hooks were attached (the model's buffers may move afterwards; the targets do not), the first layer's
    term weighted by `first` (breaching's first_bn_multiplier, from DeepInversion's code: 10)."""

    def __init__(self, model: nn.Module, first: float = 1.0):
        self.layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                       and m.running_mean is not None and m.running_var is not None]  # fmt: skip
        self.targets = [(m.running_mean.detach().clone(), m.running_var.detach().clone()) for m in self.layers]
        self.first = first
        self.seen: list[tuple[Tensor, Tensor]] = []
        self._hooks = [m.register_forward_hook(self._record) for m in self.layers]

    def _record(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        x = inputs[0]
        dims = [0] + list(range(2, x.dim()))  # every axis but the channels
        self.seen.append((x.mean(dims), x.var(dims, unbiased=False)))

    def prior(self) -> Tensor:
        terms = [(mu - tm).norm() + (var - tv).norm() for (mu, var), (tm, tv) in zip(self.seen, self.targets)]
        if self.first != 1.0:
            terms[0] = self.first * terms[0]
        return torch.stack(terms).sum()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@register_attack("gradinversion")
class GradInversion(Attack):
    """GradInversion (Yin et al., CVPR 2021): batch label restoration, BatchNorm-statistics prior, group consistency.

    Parameters
    ----------
    iterations: optimisation steps (20,000: the paper and breaching). lr: Adam's step size (0.1), decayed by a
        cosine after `warmup` linear warm-up steps (50, breaching's). restarts: the group's size G, agents from
        independent N(0, 1) starts optimised side by side (default 4).
    labels: "yin" (default): the paper's label restoration (row minima of the last layer's weight gradient); any
        of inverting-gradients' strategies, or "given" (true labels; adds "labels" to `needs`); "soft": no label
        restoration, DLG's dummy label logits (N(0, 1), one set per agent) optimised jointly with the images by the
        same Adam steps, with DLG's soft-label cross entropy, the labels read as their argmax (the ablation of the
        paper's step 1: the same optimisation without restored labels); "guess": no label restoration, batch-size
        distinct classes drawn uniformly from the trial's generator (a naive guess, fixed during the optimisation).
    grad_weight: weight of the squared gradient distance (1: the paper's objective adds the regularisers to an
        unweighted gradient loss; breaching scales its Euclidean gradient loss by 1e-4, set grad_weight = 1e-4 for
        its balance). TV is a mean over pixels, so against grad_weight 1 and a squared distance of order 10-100 it
        needs a weight of order 10-100 to count (suites/dgp-table1.toml's probes: tv 1e-4 leaves the images noise on
        ResNet-20 at 16 px, tv 100 smooths them past the blind guess). tv, l2, bn, group: the regularisers' weights a_TV = 1e-4, a_l2 = 1e-6, a_BN = 0.1,
        a_group = 0.01, taken from breaching's see-through-gradients config (its transcription of the paper; the
        paper's own implementation section was not at hand); 0 turns a term off. noise: Langevin noise scale (0.2,
        the paper's value according to breaching, which itself uses 0.01). boxed: clamp pixels to the valid range.
    output: "best" (default): the agent with the lowest final gradient distance (inverting-gradients' rule; which
        image the paper reports is not stated in what was read); "consensus": the group's mean.
    first_bn: the weight of the first BatchNorm layer's term in R_BN relative to the others (10: breaching's
        DeepInversion regulariser, first_bn_multiplier, as in DeepInversion's code; 1 weighs every layer alike, the
        computation behind results stored before the option).
    batch_restarts: "auto" (default) runs the agents as one torch.func.vmap computation (the derivative of each
        agent's whole objective, BN prior included) when there are several and the model has fewer than 1M
        parameters, else one after another; "vmap" / "loop" force it. The same computation to rounding (float64:
        within 1e-15, tests/test_batched_restarts.py); BatchNorm in train mode runs on batch statistics either way.

    The BN prior's targets are the running statistics of the model the server sent, as the attacker holds it: for
    a trained case (model_state "trained") the trained model's, which gleak's pretraining stores with its weights;
    for an untrained one its initial statistics (zero mean, unit variance: FedSGD never moves them, so on an
    untrained model the prior only pulls the features towards that).

    Named deviations: group consistency without registration: the paper aligns the agents' images (RANSAC-flow)
    before averaging them into the consensus E(x); here the consensus is the plain pixel mean of the agents' current
    images (detached, refreshed every step). The image slots of all agents share the restored labels in order, so
    slot j of every agent aims at the same image. No image jitter or flips. The BN prior compares the dummy batch's
    statistics at each BatchNorm input with the running statistics of the observer's model copy; a model without
    BatchNorm leaves the prior out (extra bn_layers = 0). Cross entropy with hard labels, mean over the batch; a FedAvg
    delta is read as a gradient (delta / (lr * local_steps)).
    extra: grad_loss (final squared gradient distance of the output), restart, bn_layers, bn_prior (its final value
    for the output), iterations.
    """

    # Parameters added after the attack's first release, left out of trial ids at these values where they compute
    # what the first release did: batch_restarts with one agent. first_bn changes what is computed: always stored.
    LATER_DEFAULTS = {"batch_restarts": "auto"}

    needs = frozenset({"architecture", "parameters", "batch_size", "data_stats"})
    conformance_params = {"iterations": 4, "restarts": 2, "warmup": 1}

    def __init__(
        self,
        iterations: int = 20_000,
        lr: float = 0.1,
        restarts: int = 4,
        labels: GILabels = "yin",
        grad_weight: float = 1.0,
        tv: float = 1e-4,
        l2: float = 1e-6,
        bn: float = 0.1,
        group: float = 0.01,
        noise: float = 0.2,
        warmup: int = 50,
        boxed: bool = True,
        output: Literal["best", "consensus"] = "best",
        first_bn: float = 10.0,
        batch_restarts: Literal["auto", "vmap", "loop"] = "auto",
    ):
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if restarts < 1:
            raise ValueError(f"restarts must be >= 1, got {restarts}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        for name, value in (("grad_weight", grad_weight), ("tv", tv), ("l2", l2), ("bn", bn), ("group", group), ("noise", noise),
                            ("first_bn", first_bn)):  # fmt: skip
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if grad_weight == 0:
            raise ValueError("grad_weight must be > 0 (without the gradient term nothing is matched)")
        check_choice("labels", labels, LABELS)
        check_choice("output", output, ("best", "consensus"))
        check_choice("batch_restarts", batch_restarts, BATCH_RESTARTS)
        self.first_bn, self.batch_restarts = float(first_bn), batch_restarts
        self.iterations, self.lr, self.restarts, self.labels = iterations, lr, restarts, labels
        self.grad_weight, self.tv, self.l2, self.bn, self.group = grad_weight, tv, l2, bn, group
        self.noise, self.warmup, self.boxed, self.output = noise, warmup, boxed, output
        if labels == "given":
            self.needs = self.needs | {"labels"}

    @classmethod
    def identity_params(cls, params: dict) -> dict:
        """The stored parameters: those of LATER_DEFAULTS only where they differ from them or several agents run
        (one agent computes the same either way; several batched agents compute other numbers than the loop)."""
        one = int(params.get("restarts", 1)) == 1
        return {k: v for k, v in params.items() if not (one and k in cls.LATER_DEFAULTS and v == cls.LATER_DEFAULTS[k])}

    @classmethod
    def estimated_cost(cls, params: dict, case) -> float:
        """One gradient-matching evaluation per iteration and agent, the agents counted as _gradmatch.restarts_cost
        does where they run batched."""
        p = {"iterations": 20_000, "restarts": 4, "batch_restarts": "auto", **params}
        return float(p["iterations"]) * restarts_cost(int(p["restarts"]), p["batch_restarts"], case, train_bn=True)

    def schedule(self, step: int) -> float:
        """The learning-rate factor at `step`: linear warm-up, then cosine decay to 0 at the last step."""
        warm = min(self.warmup, self.iterations - 1)
        if step < warm:
            return (step + 1) / warm
        span = max(1, self.iterations - warm)
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / span))

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        x, losses, bn_values, y, extra = self.reconstruct_all(observation, rng)
        if self.output == "consensus":
            out, chosen = x.mean(0), -1
            extra.update(grad_loss=float(losses.mean()), restart=chosen, bn_prior=float("nan"))
        else:
            chosen = int(torch.argmin(losses))
            out = x[chosen]
            extra.update(grad_loss=float(losses[chosen]), restart=chosen, bn_prior=bn_values[chosen])
        return Reconstruction(x=out, y=None if y is None else hard_labels(y), extra=extra)

    def reconstruct_all(self, observation: Observation, rng: torch.Generator):
        """Every agent's final images (G, B, C, H, W), their final squared gradient distances (G,), their final BN
        priors, the labels used, and extra."""
        model, names, params = attack_model(observation)
        k = observation.knowledge
        if k.batch_size is None or k.mean is None or k.std is None:
            raise UnsupportedCase("gradinversion needs the batch size and the data mean/std")
        dtype = params[0].dtype
        gradient, extra = observed_gradient(observation.update, names, dtype)
        target = list(gradient)
        y = self._labels(gradient, model, k, rng)
        stats = BNStatistics(model, self.first_bn)  # targets: the running statistics the model arrived with
        vmapped = vmap_restarts(self.batch_restarts, self.restarts, model, params, "gradinversion", train_bn=True)
        try:
            step_gradients = self._gradient_function(model, names, params, stats, target, y, vmapped)
            x, logits = self._optimise(step_gradients, k, dtype, rng)
            per_agent = logits if logits is not None else [y] * self.restarts
            finals = [self._objective(model, params, stats, xr.clone().requires_grad_(True), yr, target, None)
                      for xr, yr in zip(x, per_agent)]  # fmt: skip
        finally:
            stats.remove()
        extra.update(bn_layers=len(stats.layers), iterations=self.iterations)
        losses = torch.stack([f[1] for f in finals])
        if logits is not None:  # the labels of the agent the output reads (the best; the consensus takes the first agent's)
            best = int(torch.argmin(losses)) if self.output == "best" else 0
            y = logits[best].argmax(-1)
        return x, losses, [f[2] for f in finals], y, extra

    def _labels(self, gradient, model: nn.Module, k, rng: torch.Generator) -> Tensor | None:
        """The labels the agents share (None: soft labels, optimised per agent)."""
        if self.labels == "soft":
            return None
        if self.labels == "guess":  # distinct classes, as the restoration assumes; more than the classes repeat
            draws = -(-k.batch_size // k.num_classes)
            return torch.cat([torch.randperm(k.num_classes, generator=rng) for _ in range(draws)])[: k.batch_size]
        return fixed_labels(self.labels, gradient, model, k, k.batch_size, rng)

    def _optimise(self, step_gradients, k, dtype: torch.dtype, rng: torch.Generator) -> tuple[Tensor, Tensor | None]:
        """The group's Adam run: (final images (G, B, C, H, W), final label logits (G, B, K) or None)."""
        lo = ((0 - k.mean) / k.std).to(dtype).view(-1, 1, 1)
        hi = ((1 - k.mean) / k.std).to(dtype).view(-1, 1, 1)
        x = torch.randn((self.restarts, k.batch_size, *k.input_shape), generator=rng, dtype=dtype).requires_grad_(True)
        variables = [x]
        if self.labels == "soft":  # one set of label logits per agent, moved by the same optimiser as the images
            variables.append(torch.randn((self.restarts, k.batch_size, k.num_classes), generator=rng, dtype=dtype))
            variables[1].requires_grad_(True)
        opt = torch.optim.Adam(variables, lr=self.lr)
        use_group = self.group > 0 and self.restarts > 1
        for step in range(self.iterations):
            lr_now = self.lr * self.schedule(step)
            for g in opt.param_groups:
                g["lr"] = lr_now
            consensus = x.detach().mean(0) if use_group else None
            for v, g in zip(variables, step_gradients(*[v.detach() for v in variables], consensus)):
                v.grad = g
            opt.step()
            report_progress(step + 1, self.iterations)
            with torch.no_grad():
                if self.noise > 0:
                    x.add_(torch.randn(x.shape, generator=rng, dtype=dtype), alpha=lr_now * self.noise)
                if self.boxed:
                    x.clamp_(lo, hi)
        return x.detach(), (variables[1].detach() if len(variables) > 1 else None)

    def _gradient_function(self, model: nn.Module, names, params, stats: BNStatistics, target, y, vmapped: bool):
        """(images (G, B, ...), [label logits (G, B, K)], consensus or None) -> the objective's derivative in each
        variable, for every agent: one torch.func.vmap pass over the agents (`vmapped`), or one agent after another."""
        soft = y is None
        if not vmapped:
            def one_by_one(x: Tensor, *rest):
                logits, consensus = (rest[0], rest[1]) if soft else (None, rest[0])
                grads = [torch.empty_like(x)] + ([torch.empty_like(logits)] if soft else [])
                for r in range(x.shape[0]):
                    xr = x[r].detach().requires_grad_(True)
                    inputs = (xr, logits[r].detach().requires_grad_(True)) if soft else (xr,)
                    obj, _, _ = self._objective(model, params, stats, xr, inputs[1] if soft else y, target, consensus)
                    for out, g in zip(grads, torch.autograd.grad(obj, inputs)):
                        out[r] = g
                return grads

            return one_by_one
        from torch.func import grad, vmap

        objective = self._vmap_objective(model, names, stats, target, y)
        if soft:
            return vmap(grad(objective, argnums=(0, 1)), in_dims=(0, 0, None), randomness="different")
        # randomness="different": a model that samples in its forward (PRECODE's bottleneck) draws anew for each agent,
        # as the agents optimised one after another do (vmap refuses random operations otherwise).
        per_agent = vmap(grad(objective), in_dims=(0, None), randomness="different")
        return lambda x, consensus: [per_agent(x, consensus)]

    def _vmap_objective(self, model: nn.Module, names, stats: BNStatistics, target, y):
        """One agent's objective as a function of its variables (for torch.func): its parameter gradient by
        torch.func.grad through functional_call, the BN prior from the hooks' records of the same forward pass.
        BatchNorm in train mode is switched to batch statistics without running ones on the attack's private model
        copy (torch.func.replace_all_batch_norm_modules_: vmap cannot update buffers); the prior's targets were
        copied before."""
        from torch.func import functional_call, grad, replace_all_batch_norm_modules_

        if train_mode_batchnorm(model):
            replace_all_batch_norm_modules_(model)
        weights = {n: p.detach() for n, p in model.named_parameters() if n in set(names)}
        buffers = dict(model.named_buffers())

        def loss_and_prior(w, xr, label):
            stats.seen.clear()
            out = functional_call(model, (w, buffers), (xr,))
            # label logits where the labels are optimised; given labels (indices, or MixUp's probabilities) as they are
            loss = soft_cross_entropy(out, label) if y is None else F.cross_entropy(out, label)
            return loss, (stats.prior() if stats.layers else loss.new_zeros(()))

        def objective(xr: Tensor, *rest) -> Tensor:
            label, consensus = (rest[0], rest[1]) if y is None else (y, rest[0])
            g, prior = grad(loss_and_prior, has_aux=True)(weights, xr, label)
            dist = squared_distance([g[n] for n in names], target)
            return self._regularised(dist, xr, prior if stats.layers else None, consensus)

        return objective

    def _objective(self, model, params, stats: BNStatistics, x: Tensor, y: Tensor, target, consensus):
        """(objective, squared gradient distance, BN prior) of one agent's batch x; y: hard labels, or (float) the
        agent's label logits (labels "soft"), or given soft labels (probabilities, MixUp)."""
        stats.seen.clear()
        loss = soft_cross_entropy(model(x), y) if self.labels == "soft" else F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        dist = squared_distance(grads, target)
        prior = stats.prior() if stats.layers else None
        obj = self._regularised(dist, x, prior, consensus)
        return obj, dist.detach(), float(prior.detach()) if prior is not None else float("nan")

    def _regularised(self, dist: Tensor, x: Tensor, prior: Tensor | None, consensus: Tensor | None) -> Tensor:
        """grad_weight x the gradient distance plus the regularisers of one agent's batch x (terms at weight 0
        left out, so that turning a term off removes it exactly)."""
        obj = self.grad_weight * dist
        if self.tv > 0:
            obj = obj + self.tv * total_variation(x)
        if self.l2 > 0:
            obj = obj + self.l2 * x.norm()
        if prior is not None and self.bn > 0:
            obj = obj + self.bn * prior
        if consensus is not None:
            obj = obj + self.group * (x - consensus).norm()
        return obj
