"""R-GAP: Recursive Gradient Attack on Privacy (Zhu and Blaschko, ICLR 2021, arXiv:2010.07733; code
JunyiZhu-AI/R-GAP, wrapped by breaching's `rgap`).

A closed-form attack on one sample (batch size 1). Write every layer as z_i = W_i x_i (+ b_i), x_{i+1} = sigma(z_i),
and let k_i = dL/dz_i. The observed weight gradient of layer i is linear in its input x_i for a known k_i:

    fully connected: dW_i = k_i x_i^T                    (x_i = dW_i^T k_i / ||k_i||^2)
    convolution:     dW_i[f, q] = sum_l k_i[f, l] x_i[q, l]   (the unfolded input: "gradient constraints")

and a convolution's output is linear in x_i as well (W_i x_i + b_i = z_i, the "forward constraints"; the layer above
gives z_i = sigma^{-1}(x_{i+1})). The recursion starts at the classifier, where k_L comes from the loss, and walks
down: x_{i+1} recovered -> z_i = sigma^{-1}(x_{i+1}) -> k_i = (W_{i+1}^T k_{i+1}) * sigma'(z_i) -> solve layer i's
constraints for x_i (least squares: exact when the stacked system has full column rank) -> ... -> the input image.

Rank analysis (the paper's section 4): a layer is invertible when its gradient and forward constraints together
have rank equal to its number of unknowns (the input's entries; zero padding is known and substituted, which is the
authors' padding constraint). The numerical rank is measured from the singular values of each layer's system; where
it falls short, least squares returns the minimum-norm solution (as the authors' `lstsq`) and the error carries down.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from scipy import sparse
from torch import Tensor, nn

from gleak.attacks._gradmatch import attack_model, observed_gradient
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, check_choice
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Observation, Reconstruction

ACTIVATIONS = (nn.LeakyReLU, nn.Sigmoid, nn.Tanh, nn.Identity)
PARAMETRIC = (nn.Linear, nn.Conv2d)
# Most unknowns (input entries) one convolution may have: its dense normal matrix is unknowns^2 float64 (a 3x32x32
# input: 75 MB, eigendecomposed in about 20 s on one core); beyond 8192 (540 MB) the attack declines.
MAX_UNKNOWNS = 8192


@dataclass
class Stage:
    """One parametric layer and the element-wise or reshaping modules that follow it up to the next one."""

    name: str
    layer: nn.Module
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    post: list[tuple[nn.Module | None, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # None: reshape


@dataclass
class LayerRank:
    name: str
    unknowns: int
    gradient_constraints: int
    forward_constraints: int
    rank: int

    @property
    def deficiency(self) -> int:
        return self.unknowns - self.rank

    @property
    def count_deficiency(self) -> int:
        """Unknowns minus the number of constraints: the counting bound of the paper's rank analysis."""
        return max(0, self.unknowns - self.gradient_constraints - self.forward_constraints)


def _why_not(module: nn.Module) -> str | None:
    """Why R-GAP cannot pass through `module` (None when it can)."""
    if isinstance(module, nn.LeakyReLU):
        return None if module.negative_slope > 0 else "LeakyReLU with slope <= 0 is not invertible"
    if isinstance(module, ACTIVATIONS) or isinstance(module, nn.Flatten):
        return None
    if isinstance(module, nn.Linear):
        return None
    if isinstance(module, nn.Conv2d):
        if module.groups != 1 or tuple(module.dilation) != (1, 1) or module.padding_mode != "zeros":
            return "only plain convolutions (groups 1, dilation 1, zero padding) are written as matrices here"
        if isinstance(module.padding, str):
            return "convolution padding given as a string; R-GAP needs explicit padding"
        return None
    name = type(module).__name__
    if isinstance(module, (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                           nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)):  # fmt: skip
        return f"{name}: R-GAP covers fully connected and convolutional layers without pooling"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return f"{name}: R-GAP covers fully connected and convolutional layers, not normalisation layers"
    if isinstance(module, nn.ReLU):
        return ("ReLU is not invertible (a zeroed unit loses its pre-activation); R-GAP needs an invertible "
                "activation such as the paper's LeakyReLU, or sigmoid / tanh")  # fmt: skip
    return f"{name} is not a layer R-GAP inverts (Linear, Conv2d, Flatten, LeakyReLU, Sigmoid, Tanh, Identity)"


