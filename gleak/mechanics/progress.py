"""Progress inside a trial: an attack's optimisation loop says where it is, the run shows it.

An attack calls `report(step, total, loss)` once per iteration (one line in its loop; a no-op unless a run listens).
The trial in progress listens through `reporting(sink)`: `gleak run --verbose` hands every trial a `line_printer`,
which writes a line to stderr at the first iteration, every tenth and every 10 s (from the worker process running the trial,
whose stderr is the run's). A module-level sink rather than an argument: the loops sit several calls deep inside
plugins, and one trial runs at a time in a process.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Any, Callable, Iterator, TextIO

Sink = Callable[[int, int, Any], None]
_sink: Sink | None = None


def report(step: int, total: int, loss: Any = None) -> None:
    """Iteration `step` (1-based) of `total` of the attack's loop is done; `loss` its objective (a number or a 0-d
    tensor, read only when shown). A loop that restarts reports 1..total again for each start."""
    if _sink is not None:
        _sink(step, total, loss)


@contextlib.contextmanager
def reporting(sink: Sink | None) -> Iterator[None]:
    """`report` calls inside the block go to `sink` (None: nowhere)."""
    global _sink
    before, _sink = _sink, sink
    try:
        yield
    finally:
        _sink = before


# A line at least this often (seconds) while a loop runs, whatever a tenth of its iterations takes: a 24,000-iteration
# inverting-gradients trial would otherwise say nothing for minutes.
EVERY_SECONDS = 10.0


def line_printer(label: str, stream: TextIO | None = None, every_seconds: float = EVERY_SECONDS) -> Sink:
    """A sink writing 'gleak: LABEL: iteration i/total, loss L' at the first iteration, every tenth of `total`
    iterations, at the last, and whenever `every_seconds` have passed since the line before."""
    last = [-math.inf]

    def sink(step: int, total: int, loss: Any) -> None:
        every = max(1, total // 10)
        now = time.monotonic()
        if step % every and step not in (1, total) and now - last[0] < every_seconds:
            return
        last[0] = now
        shown = ""
        if loss is not None:
            try:
                shown = f", loss {float(loss):.4g}"
            except (TypeError, ValueError, RuntimeError):  # a loss per restart: its best
                shown = f", loss {float(min(float(v) for v in loss)):.4g}"
        print(f"gleak: {label}: iteration {step}/{total}{shown}", file=stream or sys.stderr, flush=True)

    return sink


def fanout(*sinks: Sink | None) -> Sink | None:
    """One sink handing every report to each of `sinks` (the Nones left out); None when none is left."""
    live = [s for s in sinks if s is not None]
    if not live:
        return None
    if len(live) == 1:
        return live[0]

    def sink(step: int, total: int, loss: Any) -> None:
        for s in live:
            s(step, total, loss)

    return sink


# How often (seconds) a worker tells the run where its trial is: often enough for the bar to move, seldom enough
# that a loop of tiny iterations spends nothing on it.
SEND_EVERY_SECONDS = 0.5


def throttled(send: Callable[[int, int], None], every_seconds: float = SEND_EVERY_SECONDS) -> Sink:
    """A sink passing (step, total) to `send` at the first and the last iteration and at most every
    `every_seconds` between (the loss stays in the worker: the bar does not show it)."""
    last = [-math.inf]

    def sink(step: int, total: int, loss: Any) -> None:
        now = time.monotonic()
        if step not in (1, total) and now - last[0] < every_seconds:
            return
        last[0] = now
        send(step, total)

    return sink
