"""How a client computes its update and what the server does with what was sent: FedSGD's gradient, FedAvg's local
steps, each client's defense applied on the way out (`transmit`), and the server's step.

These are the building blocks of a Protocol (gleak.mechanics.protocol); a protocol plugin composes them.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from gleak.contracts.errors import NonFiniteUpdate
from gleak.contracts.plugin import Defense, batch_gradient, trainable
from gleak.contracts.wire import ClientBatch, Update
from gleak.mechanics.defense_output import check_sent


def _gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, defense: Defense | None, rng: torch.Generator | None):
    if defense is None:
        return batch_gradient(model, x, y)
    if rng is None:
        raise ValueError("a defense's client_gradient needs the client's generator")
    return defense.client_gradient(model, x, y, rng)


def fedsgd_update(model: nn.Module, batch: ClientBatch, defense: Defense | None = None, rng: torch.Generator | None = None) -> Update:
    """The client's gradient on its batch (the defense's `client_gradient`, plain mean-loss gradient by default)."""
    return Update(_gradient(model, batch.x, batch.y, defense, rng), "gradient", batch.size)


def check_local_steps(local_steps: int | None, local_lr: float, local_batch_size: int | None) -> None:
    """Validate FedAvg's local-training settings (ValueError naming the parameter); local_steps None: FedSGD."""
    if local_steps is not None and local_steps < 1:
        raise ValueError(f"local_steps must be >= 1, got {local_steps}")
    if not local_lr > 0:
        raise ValueError(f"local_lr must be > 0, got {local_lr}")
    if local_batch_size is not None and local_batch_size < 1:
        raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")


def local_batches(n: int, bs: int, local_steps: int) -> list[tuple[int, int, int]]:
    """(epoch, lo, hi) of each local step: step s takes samples lo:hi of epoch (s * bs) // n's order, lo =
    (s * bs) % n (a batch that reaches the end is cut short there, not wrapped)."""
    return [((s * bs) // n, (s * bs) % n, min((s * bs) % n + bs, n)) for s in range(local_steps)]


def fedavg_update(
    model: nn.Module, batch: ClientBatch, lr: float, local_steps: int, local_batch_size: int | None = None,
    defense: Defense | None = None, rng: torch.Generator | None = None, shuffle: bool = False,
) -> Update:  # fmt: skip
    """`local_steps` of plain SGD on the batch (mini-batches of local_batch_size, `local_batches`); send w_before -
    w_after. In order, or with `shuffle` in a fresh random order each epoch (torch.randperm from `rng`, drawn when
    the epoch starts). Each step's gradient comes from the defense's `client_gradient` (plain by default)."""
    local = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in trainable(local)}
    bs = local_batch_size or batch.size
    if shuffle and rng is None:
        raise ValueError("a shuffling FedAvg client needs its generator")
    x, y, epoch = batch.x, batch.y, -1
    for e, lo, hi in local_batches(batch.size, bs, local_steps):
        if shuffle and e != epoch:
            order = torch.randperm(batch.size, generator=rng)
            x, y, epoch = batch.x[order], batch.y[order], e
        xb, yb = x[lo:hi], y[lo:hi]
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
        check_sent(u, s, f"{where}defense {name!r} on client {i}")
        check_finite(s, f"{where}defense {name!r} on client {i}")
        sent.append(s)
    return sent


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


def shifted(model: nn.Module, displacement: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of `model` with each named trainable parameter moved by `displacement[name]` (absent names stay)."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in trainable(new):
            if n in displacement:
                p += displacement[n].to(p.dtype).to(p.device)
    return new


def shift_each(models: list[nn.Module], displacement: dict[str, torch.Tensor]) -> list[nn.Module]:
    """`shifted` of each model, a model shared by several clients moved once (and still shared)."""
    moved: dict[int, nn.Module] = {}
    for m in models:
        if id(m) not in moved:
            moved[id(m)] = shifted(m, displacement)
    return [moved[id(m)] for m in models]


def client_defense(name: str, params: dict, mean, std, num_classes: int) -> Defense:
    """A fresh client's defense `name`, bound as every client's is before its first round: no state, a privacy
    accountant of its own (stepped by its noisy steps), its data's normalisation and number of classes."""
    from gleak.contracts.registry import create
    from gleak.mechanics.accountant import PrivacyAccountant

    d: Defense = create("defense", name, **params)
    d.reset()
    d.bind_accountant(PrivacyAccountant())
    d.bind_data(mean, std)
    d.bind_classes(num_classes)
    return d
