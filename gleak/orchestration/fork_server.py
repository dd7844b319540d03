"""The fork server gleak's worker processes start from (trials: gleak.orchestration.workers; utility runs:
gleak.orchestration.utility): it imports torch and gleak once, so that a new worker starts in milliseconds instead
of importing them again, and it has started no torch threads (forking after torch has started threads can
deadlock)."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys


def process_context():
    """The multiprocessing context gleak's worker processes start from (trials and utility runs): a fork server that
    imported torch and gleak once, so a new worker starts in milliseconds; spawn where fork servers do not exist."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # scipy.optimize: every image trial pairs its reconstructions (gleak.mechanics.metrics imports it lazily)
        ctx.set_forkserver_preload(["gleak.orchestration.trial", "scipy.optimize"])
        _ensure_fork_server()
        return ctx
    return mp.get_context("spawn")


@contextlib.contextmanager
def without_main_file():
    """Hide `__main__`'s file while a fork server or a worker starts: multiprocessing hands a new process the path of
    the caller's script and the process imports it, which would run a user's script or notebook export
    (`python walkthrough.py` calling gleak.run) once more inside every worker. Workers need gleak only."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is not None:
        del main.__file__
    try:
        yield
    finally:
        if path is not None:
            main.__file__ = path


def _ensure_fork_server() -> None:
    from multiprocessing import forkserver

    with without_main_file():
        forkserver.ensure_running()


def prestart() -> None:
    """Start the fork server now: it imports torch and gleak (seconds), which can overlap with what the caller does
    before the pool starts (the CLI validates the suite meanwhile). Starts no worker and touches no file."""
    process_context()
