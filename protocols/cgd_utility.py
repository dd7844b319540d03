"""CGD's utility runs (protocols/cgd.py, train_utility): the training samples and the network's sizes, the centralized
baseline every CGD and local-training row compares with, and the per-participant path through run_rounds that
the vectorised engine (protocols/cgd_training.py) is the fast path of."""
from __future__ import annotations

import copy
import json
import time
from typing import Any

import torch
from gleak.protocols.cgd_training import Partition, blocks, init_deltas, participant_init, train
from gleak.protocols.cgd_vertical import VerticalBlock, initial_blocks
from torch import nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.seeds import derive_seed
from gleak.contracts.wire import ClientBatch
from gleak.mechanics.accountant import PrivacyAccountant
from gleak.mechanics.models import create_model
from gleak.mechanics.rounds import Schedule, run_rounds

_CENTRAL_CACHE: dict[str, Any] = {}


def centralized(x, y, x_test, y_test, common: dict) -> Any:
    """Centralized training (one participant, all data) with the same init law and schedule; cached per process
    because every CGD and local row of a suite compares with it."""
    # One participant: nothing is shared, so neither the gradient scale nor the encoding matters.
    common = {**common, "grad_scale": "data", "frac_bits": 24}
    key = json.dumps({k: v for k, v in common.items() if k != "progress"}, sort_keys=True) + f"/{len(y)}/{float(x.sum())}"
    if key not in _CENTRAL_CACHE:
        _CENTRAL_CACHE[key] = train(x, y, x_test, y_test, partition=Partition(1, 1), mode="cgd", secure_sum="float",
                                    eval_participants=1, **common)  # fmt: skip
    return _CENTRAL_CACHE[key]


def mlp_sizes(config: Any, train_ds: Any) -> list[int]:
    if config.model != "mlp":
        raise UnsupportedCase(f"CGD trains the paper's fully connected ReLU network (model 'mlp'), not {config.model!r}")
    params = dict(config.model_params or {})
    if params.get("activation", "relu") != "relu":
        raise UnsupportedCase("CGD's vectorised training supports ReLU hidden layers only")
    hidden = [int(h) for h in params.get("hidden", [256])]
    d = int(torch.Size(train_ds.input_shape).numel())
    return [d, *hidden, train_ds.num_classes]


def features(ds: Any, idx: Any, inputs: str) -> torch.Tensor:
    """Flattened inputs: pixels in [0, 1], or standardised with the train split's mean and std (gleak's default)."""
    x = ds.x[idx] if inputs == "pixels" else ds.normalized(idx)
    return x.flatten(1)


