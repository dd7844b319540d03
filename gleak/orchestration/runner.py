"""Execute a suite's trials, in this process, on local worker processes, or as Ray tasks, writing each finished
trial to the store at once.

- Trials run in worker processes, also with one worker (`gleak.orchestration.workers`): a trial that crashes, exits, hangs past
  its time limit or is killed for memory is stored as failed with the reason, and the run goes on.
- Trials already stored as 'ok' (or 'not-applicable') are skipped, so a rerun after an interruption computes only what is missing;
  a run killed at any point loses only the trials in flight.
- The output folder is locked before anything in it is touched: a second run on it stops with one line (exit 2).
- Trials start longest first (by `estimated_costs`), so that no long trial is left to run alone at the end.
- Every trial runs with the same number of torch threads (`threads`, default 1) whatever the number of workers:
  torch's reductions split their work by thread count, so the thread count is part of what makes a trial's
  metrics bit-identical between runs with 1 or N workers, locally or on Ray. Parallelism comes from processes.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.errors import InputError
from gleak.orchestration.folder_lock import LOCK_NAME, check_unlocked, release_lock, take_lock
from gleak.orchestration.store import ARRAYS_NAME, DB_NAME, DONE, NOT_APPLICABLE, CommitThread, Store, check_store, read_meta
from gleak.orchestration.suite import Suite
from gleak.orchestration.workers import Finished, TrialEnv, run_in_process, run_pool

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
    failed: int  # over the whole suite (also trials stored failed by an earlier run) and its utility runs
    ok: int = 0  # of this run's trials
    not_applicable: int = 0  # of this run's trials: the plugin cannot handle the case (UnsupportedCase)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


# -- cost estimates -----------------------------------------------------------------------------------------------
def _model_pass_cost(case: CaseConfig) -> float:
    """Floating-point operations of one forward and backward pass of the case's model on one client batch, counted by
    torch.utils.flop_counter.FlopCounterMode on one input (`_pass_flops`, once per model shape) times the batch size,
    plus a few per parameter for what works on the whole update (defenses, distances). Falls back to a guess from
    the batch size when that fails."""
    try:
        from gleak.mechanics.data import load_dataset

        ds = load_dataset(case.dataset, root=case.data_root, resolution=case.resolution, channels=case.channels,
                          download=case.download)  # fmt: skip  # cached: the suite loaded it to validate
        flops, params = _pass_flops(case.model, json.dumps(case.model_params, sort_keys=True), tuple(ds.input_shape),
                                    ds.num_classes, case.dtype)  # fmt: skip
        return (flops * case.batch_size + 20.0 * params) * (2 if case.dtype == "float64" else 1)
    except Exception:  # noqa: BLE001 - an estimate only: never let it stop a run
        return 1e6 * case.batch_size


@functools.lru_cache(maxsize=None)
def _pass_flops(model: str, model_params: str, input_shape: tuple[int, ...], classes: int, dtype: str) -> tuple[float, int]:
    """(flops of one forward and backward pass on a single input, parameters) of a model, as
    torch.utils.flop_counter.FlopCounterMode counts them (the matrix products and convolutions torch runs). A model
    made of linear and convolution layers and parameter-free ones is counted by `_layer_flops` (a forward pass on
    one input: the same numbers, tested equal), any other on torch's meta device under FlopCounterMode (no
    arithmetic, but its first use imports torch._dynamo: about a second of every `gleak run`'s start)."""
    import torch

    from gleak.mechanics.models import create_model

    dt = torch.float64 if dtype == "float64" else torch.float32
    net = create_model(model, input_shape, classes, seed=0, dtype=dt, **json.loads(model_params))
    params = sum(p.numel() for p in net.parameters())
    counted = _layer_flops(net, torch.zeros((1, *input_shape), dtype=dt))
    if counted is not None:
        return counted, params
    from torch.utils.flop_counter import FlopCounterMode

    net = net.to("meta")
    with FlopCounterMode(display=False) as counter:
        net(torch.zeros((1, *input_shape), dtype=dt, device="meta")).sum().backward()
    return float(counter.get_total_flops()), params


