"""Execute a suite's trials, sequentially or in a local process pool, writing each finished trial at once.

Trials already stored as 'ok' are skipped, so a rerun after an interruption computes only what is missing.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from gleak.config import TrialConfig
from gleak.store import Store
from gleak.suite import Suite
from gleak.trial import run_trial


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


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _work(cfg_json: str, lpips_weights: str | None, image_dir: str | None) -> dict[str, Any]:
    return run_trial(TrialConfig.from_json(cfg_json), lpips_weights, image_dir)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="trial", disable=not enabled, dynamic_ncols=True, file=sys.stderr, smoothing=0.1)


def _execute(
    todo: list[TrialConfig], store: Store, workers: int, lpips_weights: str | None, image_dir: str | None, progress: bool
) -> int:
    failed = 0
    bar = _progress(len(todo), progress)

    def record(cfg: TrialConfig, row: dict[str, Any]) -> None:
        nonlocal failed
        store.put(cfg, row)
        failed += row["status"] != "ok"
        bar.update(1)
        bar.set_postfix(failed=failed, refresh=False)

    try:
        if workers <= 1:
            for cfg in todo:
                record(cfg, run_trial(cfg, lpips_weights, image_dir))
            return failed
        threads = max(1, (os.cpu_count() or 1) // workers)
        ctx = mp.get_context("spawn")  # fork after torch has started threads can deadlock
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(threads,)) as pool:
            pending = {}
            queue: Iterable[TrialConfig] = iter(todo)
            # Keep a bounded number of trials in flight so that an interruption loses few of them.
            for cfg in queue:
                pending[pool.submit(_work, cfg.to_json(), lpips_weights, image_dir)] = cfg
                if len(pending) >= 2 * workers:
                    break
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    record(pending.pop(fut), fut.result())
                for cfg in queue:
                    pending[pool.submit(_work, cfg.to_json(), lpips_weights, image_dir)] = cfg
                    if len(pending) >= 2 * workers:
                        break
        return failed
    finally:
        bar.close()


def run_suite(
    suite: Suite,
    out: str | Path,
    workers: int = 1,
    progress: bool = True,
    lpips_weights: str | None = None,
) -> RunSummary:
    """Run every trial of `suite` that `out` does not already hold, then write the reports."""
    from gleak.report import write_reports

    out = Path(out)
    store = Store(out)
    try:
        store.lock()
        store.set_meta("suite", suite.name)
        store.set_meta("description", suite.description)
        store.set_membership(suite.trials)
        finished = store.finished_ids()
        todo = [t for t in suite.trials if t.trial_id not in finished]
        image_dir = str(out / "images") if suite.save_images else None
        failed = _execute(todo, store, workers, lpips_weights, image_dir, progress)
        from gleak.utility import run_suite_utility

        util_failed = run_suite_utility(suite, store, progress, workers)  # accuracy under each defense, beside the trials
        # Trials that failed earlier and were skipped would otherwise be missed in the count.
        failed_total = int(
            store.db.execute(
                "SELECT COUNT(*) FROM membership m JOIN trials t ON t.trial_id = m.trial_id WHERE t.status != 'ok'"
            ).fetchone()[0]
        )
        write_reports(out, suite.name, suite.description)
    finally:
        store.close()
    return RunSummary(out, len(suite.trials), len(suite.trials) - len(todo), len(todo), max(failed, failed_total) + util_failed)
