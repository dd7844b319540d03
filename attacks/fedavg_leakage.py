"""Data leakage in federated averaging (Dimitrov, Balunović, Konstantinov, Vechev, "Data Leakage in Federated
Averaging", TMLR 2022; code eth-sri/fedavg_leakage).

A FedAvg client sends w_before - w_after after several local SGD steps over several epochs of its data, so the
update is not one gradient. The attacker simulates the client's local training on reconstruction variables,
differentiably, with the known local learning rate, number of steps and mini-batch size, and matches the simulated
update to the observed one:

    min_{X_1..X_E}  fac_t * D(sim(X_1..X_E, y) / lr, delta / lr) / k  +  tv * TV(X)  +  clip * Clip(X)
                    + reorder * R(X_1, ..., X_E)

with separate variables X_e for each epoch e (the client may reorder its data every epoch, an order the attacker
does not know) and the *epoch order-invariant prior* R: a function of each epoch's samples that does not depend on
their order (their mean, or their pixel-wise maximum, optionally after a random convolution) is pulled together
across epochs, over all pairs of epochs. At the end each epoch's images are matched to the first epoch's (Hungarian
assignment on PSNR) and averaged. The labels are estimated from the update first (Geng et al.'s count rule, its
output statistics averaged along the client's trajectory: the paper's "avg" rule).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gleak.attacks._gradmatch import attack_model, observed_gradient
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, check_choice, loss_fn
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Knowledge, Observation, Reconstruction, Update
from gleak.mechanics.client_update import local_batches
from gleak.mechanics.progress import report as report_progress

# Their reconstruction scripts: (Adam lr, tv, clip, epoch prior, its weight, features the prior compares).
PRESETS = {
    "femnist": (0.4, 1e-3, 2.0, "l2-mean", 1000.0, "pixels"),  # scripts/reconstruct_femnist_table1.sh
    "cifar": (0.1, 2e-4, 10.0, "l2-max", 6.075, "conv"),  # scripts/reconstruct_cifar_table1.sh
}
PRIORS = ("l2-mean", "l2-max", "l1-mean", "l1-max", "none")
LABELS = ("geng-avg", "idlg", "bias-sign", "row-sign", "count-aware", "yin", "llg", "llg+", "geng", "given")
CONV_FEATURES = 96  # their random 3x3 convolution of the prior's "conv" variants


def simulated_delta(
    model: nn.Module, names: list[str], epochs: list[Tensor], y: Tensor | list[Tensor], lr: float, local_steps: int,
    bs: int, create_graph: bool = True,
) -> list[Tensor]:  # fmt: skip
    """w_before - w_after of `local_steps` plain SGD steps at `lr` on mini-batches of `bs`, as the FedAvg client
    takes them (gleak.mechanics.client_update.local_batches): step s takes samples lo:hi of epoch e's inputs
    `epochs[min(e, len - 1)]` (one tensor (N, ...) per epoch; the last for every later epoch) with the labels lo:hi
    of `y` (one tensor for every epoch, or one per epoch like `epochs`). Differentiable in the inputs
    (torch.func.functional_call on the parameters, create_graph); detached without create_graph."""
    from torch.func import functional_call

    named = dict(model.named_parameters())
    w0 = [named[n].detach() for n in names]
    w = [t.clone().requires_grad_(True) for t in w0]
    buffers = dict(model.named_buffers())
    rest = {n: p.detach() for n, p in named.items() if n not in names}
    ys = y if isinstance(y, (list, tuple)) else [y]
    for e, lo, hi in local_batches(len(ys[0]), bs, local_steps):
        xb, yb = epochs[min(e, len(epochs) - 1)][lo:hi], ys[min(e, len(ys) - 1)][lo:hi]
        with torch.enable_grad():
            out = functional_call(model, ({**rest, **dict(zip(names, w)), **buffers}), (xb,))
            g = torch.autograd.grad(loss_fn(out, yb), w, create_graph=create_graph)
        w = [p - lr * gi for p, gi in zip(w, g)]
        if not create_graph:
            w = [p.detach().requires_grad_(True) for p in w]
    return [a - b if create_graph else (a - b).detach() for a, b in zip(w0, w)]


def layer_weights(names: list[str], kind: str) -> list[float]:
    """Their `att_exp_layers`: the parameters of the l-th layer (module, in model order, from 0) weigh exp(-l)
    (the first layer 1); "uniform": 1 each."""
    modules: list[str] = []
    for n in names:
        m = n.rsplit(".", 1)[0] if "." in n else ""
        if m not in modules:
            modules.append(m)
    if kind == "uniform":
        return [1.0] * len(names)
    return [math.exp(-modules.index(n.rsplit(".", 1)[0] if "." in n else "")) for n in names]


def epoch_prior(x: Tensor, kind: str, conv: Tensor | None = None) -> Tensor:
    """Their invariant prior on x (E, N, C, H, W): each epoch's samples reduced by an order-free statistic (mean or
    pixel-wise max over its N samples, after the random convolution `conv` where given), the squared (l2) or
    absolute (l1) difference of two epochs' statistics averaged over their entries, averaged over all E x E ordered
    pairs of epochs (their meshgrid, the pairs of an epoch with itself included)."""
    E = x.shape[0]
    if conv is not None:
        x = F.conv2d(x.flatten(0, 1), conv, padding=conv.shape[-1] // 2).view(E, x.shape[1], -1, *x.shape[-2:])
    stat = x.mean(1) if kind.endswith("mean") else x.max(1).values
    diff = stat.unsqueeze(0) - stat.unsqueeze(1)  # (E, E, ...)
    err = diff.pow(2) if kind.startswith("l2") else diff.abs()
    return err.flatten(2).mean(2).mean()


def total_variation(x: Tensor) -> Tensor:
    """Their TV: per image, the sum over pixels of the squared differences to the next pixel right and down
    (wrapping around, jnp.roll) plus 1e-7; the mean over images."""
    dx = x - torch.roll(x, -1, dims=-1)
    dy = x - torch.roll(x, -1, dims=-2)
    return (dx.pow(2) + dy.pow(2) + 1e-7).flatten(-3).sum(-1).mean()


def clip_prior(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Their clip prior: the images in [0, 1] (x * std + mean), the squared distance of each pixel to [0, 1],
    averaged over the images and summed over the pixels."""
    img = (x * std.view(-1, 1, 1) + mean.view(-1, 1, 1)).flatten(0, -4)
    return (img - img.clamp(0, 1)).pow(2).mean(0).sum()


