"""The conformance checks of a protocol: every method on a small MLP with three clients."""
from __future__ import annotations

import copy
from typing import Any

import torch

from gleak.contracts import registry
from gleak.contracts.plugin import Defense
from gleak.contracts.tags import get_tags
from gleak.contracts.wire import ClientBatch, Update
from gleak.mechanics.models import create_model
from gleak.mechanics.rounds import run_rounds
from gleak.orchestration.conformance.common import Check, _meta_checks, _run, _tensors_equal


def _probe_setup(dtype: torch.dtype = torch.float32):
    """A small MLP and three clients' batches (the victim first)."""
    model = create_model("mlp", (1, 4, 4), 3, seed=0, dtype=dtype, hidden=[6])
    g = torch.Generator().manual_seed(0)
    zero, one = torch.zeros(1), torch.ones(1)
    batches = [ClientBatch(torch.randn(2, 1, 4, 4, generator=g, dtype=dtype), torch.tensor([i % 3, (i + 1) % 3]), zero, one)
               for i in range(3)]  # fmt: skip
    return model, batches


def _layout(module: Any) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in module.named_parameters()] if isinstance(module, torch.nn.Module) else []


class _ProtocolProbe:
    """The checks of one protocol, on a small probe model and three clients' batches: each method returns '' or
    what is wrong."""

    def __init__(self, name: str, fast: dict[str, Any]):
        self.name, self.fast = name, fast
        self.model, self.batches = _probe_setup()
        self.layout = _layout(self.model)

    def factory(self) -> Any:
        return registry.create("protocol", self.name, **self.fast)

    @staticmethod
    def none() -> Defense:
        return registry.create("defense", "none")

    @staticmethod
    def rng(s: int) -> torch.Generator:
        return torch.Generator().manual_seed(s)

    def start(self) -> tuple[Any, list[torch.nn.Module]]:
        from gleak.mechanics.protocol import Protocol

        p = self.factory()
        if not isinstance(p, Protocol):
            raise TypeError(f"a protocol must be a gleak.mechanics.protocol.Protocol, got {type(p).__name__}")
        p.reset()
        return p, p.client_models(self.model, len(self.batches), self.rng(1))

    def sent_updates(self, p: Any, ms: list[torch.nn.Module]) -> list[Update]:
        return [p.client_update(m, b, self.none(), self.rng(10 + i)) for i, (m, b) in enumerate(zip(ms, self.batches))]

    def models_ok(self) -> str:
        snap = copy.deepcopy(self.model.state_dict())
        p, ms = self.start()
        if len(ms) != len(self.batches) or any(_layout(m) != self.layout for m in ms):
            return "client_models must return one module per client with the model's parameter layout"
        if not _tensors_equal(snap, self.model.state_dict()):
            return "client_models modified the server's model"
        again = self.start()[1]
        if any(not _tensors_equal(a.state_dict(), b.state_dict()) for a, b in zip(ms, again)):
            return "two calls with the same generator differ"
        return ""

    def update_ok(self) -> str:
        p, ms = self.start()
        u = self.sent_updates(p, ms)[0]
        names = [n for n, q in ms[0].named_parameters() if q.requires_grad]
        if not isinstance(u, Update) or u.names() != names:
            return "client_update must return an Update with one tensor per trainable parameter, in model order"
        if any(u[n].shape != q.shape or u[n].dtype != q.dtype for n, q in ms[0].named_parameters()) or not u.is_finite()[0]:
            return "a tensor has the wrong shape or dtype, or is not finite"
        if u.num_samples != self.batches[0].size:
            return f"num_samples must be the client's batch size ({self.batches[0].size}), got {u.num_samples}"
        return ""

    def view_ok(self) -> str:
        p, ms = self.start()
        sent = self.sent_updates(p, ms)
        snap = [dict((k, v.clone()) for k, v in u.tensors.items()) for u in sent]
        view = p.observe(sent, self.rng(4))
        if not isinstance(view, Update) or view.names() != sent[0].names() or not view.is_finite()[0]:
            return "observe must return a finite Update of the clients' layout"
        if any(not _tensors_equal(a, u.tensors) for a, u in zip(snap, sent)):
            return "observe modified what the clients sent"
        p2, ms2 = self.start()
        if not _tensors_equal(view.tensors, p2.observe(self.sent_updates(p2, ms2), self.rng(4)).tensors):
            return "two views with the same generator differ"
        return ""

    def held_ok(self) -> str:
        p, ms = self.start()
        p.observe(self.sent_updates(p, ms), self.rng(4))
        held = p.observer_model(ms[0], ms)
        return "" if _layout(held) == self.layout else "observer_model must return a module with the model's layout"

    def step_ok(self) -> str:
        p, ms = self.start()
        sent = self.sent_updates(p, ms)
        p.observe(sent, self.rng(4))
        snaps = [copy.deepcopy(m.state_dict()) for m in ms]
        new = p.server_step(ms, sent, 0.1, self.rng(5))
        if len(new) != len(ms) or any(_layout(m) != self.layout for m in new):
            return "server_step must return one module per client with the model's layout"
        if any(not _tensors_equal(s, m.state_dict()) for s, m in zip(snaps, ms)):
            return "server_step modified the models it was given (return new modules)"
        if all(_tensors_equal(s, m.state_dict()) for s, m in zip(snaps, new)):
            return "server_step left every model where it was (no client's model moved)"
        return ""

    def rounds_ok(self) -> str:
        from gleak.mechanics.rounds import Schedule

        rng, batches = self.rng, self.batches
        views = []
        for _ in range(2):
            p, ms = self.start()
            sched = Schedule(lambda r: batches, lambda r: [rng(20 + i + 10 * r) for i in range(3)], lambda r: rng(30 + r))
            out, seen = run_rounds(p, [self.none() for _ in batches], ms, 2, sched, 0.1)
            if len(seen) != 2 or any(w.view is None for w in seen) or len(out) != len(batches):
                return "run_rounds did not return two observed rounds and one model per client"
            views.append(torch.cat([w.view.flat() for w in seen]))
        if not torch.equal(*views):
            return "two runs with the same seeds differ"
        if p.observed_rounds() < 1:
            return f"observed_rounds must be >= 1, got {p.observed_rounds()}"
        return ""

    def trains_ok(self) -> str:
        from gleak.contracts.config import UtilityConfig
        from gleak.orchestration.utility import load_utility_data

        cfg = UtilityConfig(dataset="skimage", model="mlp", model_params={"hidden": [8]}, resolution=8, clients=3,
                            training_rounds=2, batch_size=2, server_lr=0.1)  # fmt: skip
        train, test = load_utility_data(cfg)
        out = self.factory().train_utility(cfg, train, test, self.rng(6))
        acc = out.get("accuracy") if isinstance(out, dict) else None
        if not isinstance(acc, float) or not 0 <= acc <= 1:
            return f"train_utility must return {{'accuracy': float in [0, 1], ...}}, got {out!r}"[:200]
        return ""


def check_protocol(name: str, params: dict[str, Any] | None = None) -> list[Check]:
    info = registry.plugin_info("protocol", name)
    fast = {**get_tags(info.obj).fast_params, **(params or {})}
    checks = _meta_checks("protocol", name)
    probe = _ProtocolProbe(name, fast)
    for check, fn in (("client models", probe.models_ok), ("client update well formed", probe.update_ok),
                      ("observer view well formed", probe.view_ok), ("observer model", probe.held_ok),
                      ("server step moves the models", probe.step_ok), ("rounds run deterministically", probe.rounds_ok),
                      ("trains for utility", probe.trains_ok)):  # fmt: skip
        checks.append(_run(check, fn))
    return checks
