"""How a client turns its batch into an update, and how updates travel through a defense to the observer.

FedSGD: the client sends the gradient of its mean cross-entropy loss at the global parameters.
FedAvg: the client takes `local_steps` SGD steps and sends w_before - w_after (kind "delta").
Every gradient a client computes goes through its defense's `client_gradient` hook (the plain mean-loss gradient by
default; DP-SGD clips per example and adds noise there), so the trial and the utility loop share one client.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from gleak.errors import NonFiniteUpdate
from gleak.plugin import Defense
from gleak.threat import ClientBatch, Update


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy averaged over the batch: the loss every attack here assumes the client minimises."""
    return F.cross_entropy(logits, y)


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def batch_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient of the mean loss over (x, y), one tensor per trainable parameter (model untouched)."""
    params = trainable(model)
    loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, [p for _, p in params])
    return {n: g.detach() for (n, _), g in zip(params, grads)}


def _gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, defense: Defense | None, rng: torch.Generator | None):
    if defense is None:
        return batch_gradient(model, x, y)
    if rng is None:
        raise ValueError("a defense's client_gradient needs the client's generator")
    return defense.client_gradient(model, x, y, rng)


def fedsgd_update(model: nn.Module, batch: ClientBatch, defense: Defense | None = None, rng: torch.Generator | None = None) -> Update:
    """The client's gradient on its batch (the defense's `client_gradient`, plain mean-loss gradient by default)."""
    return Update(_gradient(model, batch.x, batch.y, defense, rng), "gradient", batch.size)


def fedavg_update(
    model: nn.Module, batch: ClientBatch, lr: float, local_steps: int, local_batch_size: int | None = None,
    defense: Defense | None = None, rng: torch.Generator | None = None,
) -> Update:  # fmt: skip
    """`local_steps` of plain SGD on the batch (in order, mini-batches of local_batch_size); send w_before - w_after.
    Each step's gradient comes from the defense's `client_gradient` (plain by default)."""
    local = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in trainable(local)}
    bs = local_batch_size or batch.size
    for step in range(local_steps):
        lo = (step * bs) % batch.size
        xb, yb = batch.x[lo : lo + bs], batch.y[lo : lo + bs]
        grads = _gradient(local, xb, yb, defense, rng)
        with torch.no_grad():
            for n, p in trainable(local):
                p.add_(grads[n], alpha=-lr)  # torch.optim.SGD's step without momentum, bit for bit
    delta = {n: before[n] - p.detach() for n, p in trainable(local)}
    return Update(delta, "delta", batch.size, {"lr": lr, "local_steps": local_steps, "local_batch_size": bs})


def check_finite(update: Update, who: str) -> None:
    ok, name = update.is_finite()
    if not ok:
        raise NonFiniteUpdate(f"{who}: update has NaN or infinity in parameter {name!r}")


def transmit(defenses: list[Defense], updates: list[Update], rng: torch.Generator, where: str = "") -> list[Update]:
    """Client i sends `defenses[i].transform(updates[i])` (one defense instance per client, since a defense may keep
    state across rounds). Returns what the clients sent, in client order. `where` prefixes the errors (a round)."""
    name = defenses[0].registered_name or type(defenses[0]).__name__
    sent = []
    for i, (d, u) in enumerate(zip(defenses, updates)):
        check_finite(u, f"{where}client {i}")
        s = d.transform(u, rng)
        check_finite(s, f"{where}defense {name!r} on client {i}")
        sent.append(s)
    return sent


def send_round(defenses: list[Defense], updates: list[Update], rng: torch.Generator) -> Update:
    """One round on the wire: the observer sees `defenses[0].observe(transmit(...))`. The victim is client 0."""
    return defenses[0].observe(transmit(defenses, updates, rng), rng)


def server_step(model: nn.Module, sent: list[Update], lr: float) -> nn.Module:
    """The next global model (a new module): the server applies the mean of the clients' sent updates,
    w - lr * mean gradient (FedSGD) or w - mean delta (FedAvg: the delta already holds the local learning rate).
    Under secure aggregation the server learns only the sum, which is all this needs."""
    mean = Update.sum(sent).map(lambda _, t: t / len(sent))
    step = lr if mean.kind == "gradient" else 1.0
    new = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in trainable(new):
            p -= step * mean[n].to(p.dtype)
    return new
