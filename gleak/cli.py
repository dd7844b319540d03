"""The `gleak` command line.

    gleak run [SUITE] [--out DIR] [--workers N] [--plugin FILE]   run a suite (default: suites/quick.toml)
              [--threads T] [--executor local|ray] [--address ADDR]
              [--trial-timeout S] [--in-process] [--force] [--device auto|cpu|cuda[:N]] [--verbose]
              [--set KEY=VALUE ... --out DIR]                      one setting of the suite changed
    gleak leaderboard DIR                                         regenerate results.csv and the leaderboards
    gleak plot DIR                                                regenerate the figures (DIR/figures/*.png)
    gleak rescore DIR [--metrics lpips,...] [--lpips-backbone F]  recompute metrics from the stored reconstructions
    gleak list [attacks|defenses|models|datasets|suites] [PATTERN]
    gleak check-plugin NAME_OR_FILE [--kind attack|defense|protocol] [--full]
    gleak show attack|defense|protocol|model NAME [--plugin FILE]  a plugin's parameters, defaults, choices, needs, docstring
    gleak compare DIR1 DIR2 [--all]                              per-cell differences of two output folders, with the spread

Exit status: 0 when every trial ran, 1 when some trials failed (their rows say why), 2 on bad input (nothing run,
nothing stored changed) and on a file-system problem (a full disk: what finished is stored).
"""
from __future__ import annotations

import argparse
import errno
import sqlite3
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gleak.contracts.errors import InputError
from gleak.contracts.escaping import strip_controls
from gleak.plugin_commands import EXIT_BAD_INPUT, EXIT_OK, cmd_check_plugin, cmd_list, cmd_show, load_plugins

if TYPE_CHECKING:
    from gleak.orchestration.runner import RunSummary


