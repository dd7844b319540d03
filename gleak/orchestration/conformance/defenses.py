"""The conformance checks of a defense: layout, dtype, determinism, no mutation, its client gradient."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from gleak.contracts import registry
from gleak.contracts.plugin import Defense, soft_labels
from gleak.contracts.tags import get_tags
from gleak.contracts.wire import Update
from gleak.mechanics.models import create_model
from gleak.orchestration.conformance.common import ROUND_HOOKS, Check, _meta_checks, _tensors_equal


def _probe_update(dtype: torch.dtype, seed: int) -> Update:
    g = torch.Generator().manual_seed(seed)
    return Update(
        {
            "a.weight": torch.randn(32, 20, generator=g, dtype=dtype),
            "a.bias": torch.randn(32, generator=g, dtype=dtype),
            "b.weight": torch.randn(10, 32, generator=g, dtype=dtype) * 1e-3,
            "b.bias": torch.randn(1, generator=g, dtype=dtype),
        },
        "gradient",
        4,
    )


def _client_gradient_problems(factory: Callable[[], Any], dtype: torch.dtype) -> list[str]:
    """The client_gradient hook on a small MLP: one finite tensor per trainable parameter, deterministic under the
    client's generator, and the model untouched."""
    from gleak.contracts.plugin import trainable

    model = create_model("mlp", (1, 4, 4), 3, seed=0, dtype=dtype, hidden=[6])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 1, 4, 4, generator=g, dtype=dtype), torch.tensor([0, 1, 2, 1, 0])
    snap = copy.deepcopy(model.state_dict())
    try:
        g1 = factory().client_gradient(model, x, y, torch.Generator().manual_seed(6))
        g2 = factory().client_gradient(model, x, y, torch.Generator().manual_seed(6))
    except Exception as exc:  # noqa: BLE001
        return [f"{dtype}: {type(exc).__name__}: {exc}"]
    params = dict(trainable(model))
    out = []
    if not isinstance(g1, dict) or list(g1) != list(params):
        return [f"{dtype}: must return a dict with one tensor per trainable parameter, in model order"]
    if any(g1[n].shape != p.shape or g1[n].dtype != dtype or not torch.isfinite(g1[n]).all() for n, p in params.items()):
        out.append(f"{dtype}: a gradient has the wrong shape or dtype, or is not finite")
    if not _tensors_equal(g1, g2):
        out.append(f"{dtype}: two calls with the same generator differ")
    if not _tensors_equal(snap, model.state_dict()):
        out.append(f"{dtype}: the model was modified")
    return out


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The values under torch.func's wrappers (DP-SGD computes per-example gradients under vmap), detached."""
    try:
        from torch._C import _functorch as ft

        while ft.is_functorch_wrapped_tensor(t):
            t = ft.get_unwrapped(t)
    except (ImportError, AttributeError):  # another torch: the tensor as it is
        pass
    return t.detach().clone()


def _missing_rows(rows: torch.Tensor, allowed: torch.Tensor) -> int:
    """How many of `rows` (n, d) are not exactly one of `allowed`'s rows (m, d)."""
    if not len(rows):
        return 0
    if not len(allowed):
        return len(rows)
    same = (rows.unsqueeze(1) == allowed.unsqueeze(0)).all(-1)
    return int((~same.any(1)).sum())