def _layer_flops(net: Any, x: Any) -> float | None:
    """FlopCounterMode's count of one forward and backward pass, from the linear and convolution layers' shapes:
    each layer's forward product (2 multiply-adds per weight use), once more for its weight's gradient and once
    more for its input's gradient where the input depends on a parameter. None where the model has a leaf module
    that may compute products this does not see (anything but those layers and parameter-free standard ones)."""
    import math

    from torch import nn

    counted = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    free = (nn.ReLU, nn.LeakyReLU, nn.Sigmoid, nn.Tanh, nn.GELU, nn.Flatten, nn.Unflatten, nn.Identity, nn.Dropout,
            nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm,
            nn.GroupNorm, nn.Softmax, nn.Sequential)  # fmt: skip  # an empty Sequential: an identity shortcut
    if any(next(m.children(), None) is None and type(m) not in (*counted, *free) for m in net.modules()):
        return None
    total = [0.0]

    def hook(m: Any, inp: tuple, out: Any) -> None:
        if isinstance(m, nn.Linear):
            f = 2.0 * (inp[0].numel() // m.in_features) * m.in_features * m.out_features
        else:
            f = 2.0 * out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)
        total[0] += f * (3 if inp[0].requires_grad else 2)

    handles = [m.register_forward_hook(hook) for m in net.modules() if isinstance(m, counted)]
    try:
        net(x)
    finally:
        for h in handles:
            h.remove()
    return total[0]