def _parallelism(args: argparse.Namespace) -> int | None:
    """--workers as a number (None: Ray's default, every CPU of the cluster); bad values are InputError."""
    from gleak.orchestration.workers import usable_cores

    if args.threads < 1:
        raise InputError(f"--threads must be >= 1, got {args.threads}")
    from gleak.orchestration.runner import check_timeout_executor

    check_timeout_executor(args.executor, args.trial_timeout)
    if args.address and args.executor != "ray":
        raise InputError("--address names a Ray cluster: use it with --executor ray")
    if args.executor == "ray":
        from gleak.orchestration.ray_executor import check_address, ray_available

        if not ray_available():
            raise InputError("--executor ray needs Ray: pip install 'gleak[ray]'")
        if args.address:
            check_address(args.address)
    if args.in_process and (args.executor == "ray" or (args.workers not in (None, "1"))):
        raise InputError("--in-process runs trials one after another in this process: use it without --workers and --executor ray")
    if args.trial_timeout is not None and not (args.trial_timeout >= 0 and args.trial_timeout < float("inf")):
        raise InputError(f"--trial-timeout must be a number of seconds >= 0 (0: no limit), got {args.trial_timeout}")
    if args.workers is None:
        return None if args.executor == "ray" else 1
    if args.workers == "auto":
        return max(1, usable_cores() // args.threads)
    try:
        n = int(args.workers)
    except ValueError:
        raise InputError(f"--workers must be a number or 'auto', got {args.workers!r}") from None
    if n < 1:
        raise InputError(f"--workers must be >= 1, got {n}")
    return n


def cmd_run(args: argparse.Namespace) -> int:
    workers = _parallelism(args)  # before any import of torch: a mistyped option is one line at once
    if args.overrides and not args.out:  # results/NAME holds the suite as its file says, never a changed copy of it
        raise InputError("--set changes the suite: name the folder for its results with --out")
    from gleak.orchestration.runner import run_suite
    from gleak.orchestration.suite import find_suite, load_suite
    from gleak.reporting.report import write_folder_reports as write_reports

    if args.device is not None:  # before anything starts: a device that is not here is one line
        from gleak.mechanics.device import resolve

        resolve(args.device)
    if args.executor == "local" and not args.in_process:
        from gleak.orchestration.fork_server import prestart

        prestart()  # the workers' fork server imports torch while the suite is validated
    load_plugins(args.plugin)
    path = find_suite(args.suite)
    suite = load_suite(path, overrides=args.overrides)  # validates everything before the folder is touched
    _check_lpips(args.lpips_backbone)  # a bad suite is refused before the weights are fetched (233 MB)
    out = Path(args.out) if args.out else Path("results") / suite.name

    def announce(todo: int, stored: int) -> None:  # once the folder is ours (a refused run prints only its error)
        if args.in_process:
            where = "this process (--in-process)"
        else:
            where = "Ray" if args.executor == "ray" else (f"{workers} workers" if (workers or 1) > 1 else "1 worker process")
        print(f"gleak: suite {suite.name!r} from {path}: {len(suite.trials)} trials ({stored} stored, {todo} to run"
              f" on {where}) -> {out}/", file=sys.stderr)  # fmt: skip

    t0 = time.perf_counter()
    summary = run_suite(
        suite, out, workers=workers, progress=not args.no_progress, lpips_weights=args.lpips_backbone,
        threads=args.threads, executor=args.executor, address=args.address,
        plugin_files=tuple(str(Path(f).resolve()) for f in args.plugin or ()), on_start=announce,
        in_process=args.in_process, trial_timeout=args.trial_timeout, force=args.force, device=args.device,
        verbose=args.verbose, reports=lambda o: write_reports(o, suite.name, suite.description, locked=True),
    )  # fmt: skip (the reports: once the run stored everything, from the store, before the run lets the folder go)
    dt = time.perf_counter() - t0
    print(
        f"gleak: {_run_counts(summary)}, {dt:.1f} s",
        file=sys.stderr,
    )
    print(f"leaderboard: {out / 'leaderboard.md'}")
    print(f"results:     {out / 'results.csv'}")
    return summary.exit_code


def _run_counts(summary: "RunSummary") -> str:
    """'N trials run: a ok, b failed, c not applicable, S already stored' (and the suite's failures where earlier
    runs or its utility runs add to this run's): a trial its attack cannot handle is neither ok nor failed."""
    failed_now = summary.ran - summary.ok - summary.not_applicable
    counts = f": {summary.ok} ok, {failed_now} failed, {summary.not_applicable} not applicable" if summary.ran else ""
    text = f"{summary.ran} trials run{counts}, {summary.skipped} already stored"
    if summary.failed != failed_now:
        text += f" ({summary.failed} failed in the whole suite, stored trials and utility runs included)"
    return text


def _check_lpips(flag: str | None, fetch: bool = True) -> None:
    """The LPIPS backbone, before anything runs: a named file (--lpips-backbone, else $GLEAK_LPIPS_BACKBONE) or the
    one in the torch hub cache must be the published AlexNet weights (a missing or wrong file is bad input, exit 2,
    not a failure of every trial); with none named or cached, `fetch` downloads it into the cache where the network
    allows (else one line says how to fill LPIPS, and the run goes on without it)."""
    import os

    from gleak.mechanics.perceptual import LPIPS_ENV, check_lpips_weights, fetch_weights, hub_weights_file

    if flag:
        check_lpips_weights(flag, "--lpips-backbone")
        return
    named = os.environ.get(LPIPS_ENV)
    if named and not Path(named).expanduser().is_file():
        raise InputError(f"${LPIPS_ENV} names {named}, which does not exist (unset it, or point it at alexnet-owt-7be5be79.pth)")
    if named:
        check_lpips_weights(named, f"${LPIPS_ENV}")
        return
    if hub_weights_file().is_file():
        check_lpips_weights(hub_weights_file(), "the torch hub cache's")
    elif fetch:
        fetch_weights(say=lambda line: print(f"gleak: {strip_controls(line)}", file=sys.stderr))


def cmd_plot(args: argparse.Namespace) -> int:
    from gleak.orchestration import output_folder as owned
    from gleak.orchestration.folder_lock import holding_lock
    from gleak.orchestration.store import check_store
    from gleak.reporting.report import write_figures

    owned.claim_results(args.dir, check_store)  # read-only first: a folder gleak may not write gets no lock file
    with holding_lock(args.dir):  # never while a run writes the folder
        owned.claim_results(args.dir, check_store).save()
        figures = write_figures(args.dir)
        owned.record(args.dir, [Path(args.dir) / rel for rel, _ in figures])
    for rel, _ in figures:
        print(Path(args.dir) / rel)
    if not figures:
        print(f"gleak: no figures for {args.dir} (no finished trials with images or metrics to draw)", file=sys.stderr)
    return EXIT_OK


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from gleak.reporting.report import write_folder_reports as write_reports

    if not args.claims:
        paths = write_reports(args.dir)  # under the folder's lock: refused while a run writes the folder
    else:
        from gleak.orchestration.folder_lock import holding_lock
        from gleak.orchestration.output_folder import claim_results
        from gleak.orchestration.store import check_store

        claim_results(args.dir, check_store)  # gleak's folder with readable results, before anything in it changes
        with holding_lock(args.dir):
            _take_claims(Path(args.dir), args.claims)
            paths = write_reports(args.dir, locked=True)
    for p in paths.values():
        print(p)
    return EXIT_OK


def _take_claims(folder: Path, suite_file: str) -> None:
    """--claims SUITE: judge the folder's trials against the (edited) claims of its own suite file."""
    from gleak.orchestration.suite import load_suite
    from gleak.reporting.claims import replace_claims
    from gleak.reporting.report import folder_suite_name

    suite = load_suite(suite_file)
    have = folder_suite_name(folder)
    if have != suite.name:
        raise InputError(f"--claims {suite_file}: suite {suite.name!r}, but {folder} holds suite {have!r}")
    replace_claims(folder, suite.claims)


def cmd_rescore(args: argparse.Namespace) -> int:
    from gleak.orchestration.output_folder import claim_results
    from gleak.orchestration.reconstructions import check_stored_arrays, coverage_text, parse_metrics, rescore_counts
    from gleak.orchestration.store import check_store
    from gleak.reporting.report import write_folder_reports as write_reports

    metrics = parse_metrics(args.metrics)
    claim_results(args.dir, check_store)  # as `gleak leaderboard`: gleak's folder, no user's file where a report goes
    check_stored_arrays(args.dir)  # a store that cannot be rescored is refused before any weights are fetched
    _check_lpips(args.lpips_backbone, fetch="lpips" in metrics)
    paths = {}
    # The reports under the lock that the rescoring holds: no run writes the folder in between.
    n, cov = rescore_counts(args.dir, metrics, args.lpips_backbone,
                            then=lambda: paths.update(write_reports(args.dir, locked=True)), checked=True)  # fmt: skip
    print(f"gleak: rescored {', '.join(metrics)} of {n} trials from their stored reconstructions: {coverage_text(n, cov)}",
          file=sys.stderr)  # fmt: skip
    for p in paths.values():
        print(p)
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    from gleak.api import compare

    table = compare(args.dir1, args.dir2)
    both = table[table["in"] == "both"]
    moved = both[both["beyond_spread"]]
    print(f"{args.dir1} (A) vs {args.dir2} (B): {len(both)} cells in both, {len(moved)} moved beyond their spread, "
          f"{int((table['in'] == 'A').sum())} only in A, {int((table['in'] == 'B').sum())} only in B")  # fmt: skip
    for _, r in moved.iterrows():  # by name: a count alone sends the reader hunting through the table
        print(f"  moved: {r['case']}, {r['defense']} x {r['attack']}: PSNR {r['psnr_a']:.3g} -> {r['psnr_b']:.3g} dB "
              f"({r['d_psnr']:+.3g}, spread {r['spread']:.3g})")  # fmt: skip
    shown = table if args.all else table[(table["in"] != "both") | table["beyond_spread"] | table["changed"]]
    if len(shown):
        cols = ["case", "defense", "attack", "in", "trials_a", "trials_b", "psnr_a", "psnr_b", "d_psnr", "spread",
                "label_acc_a", "label_acc_b", "d_label_acc"]  # fmt: skip
        print()
        print(strip_controls(shown[cols].to_markdown(index=False, floatfmt=".3g")))
    elif len(both):
        print("every cell in both folders has the same aggregates")
    return EXIT_OK


def _add_workflow_commands(sub) -> None:
    sh = sub.add_parser("show", help="a plugin's parameters, defaults, choices, needs and docstring")
    sh.add_argument("kind", choices=["attack", "defense", "protocol", "model"])
    sh.add_argument("name")
    sh.add_argument("--plugin", action="append", help="a Python file that registers plugins (repeatable)")
    sh.set_defaults(func=cmd_show)

    cm = sub.add_parser("compare", help="per-cell differences of two output folders' leaderboard cells, with the spread")
    cm.add_argument("dir1")
    cm.add_argument("dir2")
    cm.add_argument("--all", action="store_true", help="also the cells whose aggregates are unchanged")
    cm.set_defaults(func=cmd_compare)


def _add_run_parser(sub) -> None:
    r = sub.add_parser("run", help="run a suite and write its leaderboard")
    r.add_argument("suite", nargs="?", help="suite file or shipped suite name (default: quick)")
    r.add_argument("--out", help="output folder (default: results/<suite name>/)")
    r.add_argument("--workers", help="parallel worker processes, or 'auto' (usable cores / threads); default 1, "
                   "with Ray every CPU of the cluster")  # fmt: skip
    r.add_argument("--threads", type=int, default=1, help="torch threads per trial (default 1; metrics are identical "
                   "for any number of workers at the same --threads)")  # fmt: skip
    r.add_argument("--executor", choices=["local", "ray"], default="local", help="local processes (default) or Ray tasks")
    r.add_argument("--address", help="Ray cluster to use (with --executor ray; default: start a local one)")
    r.add_argument("--plugin", action="append", help="a Python file that registers plugins (repeatable)")
    r.add_argument("--lpips-backbone", help="AlexNet ImageNet weights file for LPIPS")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--trial-timeout", type=float, metavar="S", help="seconds after which a trial is killed and stored "
                   "as failed (default: from its cost estimate, at least 15 min; 0: no limit; local workers only)")  # fmt: skip
    r.add_argument("--in-process", action="store_true", help="run trials in this process (for debugging a plugin: a "
                   "crash, exit or hang of one trial then stops the run)")  # fmt: skip
    r.add_argument("--device", help="where trials and utility runs compute: auto (cuda if available, else cpu), cpu, "
                   "cuda or cuda:N (default: the suite's [suite] device, else cpu); not part of the trial ids, "
                   "recorded per trial (extra.device)")  # fmt: skip
    r.add_argument("--verbose", action="store_true", help="each trial prints its attack's iterations to stderr "
                   "(trial, iteration/total, loss): the first, every tenth and at least every 10 s")  # fmt: skip
    r.add_argument("--force", action="store_true", help="write into a non-empty folder that is not gleak's (gleak "
                   "adds its files beside the others and never touches them)")  # fmt: skip
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides", help="change one "
                   "setting of the suite (repeatable; with --out): seeds=1, case.batch_size=4, attack.iterations=100")  # fmt: skip
    r.set_defaults(func=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gleak", description="Benchmark gradient-leakage attacks and defenses.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)

    lb = sub.add_parser("leaderboard", help="regenerate results.csv and leaderboards of an output folder")
    lb.add_argument("dir")
    lb.add_argument("--claims", metavar="SUITE", help="first take the [[claim]] tables of the folder's suite file "
                    "SUITE (edited claims are judged again; no trial reruns)")  # fmt: skip
    lb.set_defaults(func=cmd_leaderboard)

    pl = sub.add_parser("plot", help="regenerate the figures of an output folder (DIR/figures/*.png)")
    pl.add_argument("dir")
    pl.set_defaults(func=cmd_plot)

    rs = sub.add_parser("rescore", help="recompute metrics from the stored reconstructions (no attack reruns)")
    rs.add_argument("dir")
    rs.add_argument("--metrics", help="comma-separated: " + "mse,psnr,ssim,cosine,lpips,label_acc,verdict,blind,share_psnr40"
                    " (default: all)")  # fmt: skip
    rs.add_argument("--lpips-backbone", help="AlexNet ImageNet weights file for LPIPS")
    rs.set_defaults(func=cmd_rescore)

    ls = sub.add_parser("list", help="list attacks, defenses, protocols, models, datasets or suites")
    ls.add_argument("what", nargs="?", default="attacks")
    ls.add_argument("pattern", nargs="?", default="*", help="shell-style wildcard, e.g. '*dlg*'")
    ls.set_defaults(func=cmd_list)

    cp = sub.add_parser("check-plugin", help="conformance check of a plugin (a registered name or a .py file)")
    cp.add_argument("target")
    cp.add_argument("--kind", choices=["attack", "defense", "protocol", "model"])
    cp.add_argument("--timeout", type=float, default=600.0, help="seconds for all checks of one plugin (default 600)")
    cp.add_argument("--full", action="store_true", help="check at the plugin's default settings, not the quick ones")
    cp.set_defaults(func=cmd_check_plugin)
    _add_workflow_commands(sub)
    return p


