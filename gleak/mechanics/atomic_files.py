"""Files written whole or not at all: a temporary file beside the target, then a rename.

The temporary file's name says whose it is (`.NAME.gleak-tmp-XXXXXXXX` beside NAME): gleak.orchestration.output_folder.clean_partial_files
removes only such files, left by a writer that was killed between the two steps.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from gleak.contracts.errors import InputError


def refuse_link(path: Path) -> None:
    """InputError when the folder that `path` is written into is a symbolic link (`atomic_write_bytes` calls this
    before every write: images/ or figures/ replaced by a link mid-run still writes nothing outside)."""
    if path.parent.is_symlink():
        raise InputError(f"{path.parent}: a symbolic link, where gleak writes its own files; nothing written there")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    refuse_link(path)  # images/ or figures/ as a link out of the folder: nothing written through it
    path.parent.mkdir(parents=True, exist_ok=True)
    # The name says whose it is: gleak.orchestration.output_folder.clean_partial_files removes only these (left by a killed writer).
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.gleak-tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be read by others
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
