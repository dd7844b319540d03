"""Throughput of gleak's executors, measured in one run: trials per minute of a suite at 1 and 2 local workers and
through Ray on a local cluster, the parallel efficiency at 2 workers, and the per-trial overhead of each executor
next to the median trial.

    python benchmarks/suite_throughput.py                      # suites/quick.toml and benchmarks/cpu-bound.toml
    python benchmarks/suite_throughput.py --suite my.toml      # any suites (repeatable)

Every configuration runs the whole suite into a fresh output folder through `gleak.orchestration.runner.run_suite`, exactly as
`gleak run` does (store writes and reports included), with one torch thread per trial. Definitions:

- trials/min: trials / wall time of run_suite x 60: everything a user waits for, start-up of workers included.
- run fixed: the part of the wall time outside the executor (lock, membership, cost estimates, reports), which does
  not grow with the number of trials.
- parallel efficiency at 2 workers: (trials/min at 2 workers) / (2 x trials/min at 1 worker), 1 worker running in
  the main process. Each local configuration is run `--repeat` times and the fastest is kept (the machine may be
  shared; the spread is printed).
- overhead per trial: (executor time x slots - sum of the trials' own seconds) / trials: what the executor spends
  outside trials (worker start-up, scheduling, serialisation, store writes, idle workers at the end), per trial.
  Ray's is measured on a warm cluster with one task running at a time (slots = 1), so that it is Ray's cost and not
  the tail of a parallel run; once with batching (the default: cheap trials share a task of about 0.5 s) and once
  without (one trial per task). Ray's cold start (workers importing torch and loading data) shows in the cold run.
- workers busy: sum of the trials' own seconds / (2 x executor time): how well the runner keeps the workers fed.
  It does not depend on how fast the machine runs the trials; the median trial at 2 workers / at 1 worker does:
  above 1, the two workers did not have two free cores.
- the machine now: before each suite, the same one-thread matmul loop timed in 1 process and in 2 at once: the
  parallel efficiency the machine itself offers at that moment, for comparison (measured, not used in the others).
- identical metrics: every configuration's trials compared field by field with the first run's.
The local pool's fork server is started once at the beginning, as `gleak run` starts it while it validates the suite;
each local run still starts its own worker processes. The machine's load is printed before and after: on a shared
machine the efficiency is a lower bound.
"""
from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's gleak, also for the local Ray cluster's workers
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

from gleak.orchestration import ray_executor, runner  # noqa: E402
from gleak.orchestration.runner import run_suite  # noqa: E402
from gleak.orchestration.suite import load_suite  # noqa: E402
from gleak.orchestration.trial import run_trial  # noqa: E402
from gleak.orchestration.workers import prestart  # noqa: E402

METRICS = "status, error, mse, psnr, ssim, lpips, label_acc, cosine, grad_dist, matched, verdict, extra"


_executor_seconds: list[float] = []


def _timed(f):
    """Wrap an executor entry point to record how long it ran (the trials, without the run's fixed costs)."""

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            _executor_seconds.append(time.perf_counter() - t0)

    return wrapper


runner.run_in_process = _timed(runner.run_in_process)
runner.run_pool = _timed(runner.run_pool)
ray_executor.RayExecutor.run = _timed(ray_executor.RayExecutor.run)


def measure(suite, folder: Path, **kw) -> dict:
    """Run `suite` into the fresh `folder`: wall time, the executor's time, the trials' own seconds and metrics."""
    _executor_seconds.clear()
    t0 = time.perf_counter()
    summary = run_suite(suite, folder, progress=False, **kw)
    wall = time.perf_counter() - t0
    (executor,) = _executor_seconds
    assert summary.ran == len(suite.trials), summary
    con = sqlite3.connect(folder / "results.sqlite")
    secs = [r[0] for r in con.execute("SELECT seconds FROM trials")]
    metrics = {r[0]: r[1:] for r in con.execute(f"SELECT trial_id, {METRICS} FROM trials")}
    con.close()
    return {"wall": wall, "exec": executor, "n": len(secs), "sum": sum(secs), "median": statistics.median(secs),
            "metrics": metrics}


def line(label: str, m: dict, slots: int) -> str:
    per_min = m["n"] / m["wall"] * 60
    over = overhead(m, slots)
    return (f"  {label:<38} {m['wall']:7.2f} s {per_min:7.0f}/min | run fixed {m['wall'] - m['exec']:5.2f} s | "
            f"median trial {m['median'] * 1e3:7.1f} ms | overhead/trial {over * 1e3:7.2f} ms "
            f"({over / m['median']:6.1%} of median)")  # fmt: skip


def busy(m: dict, slots: int) -> float:
    """Share of the executor's time x slots that the workers spent inside trials."""
    return m["sum"] / (m["exec"] * slots)


def overhead(m: dict, slots: int) -> float:
    """Executor time not spent inside trials, per trial (slots run at once)."""
    return (m["exec"] * slots - m["sum"]) / m["n"]


def _spin(iterations: int, barrier, out) -> None:
    import torch

    torch.set_num_threads(1)
    a = torch.rand(192, 192, dtype=torch.float64)
    a @ a
    barrier.wait()
    t0 = time.time()
    for _ in range(iterations):
        a @ a
    out.put((t0, time.time()))