class _ClosedPipeQuiet:
    """sys.stdout or sys.stderr for one command: when the reader goes away (`gleak list | head -1`: a broken pipe),
    the rest of what the command prints goes nowhere, as with any command-line tool, and the command itself goes on
    to its end and its own exit status: a run still stores every trial and writes every report. The descriptor is
    pointed at /dev/null, so that Python's flush at exit finds no broken pipe either."""

    def __init__(self, stream):
        self._stream = stream
        self.broken = False

    def _closed(self) -> None:
        import os

        self.broken = True
        try:
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except (OSError, ValueError, AttributeError):  # a stream without a descriptor (a test's capture): dropped
            pass

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._closed()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._closed()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ClosedPipeQuiet(out), _ClosedPipeQuiet(err)
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader gone before the last line: found here, not by Python's flush at exit
        sys.stderr.flush()
        return code
    finally:
        sys.stdout, sys.stderr = out, err


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be, so that a terminated run stops its worker
    processes and keeps what it stored, as an interrupted one does (left to Python's default, SIGTERM ends this
    process at once and its workers, children of a forkserver, go on computing)."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return args.func(args)
    except InputError as exc:
        print(f"gleak: error: {strip_controls(exc)}", file=sys.stderr)  # it may quote a plugin's or a file's text
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:
        what = "terminated" if isinstance(exc, Terminated) else "interrupted"
        print(f"gleak: {what}; finished trials are stored, rerun to resume", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except (OSError, sqlite3.OperationalError) as exc:  # the disk filled up, the folder went away: one line
        full = getattr(exc, "errno", None) == errno.ENOSPC or "full" in str(exc)
        what = "the disk is full; free space and rerun to resume" if full else f"{type(exc).__name__}: {exc}"
        print(f"gleak: error: {what} (finished trials are stored)", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def entry() -> None:
    """The `gleak` command: `main`, then exit without waiting for threads a plugin left running. Python's exit
    waits for every non-daemon thread, so one a plugin started under `--in-process` (where plugins run in this
    process) would keep a finished run from ever exiting; it is named in one line instead."""
    import os
    import threading

    code = main()
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not left:
        sys.exit(code)
    names = ", ".join(strip_controls(t.name) for t in left[:3]) + (", ..." if len(left) > 3 else "")
    print(f"gleak: warning: {len(left)} thread(s) a plugin started still run ({names}); exiting without waiting "
          "for them (everything is stored)", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