def _plugin_cost(kind: str, name: str, params: dict[str, Any], case: CaseConfig) -> float:
    from gleak.contracts.plugin import Plugin
    from gleak.contracts.registry import plugin_info

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
    (weighted by estimated cost, so long trials first do not make the estimate too pessimistic). Inside a trial the
    bar moves too: `inside` (the workers' reports of their attack loops) counts a running trial's share of its
    loop's iterations as that share of its cost done, and shows the iterations of the latest."""

    def __init__(self, total: int, total_cost: float, enabled: bool):
        import threading

        from tqdm import tqdm

        self.bar = tqdm(
            total=total, unit="trial", disable=not enabled, dynamic_ncols=True, file=sys.stderr,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} trials [{elapsed}{postfix}]",
        )  # fmt: skip
        self.total_cost, self.done_cost, self.failed = total_cost, 0.0, 0
        self.running: dict[str, tuple[float, float]] = {}  # trial id -> (its cost, the share of its loop done)
        self.iterations = ""  # 'trial 3f2a: 1,200/24,000 it' of the trial reported last
        self.lock = threading.Lock()  # updates come from the writer thread (rows) and the runner's (iterations)
        self.t0 = time.perf_counter()
        self.bar.set_postfix_str("failed 0, left ?", refresh=False)

    def _postfix(self) -> str:
        from tqdm import tqdm

        done = self.done_cost + sum(cost * share for cost, share in self.running.values())
        elapsed = time.perf_counter() - self.t0
        left = max(0.0, self.total_cost - done) * elapsed / done if done > 0 else None
        eta = tqdm.format_interval(left) if left is not None else "?"
        return f"failed {self.failed}, left {eta}" + (f"; {self.iterations}" if self.iterations else "")

    def inside(self, trial_id: str, cost: float, step: int, total: int) -> None:
        """Iteration `step` of `total` of a running trial's attack loop (a loop that restarts counts each start
        from 1 again: its share is that of the current start)."""
        with self.lock:
            self.running[trial_id] = (cost, min(1.0, max(0.0, step / total)) if total > 0 else 0.0)
            self.iterations = f"trial {trial_id[:8]}: {step:,}/{total:,} it"
            self.bar.set_postfix_str(self._postfix(), refresh=True)

    def update(self, cost: float, ok: bool, trial_id: str | None = None) -> None:
        with self.lock:
            self.done_cost += cost
            self.failed += not ok
            if trial_id is not None and self.running.pop(trial_id, None) is not None:
                self.iterations = ""
            self.bar.set_postfix_str(self._postfix(), refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


# -- time limits and budget ------------------------------------------------------------------------------------
# The default --trial-timeout: the larger of 15 minutes and 1e-8 s per estimated operation. Measured on the shipped
# suites' results (seconds over estimated cost): median 2e-11 to 1.5e-9 s per operation, the slowest trial 1e-7 at
# a cost of 1.5e9 (a fixed start-up cost), far under 15 minutes; at 1e-8 the longest trials (geiping-table1, ~4.8e12)
# get ~13 h for ~11 min of work.
TIMEOUT_FLOOR = 900.0
TIMEOUT_PER_COST = 1e-8
TIMEOUT_CEILING = 7 * 24 * 3600.0
# A trial estimated above this many floating-point operations (about a week of one core at 1e10 per second) is
# refused at validation: a count or size typed with too many zeros, not a benchmark.
MAX_TRIAL_COST = 1e16


def default_timeout(cost: float) -> float:
    return min(TIMEOUT_CEILING, max(TIMEOUT_FLOOR, TIMEOUT_PER_COST * cost))


def check_budget(trials: list[TrialConfig], costs: dict[str, float]) -> None:
    """InputError naming the first trial whose estimated cost exceeds MAX_TRIAL_COST."""
    for t in trials:
        if costs[t.trial_id] > MAX_TRIAL_COST:
            raise InputError(
                f"{t.suite}: trial {t.attack} {json.dumps(t.attack_params, sort_keys=True)} / {t.defense} on "
                f"{t.case.model} B={t.case.batch_size} is estimated at {costs[t.trial_id]:.2g} operations, over the "
                f"budget of {MAX_TRIAL_COST:.0e} per trial (about a week of one core); check its counts and sizes"
            )


def check_timeout_executor(executor: str, trial_timeout: float | None) -> None:
    """InputError where a time limit is asked of an executor that cannot apply it: Ray tasks are not killed at a
    limit here, and a limit accepted and not applied would let a hung trial hold the run."""
    if executor == "ray" and trial_timeout is not None:
        raise InputError("--trial-timeout applies to local worker processes; with --executor ray it would not be "
                         "applied: leave it out (Ray tasks then run without a limit) or use --executor local")  # fmt: skip


def plan(trials: list[TrialConfig], trial_timeout: float | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """(estimated costs, time limits in seconds) of `trials`; InputError when a trial is over the budget.
    trial_timeout: one limit for every trial (0: none); None: `default_timeout` of each trial's cost."""
    costs = estimated_costs(trials)
    check_budget(trials, costs)
    if trial_timeout is None:
        limits = {t: default_timeout(c) for t, c in costs.items()}
    else:
        limits = {t: float(trial_timeout) for t in costs} if trial_timeout > 0 else {}
    return costs, limits


# -- the run ----------------------------------------------------------------------------------------------------
def suite_device(suite: Suite, device: str | None = None) -> str:
    """The resolved device of a run: `device` (the caller's, e.g. --device) or else the suite's [suite] device, else
    cpu: the shipped results were measured on the CPU, and a rerun that resumes a folder should not mix devices
    unless asked to. InputError naming where the device was asked for when it is not a device or not here."""
    from gleak.mechanics.device import resolve

    if device is not None:
        return resolve(device, "--device")
    if suite.device is not None:
        return resolve(suite.device, f"{suite.path}: [suite] device")
    return "cpu"


def _claim(out: Path, suite: Suite, force: bool) -> None:
    """Read-only checks (the folder is gleak's or empty, its store is gleak's, it holds no other suite's results):
    a run that may not write the folder stops here, having changed nothing."""
    from gleak.orchestration import output_folder as owned

    check_unlocked(out)  # a run creating its files right now: say so, rather than "not a gleak folder"
    owned.claim(out, force, check_store)
    held = read_meta(out, "suite")
    if held is not None and held != suite.name and not force:
        raise InputError(f"{out}: holds the results of suite {held!r}; a run of suite {suite.name!r} would replace "
                         f"its leaderboard: use another --out (or --force)")  # fmt: skip


def _lock(out: Path, force: bool, stack: contextlib.ExitStack) -> tuple[Any, Any]:
    """Take the folder's lock (released by `stack`; until the lock is marked kept, a refusal removes the lock file
    and the folder it had to create: a refused run leaves no .lock behind). Returns (the lock, the folder's
    manifest read again under the lock: what another run left meanwhile)."""
    from gleak.orchestration import output_folder as owned

    lock = take_lock(out)
    lock.gleak_keep = False
    stack.callback(lambda: release_lock(lock, tidy=not lock.gleak_keep))
    return lock, owned.claim(out, force, check_store)


def _adopt_suite(store: Store, suite: Suite) -> None:
    """Every trial of the suite is stored now (ok or failed): only now does the folder's suite become this one, so
    that an interrupted run, or a run of another suite that stops, hides none of the trials shown before."""
    store.set_meta("suite", suite.name)
    store.set_meta("description", suite.description)
    store.set_meta("verdict", suite.verdict)  # the leaderboard's verdict rule
    store.set_meta("claims", suite.claims)  # the [[claim]] tables its leaderboard judges (gleak.reporting.claims)
    store.set_meta("set_params", suite.set_params)  # the parameters its file sets: the reports name them
    store.set_membership(suite.trials)


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
    in_process: bool = False,
    trial_timeout: float | None = None,
    force: bool = False,
    device: str | None = None,
    verbose: bool = False,
    reports: Callable[[Path], Any] | None = None,
) -> RunSummary:
    """Run every trial of `suite` that `out` does not already hold, and its [utility] runs. The reports are the
    caller's to write: reports(out) is called once everything is stored, still under the folder's lock (the CLI and
    the API pass gleak.reporting.report.write_folder_reports with locked=True), so that the lock is released only after the
    last report file is written.

    workers: local worker processes, or the Ray tasks in flight at once (None: every CPU of the cluster). Trials run
    in worker processes also with one worker, so that a crash, an exit or a hang costs only its trial; in_process:
    in this process instead (for debugging; no such protection, no time limit). trial_timeout: seconds per trial
    (None: derived from its estimated cost, see `default_timeout`; 0: none; local workers only). threads: torch
    threads per trial. plugin_files: loaded in every worker (already loaded here). force: accept a non-empty folder
    that is not gleak's (see gleak.orchestration.output_folder). on_start(todo, stored) is called once the folder is locked, before any
    trial runs. Raises InputError, with the folder untouched, when the folder is not one gleak may write, another
    run holds it, its store is not gleak's, a trial is over the budget or Ray cannot start. device: where trials and
    utility runs compute (auto, cpu, cuda, cuda:N; None: the suite's [suite] device, else cpu; see gleak.mechanics.device);
    InputError, before anything is touched, for a device that is not here. verbose: every trial prints its attack's
    iterations to stderr (gleak.mechanics.progress), also from worker processes and Ray tasks.
    """
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    check_timeout_executor(executor, trial_timeout)
    out = Path(out)
    device = suite_device(suite, device)
    costs_all, limits = plan(suite.trials, trial_timeout)  # reads nothing of the folder: bad input stops here
    if any(t.case.model_state == "trained" for t in suite.trials):
        from gleak.mechanics.pretrain import check_model_cache

        check_model_cache()  # once, before any trial trains into it
    with contextlib.ExitStack() as stack:
        ray, store, manifest = _open_folder(out, suite, force, stack, executor, address, workers, threads)
        finished = store.finished_ids()
        todo = [t for t in suite.trials if t.trial_id not in finished]
        if on_start is not None:
            on_start(len(todo), len(suite.trials) - len(todo))
        costs = {t.trial_id: costs_all[t.trial_id] for t in todo}
        todo = longest_first(todo, costs)
        bar_inside = progress and bool(todo) and ray is None  # Ray's tasks have no pipe back: their bar moves per trial
        env = TrialEnv(lpips_weights, str(Path(out).absolute() / "images") if suite.save_images else None, tuple(plugin_files), threads, device, verbose,
                       bar_inside)  # fmt: skip
        bar = stack.enter_context(contextlib.closing(Progress(len(todo), sum(costs.values()), progress and bool(todo))))
        counts = _run_trials(todo, env, costs, {t.trial_id: limits[t.trial_id] for t in todo if t.trial_id in limits},
                             store, manifest, bar, ray, in_process, workers or 1)  # fmt: skip
        bar.close()
        store.clean_partial_files()  # a worker killed while writing an image; no worker runs now
        _adopt_suite(store, suite)
        from gleak.orchestration.utility import run_suite_utility

        util_failed = run_suite_utility(suite, store, progress, workers or 1, device)  # accuracy under each defense
        failed_total = store.failed_members()  # over the whole suite, not only this run's trials
        if reports is not None:  # still under the lock: no `gleak leaderboard` writes the folder while they are written
            reports(out)
    return RunSummary(out, len(suite.trials), len(suite.trials) - len(todo), len(todo),
                      max(counts["failed"], failed_total) + util_failed, counts["ok"], counts["not_applicable"])  # fmt: skip


def _open_folder(out: Path, suite: Suite, force: bool, stack: contextlib.ExitStack, executor: str, address: str | None,
                 workers: int | None, threads: int) -> tuple[Any, Store, Any]:  # fmt: skip
    """The run's hold on its folder: read-only checks first (the folder is gleak's or empty, its store is gleak's),
    then Ray, so that a cluster that cannot be reached stops the run before the folder is touched, then the lock (a
    second run on the folder stops there, having changed nothing), then the store, listed in the manifest. Returns
    (the Ray executor or None, the store, the manifest); `stack` closes them."""
    _claim(out, suite, force)
    ray = None
    if executor == "ray":
        from gleak.orchestration.ray_executor import RayExecutor

        ray = stack.enter_context(RayExecutor(address, workers, threads))
    lock, manifest = _lock(out, force, stack)
    store = Store(out)
    stack.callback(store.close)
    manifest.add([Path(out) / DB_NAME, Path(out) / ARRAYS_NAME, Path(out) / LOCK_NAME])
    manifest.save()  # from here on the folder says it is gleak's
    lock.gleak_keep = True  # the manifest lists the lock file: it stays, so that later runs share one file
    store.clean_partial_files()  # left by a run that was killed while writing an image or a report
    store.rekey()  # trials stored before a compatible change of the id rule keep counting as finished
    return ray, store, manifest


def _run_trials(todo: list[TrialConfig], env: TrialEnv, costs: dict[str, float], limits: dict[str, float],
                store: Store, manifest: Any, bar: Progress, ray: Any, in_process: bool,
                workers: int) -> dict[str, int]:  # fmt: skip
    """Run `todo` on the executor chosen (Ray, this process, or local workers), each result committed as it
    arrives; the images written are listed in the manifest also when interrupted. Returns the counts by status."""
    counts = {"failed": 0, "ok": 0, "not_applicable": 0}

    def stored(done: Finished) -> None:
        for cfg, row in done:
            counts["failed"] += row["status"] not in DONE
            counts["ok"] += row["status"] == "ok"
            counts["not_applicable"] += row["status"] == NOT_APPLICABLE
            bar.update(costs[cfg.trial_id], row["status"] in DONE, cfg.trial_id)

    def inside(cfg: TrialConfig, step: int, total: int) -> None:
        bar.inside(cfg.trial_id, costs[cfg.trial_id], step, total)

    writer = CommitThread(store, stored)
    try:
        if ray is not None:
            ray.run(todo, env, writer.put, costs)
        elif in_process:
            run_in_process(todo, env, writer.put, inside if env.bar else None)
        else:
            run_pool(todo, env, workers, writer.put, limits, inside if env.bar else None)
    finally:
        writer.close()  # everything finished is committed, also when interrupted
        manifest.add(store.folder / "images" / n for n in store.image_names())
        manifest.save()
    return counts

