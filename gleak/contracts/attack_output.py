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


class ExitCalled(SystemExit):
    """Raised in place of os._exit by `no_exit`: a plugin tried to end the process."""


@contextlib.contextmanager
def no_exit() -> Iterator[None]:
    """While a plugin file is imported or a plugin built (gleak.contracts.registry), os._exit raises ExitCalled instead of
    ending gleak's process: the caller turns it, like sys.exit's SystemExit, into one line naming the plugin."""
    import os

    real = os._exit

    def refuse(code: int = 0) -> None:
        raise ExitCalled(f"called os._exit({code!r})")

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def exit_text(exc: SystemExit) -> str:
    """What a plugin's attempt to end the process was, in words."""
    return str(exc) if isinstance(exc, ExitCalled) else f"called sys.exit({exc.code!r})"


# A plugin's construction while a suite is validated: a plugin whose __init__ hangs must not hang `gleak run`
# before anything runs. Generous by default (a plugin may load weights); $GLEAK_PLUGIN_INIT_TIMEOUT sets it.
INIT_TIMEOUT_ENV = "GLEAK_PLUGIN_INIT_TIMEOUT"
INIT_TIMEOUT_S = 60.0


class ConstructionTimeout(BaseException):
    """Raised inside a plugin's __init__ by `construction_timeout` when it runs past its time (a BaseException, as
    KeyboardInterrupt: a plugin's `except Exception` does not swallow it)."""


def init_timeout() -> float:
    """Seconds a plugin's construction may take during validation ($GLEAK_PLUGIN_INIT_TIMEOUT, else 60)."""
    import os

    from gleak.contracts.errors import InputError

    text = os.environ.get(INIT_TIMEOUT_ENV)
    if not text:
        return INIT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise InputError(f"${INIT_TIMEOUT_ENV} must be a number of seconds > 0, got {text!r}")
    return value


@contextlib.contextmanager
def construction_timeout(seconds: float) -> Iterator[None]:
    """Raise ConstructionTimeout in the block once it has run `seconds` (a SIGALRM timer, in the main thread only;
    elsewhere the block runs unlimited). A timer set before (a test runner's own) is kept: where it expires first
    it is left alone, else it is set again afterwards with its time left. Python code (a loop, a sleep) is
    interrupted; a plugin stuck inside one C call is interrupted when that call returns to Python."""
    import signal
    import threading
    import time

    before_left, before_interval = signal.getitimer(signal.ITIMER_REAL)
    if threading.current_thread() is not threading.main_thread() or (before_left and before_left <= seconds):
        yield
        return

    def expired(signum, frame):
        raise ConstructionTimeout(f"did not return within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if before_left:  # the earlier timer, with the time it has left
            signal.setitimer(signal.ITIMER_REAL, max(before_left - (time.monotonic() - started), 1e-3), before_interval)
