"""What a plugin may not do to gleak's process while it is imported or built: end it (`no_exit`), hang it
(`construction_timeout`), or pass its own KeyboardInterrupt off as the user's Ctrl-C (`sigint_watch`).

Each turns the plugin's act into an exception its caller names in one line (gleak.contracts.registry), so that a
plugin's fault is never read as gleak's exit status or as the user stopping the run.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


class ExitCalled(SystemExit):
    """Raised in place of os._exit by `no_exit`: a plugin tried to end the process."""


@contextlib.contextmanager
def no_exit() -> Iterator[None]:
    """While a plugin file is imported or a plugin built (gleak.contracts.registry), os._exit raises ExitCalled instead of
    ending gleak's process: the caller turns it, like sys.exit's SystemExit, into one line naming the plugin."""
    import os

    real = os._exit

    def refuse(code: int = 0) -> None:
        raise ExitCalled(f"called os._exit({code!r})")

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def exit_text(exc: SystemExit) -> str:
    """What a plugin's attempt to end the process was, in words."""
    return str(exc) if isinstance(exc, ExitCalled) else f"called sys.exit({exc.code!r})"


# A plugin's construction while a suite is validated: a plugin whose __init__ hangs must not hang `gleak run`
# before anything runs. Generous by default (a plugin may load weights); $GLEAK_PLUGIN_INIT_TIMEOUT sets it.
INIT_TIMEOUT_ENV = "GLEAK_PLUGIN_INIT_TIMEOUT"
INIT_TIMEOUT_S = 60.0


class ConstructionTimeout(BaseException):
    """Raised inside a plugin's __init__ by `construction_timeout` when it runs past its time (a BaseException, as
    KeyboardInterrupt: a plugin's `except Exception` does not swallow it)."""


def init_timeout() -> float:
    """Seconds a plugin's construction may take during validation ($GLEAK_PLUGIN_INIT_TIMEOUT, else 60)."""
    import os

    from gleak.contracts.errors import InputError

    text = os.environ.get(INIT_TIMEOUT_ENV)
    if not text:
        return INIT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise InputError(f"${INIT_TIMEOUT_ENV} must be a number of seconds > 0, got {text!r}")
    return value


@contextlib.contextmanager
def construction_timeout(seconds: float) -> Iterator[None]:
    """Raise ConstructionTimeout in the block once it has run `seconds` (a SIGALRM timer, in the main thread only;
    elsewhere the block runs unlimited). A timer set before (a test runner's own) is kept: where it expires first
    it is left alone, else it is set again afterwards with its time left. Python code (a loop, a sleep) is
    interrupted; a plugin stuck inside one C call is interrupted when that call returns to Python."""
    import signal
    import threading
    import time

    before_left, before_interval = signal.getitimer(signal.ITIMER_REAL)
    if threading.current_thread() is not threading.main_thread() or (before_left and before_left <= seconds):
        yield
        return

    def expired(signum, frame):
        raise ConstructionTimeout(f"did not return within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if before_left:  # the earlier timer, with the time it has left
            signal.setitimer(signal.ITIMER_REAL, max(before_left - (time.monotonic() - started), 1e-3), before_interval)


@contextlib.contextmanager
def sigint_watch() -> Iterator[list[int]]:
    """Tell the user's Ctrl-C from a plugin raising KeyboardInterrupt: the yielded list gets an entry when SIGINT
    arrives inside the block. The caller re-raises a KeyboardInterrupt only then, and names the plugin otherwise.
    In the main thread only (elsewhere SIGINT never raises, so every KeyboardInterrupt there is a plugin's); a
    SIGINT that the process ignores (a worker) stays ignored."""
    import signal
    import threading

    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.getsignal(signal.SIGINT)

    def arrived(signum, frame):
        seen.append(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, arrived)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)