def subset(ds: Any, n: int | None, seed: int, inputs: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The training samples in a seeded random order (the first n of them when n is set): blocks are then IID."""
    g = torch.Generator().manual_seed(derive_seed(seed, "cgd/train-order"))
    order = torch.randperm(len(ds), generator=g)
    if n is not None:
        order = order[: min(n, len(ds))]
    return features(ds, order, inputs), ds.y[order]


def train_per_participant(
    proto: Any, config: Any, train_ds: Any, test_ds: Any, defense: tuple[str, dict[str, Any]] = ("none", {}),
    dtype: torch.dtype = torch.float32, models_only: bool = False,
) -> Any:  # fmt: skip
    """A utility run of `proto` (cgd or local-training) participant by participant through run_rounds:
    full-batch rounds on each participant's sample block, from the engine's initial models
    (participant_init), each participant's gradients through its defense; vertical partitions (vfl reading) one
    client per sample block (protocols/cgd_vertical.py). `models_only`: return the trained models (the engine's
    equality tests)."""
    from gleak.contracts.registry import create

    t0 = time.perf_counter()
    part = Partition.parse(proto.partition)
    vertical = part.cols > 1 and proto._mode == "cgd"
    if part.cols > 1 and (not vertical or getattr(proto, "vertical", "vfl") != "vfl"):
        raise UnsupportedCase("CGD's per-participant path runs horizontal partitions and vertical ones in the vfl reading")
    sizes = mlp_sizes(config, train_ds)
    x, y = subset(train_ds, proto.train_samples, config.seed, proto.inputs)
    x_test, y_test = features(test_ds, slice(None), proto.inputs), test_ds.y
    seed = derive_seed(config.seed, "cgd")
    if vertical:  # one client per sample block (protocols/cgd_vertical.py)
        deltas = init_deltas(part.m, proto.delta, proto.delta_high, seed)
        models, batches = initial_blocks(part, deltas, x, y, sizes, seed, dtype, proto.init_law)
    else:
        models, batches = initial_participants(proto, x, y, sizes, seed, dtype)
    defenses = [create("defense", defense[0], **defense[1]) for _ in models]
    for d in defenses:
        d.reset()
        d.bind_accountant(PrivacyAccountant())  # this client's own, stepped by its noisy steps
    rngs = [torch.Generator().manual_seed(derive_seed(config.seed, f"cgd/client/{i}")) for i in range(len(models))]
    wire = torch.Generator().manual_seed(derive_seed(config.seed, "cgd/wire"))
    proto = copy.copy(proto)  # the utility run's schedule: alpha = [utility] server_lr over T = [utility] training_rounds
    proto.alpha, proto.iterations = config.server_step, config.training_rounds
    if vertical:
        proto.split_features = True  # the fixed-point sums then count every participant of a block as an addend
    proto.reset()
    proto._models = list(models)
    schedule = Schedule(lambda r: batches, lambda r: rngs, lambda r: wire)
    models, _ = run_rounds(proto, defenses, models, config.training_rounds, schedule, config.server_step, observe=False)
    if models_only:  # the engine's equality test compares the models themselves
        return models
    members = [p for m in models for p in (m.members if isinstance(m, VerticalBlock) else [m])]
    accs = torch.tensor([participant_accuracy(m, x_test, y_test) for m in members])
    spent = [d.privacy_spent() for d in defenses]  # each participant's accountant: full-batch steps
    eps = max(spent) if spent and None not in spent else None
    return {"accuracy": float(accs.min()), "mean_accuracy": float(accs.mean()), "best_accuracy": float(accs.max()),
            "participants": len(members), "iterations": config.training_rounds, "train_samples": len(y), "epsilon": eps,
            "path": "per-participant", "seconds": time.perf_counter() - t0}  # fmt: skip


def participant_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x.to(next(model.parameters()).dtype)).argmax(1) == y).double().mean())


def initial_participants(
    proto: Any, x: torch.Tensor, y: torch.Tensor, sizes: list[int], seed: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[nn.Module], list[ClientBatch]]:  # fmt: skip
    """The m = rows participants of a horizontal partition as modules and batches: participant l holds sample
    block l of (x, y) (cgd_training.blocks, in order) and starts from the engine's initial model
    (cgd_training.participant_init, its own delta from init_deltas), so that run_rounds and the engine train the
    same models."""
    part = Partition.parse(proto.partition)
    deltas = init_deltas(part.m, proto.delta, proto.delta_high, seed)
    models, batches = [], []
    zero = torch.zeros(1)
    for l, (lo, hi) in enumerate(blocks(len(y), part.rows)):
        params = participant_init(l, sizes[0], sizes[0], sizes, float(deltas[l]), seed, torch.float64, proto.init_law)
        model = create_model("mlp", (sizes[0],), sizes[-1], hidden=sizes[1:-1], dtype=dtype)
        linears = [mod for mod in model.modules() if isinstance(mod, nn.Linear)]
        with torch.no_grad():
            for r, lin in enumerate(linears):
                lin.weight.copy_(params[2 * r].T.to(dtype))
                lin.bias.copy_(params[2 * r + 1].to(dtype))
        models.append(model)
        batches.append(ClientBatch(x[lo:hi].to(dtype), y[lo:hi], zero, zero + 1))
    return models, batches