def machine_parallelism(iterations: int = 600, repeat: int = 2) -> float:
    """What two processes get from this machine now: the same one-thread matmul loop run by 1 process, then by 2 at
    once; (time of 1) / (time of 2). 1.0 on an idle machine with two free cores; the best of `repeat` tries."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    best = 0.0
    for _ in range(repeat):
        times = {}
        for n in (1, 2):
            barrier, out = ctx.Barrier(n), ctx.Queue()
            procs = [ctx.Process(target=_spin, args=(iterations, barrier, out)) for _ in range(n)]
            for p in procs:
                p.start()
            spans = [out.get() for _ in procs]
            for p in procs:
                p.join()
            times[n] = max(e for _, e in spans) - min(s for s, _ in spans)
        best = max(best, times[1] / times[2])
    return best


def machine_load() -> str:
    """Load average, and the share of time some task waited for a CPU (Linux pressure stall information)."""
    text = f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    try:
        some = Path("/proc/pressure/cpu").read_text().split("\n")[0].split()
        text += f", CPU pressure {' '.join(some[1:4])} (% of time some task waited for a CPU)"
    except (OSError, IndexError):
        pass
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", action="append", help="suite files (default: suites/quick.toml, benchmarks/cpu-bound.toml)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each local configuration; the fastest is kept")
    ap.add_argument("--no-ray", action="store_true", help="local executors only")
    args = ap.parse_args()
    paths = args.suite or [str(ROOT / "suites" / "quick.toml"), str(ROOT / "benchmarks" / "cpu-bound.toml")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"machine: {cores} usable cores; before: {machine_load()}")
    prestart()  # as `gleak run` does while it validates the suite: the fork server imports torch once
    ray = None
    if not args.no_ray:
        import ray

        t0 = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
        print(f"Ray {ray.__version__}: local cluster of 2 CPUs started in {time.perf_counter() - t0:.2f} s")
    tmp = Path(tempfile.mkdtemp(prefix="gleak-throughput-"))
    for path in paths:
        suite = load_suite(path)
        print(f"\n{suite.name} ({path}): {len(suite.trials)} trials")
        run_trial(suite.trials[0])  # imports and data caches, as `gleak run` has them after validating the suite
        runs: list[dict] = []
        best: dict[int, dict] = {}
        offered = machine_parallelism()
        print(f"  the machine now: a one-thread matmul loop in 2 processes at once runs at {offered:.1%} of the speed "
              f"of 1 process (the best 2-worker efficiency on offer; 100% on an idle machine with 2 free cores)")  # fmt: skip
        for workers in (1, 2):
            these = [measure(suite, tmp / f"{suite.name}-local{workers}-{i}", workers=workers) for i in range(args.repeat)]
            runs += these
            best[workers] = min(these, key=lambda m: m["wall"])
            spread = ", ".join(f"{m['wall']:.2f}" for m in these)
            print(line(f"local, {workers} worker{'s' if workers > 1 else ''} (runs: {spread} s)", best[workers], workers))
        eff = best[1]["wall"] / (2 * best[2]["wall"])
        print(f"  parallel efficiency at 2 workers: {eff:.1%} (speed-up {best[1]['wall'] / best[2]['wall']:.2f}x); "
              f"workers busy {busy(best[2], 2):.1%} of the pool's time; median trial {best[2]['median'] / best[1]['median']:.2f}x "
              f"as long as at 1 worker (1.00x on an idle machine with 2 free cores)")  # fmt: skip
        if ray is None:
            print(f"  identical metrics in all {len(runs)} runs: {all(m['metrics'] == runs[0]['metrics'] for m in runs)}")
            continue
        cold = measure(suite, tmp / f"{suite.name}-ray-cold", executor="ray", workers=2)
        print(line("Ray, 2 slots, cold workers", cold, 2))
        warm = measure(suite, tmp / f"{suite.name}-ray-warm", executor="ray", workers=2)
        print(line("Ray, 2 slots, warm workers", warm, 2))
        serial = measure(suite, tmp / f"{suite.name}-ray-serial", executor="ray", workers=1)
        print(line("Ray, 1 slot, warm, batched", serial, 1))
        saved, ray_executor.TASK_SECONDS = ray_executor.TASK_SECONDS, 0.0
        try:
            single = measure(suite, tmp / f"{suite.name}-ray-single", executor="ray", workers=1)
        finally:
            ray_executor.TASK_SECONDS = saved
        print(line("Ray, 1 slot, warm, 1 trial per task", single, 1))
        runs += [cold, warm, serial, single]
        print(f"  identical metrics in all {len(runs)} runs: {all(m['metrics'] == runs[0]['metrics'] for m in runs)}")
        print(f"  Ray at 2 slots (warm): {best[2]['wall'] / warm['wall']:.2f}x the throughput of 2 local workers")
        over = overhead(serial, 1)
        print(f"  Ray's overhead per trial (1 slot, batched): {over * 1e3:.2f} ms = {over / serial['median']:.1%} of the "
              f"median trial ({serial['median'] * 1e3:.1f} ms)")  # fmt: skip
    print(f"\nafter: {machine_load()}")
    if ray is not None:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
