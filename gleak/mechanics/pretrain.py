"""The model a trial attacks: freshly initialised ("untrained") or first trained on the case's training split
("trained"), as Geiping et al. 2020 (Table 1) attack both.

    model, info = build_model(case, ds, seed, dtype)

A trained model is a function of the case alone (model, data, training settings, train_seed), not of the trial
seed: like the paper, which attacks one trained network on every image, a grid trains each model once. Training
is deterministic (plain SGD with momentum 0.9 and weight decay 5e-4 at a constant learning rate, mini-batches drawn
from a generator seeded by train_seed, no augmentation) and cached twice: in the process, and on disk under
$GLEAK_CACHE (default ~/.cache/gleak)/models/, written atomically under a file lock so that parallel workers wait
for the one that trains instead of training again.

A defense that changes the architecture (`Defense.wrap_model`: PRECODE's bottleneck) is part of what is trained, as
its paper trains it: the case's model is wrapped first (the wrapper's initialisation from train_seed) and every
step takes the defense's own client gradient (PRECODE: cross entropy plus beta KL), with its own cache key. Other
defenses attack the model trained without them.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from torch import nn

from gleak.contracts.config import CaseConfig
from gleak.contracts.errors import InputError
from gleak.contracts.plugin import Defense, loss_fn, trainable
from gleak.contracts.seeds import derive_seed, generator
from gleak.mechanics.data import ImageDataset
from gleak.mechanics.disk_cache import CACHE_ENV, cache_dir  # noqa: F401 - CACHE_ENV: the tests set the folder by it
from gleak.mechanics.disk_cache import tensors_digest as state_digest
from gleak.mechanics.models import create_model

# Bump when training changes, so that cached weights of the old procedure are not reused.
PRETRAIN_FORMAT = 1
_MEMORY: dict[str, tuple[dict[str, torch.Tensor], dict[str, float]]] = {}


def wraps_model(defense: Defense | None) -> bool:
    """Whether the defense changes the architecture (overrides Defense.wrap_model)."""
    return defense is not None and type(defense).wrap_model is not Defense.wrap_model


def training_key(case: CaseConfig, ds: ImageDataset, dtype: torch.dtype, wrapper: Any = None) -> str:
    """A hash of everything the trained weights depend on; `wrapper`: the (name, parameters) of the defense whose
    wrapped model is trained (None: the case's model alone, the keys of before)."""
    ident = {
        "format": PRETRAIN_FORMAT, "model": case.model, "model_params": case.model_params, "dataset": case.dataset,
        "data_root": case.data_root, "resolution": case.resolution, "channels": case.channels,
        "input_shape": list(ds.input_shape), "classes": ds.num_classes, "samples": len(ds), "dtype": str(dtype),
        "steps": case.train_steps, "lr": case.train_lr, "batch_size": case.train_batch_size, "seed": case.train_seed,
    }  # fmt: skip
    if wrapper is not None:
        ident["wrapped_by"] = wrapper
    if getattr(ds, "vocab_sha256", None):  # a text data set: the tokenizer's vocabulary (input_shape holds its size)
        ident["vocab_sha256"] = ds.vocab_sha256
    blob = json.dumps(ident, sort_keys=True, default=str)
    return f"{case.model}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def train(model: nn.Module, ds: ImageDataset, case: CaseConfig, defense: Defense | None = None) -> dict[str, float]:
    """Train `model` in place on the whole training split; return its accuracy and loss there afterwards. With a
    defense, each step's gradient is its client gradient (its randomness from a generator of train_seed)."""
    gen = generator(case.train_seed, "pretrain")
    defense_rng = generator(case.train_seed, "pretrain-defense") if defense is not None else None
    x, y = ds.model_input(None, next(model.parameters()).dtype), ds.y
    opt = torch.optim.SGD(model.parameters(), lr=case.train_lr, momentum=0.9, weight_decay=5e-4)
    model.train()
    order, pos = torch.randperm(len(y), generator=gen), 0
    for _ in range(case.train_steps):
        if pos + case.train_batch_size > len(y):  # a new epoch: reshuffle
            order, pos = torch.randperm(len(y), generator=gen), 0
        idx = order[pos : pos + case.train_batch_size]
        pos += case.train_batch_size
        opt.zero_grad()
        if defense is None:
            loss_fn(model(x[idx]), y[idx]).backward()
        else:
            grads = defense.client_gradient(model, x[idx], y[idx], defense_rng)
            for n, p in trainable(model):
                p.grad = grads[n]
        opt.step()
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x[i : i + 256]) for i in range(0, len(y), 256)])
    scored = y != -100  # every label of a classifier; a language model's positions that have a next token
    return {"train_acc": float((logits.argmax(1) == y)[scored].double().mean()), "train_loss": float(loss_fn(logits, y))}


def _initial(case: CaseConfig, ds: ImageDataset, dtype: torch.dtype, defense: Defense | None) -> nn.Module:
    """The model pretraining starts from: the case's model (its init from train_seed), wrapped by the defense."""
    model = create_model(
        case.model, ds.input_shape, ds.num_classes, seed=derive_seed(case.train_seed, "pretrain-init"),
        dtype=dtype, **case.model_params,
    )  # fmt: skip
    if defense is not None:
        model = defense.wrap_model(model, generator(case.train_seed, "pretrain-defense-model"))
    return model


def check_model_cache() -> Path:
    """The model cache's folder, created where missing; InputError in one line naming it (and $GLEAK_CACHE) where
    it cannot be: a file in its place or above it, or a folder this process cannot write."""
    folder = cache_dir() / "models"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InputError(f"model cache {folder}: cannot be written ({exc.strerror or type(exc).__name__}); set "
                         f"${CACHE_ENV} to a writable folder") from None  # fmt: skip
    return folder


