"""A store's two files checked before anything uses them, and created whole: results.sqlite (the trials' rows) and
reconstructions.sqlite (their arrays) of gleak.orchestration.store.

`check_store` reads a file before anything uses it: one that is not SQLite, damaged, someone else's (another
application id, or tables that are not gleak's), empty, or written by a newer gleak is refused with one line and
left untouched. Stores written before the id existed (gleak's tables, id 0) are recognised and stamped. The arrays
file beside it is checked the same way (`check_arrays_file`).
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import tempfile
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

from gleak.contracts.errors import InputError
from gleak.orchestration.stored_values import check_rows

DB_NAME = "results.sqlite"
ARRAYS_NAME = "reconstructions.sqlite"
APPLICATION_ID = 0x474C4B31  # "GLK1" in SQLite's header: this file is a gleak results store
ARRAYS_APPLICATION_ID = 0x474C4B41  # "GLKA": this file holds a gleak store's reconstruction arrays
# user_version; a newer one is refused (written by a newer gleak). 2: a reconstruction's arrays carry a digest that
# binds them to their trial (`arrays_digest`). 3: registered PSNR and IIP columns. 4: feature-space MSE. 5: the
# arrays in their own file (ARRAYS_NAME). 6: each case held once (gleak.orchestration.case_table). An older store
# is brought up to this version when it is opened (`Store._upgrade`).
SCHEMA_VERSION = 6
ARRAYS_VERSION = 1  # the arrays file's own user_version
_GLEAK_TABLES = {"trials": {"trial_id", "config", "status"}, "membership": {"trial_id"}, "meta": {"key", "value"}}



def _read_only(path: Path) -> sqlite3.Connection:
    """A connection that writes nothing: without a write-ahead log beside the file, `immutable` (SQLite creates no
    -shm/-wal files then); with one (a writer was killed), read-only mode, which replays it in memory."""
    wal = path.with_name(path.name + "-wal")
    flags = "mode=ro" if wal.exists() and wal.stat().st_size > 0 else "mode=ro&immutable=1"
    return sqlite3.connect(f"file:{quote(str(path.resolve()))}?{flags}", uri=True, timeout=10)


def _open_sqlite(path: Path) -> sqlite3.Connection:
    """A read-only connection to `path` once its first bytes say SQLite; InputError (one line, file untouched) when
    it cannot be read, is empty or is not SQLite."""
    where = f"{path}:"
    try:
        with open(path, "rb") as fh:
            head = fh.read(100)
    except OSError as exc:
        raise InputError(f"{where} cannot be read ({exc.strerror})") from None
    if len(head) == 0:
        raise InputError(f"{where} an empty file, not a gleak store; move it away or use another --out")
    if not head.startswith(b"SQLite format 3\x00"):
        raise InputError(f"{where} not an SQLite file (not a gleak store, or damaged); move it away or use another --out")
    try:
        return _read_only(path)
    except sqlite3.Error as exc:
        raise InputError(f"{where} cannot be opened: {exc}") from None


@contextlib.contextmanager
def _reading(path: Path, noun: str) -> Iterator[tuple[sqlite3.Connection, str]]:
    """A read-only connection to the checked file and the start of its error lines; a file whose schema or pages
    SQLite cannot read (damaged names do not even decode) is one line, left untouched."""
    where = f"{path}:"
    con = _open_sqlite(path)
    try:
        yield con, where
    except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
        raise InputError(f"{where} damaged or not {noun} ({type(exc).__name__}); left untouched") from None
    finally:
        con.close()


def _check_intact(con: sqlite3.Connection, where: str) -> None:
    check = con.execute("PRAGMA quick_check").fetchone()[0]
    if check != "ok":
        raise InputError(f"{where} damaged ({check}); restore it from a copy or use another --out")


def _identity(con: sqlite3.Connection, where: str, accepted: tuple[int, ...], newest: int, noun: str) -> int:
    """The file's application id, once it is one of `accepted` (0: a store from before the id) and its version is
    not newer than `newest`; InputError (one line) otherwise."""
    app, version = (con.execute(f"PRAGMA {p}").fetchone()[0] for p in ("application_id", "user_version"))
    if app not in accepted:
        raise InputError(f"{where} an SQLite file of another application (id {app:#x}), not {noun}; left untouched")
    if app != 0 and version > newest:
        raise InputError(f"{where} written by a newer gleak (version {version}, this gleak reads up to {newest}); "
                         "upgrade gleak")  # fmt: skip
    return app


def check_store(folder: str | Path) -> bool:
    """Whether FOLDER/results.sqlite is a store this gleak can use (True) or absent (False); InputError, the file
    untouched, when it (or the arrays file beside it, `check_arrays_file`) is not SQLite, damaged, not gleak's,
    empty, or written by a newer gleak."""
    path = Path(folder) / DB_NAME
    if not path.exists():
        return False
    with _reading(path, "a gleak store") as (con, where):
        app = _identity(con, where, (0, APPLICATION_ID), SCHEMA_VERSION, "a gleak store")
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if app == 0:  # a store from before the id, or not gleak's at all: its tables tell
            if not tables:
                raise InputError(f"{where} an empty SQLite file, not a gleak store; move it away or use another --out")
            for t, cols in _GLEAK_TABLES.items():
                have = {r[1] for r in con.execute(f'PRAGMA table_info("{t}")')} if t in tables else set()
                if not cols <= have:
                    raise InputError(f"{where} an SQLite file whose tables are not gleak's (no {t} table of gleak's); left untouched")
        _check_intact(con, where)
        check_rows(con, where)  # every value a reader will use, before anything reads or rewrites it
    check_arrays_file(folder)
    return True


def check_arrays_file(folder: str | Path) -> bool:
    """Whether FOLDER/reconstructions.sqlite is an arrays file of gleak's (True) or absent (False); InputError, the
    file untouched, when it is not SQLite, damaged, another application's, or written by a newer gleak."""
    path = Path(folder) / ARRAYS_NAME
    if not path.exists():
        return False
    with _reading(path, "gleak's reconstruction arrays") as (con, where):
        _identity(con, where, (ARRAYS_APPLICATION_ID,), ARRAYS_VERSION, "gleak's reconstruction arrays")
        have = {r[1] for r in con.execute("PRAGMA table_info(reconstructions)")}
        if not {"trial_id", "arrays", "digest"} <= have:
            raise InputError(f"{where} has no reconstructions table of gleak's; restore it from a copy or move it away")
        _check_intact(con, where)
    return True


def read_meta(folder: str | Path, key: str) -> Any:
    """A meta value of FOLDER's store, read without writing anything (None without a store or the key)."""
    path = Path(folder) / DB_NAME
    if not check_store(folder):
        return None
    con = _read_only(path)
    try:
        row = con.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None
    except (sqlite3.Error, ValueError):
        return None
    finally:
        con.close()


def create_file(path: Path, application_id: int, version: int, schema: str) -> None:
    """Create an empty SQLite file of gleak's at `path` atomically (a temporary file renamed): a kill leaves either
    no file or one that says it is gleak's, never an empty file that could be anyone's."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.gleak-tmp-")
    os.close(fd)
    try:
        con = sqlite3.connect(tmp, isolation_level=None)
        con.execute(f"PRAGMA application_id = {application_id}")
        con.execute(f"PRAGMA user_version = {version}")
        con.executescript(schema)
        con.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
