"""Local worker processes that run trials, and what every trial process needs (threads, plugin files).

gleak manages its own workers rather than using concurrent.futures: a worker that dies (killed, out of memory,
a crash in native code) breaks a whole ProcessPoolExecutor, whereas here only that worker's trial is affected.
Each worker owns one pipe and runs one trial at a time, so the runner always knows which trial a dead worker held:
that trial is retried once on a fresh worker and then stored as failed, and the run goes on.

Workers are forked from a fork server that has imported torch and gleak once (start-up costs one import, not one
per worker) and has started no torch threads (forking after torch has started threads can deadlock). A worker
dies with its parent (Linux PR_SET_PDEATHSIG), so a killed run leaves no orphan computing or writing.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

from gleak.config import TrialConfig

ATTEMPTS = 2  # a trial whose worker dies is run once more, then stored as failed

Finished = list[tuple[TrialConfig, dict[str, Any]]]
Record = Callable[[Finished], None]


@dataclass(frozen=True)
class TrialEnv:
    """What every trial of a run needs besides its config (picklable: it travels to workers and Ray tasks)."""

    lpips_weights: str | None = None
    image_dir: str | None = None
    plugin_files: tuple[str, ...] = ()
    threads: int = 1


_prepared: TrialEnv | None = None


def prepare_process(env: TrialEnv) -> None:
    """Set torch's thread count and load the run's plugin files, once per process (idempotent)."""
    global _prepared
    import torch

    torch.set_num_threads(env.threads)
    if _prepared is not None and _prepared.plugin_files == env.plugin_files:
        _prepared = env
        return
    from gleak.registry import load_plugin_file

    for f in env.plugin_files:
        if _prepared is None or f not in _prepared.plugin_files:
            load_plugin_file(f)
    _prepared = env


def died_row(cfg: TrialConfig, how: str, attempts: int, seconds: float) -> dict[str, Any]:
    """The stored row of a trial whose process died under it every time it ran."""
    times = "once" if attempts == 1 else f"on all {attempts} attempts"
    return {
        "trial_id": cfg.trial_id, "config": cfg.to_json(), "status": "failed", "traceback": None, "extra": "{}",
        "error": f"WorkerDied: the process running this trial died ({how}) {times}", "seconds": seconds,
    }  # fmt: skip


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(conn, env: TrialEnv) -> None:
    from gleak.trial import run_trial

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the runner's to handle; it stops the workers
    _die_with_parent()
    prepare_process(env)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        row = run_trial(TrialConfig.from_json(msg), env.lpips_weights, env.image_dir)
        try:
            conn.send(row)
        except OSError:
            return


def _context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["gleak.trial"])
        return ctx
    return mp.get_context("spawn")


def prestart() -> None:
    """Start the fork server now: it imports torch and gleak (seconds), which can overlap with what the caller does
    before the pool starts (the CLI validates the suite meanwhile). Starts no worker and touches no file."""
    if _context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


class _Worker:
    def __init__(self, ctx, env: TrialEnv):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, env), daemon=True, name="gleak-worker")
        self.proc.start()
        child.close()
        self.task: TrialConfig | None = None
        self.t0 = 0.0

    def give(self, cfg: TrialConfig) -> bool:
        try:
            self.conn.send(cfg.to_json())
        except OSError:
            return False
        self.task, self.t0 = cfg, time.perf_counter()
        return True

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def run_in_process(todo: list[TrialConfig], env: TrialEnv, record: Record) -> None:
    """Run the trials one after another in this process (plugin files are loaded here already)."""
    import torch

    from gleak.trial import run_trial

    previous = torch.get_num_threads()
    torch.set_num_threads(env.threads)
    try:
        for cfg in todo:
            record([(cfg, run_trial(cfg, env.lpips_weights, env.image_dir))])
    finally:
        torch.set_num_threads(previous)


def run_pool(todo: list[TrialConfig], env: TrialEnv, workers: int, record: Record) -> None:
    """Run the trials on `workers` processes in the order given; `record` gets the results as they arrive (those
    that arrive together in one call, so that they are stored in one transaction)."""
    ctx = _context()
    queue = deque(todo)
    attempts: dict[str, int] = {}
    pool = [_Worker(ctx, env) for _ in range(min(workers, len(todo)))]

    def hand_out() -> None:
        for i, w in enumerate(pool):
            while w.task is None and queue:
                cfg = queue.popleft()
                if not w.give(cfg):  # died while idle: nothing was running on it
                    queue.appendleft(cfg)
                    w.stop()
                    pool[i] = w = _Worker(ctx, env)

    try:
        hand_out()
        while any(w.task for w in pool):
            busy = [w for w in pool if w.task is not None]
            ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy]))
            done: Finished = []
            for i, w in enumerate(pool):
                if w.task is None or (w.conn not in ready and w.proc.sentinel not in ready):
                    continue
                row = None
                try:
                    if w.conn.poll():
                        row = w.conn.recv()
                except (EOFError, OSError):
                    pass
                if row is not None:
                    done.append((w.task, row))
                    w.task = None
                    continue
                # No result, and the pipe or the process says it is gone: the worker died under this trial.
                w.proc.join(5)
                cfg, seconds = w.task, time.perf_counter() - w.t0
                w.stop()
                n = attempts[cfg.trial_id] = attempts.get(cfg.trial_id, 0) + 1
                if n < ATTEMPTS:
                    queue.appendleft(cfg)  # first in line again, on a fresh worker
                else:
                    done.append((cfg, died_row(cfg, _exit_text(w.proc.exitcode), n, seconds)))
                pool[i] = _Worker(ctx, env)
            hand_out()  # the workers go on while the results are written
            record(done)
    finally:
        for w in pool:
            w.stop()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
