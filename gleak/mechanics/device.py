"""The device trials and utility runs compute on (`gleak run --device`, `device =` in a suite's [suite] table,
`device=` in gleak.run_trial / gleak.run): the one place where a device name is checked and resolved.

What runs on it: the model, the clients' batches and so the victims' updates, the attack's optimisation (its model
and its dummy data), utility training. What stays on the CPU: data loading, scoring, the stored arrays.

Randomness stays on the CPU: every plugin draws from the torch.Generator it is given, which is a CPU generator, so
that a trial's random numbers are the same on every device. While a trial runs on a GPU (`use`), a draw from a CPU
generator is made on the CPU and its floating-point result moved to the device (`_CpuDraws`); integer draws
(permutations, indices) stay on the CPU, where indexing either device's tensors accepts them.

The device is not part of a trial's id (a result is a function of its config and seed; CPU and GPU differ only by
floating-point rounding); it is recorded per trial in its `extra` ("device").
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from gleak.contracts.errors import InputError

CHOICES = "auto, cpu, cuda or cuda:N"
_current = torch.device("cpu")


def check_name(spec: object) -> str | None:
    """What is wrong with `spec` as a device name (None: nothing); says nothing of whether the device is here."""
    if isinstance(spec, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", spec.strip()):
        return None
    return f"must be {CHOICES}, got {spec!r}"


def resolve(spec: str | None, where: str = "--device") -> str:
    """The device `spec` names, as torch spells it ('cpu', 'cuda:0'); 'auto' (and None): cuda when available, else
    cpu. InputError (one line, naming `where`) for a name that is not a device, or cuda where there is none."""
    spec = "auto" if spec is None else spec
    problem = check_name(spec)
    if problem:
        raise InputError(f"{where}: {problem}")
    spec = spec.strip()
    if spec == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        # The way out in the caller's own terms: a flag on the command line, an argument in Python.
        fix = "--device cpu or auto" if where.startswith("--") else "device='cpu' or device='auto'"
        raise InputError(f"{where}: {spec} asked for, but torch sees no CUDA device here (use {fix})")
    index = int(spec.split(":")[1]) if ":" in spec else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise InputError(f"{where}: {spec} asked for, but torch sees {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return f"cuda:{index}"


def current() -> torch.device:
    """The device of the trial or utility run in progress (cpu outside one)."""
    return _current


class _CpuDraws(TorchFunctionMode):
    """A random draw from a CPU generator, on the CPU; a floating-point result moved to the device (see the module)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        gen = kwargs.get("generator")
        if not isinstance(gen, torch.Generator) or gen.device.type != "cpu":
            return func(*args, **kwargs)
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is not None and target.device.type != "cpu" and getattr(func, "__name__", "").endswith("_"):
            drawn = target.detach().cpu()  # an in-place draw (exponential_, normal_) on a device tensor
            func(drawn, *args[1:], **kwargs)
            with torch.no_grad():
                target.copy_(drawn)
            return target
        cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        kwargs.pop("device", None)
        out = func(*cpu_args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            return out.to(self.device)
        return out


@contextlib.contextmanager
def use(device: str | torch.device) -> Iterator[torch.device]:
    """Compute on `device` inside the block (`current()` names it; on a GPU, CPU-generator draws land on it)."""
    global _current
    dev = torch.device(device)
    before = _current
    _current = dev
    try:
        if dev.type == "cpu":
            yield dev
        else:
            with _CpuDraws(dev):
                yield dev
    finally:
        _current = before


def to_device(module_or_tensor: Any) -> Any:
    """`module_or_tensor` on the current device (itself on the CPU)."""
    return module_or_tensor if _current.type == "cpu" else module_or_tensor.to(_current)
