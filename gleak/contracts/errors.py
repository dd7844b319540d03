"""Error types. Each maps to one behaviour of the command line (see gleak.cli)."""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Iterable


class GleakError(Exception):
    """Base class of every error gleak raises on purpose."""


class InputError(GleakError):
    """Bad input from the user: a malformed suite, an unknown plugin, a missing dataset.

    The message is one line that names the file, table and key (or the name). The CLI prints it and exits 2
    before anything runs or anything stored changes.
    """


class UnknownPluginError(InputError, KeyError):
    """A plugin name that is not registered; the message lists the close matches."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class DatasetMissing(InputError):
    """A dataset that is not on disk (and may not be downloaded); the message says where it was looked for."""


class UnsupportedCase(GleakError):
    """A plugin cannot handle this case (for example closed-form on a model without a linear first layer).

    Raised during a trial: the trial is stored as failed with this reason and the run goes on.
    """


class NonFiniteUpdate(GleakError):
    """A client update (or a defended update) contains NaN or infinity."""


class PluginContractError(GleakError):
    """A plugin broke its contract at run time (a defense modified its input in place, an attack's `extra` is not
    JSON): the trial is stored as failed with this reason (gleak.mechanics.defense_output)."""


class Where:
    """Builds the one-line errors of a file: 'FILE: [table] key 'k': problem' (a suite file; gleak.api names its own
    'file')."""

    def __init__(self, path: Path):
        self.path = path

    def error(self, table: str, key: str | None, problem: str) -> InputError:
        k = f" key {key!r}" if key else ""
        return InputError(f"{self.path}: [{table}]{k}: {problem}")


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """'; did you mean 'a', 'b'?' for a mistyped key or name with close matches among `known`, else ''."""
    close = difflib.get_close_matches(key, list(known), n=2, cutoff=0.5)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