def _declared_inputs_problems(factory: Callable[[], Any]) -> list[str]:
    """The inputs the model sees inside client_gradient (a forward pre-hook on the probe model) against what the
    defense declares: without a `gradient_batch` override, only rows of the client's batch; with one, exactly the
    rows of the batch it kept (Defense.training_batch), which has the client's shapes and is deterministic."""
    model = create_model("mlp", (1, 4, 4), 3, seed=0, dtype=torch.float64, hidden=[6])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 1, 4, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    seen: list[torch.Tensor] = []
    handle = model.register_forward_pre_hook(lambda _, inp: seen.append(_unwrapped(inp[0])))
    d = factory()
    d.reset()
    kept: list = []
    d.kept_batches = kept
    try:
        d.client_gradient(model, x, y, torch.Generator().manual_seed(6))
    except Exception as exc:  # noqa: BLE001
        return [f"client_gradient raised {type(exc).__name__}: {exc}"]
    finally:
        handle.remove()
        d.kept_batches = None
    width = x[0].numel()
    rows = torch.cat([t.reshape(-1, width) for t in seen]) if seen else x.new_zeros(0, width)
    if not get_tags(d).transforms_inputs:
        n = _missing_rows(rows, x.reshape(-1, width))
        return [f"the model saw {n} input rows that are not the client's: a defense that trains on transformed inputs "
                "must declare it (override Defense.gradient_batch, train through Defense.training_batch)"] if n else []  # fmt: skip
    if not kept:
        return ["gradient_batch is overridden but client_gradient kept no batch (call Defense.training_batch)"]
    sent = torch.cat([xb.reshape(-1, width) for _, xb, _ in kept])
    problems = []
    if any(xb.shape != x.shape or xb.dtype != x.dtype or yb.shape != y.shape and not soft_labels(yb, len(y))
           for _, xb, yb in kept):  # fmt: skip
        problems.append("gradient_batch must return x's shape and dtype and y's shape (or soft labels (B, classes))")
    if _missing_rows(rows, sent) or _missing_rows(sent, rows):
        problems.append("the model did not train on exactly the batch gradient_batch returned and training_batch kept")
    again = factory().gradient_batch(x, y, torch.Generator().manual_seed(6))
    if not torch.equal(again[0], kept[0][1]):
        problems.append("gradient_batch: two calls with the same generator differ")
    return problems


def check_defense(name: str, params: dict[str, Any] | None = None) -> list[Check]:
    info = registry.plugin_info("defense", name)
    fast = {**get_tags(info.obj).fast_params, **(params or {})}
    factory = lambda: registry.create("defense", name, **fast)  # noqa: E731
    checks = _meta_checks("defense", name)
    problems = {"layout and dtype preserved": [], "deterministic under a seed": [], "does not mutate its input": [],
                "finite on zero and tiny updates": [], "client gradient well formed": []}  # fmt: skip
    for dtype in (torch.float32, torch.float64):
        u = _probe_update(dtype, 0)
        snap = {k: v.clone() for k, v in u.tensors.items()}
        d1, d2 = factory(), factory()
        d1.reset()
        d2.reset()
        out1 = d1.transform(u, torch.Generator().manual_seed(1)).clone()
        out2 = d2.transform(_probe_update(dtype, 0), torch.Generator().manual_seed(1))
        if out1.names() != u.names() or any(out1[k].shape != u[k].shape or out1[k].dtype != dtype for k in u.names()):
            problems["layout and dtype preserved"].append(f"{dtype}: layout or dtype changed")
        if not _tensors_equal(out1.tensors, out2.tensors):
            problems["deterministic under a seed"].append(f"{dtype}: two runs differ")
        if not _tensors_equal(snap, u.tensors):
            problems["does not mutate its input"].append(f"{dtype}: input tensors changed")
        zero = u.map(lambda _, t: torch.zeros_like(t))
        tiny = Update({"w": torch.tensor([0.5], dtype=dtype)}, "gradient", 1)
        for label, probe in (("all-zero", zero), ("one-element", tiny)):
            d = factory()
            d.reset()
            try:
                out = d.transform(probe, torch.Generator().manual_seed(2))
                if not out.is_finite()[0]:
                    problems["finite on zero and tiny updates"].append(f"{label}: NaN or infinity")
            except Exception as exc:  # noqa: BLE001
                problems["finite on zero and tiny updates"].append(f"{label}: {type(exc).__name__}: {exc}")
        problems["client gradient well formed"] += _client_gradient_problems(factory, dtype)
    checks += [Check(k, not v, "; ".join(v)) for k, v in problems.items()]
    hooks = [h for h in ROUND_HOOKS if isinstance(info.obj, type) and hasattr(info.obj, h) and not hasattr(Defense, h)]
    checks.append(Check("no round hooks", not hooks, f"{', '.join(hooks)}: a Protocol's methods, never called on a "
                        "defense (register a protocol with register_protocol)" if hooks else ""))  # fmt: skip
    declared = _declared_inputs_problems(factory)
    checks.append(Check("declares the inputs it trains on", not declared, "; ".join(declared)))
    return checks
