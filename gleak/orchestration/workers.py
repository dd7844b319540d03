"""Local worker processes that run trials, and what every trial process needs (threads, plugin files).

gleak manages its own workers rather than using concurrent.futures: a worker that dies (killed, out of memory,
a crash in native code) breaks a whole ProcessPoolExecutor, whereas here only that worker's trial is affected.
Each worker owns one pipe and runs one trial at a time, so the runner always knows which trial a dead worker held:
that trial is retried once on a fresh worker and then stored as failed, and the run goes on. A trial that runs past
its time limit is killed and stored as failed ("timed out after N s"), not retried: a hang hangs again.

Trials run in worker processes by default, also with one worker: a plugin that segfaults, calls os._exit or
sys.exit, raises KeyboardInterrupt, is killed for memory or hangs costs only its own trial. `run_in_process`
(`gleak run --in-process`) is for debugging a plugin under pdb, without that protection.

Workers are forked from a fork server that has imported torch and gleak once (start-up costs one import, not one
per worker) and has started no torch threads (forking after torch has started threads can deadlock). A worker
dies with its parent (Linux PR_SET_PDEATHSIG), so a killed run leaves no orphan computing or writing.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

from gleak.contracts.config import TrialConfig
from gleak.orchestration.fork_server import process_context, without_main_file

ATTEMPTS = 2  # a trial whose worker dies is run once more, then stored as failed

Finished = list[tuple[TrialConfig, dict[str, Any]]]
Record = Callable[[Finished], None]
OnProgress = Callable[[TrialConfig, int, int], None]  # (trial, step, total) of the trial's attack loop


@dataclass(frozen=True)
class TrialEnv:
    """What every trial of a run needs besides its config (picklable: it travels to workers and Ray tasks)."""

    lpips_weights: str | None = None
    image_dir: str | None = None
    plugin_files: tuple[str, ...] = ()
    threads: int = 1
    device: str = "cpu"  # resolved (gleak.mechanics.device.resolve): where trials compute
    verbose: bool = False  # each trial prints its attack's iterations to stderr (gleak.mechanics.progress.line_printer)
    bar: bool = False  # each trial tells the run's progress bar where its attack's loop is (gleak.mechanics.progress.throttled)


def progress_sink(cfg: TrialConfig, env: TrialEnv, to_bar: Callable[[int, int], None] | None = None):
    """The gleak.mechanics.progress sink of a trial under `env`: its iterations printed (--verbose) and/or handed to `to_bar`
    (the run's progress bar, throttled); None when neither listens."""
    from gleak.mechanics.progress import fanout, line_printer, throttled

    printer = line_printer(f"trial {cfg.trial_id[:12]} {cfg.attack} seed {cfg.seed}") if env.verbose else None
    return fanout(printer, throttled(to_bar) if to_bar is not None else None)


# A worker's message about its trial's iterations, beside the trial's row on the same pipe: (PROGRESS, step, total).
PROGRESS = "gleak-progress"


def _is_progress(msg: Any) -> bool:
    return isinstance(msg, tuple) and len(msg) == 3 and msg[0] == PROGRESS


_prepared: TrialEnv | None = None


def prepare_process(env: TrialEnv) -> None:
    """Set torch's thread count and load the run's plugin files, once per process (idempotent)."""
    global _prepared
    import torch

    torch.set_num_threads(env.threads)
    if _prepared is not None and _prepared.plugin_files == env.plugin_files:
        _prepared = env
        return
    from gleak.contracts.registry import load_plugin_file

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


def failed_row(cfg: TrialConfig, error: str, seconds: float, tb: str | None = None) -> dict[str, Any]:
    """The stored row of a trial that failed outside the trial's own error handling (see guarded_trial)."""
    return {"trial_id": cfg.trial_id, "config": cfg.to_json(), "status": "failed", "traceback": tb, "extra": "{}",
            "error": error, "seconds": seconds}  # fmt: skip


def timed_out_row(cfg: TrialConfig, limit: float, seconds: float) -> dict[str, Any]:
    return failed_row(cfg, f"TimedOut: the trial timed out after {limit:g} s (--trial-timeout) and was killed", seconds)


def _escape_text(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit: the trial called sys.exit({exc.code!r})"
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt: raised inside the trial (not by Ctrl-C: a worker ignores SIGINT)"
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def guarded_trial(cfg: TrialConfig, env: TrialEnv, image_dir: str | None,
                  to_bar: Callable[[int, int], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """`run_trial` in a worker, with what escapes its own handling (SystemExit, KeyboardInterrupt raised by a plugin,
    a row that cannot be built or sent) turned into this trial's failed row: the worker lives on."""
    from gleak.orchestration.trial import run_trial

    t0 = time.perf_counter()
    try:
        row = run_trial(cfg, env.lpips_weights, image_dir, device=env.device, progress=progress_sink(cfg, env, to_bar))
        pickle.dumps(row)  # what the pipe (or Ray) will do with it: fail here, as this trial's failure
        return row
    except BaseException as exc:  # noqa: BLE001 - only in a worker, where SIGINT is ignored: a plugin raised it
        return failed_row(cfg, _escape_text(exc), time.perf_counter() - t0, traceback.format_exc(limit=8))


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


def _become_subreaper() -> None:
    """Orphans of the worker's descendants (a daemon a plugin double-forked) become the worker's children, not
    init's: `_end_trial_children` finds every process a trial left (Linux's PR_SET_CHILD_SUBREAPER)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # 36 = PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (read from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "(comm)": state, ppid, ...
        if len(fields) > 1 and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(e))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _end_trial_children(before: set[int]) -> None:
    """Kill what the trial started (a plugin's subprocess or its own children, also double-forked ones: the worker
    is their subreaper) and reap them, so that none outlives its trial; processes the worker had before stay."""
    for _ in range(3):  # a child may fork while its siblings are killed: look again
        left = _descendants(os.getpid()) - before
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and _descendants(os.getpid()) - before:
            time.sleep(0.01)
            _reap()
    _reap()


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants, from outside: `pid` is frozen (SIGSTOP) first, and its descendants are
    looked for again until none is left, so that a process forking while it is killed is caught too."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except OSError:
        return
    for _ in range(5):
        below = _descendants(pid)
        if not below:
            break
        for child in below:
            try:
                os.kill(child, signal.SIGSTOP)  # freeze the whole tree before any of it dies: no fork slips past
            except OSError:
                pass
        for child in below:
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _worker_main(conn, env: TrialEnv) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the runner's to handle; it stops the workers
    _die_with_parent()
    _become_subreaper()
    prepare_process(env)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return

        def to_bar(step: int, total: int) -> None:  # where the trial is, for the run's bar (gleak.orchestration.runner.Progress)
            try:
                conn.send((PROGRESS, step, total))
            except OSError:
                pass

        before = _descendants(os.getpid())
        row = guarded_trial(TrialConfig.from_json(msg), env, env.image_dir, to_bar if env.bar else None)
        _end_trial_children(before)  # a plugin's processes end with its trial
        try:
            conn.send(row)
        except OSError:
            return


class _Worker:
    def __init__(self, ctx, env: TrialEnv):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, env), daemon=True, name="gleak-worker")
        with without_main_file():
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
        """End the worker and every process below it (a plugin's child that ignores SIGTERM included): the worker
        is stopped first so that it starts no more, then what it started is killed, then the worker."""
        if self.proc.is_alive() and self.proc.pid is not None:
            _kill_tree(self.proc.pid)
        self.proc.join(5)
        self.conn.close()


def run_in_process(todo: list[TrialConfig], env: TrialEnv, record: Record, on_progress: OnProgress | None = None) -> None:
    """Run the trials one after another in this process (plugin files are loaded here already); on_progress gets
    (trial, step, total) of each trial's attack loop."""
    import torch

    from gleak.orchestration.trial import run_trial

    previous = torch.get_num_threads()
    torch.set_num_threads(env.threads)
    try:
        for cfg in todo:
            to_bar = (lambda step, total, cfg=cfg: on_progress(cfg, step, total)) if on_progress is not None else None
            record([(cfg, run_trial(cfg, env.lpips_weights, env.image_dir, device=env.device,
                                    progress=progress_sink(cfg, env, to_bar)))])  # fmt: skip
    finally:
        torch.set_num_threads(previous)


class _Pool:
    """The worker processes of one `run_pool`, the trials waiting for one, and how often each trial was attempted."""

    def __init__(self, todo: list[TrialConfig], env: TrialEnv, workers: int, timeouts: dict[str, float],
                 on_progress: OnProgress | None = None):  # fmt: skip
        self.ctx, self.env, self.timeouts, self.on_progress = process_context(), env, timeouts, on_progress
        self.queue = deque(todo)
        self.attempts: dict[str, int] = {}
        self.workers = [_Worker(self.ctx, env) for _ in range(min(workers, len(todo)))]

    def hand_out(self) -> None:
        for i, w in enumerate(self.workers):
            while w.task is None and self.queue:
                cfg = self.queue.popleft()
                if not w.give(cfg):  # died while idle: nothing was running on it
                    self.queue.appendleft(cfg)
                    w.stop()
                    self.workers[i] = w = _Worker(self.ctx, self.env)

    def wait_ready(self) -> set:
        """The busy workers' pipes and processes that have something to say, waiting at most until the first
        deadline."""
        busy = [w for w in self.workers if w.task is not None]
        deadlines = [w.t0 + self.timeouts[w.task.trial_id] for w in busy if w.task.trial_id in self.timeouts]
        left = max(0.0, min(deadlines) - time.perf_counter()) if deadlines else None
        return set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=left))

    def collect(self, i: int, ready: set, now: float, done: Finished) -> None:
        """What busy worker i has to say: its trial's row, nothing yet, a timeout, or its death (the trial is then
        retried on a fresh worker, up to ATTEMPTS times)."""
        w = self.workers[i]
        limit = self.timeouts.get(w.task.trial_id)
        row, progressed = None, False
        if w.conn in ready or w.proc.sentinel in ready:
            try:
                while row is None and w.conn.poll():
                    msg = w.conn.recv()
                    if _is_progress(msg):  # where the trial is: the bar's, then on to the row
                        progressed = True
                        if self.on_progress is not None:
                            self.on_progress(w.task, msg[1], msg[2])
                    else:
                        row = msg
            except (EOFError, OSError):
                pass
        if row is not None:
            done.append((w.task, row))
            w.task = None
            return
        if (w.conn not in ready and w.proc.sentinel not in ready) or (progressed and w.proc.sentinel not in ready):
            if limit is not None and now - w.t0 >= limit:  # hung (or just too slow): not retried
                done.append((w.task, timed_out_row(w.task, limit, now - w.t0)))
                w.stop()
                self.workers[i] = _Worker(self.ctx, self.env)
            return
        # No result, and the pipe or the process says it is gone: the worker died under this trial.
        w.proc.join(5)
        cfg, seconds = w.task, time.perf_counter() - w.t0
        w.stop()
        n = self.attempts[cfg.trial_id] = self.attempts.get(cfg.trial_id, 0) + 1
        if n < ATTEMPTS:
            self.queue.appendleft(cfg)  # first in line again, on a fresh worker
        else:
            done.append((cfg, died_row(cfg, _exit_text(w.proc.exitcode), n, seconds)))
        self.workers[i] = _Worker(self.ctx, self.env)


def run_pool(
    todo: list[TrialConfig], env: TrialEnv, workers: int, record: Record, timeouts: dict[str, float] | None = None,
    on_progress: OnProgress | None = None,
) -> None:
    """Run the trials on `workers` processes in the order given; `record` gets the results as they arrive (those
    that arrive together in one call, so that they are stored in one transaction). timeouts: trial_id -> seconds
    after which the trial's worker is killed and the trial stored as timed out (none when absent). on_progress: gets
    (trial, step, total) as the workers say where their trials' attack loops are (with env.bar)."""
    pool = _Pool(todo, env, workers, timeouts or {}, on_progress)
    try:
        pool.hand_out()
        while any(w.task for w in pool.workers):
            ready = pool.wait_ready()
            done: Finished = []
            now = time.perf_counter()
            for i, w in enumerate(pool.workers):
                if w.task is not None:
                    pool.collect(i, ready, now, done)
            pool.hand_out()  # the workers go on while the results are written
            record(done)
    finally:
        for w in pool.workers:
            w.stop()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# -- check-plugin in a child process ----------------------------------------------------------------------------
def _check_main(conn, kind: str, name: str, plugin_file: str | None, full: bool = False) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    try:
        from gleak.contracts.registry import load_plugin_file
        from gleak.orchestration.conformance import check_plugin

        if plugin_file:
            load_plugin_file(plugin_file)
        from gleak.contracts.registry import plugin_info

        params = plugin_info(kind, name).defaults() if full else None  # full: the defaults over the quick settings
        result: Any = [(c.name, c.passed, c.detail) for c in check_plugin(kind, name, params)]
    except BaseException as exc:  # noqa: BLE001 - reported as a failed check, whatever it is
        result = f"the checks raised {_escape_text(exc)}"
    try:
        conn.send(result)
    except Exception as exc:  # noqa: BLE001 - a detail that does not pickle
        conn.send(f"the checks' results could not be sent: {type(exc).__name__}: {exc}")


def check_plugin_isolated(kind: str, name: str, plugin_file: str | None, timeout: float, full: bool = False) -> list:
    """gleak.orchestration.conformance.check_plugin in a child process: a plugin that crashes, exits or hangs (past `timeout`
    seconds) is one failed check, never a crash or a hang of check-plugin itself."""
    from gleak.orchestration.conformance import Check

    ctx = process_context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_check_main, args=(child, kind, name, plugin_file, full), daemon=True, name="gleak-check")
    with without_main_file():
        proc.start()
    child.close()
    result: Any = None
    try:
        if parent.poll(timeout):
            try:
                result = parent.recv()
            except (EOFError, OSError):
                result = None
        else:
            result = f"the checks did not finish within {timeout:g} s (--timeout) and were stopped"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        parent.close()
    if result is None:
        result = f"the process running the checks died ({_exit_text(proc.exitcode)})"
    if isinstance(result, str):
        return [Check("checks run to the end", False, result)]
    return [Check(n, ok, detail) for n, ok, detail in result]
