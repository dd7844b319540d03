"""The model a trial attacks: freshly initialised ("untrained") or first trained on the case's training split
("trained"), as Geiping et al. 2020 (Table 1) attack both.

    model, info = build_model(case, ds, seed, dtype)

A trained model is a function of the case alone (model, data, training settings, train_seed), not of the trial
seed: like the paper, which attacks one trained network on every image, a grid trains each model once. Training
is deterministic (plain SGD with momentum 0.9 and weight decay 5e-4 at a constant learning rate, mini-batches drawn
from a generator seeded by train_seed, no augmentation) and cached twice: in the process, and on disk under
$GLEAK_CACHE (default ~/.cache/gleak)/models/, written atomically under a file lock so that parallel workers wait
for the one that trains instead of training again.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from torch import nn

from gleak.config import CaseConfig, derive_seed, generator
from gleak.data import ImageDataset
from gleak.models import create_model
from gleak.protocol import loss_fn

# Bump when training changes, so that cached weights of the old procedure are not reused.
PRETRAIN_FORMAT = 1
CACHE_ENV = "GLEAK_CACHE"
_MEMORY: dict[str, tuple[dict[str, torch.Tensor], dict[str, float]]] = {}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gleak")


def training_key(case: CaseConfig, ds: ImageDataset, dtype: torch.dtype) -> str:
    """A hash of everything the trained weights depend on."""
    ident = {
        "format": PRETRAIN_FORMAT, "model": case.model, "model_params": case.model_params, "dataset": case.dataset,
        "data_root": case.data_root, "resolution": case.resolution, "channels": case.channels,
        "input_shape": list(ds.input_shape), "classes": ds.num_classes, "samples": len(ds), "dtype": str(dtype),
        "steps": case.train_steps, "lr": case.train_lr, "batch_size": case.train_batch_size, "seed": case.train_seed,
    }  # fmt: skip
    blob = json.dumps(ident, sort_keys=True, default=str)
    return f"{case.model}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def train(model: nn.Module, ds: ImageDataset, case: CaseConfig) -> dict[str, float]:
    """Train `model` in place on the whole training split; return its accuracy and loss there afterwards."""
    gen = generator(case.train_seed, "pretrain")
    x, y = ds.normalized().to(next(model.parameters()).dtype), ds.y
    opt = torch.optim.SGD(model.parameters(), lr=case.train_lr, momentum=0.9, weight_decay=5e-4)
    model.train()
    order, pos = torch.randperm(len(y), generator=gen), 0
    for _ in range(case.train_steps):
        if pos + case.train_batch_size > len(y):  # a new epoch: reshuffle
            order, pos = torch.randperm(len(y), generator=gen), 0
        idx = order[pos : pos + case.train_batch_size]
        pos += case.train_batch_size
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x[i : i + 256]) for i in range(0, len(y), 256)])
    return {"train_acc": float((logits.argmax(1) == y).double().mean()), "train_loss": float(loss_fn(logits, y))}


def trained_state(case: CaseConfig, ds: ImageDataset, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The trained weights and their training accuracy/loss: from memory, from disk, or trained now (once)."""
    key = training_key(case, ds, dtype)
    if key in _MEMORY:
        return _MEMORY[key]
    folder = cache_dir() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.pt"
    with FileLock(folder / f"{key}.lock", thread_local=False):  # a second worker waits here, then finds the file
        if path.is_file():
            saved = torch.load(path, map_location="cpu", weights_only=True)
            state, info = saved["state"], saved["info"]
        else:
            model = create_model(
                case.model, ds.input_shape, ds.num_classes, seed=derive_seed(case.train_seed, "pretrain-init"),
                dtype=dtype, **case.model_params,
            )  # fmt: skip
            info = train(model, ds, case)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            buf = io.BytesIO()
            torch.save({"state": state, "info": info, "key": key}, buf)
            from gleak.figures import atomic_write_bytes

            atomic_write_bytes(path, buf.getvalue())
    _MEMORY[key] = (state, info)
    return state, info


def build_model(case: CaseConfig, ds: ImageDataset, seed: int, dtype: torch.dtype) -> tuple[nn.Module, dict[str, Any]]:
    """The model of a trial, in the case's mode (train: BatchNorm uses batch statistics; eval: running ones), and
    what to record about it (training accuracy and loss of a trained model)."""
    info: dict[str, Any] = {}
    if case.model_state == "trained":
        model = create_model(case.model, ds.input_shape, ds.num_classes, seed=0, dtype=dtype, **case.model_params)
        state, stats = trained_state(case, ds, dtype)
        model.load_state_dict(state)
        info = {f"model_{k}": v for k, v in stats.items()}
    else:
        model = create_model(
            case.model, ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"), dtype=dtype, **case.model_params
        )
    model.train(case.model_mode == "train")
    return model, info
