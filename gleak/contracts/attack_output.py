"""What a trial may assume of torch, and what an attack must return: checked by every trial before it scores.

An attack is a plugin: its output is data from outside gleak. Without these checks some wrong outputs would be
scored, not refused: integer or boolean images are denormalised in their own dtype (zeros as int64 scored 3.4 dB,
as bool 7.0, as float 10.1), 5,000 images for a batch of one inflate the PSNR (the best of many guesses is
matched), every class as labels scores label accuracy 1.0, a label of 10^9 makes label scoring allocate gigabytes.
`check_reconstruction` refuses them: the trial is stored as failed with one line (PluginContractError).

Likewise a plugin may change torch's process-wide state (the default dtype, grad mode, deterministic algorithms):
`baseline_torch_state` sets the state every trial starts from, so that a trial's numbers do not depend on what ran
before it on the same worker (the random generators are forked and seeded by gleak.orchestration.trial.run_trial).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from gleak.contracts.errors import PluginContractError

_INTEGRAL = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def max_images(batch_size: int, clients: int) -> int:
    """The most images an attack may return: every sample behind what it could observe (an aggregate of all the
    clients' batches, under secure aggregation or CGD, holds `batch_size * clients`)."""
    return batch_size * max(1, clients)


def check_reconstruction(rec: Any, input_shape: tuple[int, ...], num_classes: int, limit: int, attack: str) -> None:
    """Raise PluginContractError (one line, naming the attack) unless `rec` is a Reconstruction-like output:
    x None or a floating (n, *input_shape) tensor with n <= limit; y None or an integral 1-D tensor of at most
    `limit` labels, each in [0, num_classes)."""
    who = f"attack {attack!r} returned"
    x, y = getattr(rec, "x", None), getattr(rec, "y", None)
    if not (hasattr(rec, "x") and hasattr(rec, "y")):
        raise PluginContractError(f"{who} {type(rec).__name__}, not a gleak.contracts.wire.Reconstruction")
    if x is not None:
        if not isinstance(x, torch.Tensor):
            raise PluginContractError(f"{who} images of type {type(x).__name__}, not a torch.Tensor")
        if not x.dtype.is_floating_point:
            raise PluginContractError(f"{who} images of dtype {x.dtype}: reconstructions must be floating point")
        if x.dim() != 1 + len(input_shape) or tuple(x.shape[1:]) != tuple(input_shape):
            raise PluginContractError(f"{who} images of shape {tuple(x.shape)}, expected (n, {', '.join(map(str, input_shape))})")
        if x.shape[0] > limit:
            raise PluginContractError(f"{who} {x.shape[0]} images, more than the {limit} samples it could observe")
    if y is not None:
        if not isinstance(y, torch.Tensor):
            raise PluginContractError(f"{who} labels of type {type(y).__name__}, not a torch.Tensor")
        if y.dtype not in _INTEGRAL:
            raise PluginContractError(f"{who} labels of dtype {y.dtype}: labels must be integer class indices")
        if y.dim() != 1 or len(y) > limit:
            raise PluginContractError(f"{who} labels of shape {tuple(y.shape)}, expected (n,) with n <= {limit}")
        if not len(y):
            return
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= num_classes:
            raise PluginContractError(f"{who} label {lo if lo < 0 else hi}, outside the {num_classes} classes [0, {num_classes})")


@contextlib.contextmanager
def baseline_torch_state() -> Iterator[None]:
    """Run the block from torch's default process-wide state (float32 default dtype, grad enabled, no deterministic
    algorithms, anomaly detection off), and restore the caller's state afterwards."""
    before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), torch.is_anomaly_enabled())  # fmt: skip
    try:
        _set_state(torch.float32, True, False, False, False)
        yield
    finally:
        _set_state(*before)


def _set_state(dtype: torch.dtype, grad: bool, deterministic: bool, warn_only: bool, anomaly: bool) -> None:
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    # Only when it differs: use_deterministic_algorithms imports torch._inductor (2.5 s) on its first call.
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
            deterministic, warn_only):  # fmt: skip
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    if torch.is_anomaly_enabled() != anomaly:
        torch.autograd.set_detect_anomaly(anomaly)
