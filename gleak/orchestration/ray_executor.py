"""Trials as Ray tasks (`gleak run --executor ray`, the `gleak[ray]` extra), on a cluster given by `--address` or on
a local one started for the run. Results stream back as tasks finish and go into the same store as local runs.

Cheap trials are batched: a Ray task costs about a millisecond of scheduling on top of the trial, so once the first
results have measured how long a unit of estimated cost takes, consecutive trials (in the run's longest-first
order) are packed into one task until it holds about TASK_SECONDS of work, never more than a share of what is left
(so the tail still spreads over every worker). Trial rows are computed exactly as locally (`run_trial`), with the
same torch thread count, so the metrics are identical to a local run's.

Faults: every trial gets two attempts, as locally (a plugin's sys.exit or KeyboardInterrupt is its trial's failure,
as locally; --trial-timeout is not enforced on Ray). Ray retries a one-trial task whose worker died once
(max_retries=1); a batch whose worker died is not retried but split, and each of its trials runs alone once more
(max_retries=0). A trial whose second attempt fails too is stored as failed with the reason. Images are written by
the driver from bytes the task returns, so workers on other machines need no shared file system; the run's plugin
files and LPIPS weights, though, must exist at the same paths on every node (gleak itself must be installed there).
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from gleak.contracts.config import TrialConfig
from gleak.contracts.errors import InputError
from gleak.mechanics.atomic_files import atomic_write_bytes
from gleak.orchestration.workers import Finished, Record, TrialEnv, died_row, guarded_trial, prepare_process

TASK_SECONDS = 0.5  # work per task once calibrated: Ray's per-task cost is then well under 1% of it
MAX_PER_TASK = 256


_scratch: str | None = None  # this worker process's folder for images on their way to the driver


def _run_batch(cfg_jsons: list[str], env: TrialEnv) -> list[dict[str, Any]]:
    """Body of one Ray task: run the trials, return their rows (with the PNG bytes of their image, if any)."""
    global _scratch
    prepare_process(env)
    if env.image_dir is not None and _scratch is None:
        _scratch = tempfile.mkdtemp(prefix="gleak-ray-")
    rows = []
    for text in cfg_jsons:
        row = guarded_trial(TrialConfig.from_json(text), env, _scratch if env.image_dir else None)
        if row.get("image"):
            png = Path(_scratch) / row["image"]
            row["_image_png"] = png.read_bytes()
            png.unlink()
        rows.append(row)
    return rows


CONNECT_SECONDS = 10.0  # a cluster address that does not answer within this is refused, not waited on


def check_address(address: str, seconds: float = CONNECT_SECONDS) -> None:
    """InputError unless ADDRESS ('host:port' or 'ray://host:port'; 'auto' and 'local' are Ray's to resolve)
    accepts a TCP connection within `seconds`: Ray itself waits minutes on an address where nothing answers."""
    import socket

    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InputError(f"--address {address}: expected HOST:PORT (or ray://HOST:PORT, auto)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=seconds):
            pass
    except (OSError, ValueError) as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else (getattr(exc, "strerror", None) or str(exc))
        raise InputError(f"--address {address}: the Ray cluster did not answer within {seconds:g} s ({why})") from None


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


class RayExecutor:
    """Connects to (or starts) a Ray cluster on enter, shuts down what it started on exit."""

    def __init__(self, address: str | None, workers: int | None, threads: int):
        self.address, self.workers, self.threads = address, workers, threads
        self.slots = 1
        self._started = False

    def __enter__(self) -> "RayExecutor":
        try:
            import ray
        except ImportError:
            raise InputError("--executor ray needs Ray: pip install 'gleak[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            kw: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
            try:
                if self.address:
                    ray.init(address=self.address, **kw)
                else:
                    cpus = (self.workers or max(1, (os.cpu_count() or 1) // self.threads)) * self.threads
                    ray.init(address="local", num_cpus=cpus, **kw)  # a new cluster, even where one runs already
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = f"--address {self.address}" if self.address else "a local Ray cluster"
                raise InputError(f"{where}: Ray could not start or connect: {str(exc).strip().splitlines()[0]}") from None
            self._started = True
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.slots = max(1, min(self.workers or cpus, cpus) // self.threads) if cpus >= self.threads else 1
        self._task = ray.remote(_run_batch)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._started:
            self.ray.shutdown()

    def run(self, todo: list[TrialConfig], env: TrialEnv, record: Record, costs: dict[str, float]) -> None:
        ray = self.ray
        queue = deque(todo)
        env_ref = ray.put(env)
        pending: dict[Any, list[TrialConfig]] = {}
        alone: set[str] = set()  # trials of a batch that failed: each runs once more on its own
        done_cost = done_seconds = 0.0
        left_cost = sum(costs.get(t.trial_id, 1.0) for t in todo)

        def next_batch() -> list[TrialConfig]:
            first = queue.popleft()
            batch = [first]
            if first.trial_id in alone or done_cost <= 0:
                return batch  # uncalibrated (or retrying): one trial per task
            per_cost = done_seconds / done_cost
            target = TASK_SECONDS
            if self.slots > 1:  # smaller tasks towards the end, so that no slot idles while one finishes a big one
                target = min(target, left_cost * per_cost / (4 * self.slots))
            work = costs.get(first.trial_id, 1.0) * per_cost
            while queue and len(batch) < MAX_PER_TASK and queue[0].trial_id not in alone:
                nxt = costs.get(queue[0].trial_id, 1.0) * per_cost
                if work + nxt > target:
                    break
                batch.append(queue.popleft())
                work += nxt
            return batch

        def submit() -> None:
            while queue and len(pending) < self.slots:  # one task per slot: --workers N runs N at once
                batch = next_batch()
                # Two attempts per trial: Ray retries a one-trial task once; a batch is not retried but split.
                retries = 1 if len(batch) == 1 and batch[0].trial_id not in alone else 0
                task = self._task.options(num_cpus=self.threads, max_retries=retries)
                pending[task.remote([c.to_json() for c in batch], env_ref)] = batch

        submit()
        while pending:
            ray.wait(list(pending), num_returns=1)
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            done: Finished = []
            for ref in ready:
                batch = pending.pop(ref)
                try:
                    rows = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    if len(batch) > 1:
                        alone.update(t.trial_id for t in batch)
                        queue.extendleft(reversed(batch))
                        continue
                    rows = [died_row(batch[0], _reason(exc), 2, 0.0)]
                for cfg, row in zip(batch, rows):
                    c = costs.get(cfg.trial_id, 1.0)
                    left_cost -= c
                    if row.get("seconds") and math.isfinite(row["seconds"]):
                        done_cost += c
                        done_seconds += row["seconds"]
                    done.append((cfg, row))
            submit()  # the workers go on while the results are written
            _write_images(done, env)
            record(done)


def _write_images(done: Finished, env: TrialEnv) -> None:
    """The reconstruction PNGs that came back inside the rows, written here (a task's node need not see the folder)."""
    for _, row in done:
        png = row.pop("_image_png", None)
        if png is not None and env.image_dir is not None:
            atomic_write_bytes(Path(env.image_dir) / row["image"], png)


def _reason(exc: BaseException) -> str:
    name = type(exc).__name__
    if "WorkerCrashed" in name or "NodeDied" in name or "ActorDied" in name:
        return f"Ray {name}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"Ray {name}: {first}"[:300]