def trajectory_counts(update: Update, model: nn.Module, names: list[str], k: Knowledge, batch_size: int, steps: int,
                      gen: torch.Generator) -> Tensor:  # fmt: skip
    """The paper's "avg" label rule (their restore_labels, aaai_avg): Geng et al.'s counts n_j = B (p_j - dW_j / O)
    from the update's mean gradient (delta / (lr * steps)), with the mean softmax output p and the last layer's mean
    input sum O on dummy inputs taken at the points t / steps (t = 0..steps-1) of the line from the server's model to
    the client's final one (w - delta), the counts averaged over t, rounded to sum to B (largest remainder)."""
    import copy

    from gleak.attacks.idlg import _mean_output_and_feature_sum, _round_counts, last_layer_grads

    gradient, _ = observed_gradient(update, names, next(model.parameters()).dtype)
    dw, _ = last_layer_grads(gradient, model)
    rows = dw.double().sum(1)
    end = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in end.named_parameters():
            if n in update.tensors:
                p -= update.tensors[n].to(p.dtype)
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    p0, o0 = _mean_output_and_feature_sum(model, k, torch.Generator().manual_seed(seed))
    p1, o1 = _mean_output_and_feature_sum(end, k, torch.Generator().manual_seed(seed))  # the same dummy inputs
    if not (o0 > 0 and o1 > 0):
        raise UnsupportedCase("label rule 'geng-avg' needs the last layer's inputs to have a positive mean sum")
    est = torch.zeros_like(rows)
    for t in range(steps):
        c = t / steps
        est += batch_size * ((1 - c) * p0.double() + c * p1.double() - rows / ((1 - c) * o0 + c * o1))
    return _round_counts(est / steps, batch_size)