def model_chain(model: nn.Module, input_shape: tuple[int, ...]) -> list[Stage]:
    """The model as a chain of stages, or UnsupportedCase saying why it is not one R-GAP can walk back through."""
    order: list[tuple[nn.Module, tuple[int, ...], tuple[int, ...]]] = []
    leaves = [m for m in model.modules() if not list(m.children())]
    for m in leaves:
        reason = _why_not(m)
        if reason is not None:
            raise UnsupportedCase(f"rgap cannot invert this model: {reason}")
    hooks = [m.register_forward_hook(lambda m, i, o: order.append((m, tuple(i[0].shape[1:]), tuple(o.shape[1:]))))
             for m in leaves]  # fmt: skip
    dtype = next(model.parameters()).dtype
    probe = torch.randn((1, *input_shape), generator=torch.Generator().manual_seed(0), dtype=dtype)
    try:
        with torch.no_grad():
            expected = model(probe)
    finally:
        for h in hooks:
            h.remove()
    # Replaying the recorded modules in order must give the model's output: then the model is a plain chain. A
    # functional reshape between two modules (LeNet's `.flatten(1)`) is kept as a reshape step (module None).
    chain: list[tuple[nn.Module | None, tuple[int, ...], tuple[int, ...]]] = []
    with torch.no_grad():
        out = probe
        for m, i_shape, o_shape in order:
            here = tuple(out.shape[1:])
            if here != i_shape:
                if torch.Size(here).numel() != torch.Size(i_shape).numel():
                    raise UnsupportedCase("rgap needs the model to be a plain chain of layers (no skip connections)")
                chain.append((None, here, i_shape))
                out = out.reshape(1, *i_shape)
            out = m(out)
            chain.append((m, i_shape, o_shape))
    if out.shape != expected.shape or not torch.allclose(out, expected, rtol=1e-5, atol=1e-6):
        raise UnsupportedCase("rgap needs the model to be a plain chain of layers (no skip connections or functional ops)")
    names = {id(m): n for n, m in model.named_modules()}
    stages: list[Stage] = []
    for m, i_shape, o_shape in chain:
        if isinstance(m, PARAMETRIC):
            stages.append(Stage(names[id(m)], m, i_shape, o_shape))
        elif not stages:
            if m is not None and not isinstance(m, (nn.Flatten, nn.Identity)):
                raise UnsupportedCase(f"rgap cannot invert a {type(m).__name__} applied to the raw input")
        else:
            stages[-1].post.append((m, i_shape, o_shape))
    if not stages or not isinstance(stages[-1].layer, nn.Linear):
        raise UnsupportedCase("rgap needs the model to end in a fully connected classifier")
    if any(m is not None and not isinstance(m, nn.Identity) for m, _, _ in stages[-1].post):
        raise UnsupportedCase("rgap needs the classifier's logits to reach the loss directly")
    counted = {id(p) for s in stages for p in s.layer.parameters()}
    if any(id(p) not in counted for p in model.parameters() if p.requires_grad):
        raise UnsupportedCase("rgap cannot invert a model whose parameters are not all in its layer chain")
    return stages