def _cached(path: Path, key: str) -> tuple[dict[str, torch.Tensor], dict[str, float]] | None:
    """The cache entry at `path` if it is whole and was trained for `key` (its stored key and the digest of its
    weights both check), else None after one line on stderr naming the file: the caller trains again and replaces
    it. An entry is never trusted on its name alone: a truncated file, another key's weights or edited weights
    would otherwise be attacked under this trial's id."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        ok = (isinstance(saved, dict) and saved.get("key") == key and isinstance(saved.get("state"), dict)
              and saved.get("sha256") == state_digest(saved["state"]))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - any unreadable entry is retrained, named
        ok, saved = False, exc
    if ok:
        return saved["state"], saved["info"]
    why = f"unreadable ({type(saved).__name__})" if isinstance(saved, Exception) else "its key or weights do not check"
    print(f"gleak: model cache {path}: {why}; training it again", file=sys.stderr)
    return None


def trained_state(
    case: CaseConfig, ds: ImageDataset, dtype: torch.dtype, defense: Defense | None = None, wrapper: Any = None
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The trained weights and their training accuracy/loss: from memory, from disk, or trained now (once). With
    `defense` (one that wraps the model, named by `wrapper` = (name, parameters)), the wrapped model's."""
    key = training_key(case, ds, dtype, wrapper if defense is not None else None)
    if key in _MEMORY:
        return _MEMORY[key]
    folder = cache_dir() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.pt"
    with FileLock(folder / f"{key}.lock", thread_local=False):  # a second worker waits here, then finds the file
        saved = _cached(path, key)
        if saved is not None:
            state, info = saved
        else:
            if defense is None:
                model = _initial(case, ds, dtype, None)
                info = train(model, ds, case)
            else:
                with torch.random.fork_rng(devices=[]):  # the bottleneck's evaluation passes draw from torch
                    torch.manual_seed(derive_seed(case.train_seed, "pretrain-global"))
                    model = _initial(case, ds, dtype, defense)
                    info = train(model, ds, case, defense)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            buf = io.BytesIO()
            torch.save({"state": state, "info": info, "key": key, "sha256": state_digest(state)}, buf)
            from gleak.mechanics.atomic_files import atomic_write_bytes

            atomic_write_bytes(path, buf.getvalue())
    _MEMORY[key] = (state, info)
    return state, info


def checkpoint_state(path: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict saved at `path` (torch.load with weights_only=True: tensors only, no code runs), checked
    against `model`'s: InputError, one line naming the file and the first key that is missing, unexpected or of
    another shape. Cast to the model's dtypes."""
    from gleak.contracts.errors import InputError

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - not a torch file, pickled code, a truncated file: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise InputError(f"{path}: not a state dict torch.load(weights_only=True) can read: {type(exc).__name__}: {first}") from None
    want = model.state_dict()
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InputError(f"{path}: expected a state dict (torch.save(model.state_dict(), PATH)), got {type(state).__name__}")
    for k, v in want.items():
        if k not in state:
            raise InputError(f"{path}: key {k!r} of the model (shape {tuple(v.shape)}) is missing from the checkpoint")
        if tuple(state[k].shape) != tuple(v.shape):
            raise InputError(f"{path}: key {k!r} has shape {tuple(state[k].shape)} in the checkpoint, the model's is {tuple(v.shape)}")
    extra = [k for k in state if k not in want]
    if extra:
        raise InputError(f"{path}: key {extra[0]!r} of the checkpoint is not in the model (another architecture?)")
    return {k: state[k].to(want[k].dtype) for k in want}


def build_model(
    case: CaseConfig, ds: ImageDataset, seed: int, dtype: torch.dtype, defense: Defense | None = None,
    wrapper: Any = None,
) -> tuple[nn.Module, dict[str, Any]]:  # fmt: skip
    """The model of a trial, wrapped by the client's defense where it changes the architecture (PRECODE), in the
    case's mode (train: BatchNorm uses batch statistics; eval: running ones), and what to record about it (training
    accuracy and loss of a trained model). A trained case trains the wrapped model (module docstring; `wrapper`, the
    defense's (name, parameters), keys its cache); an untrained one wraps the fresh model with the trial's
    generator."""
    info: dict[str, Any] = {}
    if case.model_state.startswith("file:"):
        path = case.model_state[len("file:"):]
        model = create_model(case.model, ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"), dtype=dtype,
                             **case.model_params)  # fmt: skip
        model.load_state_dict(checkpoint_state(path, model))
        if defense is not None:
            model = defense.wrap_model(model, generator(seed, "defense-model"))
        info = {"model_file": path}
    elif case.model_state == "trained":
        wrap = defense if wraps_model(defense) else None
        model = create_model(case.model, ds.input_shape, ds.num_classes, seed=0, dtype=dtype, **case.model_params)
        if wrap is not None:
            model = wrap.wrap_model(model, generator(case.train_seed, "pretrain-defense-model"))
        state, stats = trained_state(case, ds, dtype, wrap, wrapper)
        model.load_state_dict(state)
        info = {f"model_{k}": v for k, v in stats.items()}
    else:
        model = create_model(
            case.model, ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"), dtype=dtype, **case.model_params
        )
        if defense is not None:
            model = defense.wrap_model(model, generator(seed, "defense-model"))
    model.train(case.model_mode == "train")
    return model, info
