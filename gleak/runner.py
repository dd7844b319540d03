"""Execute a suite's trials, in this process, on local worker processes, or as Ray tasks, writing each finished
trial to the store at once.

- Trials already stored as 'ok' are skipped, so a rerun after an interruption computes only what is missing;
  a run killed at any point loses only the trials in flight.
- The output folder is locked before anything in it is touched: a second run on it stops with one line (exit 2).
- Trials start longest first (by `estimated_costs`), so that no long trial is left to run alone at the end.
- Every trial runs with the same number of torch threads (`threads`, default 1) whatever the number of workers:
  torch's reductions split their work by thread count, so the thread count is part of what makes a trial's
  metrics bit-identical between runs with 1 or N workers, locally or on Ray. Parallelism comes from processes.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gleak.config import CaseConfig, TrialConfig
from gleak.store import CommitThread, Store, release_lock, take_lock
from gleak.suite import Suite
from gleak.workers import Finished, TrialEnv, run_in_process, run_pool

EXECUTORS = ("local", "ray")
# Estimated costs are floating-point operations; every trial also has a part that does not grow with the model
# (data, metrics, images): about 10 ms of a core, ~1e8 operations.
FIXED_COST = 1e8


@dataclass
class RunSummary:
    out: Path
    total: int
    skipped: int
    ran: int
    failed: int

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


# -- cost estimates -----------------------------------------------------------------------------------------------
def _model_pass_cost(case: CaseConfig) -> float:
    """Floating-point operations of one forward and backward pass of the case's model on one client batch: three
    times the forward's multiply-adds in its linear and convolution layers (counted by hooks during one forward of a
    single zero input), plus a few per parameter for what works on the whole update (defenses, distances). Falls back
    to a guess from the batch size when that fails."""
    try:
        import torch
        from torch import nn

        from gleak.data import load_dataset
        from gleak.models import create_model

        ds = load_dataset(case.dataset, root=case.data_root, resolution=case.resolution, channels=case.channels,
                          download=case.download)  # fmt: skip  # cached: the suite loaded it to validate
        dtype = torch.float64 if case.dtype == "float64" else torch.float32
        # A real model (torch's meta device would avoid the initialisation but imports its compiler, seconds).
        model = create_model(case.model, ds.input_shape, ds.num_classes, seed=0, dtype=dtype, **case.model_params).eval()
        macs = 0

        def count(m: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
            nonlocal macs
            if isinstance(m, nn.Linear):
                macs += out.numel() * m.in_features
            else:  # a convolution: every output element reads in_channels / groups x kernel values
                macs += out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)

        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                m.register_forward_hook(count)
        with torch.no_grad():
            model(torch.zeros((1, *ds.input_shape), dtype=dtype))
        params = sum(p.numel() for p in model.parameters())
        return (6.0 * macs * case.batch_size + 20.0 * params) * (2 if dtype == torch.float64 else 1)
    except Exception:  # noqa: BLE001 - an estimate only: never let it stop a run
        return 1e6 * case.batch_size


def _plugin_cost(kind: str, name: str, params: dict[str, Any], case: CaseConfig) -> float:
    from gleak.plugin import Plugin
    from gleak.registry import plugin_info

    try:
        obj = plugin_info(kind, name).obj
        f = getattr(obj, "estimated_cost", None)
        cost = float(f(params, case) if callable(f) else Plugin.estimated_cost(params, case))
    except Exception:  # noqa: BLE001 - a plugin's estimate that fails is not the run's problem
        return 1.0
    return cost if math.isfinite(cost) and cost >= 0 else 1.0


def estimated_costs(trials: list[TrialConfig]) -> dict[str, float]:
    """trial_id -> rough work of the trial (floating-point operations): the model pass cost times the client
    updates plus the attack's and the defense's `estimated_cost`, plus a fixed part."""
    passes: dict[str, float] = {}
    out = {}
    for t in trials:
        c = t.case
        key = json.dumps(c.to_dict(), sort_keys=True, default=str)
        if key not in passes:
            passes[key] = _model_pass_cost(c)
        updates = c.clients * (c.local_steps if c.update == "fedavg" else 1)
        factor = updates + _plugin_cost("attack", t.attack, t.attack_params, c) + _plugin_cost("defense", t.defense, t.defense_params, c)
        out[t.trial_id] = FIXED_COST + passes[key] * factor
    return out


def longest_first(trials: list[TrialConfig], costs: dict[str, float]) -> list[TrialConfig]:
    """The trials by decreasing estimated cost; suite order among equals (sorted() is stable)."""
    return sorted(trials, key=lambda t: -costs[t.trial_id])


# -- progress ---------------------------------------------------------------------------------------------------
class Progress:
    """tqdm bar on stderr: trials done of total, failed, and the time left, estimated from the work done so far
    (weighted by estimated cost, so long trials first do not make the estimate too pessimistic)."""

    def __init__(self, total: int, total_cost: float, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, unit="trial", disable=not enabled, dynamic_ncols=True, file=sys.stderr,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} trials [{elapsed}{postfix}]",
        )  # fmt: skip
        self.total_cost, self.done_cost, self.failed = total_cost, 0.0, 0
        self.t0 = time.perf_counter()
        self.bar.set_postfix_str("failed 0, left ?", refresh=False)

    def update(self, cost: float, ok: bool) -> None:
        from tqdm import tqdm

        self.done_cost += cost
        self.failed += not ok
        elapsed = time.perf_counter() - self.t0
        left = max(0.0, self.total_cost - self.done_cost) * elapsed / self.done_cost if self.done_cost > 0 else None
        eta = tqdm.format_interval(left) if left is not None else "?"
        self.bar.set_postfix_str(f"failed {self.failed}, left {eta}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


# -- the run ----------------------------------------------------------------------------------------------------
def run_suite(
    suite: Suite,
    out: str | Path,
    workers: int | None = 1,
    progress: bool = True,
    lpips_weights: str | None = None,
    *,
    threads: int = 1,
    executor: str = "local",
    address: str | None = None,
    plugin_files: tuple[str, ...] | list[str] = (),
    on_start: Callable[[int, int], None] | None = None,
) -> RunSummary:
    """Run every trial of `suite` that `out` does not already hold, then write the reports.

    workers: local worker processes (1: in this process), or the Ray tasks in flight at once (None: every CPU of
    the cluster). threads: torch threads per trial. plugin_files: loaded in every worker (already loaded here).
    on_start(todo, stored) is called once the folder is locked, before any trial runs.
    Raises InputError, with the folder untouched, when another run holds the folder or Ray cannot start.
    """
    from gleak.report import write_reports

    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    out = Path(out)
    with contextlib.ExitStack() as stack:
        # First the lock: a second run on the folder stops here, having changed nothing. Then Ray, so that a cluster
        # that cannot be reached stops the run before the store is created.
        stack.callback(release_lock, take_lock(out))
        ray = None
        if executor == "ray":
            from gleak.ray_executor import RayExecutor

            ray = stack.enter_context(RayExecutor(address, workers, threads))
        store = Store(out)
        stack.callback(store.close)
        store.clean_partial_files()  # left by a run that was killed while writing an image or a report
        store.rekey()  # trials stored before a compatible change of the id rule keep counting as finished
        store.set_meta("suite", suite.name)
        store.set_meta("description", suite.description)
        store.set_meta("verdict", suite.verdict)  # the leaderboard's verdict rule
        store.set_membership(suite.trials)
        finished = store.finished_ids()
        todo = [t for t in suite.trials if t.trial_id not in finished]
        if on_start is not None:
            on_start(len(todo), len(suite.trials) - len(todo))
        costs = estimated_costs(todo)
        todo = longest_first(todo, costs)
        env = TrialEnv(lpips_weights, str(out / "images") if suite.save_images else None, tuple(plugin_files), threads)
        bar = stack.enter_context(contextlib.closing(Progress(len(todo), sum(costs.values()), progress and bool(todo))))
        failed = 0

        def stored(done: Finished) -> None:
            nonlocal failed
            for cfg, row in done:
                failed += row["status"] != "ok"
                bar.update(costs[cfg.trial_id], row["status"] == "ok")

        writer = CommitThread(store, stored)
        try:
            if ray is not None:
                ray.run(todo, env, writer.put, costs)
            elif (workers or 1) <= 1:
                run_in_process(todo, env, writer.put)
            else:
                run_pool(todo, env, workers, writer.put)
        finally:
            writer.close()  # everything finished is committed, also when interrupted
        bar.close()
        store.clean_partial_files()  # a worker killed while writing an image; no worker runs now
        from gleak.utility import run_suite_utility

        util_failed = run_suite_utility(suite, store, progress, workers or 1)  # accuracy under each defense
        # Count failures over the whole suite, not only this run's trials.
        failed_total = int(
            store.db.execute(
                "SELECT COUNT(*) FROM membership m JOIN trials t ON t.trial_id = m.trial_id WHERE t.status != 'ok'"
            ).fetchone()[0]
        )
        write_reports(out, suite.name, suite.description)
    return RunSummary(out, len(suite.trials), len(suite.trials) - len(todo), len(todo), max(failed, failed_total) + util_failed)