def match_to(first: Tensor, other: Tensor) -> Tensor:
    """The order of `other`'s images (N, ...) that best matches `first`'s: Hungarian assignment maximising the summed
    PSNR of the pairs (their compute_matching, metric psnr; images in [0, 1])."""
    from scipy.optimize import linear_sum_assignment

    mse = (first.flatten(1).unsqueeze(1) - other.flatten(1).unsqueeze(0)).pow(2).mean(-1).double()
    cost = 10 * torch.log10(mse.clamp_min(1e-12))  # -PSNR
    _, cols = linear_sum_assignment(cost.numpy())
    return torch.as_tensor(cols)


@register_attack("fedavg-leakage")
class FedAvgLeakage(Attack):
    """Data Leakage in Federated Averaging (Dimitrov et al., TMLR 2022): local epochs simulated, images per epoch.

    Dimitrov, Balunović, Konstantinov, Vechev, TMLR 2022: the client's local epochs simulated on reconstruction
    variables, one set per epoch, pulled together by an epoch order-invariant prior.

    Parameters (defaults: the authors' FEMNIST scripts, scripts/reconstruct_femnist_table1.sh)
    ----------
    preset: "femnist" (default: Adam lr 0.4, TV 1e-3, clip 2, prior "l2-mean" weight 1000 on pixels) or "cifar"
        (their CIFAR-10 script: lr 0.1, TV 2e-4, clip 10, prior "l2-max" weight 6.075 on a random convolution's 96
        features). lr, tv, clip, prior, reorder, prior_features: override the preset.
    iterations: Adam steps (400: their 2 x att_epochs, att_epochs 200); the step size decays as lr * 0.995^(t / 10)
        (their optax exponential decay), the reconstruction term's weight grows from 1 to 2 over the first half
        (their att_fac_start 1 to att_total_var 2) and stays at 2. Init N(0, 1) in normalised space.
    distance: "l2" (default, their att_metric l2): sum over parameters of w_l ||sim_l - obs_l||^2 on delta / lr,
        divided by ceil(E N / local batch), E the sets of variables (their k_batches); "cosine": 1 - sum_l w_l
        <sim_l, obs_l> / (||sim|| ||obs||) (their cos_sim_global). layers: "exp" (default, their att_exp_layers:
        layer l weighs exp(-l)) or "uniform".
    prior: the epoch order-invariant prior: "l2-mean" (each epoch's mean image, squared differences), "l2-max"
        (each epoch's pixel-wise maximum), "l1-mean", "l1-max", or "none" (the ablation). prior_features: "pixels"
        or "conv" (a random 3x3 convolution to 96 channels first, drawn from the attack's generator).
    epoch_vars: "separate" (default, their full_many: variables per epoch, matched and averaged at the end) or
        "shared" (one set of variables for every epoch, their "full": exact where the client does not reorder its
        data, as gleak's FedAvg without `shuffle`; the prior then has nothing to do).
    labels: "geng-avg" (default, the paper's "avg" rule: trajectory_counts), any of attacks/idlg.py's strategies
        applied to the update read as one gradient (delta / (lr * local_steps)), or "given" (the true labels; adds
        "labels" to `needs`). Labels are arranged sorted by class in every epoch (theirs).

    Reads lr, local_steps and local_batch_size from the update's meta (the gate passes local_batch_size with
    "batch_size"); a FedSGD gradient is read as one local step on the whole batch. Deviations (named): one restart
    (theirs picks the best of several by PSNR to the true images, which an attacker does not have); their prior
    weights were tuned on their networks and the l2 distance's scale depends on the model's gradients; the epochs'
    images matched on PSNR and averaged in normalised space, as theirs. extra: rec_loss (the final distance term),
    epochs, local_steps, label_rule. Measured against one-gradient inverting-gradients: docs/attacks.md (a gain
    with whole-batch local steps; none with reshuffled local batches of half the data at these defaults).
    """

    needs = frozenset({"architecture", "parameters", "batch_size", "data_stats"})
    conformance_params = {"iterations": 3}
    conformance_protocol = ("fedavg", {"local_steps": 2})

    def __init__(
        self,
        preset: Literal["femnist", "cifar"] = "femnist",
        iterations: int = 400,
        lr: float | None = None,
        tv: float | None = None,
        clip: float | None = None,
        prior: Literal["l2-mean", "l2-max", "l1-mean", "l1-max", "none"] | None = None,
        reorder: float | None = None,
        prior_features: Literal["pixels", "conv"] | None = None,
        distance: Literal["l2", "cosine"] = "l2",
        layers: Literal["exp", "uniform"] = "exp",
        epoch_vars: Literal["separate", "shared"] = "separate",
        labels: Literal["geng-avg", "idlg", "bias-sign", "row-sign", "count-aware", "yin", "llg", "llg+", "geng", "given"] = "geng-avg",
    ):
        check_choice("preset", preset, PRESETS)
        check_choice("distance", distance, ("l2", "cosine"))
        check_choice("layers", layers, ("exp", "uniform"))
        check_choice("epoch_vars", epoch_vars, ("separate", "shared"))
        check_choice("labels", labels, LABELS)
        if prior is not None:
            check_choice("prior", prior, PRIORS)
        if prior_features is not None:
            check_choice("prior_features", prior_features, ("pixels", "conv"))
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        for name, v in (("tv", tv), ("clip", clip), ("reorder", reorder)):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if lr is not None and not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.preset, self.iterations, self.distance, self.layers = preset, iterations, distance, layers
        self.epoch_vars, self.labels = epoch_vars, labels
        self.lr, self.tv, self.clip, self.prior, self.reorder, self.prior_features = lr, tv, clip, prior, reorder, prior_features
        given = (lr, tv, clip, prior, reorder, prior_features)
        # the settings used: each one given, else the preset's
        self._lr, self._tv, self._clip, self._prior, self._reorder, self._features = (
            p if v is None else v for v, p in zip(given, PRESETS[preset]))  # fmt: skip
        if labels == "given":
            self.needs = self.needs | {"labels"}

    @classmethod
    def estimated_cost(cls, params: dict, case) -> float:
        """One gradient-matching evaluation per local step and iteration (the simulation's double backward)."""
        steps = int((getattr(case, "protocol_params", None) or {}).get("local_steps") or getattr(case, "local_steps", 1) or 1)
        return float(params.get("iterations", 400)) * steps

    @staticmethod
    def local_training(update: Update, batch_size: int) -> tuple[float, int, int]:
        """(lr, local_steps, local mini-batch size) of the update: FedAvg's from its meta; a gradient: one step on
        the whole batch at lr 1 (delta / lr is then the gradient)."""
        if update.kind == "gradient":
            return 1.0, 1, batch_size
        if update.kind != "delta":
            raise UnsupportedCase(f"update kind {update.kind!r} is neither a gradient nor a FedAvg delta")
        meta = update.meta
        if not meta.get("lr"):
            raise UnsupportedCase("fedavg-leakage needs the delta's local learning rate")
        return float(meta["lr"]), int(meta.get("local_steps") or 1), int(meta.get("local_batch_size") or batch_size)

    def fixed_labels(self, update: Update, model: nn.Module, names: list[str], k: Knowledge, steps: int,
                     rng: torch.Generator) -> Tensor:  # fmt: skip
        B = int(k.batch_size)  # type: ignore[arg-type]
        if self.labels == "given":
            if k.labels is None:
                raise UnsupportedCase("labels = 'given' but the observation holds no labels")
            return k.labels.sort().values
        if self.labels == "geng-avg":
            return trajectory_counts(update, model, names, k, B, steps, rng)
        from gleak.attacks.idlg import recover_labels

        gradient, _ = observed_gradient(update, names, next(model.parameters()).dtype)
        return recover_labels(gradient, model, k, B, self.labels, rng).sort().values

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        model, names, params = attack_model(observation)
        k = observation.knowledge
        if k.batch_size is None or k.mean is None or k.std is None:
            raise UnsupportedCase("fedavg-leakage needs the batch size and the data mean/std")
        if len(k.input_shape) != 3:
            raise UnsupportedCase("fedavg-leakage reconstructs images (C, H, W)")
        missing = [n for n in names if n not in observation.update.tensors]
        if missing:
            raise UnsupportedCase(f"the update has no tensor for parameter(s) {', '.join(missing[:3])}")
        B, dtype = int(k.batch_size), params[0].dtype
        lr, steps, bs = self.local_training(observation.update, B)
        plan = local_batches(B, bs, steps)
        E = plan[-1][0] + 1 if self.epoch_vars == "separate" else 1
        k_batches = -(-E * B // bs)  # their k_batches: the mini-batches over all the variables (every epoch's)
        y = self.fixed_labels(observation.update, model, names, k, steps, rng)
        target = [observation.update.tensors[n].detach().to(dtype) / lr for n in names]
        weights = layer_weights(names, self.layers)
        tnorm = sum(float(t.pow(2).sum()) for t in target) ** 0.5
        mean, std = k.mean.to(dtype), k.std.to(dtype)
        conv = None
        if self._features == "conv" and self._prior != "none" and E > 1:
            c = k.input_shape[0]
            conv = torch.randn((CONV_FEATURES, c, 3, 3), generator=rng, dtype=dtype) / math.sqrt(9 * c)
        x = torch.randn((E, B, *k.input_shape), generator=rng, dtype=dtype).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=self._lr)
        half = max(self.iterations // 2, 1)

        def rec_loss(xv: Tensor) -> Tensor:
            sim = simulated_delta(model, names, list(xv), y, lr, steps, bs)
            sim = [s / lr for s in sim]
            if self.distance == "l2":
                return torch.stack([w * (s - t).pow(2).sum() for w, s, t in zip(weights, sim, target)]).sum() / k_batches
            dot = torch.stack([w * (s * t).sum() for w, s, t in zip(weights, sim, target)]).sum()
            snorm = torch.stack([s.pow(2).sum() for s in sim]).sum().sqrt()
            return 1 - dot / (snorm * tnorm + 1e-12)

        rec = torch.zeros(())
        for i in range(self.iterations):
            for group in opt.param_groups:
                group["lr"] = self._lr * 0.995 ** (i / 10)
            fac = 2.0 ** min((i + 1) / half, 1.0)
            rec = rec_loss(x)
            loss = fac * rec + self._tv * total_variation(x) + self._clip * clip_prior(x, mean, std)
            if self._prior != "none" and self._reorder > 0 and E > 1:
                loss = loss + self._reorder * epoch_prior(x, self._prior, conv)
            opt.zero_grad()
            loss.backward()
            opt.step()
            report_progress(i + 1, self.iterations, rec.detach())
        x = x.detach()
        images = (x * std.view(-1, 1, 1) + mean.view(-1, 1, 1)).clamp(0, 1)
        aligned = [x[0]] + [x[e][match_to(images[0], images[e])] for e in range(1, E)]
        out = torch.stack(aligned).mean(0)
        extra = {"rec_loss": float(rec.detach()), "epochs": E, "local_steps": steps, "label_rule": self.labels}
        return Reconstruction(x=out, y=y, extra=extra)