def _undo_activation(act: nn.Module, v: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(pre-activation, derivative at it) for the activation's output v."""
    if isinstance(act, nn.LeakyReLU):
        a = act.negative_slope
        pre = torch.where(v > 0, v, v / a)
        return pre, torch.where(pre > 0, torch.ones_like(v), torch.full_like(v, a))
    if isinstance(act, nn.Sigmoid):  # the clamp only matters for a perturbed gradient (a defense's noise)
        s = v.clamp(eps, 1 - eps)
        return torch.logit(s), s * (1 - s)
    if isinstance(act, nn.Tanh):
        t = v.clamp(-1 + eps, 1 - eps)
        return torch.atanh(t), 1 - t * t
    return v, torch.ones_like(v)  # Identity


def _solve(a: sparse.csr_matrix, b: np.ndarray, rank_tol: float) -> tuple[np.ndarray, int]:
    """Least squares a x = b through the eigendecomposition of a^T a (pseudo-inverse below rank_tol, relative to
    the largest singular value), refined once on the residual. Returns (x, numerical rank). a is sparse: a^T a
    costs the sum of squared row lengths, not rows x unknowns^2."""
    g = (a.T @ a).toarray()
    evals, vecs = np.linalg.eigh(g)
    top = max(float(evals.max()), 0.0)
    if not top > 0:
        return np.zeros(a.shape[1]), 0
    keep = evals > (rank_tol**2) * top
    v, inv = vecs[:, keep], 1.0 / evals[keep]

    def apply(rhs: np.ndarray) -> np.ndarray:
        return v @ ((v.T @ (a.T @ rhs)) * inv)

    x = apply(b)
    x = x + apply(b - a @ x)  # one step of iterative refinement: squares the normal equations' error away
    return x, int(keep.sum())


def _conv_system(layer: nn.Conv2d, in_shape: tuple[int, ...], k: Tensor) -> tuple[sparse.csr_matrix, sparse.csr_matrix, int]:
    """(gradient-constraint matrix K, forward-constraint matrix M, unknowns): dW.flatten() = K x and
    (z - b).flatten() = M x for the unpadded input x, with padding substituted as known zeros."""
    c, h, w = in_shape
    kh, kw = layer.kernel_size
    ph, pw = layer.padding
    hp, wp = h + 2 * ph, w + 2 * pw
    # Which unknown every padded position is (-1: padding, a known zero).
    colmap = torch.full((c, hp, wp), -1, dtype=torch.long)
    colmap[:, ph : ph + h, pw : pw + w] = torch.arange(c * h * w).view(c, h, w)
    where = torch.arange(c * hp * wp, dtype=torch.float64).view(1, c, hp, wp)
    picked = F.unfold(where, (kh, kw), stride=layer.stride).round().long()[0]  # (Q = c kh kw, L positions)
    cols = colmap.flatten()[picked]
    n_out, q_len, n_pos = k.shape[0], picked.shape[0], picked.shape[1]
    kk = k.reshape(n_out, n_pos)
    weight = layer.weight.detach().reshape(n_out, -1).to(k.dtype)
    f_idx = torch.arange(n_out).view(-1, 1, 1).expand(n_out, q_len, n_pos)
    q_idx = torch.arange(q_len).view(1, -1, 1).expand_as(f_idx)
    l_idx = torch.arange(n_pos).view(1, 1, -1).expand_as(f_idx)
    mask = (cols >= 0).unsqueeze(0).expand_as(f_idx)
    f_sel, q_sel, l_sel = f_idx[mask], q_idx[mask], l_idx[mask]
    col_sel = cols.unsqueeze(0).expand_as(f_idx)[mask].numpy()
    n = c * h * w
    k_mat = sparse.coo_matrix(
        (kk[f_sel, l_sel].numpy(), ((f_sel * q_len + q_sel).numpy(), col_sel)), shape=(n_out * q_len, n)
    ).tocsr()  # duplicates (none arise for a plain convolution) would be summed
    m_mat = sparse.coo_matrix(
        (weight[f_sel, q_sel].numpy(), ((f_sel * n_pos + l_sel).numpy(), col_sel)), shape=(n_out * n_pos, n)
    ).tocsr()
    return k_mat, m_mat, n


def _last_layer(dw: Tensor, db: Tensor | None, weight: Tensor, label: int | None) -> tuple[Tensor, Tensor, int]:
    """(k_L = dL/dlogits, the classifier's input, the label) from the classifier's gradient.

    With a bias, k_L = db (exact) and the label is its one negative entry (p - onehot(y)). Without one (the authors'
    models), dW = k x^T is rank one: x = s v for its top right singular vector v, the label is the entry of k whose
    sign differs from the others, and the scale s follows from softmax: for j != y, log k_j = s (W v)_j + const, a
    line whose slope is s (the authors' code solves the one-output logistic case instead; this is its softmax form).
    """
    if db is not None:
        k = db
        y = int(torch.argmin(k)) if label is None else label
        norm = (k * k).sum()
        return k, (dw.T @ k / norm if norm > 0 else torch.zeros(dw.shape[1], dtype=dw.dtype)), y
    u, s, vh = torch.linalg.svd(dw, full_matrices=False)
    u0, v0 = u[:, 0] * s[0], vh[0]
    if label is None:
        positive = u0 > 0  # k = p - onehot(y): one entry's sign differs from all the others (u's sign is free)
        if int(positive.sum()) == 1:
            y = int(torch.argmax(positive.int()))
        elif int((~positive).sum()) == 1:
            y = int(torch.argmax((~positive).int()))
        else:  # a perturbed gradient: fall back to the most negative entry
            y = int(torch.argmin(u0))
    else:
        y = label
    others = [j for j in range(len(u0)) if j != y and u0[j] != 0]
    if len(others) < 2:
        raise UnsupportedCase("rgap needs at least two non-label classes to scale a bias-free classifier's input")
    t = (weight @ v0)[others]
    logk = u0[others].abs().log()
    design = torch.stack([t, torch.ones_like(t)], dim=1)
    scale = torch.linalg.lstsq(design, logk.unsqueeze(1)).solution[0, 0]
    x = scale * v0
    return dw @ x / (x @ x), x, y


@register_attack("rgap")
class RGAP(Attack):
    """R-GAP (Zhu and Blaschko, ICLR 2021): closed-form recursive inversion, last layer to input, with rank analysis.

    Supports batch size 1 (as the paper) on a plain chain of nn.Linear / nn.Conv2d layers (any stride and zero
    padding) with invertible element-wise activations: LeakyReLU (the paper's models, slope 0.2), Sigmoid, Tanh or
    none, Flatten between them, ending in a linear classifier under cross entropy. Anything else (pooling,
    BatchNorm, ReLU, skip connections, batches) raises UnsupportedCase with the reason.

    Parameters
    ----------
    labels: "recover" (default): the label is read from the classifier's gradient (its bias gradient's one negative
        entry, or the odd-signed entry of the rank-one weight gradient without a bias); exact at batch size 1. The
        authors' code assumes the label known; "given" does that (adds "labels" to `needs`).
    rank_tol: singular values below rank_tol x the largest count as zero in a layer's system (the numerical rank).
    eps: how far from the ends of (0, 1) / (-1, 1) a perturbed sigmoid / tanh output is clamped before inversion.

    Known deviations: the classifier step is the softmax cross-entropy form of the authors' one-output logistic
    step (see `_last_layer`); fully connected hidden layers use only their gradient constraints, as the authors' code
    ("for computational efficiency"); convolution systems are solved in float64 by the normal equations with one
    refinement step (the authors call numpy's lstsq); a FedAvg delta is read as a gradient (delta / (lr * steps)).
    extra: rank_deficiency (sum over layers of unknowns minus numerical rank: 0 = every layer invertible),
    invertible, count_deficiency (the same from constraint counts), deficiency/<layer> and rank/<layer> per layer,
    and gradient_residual (relative distance between the reconstruction's gradient and the observed one).
    """

    needs = frozenset({"architecture", "parameters", "batch_size"})

    def __init__(self, labels: Literal["recover", "given"] = "recover", rank_tol: float = 1e-6, eps: float = 1e-6):
        check_choice("labels", labels, ("recover", "given"))
        if not 0 < rank_tol < 1:
            raise ValueError(f"rank_tol must be in (0, 1), got {rank_tol}")
        if not 0 < eps < 0.5:
            raise ValueError(f"eps must be in (0, 0.5), got {eps}")
        self.labels, self.rank_tol, self.eps = labels, rank_tol, eps
        if labels == "given":
            self.needs = self.needs | {"labels"}

    @classmethod
    def estimated_cost(cls, params, case) -> float:
        return 50.0  # a few dense solves: about as long as 50 forward-backward passes of a small net

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        k = observation.knowledge
        if k.batch_size != 1:
            raise UnsupportedCase(f"rgap inverts one sample (batch size 1, as the paper), got batch size {k.batch_size}")
        model, names, params = attack_model(observation)
        out_dtype = params[0].dtype
        model = model.double()
        stages = model_chain(model, tuple(k.input_shape))
        gradient, extra = observed_gradient(observation.update, names, torch.float64)
        if self.labels == "given" and k.labels.is_floating_point():
            raise UnsupportedCase("rgap's closed form needs the sample's class; it was given soft labels")
        label = int(k.labels[0]) if self.labels == "given" else None
        x, y, ranks = self.invert(model, stages, gradient.tensors, label)
        x = x.reshape(1, *k.input_shape)
        extra.update(_rank_extra(ranks))
        extra["gradient_residual"] = _gradient_residual(model, names, x, y, gradient.tensors)
        return Reconstruction(x=x.to(out_dtype), y=torch.tensor([y]), extra=extra)

    def invert(self, model: nn.Module, stages: list[Stage], grads: dict[str, Tensor], label: int | None):
        """(input, label, per-layer LayerRank from the classifier down) by the recursion."""
        last = stages[-1]
        dw, db = grads[f"{last.name}.weight"], grads.get(f"{last.name}.bias")
        k_out, x_in, y = _last_layer(dw, db, last.layer.weight.detach(), label)
        n = x_in.numel()
        ranks = [LayerRank(last.name, n, dw.numel(), 0, n if bool((k_out != 0).any()) else 0)]
        x_in = x_in.reshape(last.in_shape)
        for below, above in zip(reversed(stages[:-1]), reversed(stages[1:])):
            # dL/d(input of the layer above), then back through the activations between the two layers.
            xx = x_in.unsqueeze(0).requires_grad_(True)
            (gx,) = torch.autograd.grad(above.layer(xx), xx, k_out.reshape(1, *above.out_shape))
            v, gv = x_in.detach(), gx[0]
            for op, op_in, _ in reversed(below.post):
                v, gv = v.reshape(op_in), gv.reshape(op_in)
                if op is not None and not isinstance(op, nn.Flatten):
                    v, d = _undo_activation(op, v, self.eps)
                    gv = gv * d
            z, k_out = v.reshape(below.out_shape), gv.reshape(below.out_shape)
            x_in, rank = self._solve_layer(below, grads, z, k_out)
            ranks.append(rank)
        return x_in.detach(), y, ranks

    def _solve_layer(self, stage: Stage, grads: dict[str, Tensor], z: Tensor, k: Tensor) -> tuple[Tensor, LayerRank]:
        dw = grads[f"{stage.name}.weight"]
        layer = stage.layer
        if isinstance(layer, nn.Linear):
            norm = (k * k).sum()
            x = dw.T @ k / norm if norm > 0 else torch.zeros(layer.in_features, dtype=k.dtype)
            n = layer.in_features
            return x.reshape(stage.in_shape), LayerRank(stage.name, n, dw.numel(), 0, n if norm > 0 else 0)
        n_in = int(torch.Size(stage.in_shape).numel())
        if n_in > MAX_UNKNOWNS:
            raise UnsupportedCase(f"rgap: layer {stage.name!r} has {n_in} unknowns, more than {MAX_UNKNOWNS} (its dense "
                                  "normal matrix would not fit a small machine)")  # fmt: skip
        k_mat, m_mat, n = _conv_system(layer, stage.in_shape, k)
        rhs_forward = z - (layer.bias.detach().view(-1, 1, 1) if layer.bias is not None else 0)
        a = sparse.vstack([k_mat, m_mat]).tocsr()
        b = torch.cat([dw.reshape(-1), rhs_forward.reshape(-1)]).numpy()
        x, rank = _solve(a, b, self.rank_tol)
        x_t = torch.from_numpy(x).to(k.dtype).reshape(stage.in_shape)
        return x_t, LayerRank(stage.name, n, dw.numel(), z.numel(), rank)


def _rank_extra(ranks: list[LayerRank]) -> dict:
    out: dict = {
        "rank_deficiency": sum(r.deficiency for r in ranks),
        "count_deficiency": sum(r.count_deficiency for r in ranks),
        "invertible": all(r.deficiency == 0 for r in ranks),
    }
    for r in ranks:
        out[f"deficiency/{r.name}"] = r.deficiency
        out[f"rank/{r.name}"] = f"{r.rank}/{r.unknowns}"
    return out


def _gradient_residual(model: nn.Module, names: list[str], x: Tensor, y: int, grads: dict[str, Tensor]) -> float:
    """||grad(x, y) - observed|| / ||observed||: how well the reconstruction explains what was seen."""
    params = dict(model.named_parameters())
    loss = F.cross_entropy(model(x.to(torch.float64)), torch.tensor([y]))
    mine = torch.autograd.grad(loss, [params[n] for n in names])
    num = sum(float((g - grads[n]).pow(2).sum()) for g, n in zip(mine, names))
    den = sum(float(grads[n].pow(2).sum()) for n in names)
    return (num / den) ** 0.5 if den > 0 else float("nan")
