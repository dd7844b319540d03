"""The lock of an output folder: one gleak process writes a folder at a time (a run, or `gleak leaderboard`, `plot`,
`rescore`), and a second is told which process holds it, in one line, before it changes anything.

filelock's FileLock is an flock on Unix: the kernel releases it when the holder dies, so a killed run never leaves
a folder locked.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from filelock import FileLock, Timeout

from gleak.contracts.errors import InputError

LOCK_NAME = ".lock"


def _busy(folder: Path, holder: str, advice: str = "wait for it to finish or use another --out") -> InputError:
    who = f"pid {holder}" if holder else "another process"
    return InputError(f"{folder}: another gleak run ({who}) is writing here; {advice}")


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def take_lock(folder: str | Path, advice: str | None = None) -> FileLock:
    """Take FOLDER/.lock (filelock's FileLock: an flock on Unix, released by the kernel when the process dies) or
    raise InputError naming the process that holds it (`advice`: what the line tells the user to do). Creates the
    folder and the lock file only; writes this process's id into the lock file (filelock leaves a lock file's
    contents to its holder). The lock remembers whether it created them (`release_lock(..., tidy=True)`)."""
    folder = Path(folder)
    lock = FileLock(folder / LOCK_NAME, timeout=0, thread_local=False)  # released by the run's thread, or another
    new_folder = not folder.is_dir()
    new_file = new_folder or not (folder / LOCK_NAME).exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except Timeout:
        raise _busy(folder, _holder(folder / LOCK_NAME), *([advice] if advice else [])) from None
    except OSError as exc:
        raise InputError(f"{folder}: cannot write the output folder: {exc.strerror}") from None
    lock.gleak_created = (new_folder, new_file)
    (folder / LOCK_NAME).write_text(str(os.getpid()))
    return lock


def check_unlocked(folder: str | Path) -> None:
    """Raise take_lock's InputError when another process holds FOLDER/.lock; creates nothing (the folder is not ours
    to change yet: a run that starts while another is creating its files must say the other run is there)."""
    path = Path(folder) / LOCK_NAME
    try:
        if not path.is_file():
            return
    except (OSError, ValueError):  # a name the folder checks reject with their own line (NUL)
        return
    probe = FileLock(path, timeout=0, thread_local=False)
    try:
        probe.acquire()
    except Timeout:
        raise _busy(Path(folder), _holder(path)) from None
    except OSError:  # a lock file this process may not open: the folder checks that follow say what is wrong
        return
    probe.release()


def release_lock(lock: FileLock | None, tidy: bool = False) -> None:
    """Release a lock of take_lock. tidy: also remove the lock file when take_lock created it, and the folder when
    take_lock created that and it is empty again: a command that was refused (or one that keeps no lock file in
    a folder, such as `gleak leaderboard` of a published folder) leaves nothing behind. The file is removed while
    still held, so no other process ever holds a lock on a file that is then deleted under it."""
    if lock is None:
        return
    new_folder, new_file = getattr(lock, "gleak_created", (False, False))
    path = Path(lock.lock_file)
    if tidy and new_file and lock.is_locked:
        path.unlink(missing_ok=True)
    lock.release()
    if tidy and new_folder:
        try:
            path.parent.rmdir()  # only when empty: what was written there meanwhile stays
        except OSError:
            pass


@contextlib.contextmanager
def holding_lock(folder: str | Path):
    """This process holds FOLDER's lock for the block (gleak leaderboard, plot, rescore: never while a run writes
    the folder). InputError, nothing created, when the folder is not there or another process holds its lock; a
    lock file created for the block is removed after it (release_lock's tidy)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: no such folder")
    lock = take_lock(folder, "wait for it to finish (it writes the reports itself when it is done)")
    try:
        yield lock
    finally:
        release_lock(lock, tidy=True)
