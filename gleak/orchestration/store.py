"""The results store: one SQLite file in the output folder, one row per trial keyed by the trial's config hash, and
beside it a second file for the reconstructions' arrays (ARRAYS_NAME, attached to the same connection as `arrays`).

The arrays are kept apart because they are most of a store's bytes (up to 16 images per trial): a published folder
commits its results.sqlite (every number, small) and its reconstructions.sqlite only where that is small too. A
reader without the arrays file still has every row; only `gleak rescore` and redrawing lost PNGs need the arrays.
The two files are separate SQLite databases, so one transaction cannot span both atomically (write-ahead logging):
a trial's arrays are committed first and its row after, so a kill in between leaves arrays without a row (never
read, replaced when the trial reruns), never a row whose arrays are missing.

Every finished trial is committed at once, so an interrupted run loses at most the trials in flight; a rerun skips
trials whose row says 'ok' or 'not-applicable'. Rows are never deleted. A lock file keeps two runs from writing one folder at once.

Each file says it is gleak's: SQLite's application_id (APPLICATION_ID, ARRAYS_APPLICATION_ID) and its
user_version the schema version; both are checked before use (gleak.orchestration.store_files). Every SQL
statement of gleak is in this module and that one.

Paths read from the store (the `image` column) are checked before use (`image_path`): a plain file name inside
the folder's images/, never a path elsewhere.
"""
from __future__ import annotations

import json
import os
import queue
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from gleak.contracts.config import TrialConfig
from gleak.orchestration import case_table
from gleak.contracts.errors import InputError
from gleak.orchestration.store_files import (  # noqa: F401 - ARRAYS_NAME, DB_NAME, read_meta: public here too
    APPLICATION_ID,
    ARRAYS_APPLICATION_ID,
    ARRAYS_NAME,
    ARRAYS_VERSION,
    DB_NAME,
    SCHEMA_VERSION,
    check_arrays_file,
    check_store,
    create_file,
    read_meta,
)
from gleak.orchestration.stored_values import meta_value

# The status of a trial whose plugin raised UnsupportedCase: stored, not retried, not a failure (exit status 0);
# the leaderboard shows such a cell as "n/a".
NOT_APPLICABLE = "not-applicable"  # not "n/a": pandas reads that as a missing value
DONE = ("ok", NOT_APPLICABLE)  # statuses a rerun does not recompute
STATUSES = (*DONE, "failed")  # every status a trial is stored with
_IMAGE_NAME = re.compile(r"^[0-9A-Za-z_-]{1,64}\.png$")

# Contract columns of results.csv first (DESIGN.md), then gleak's own.
CSV_COLUMNS = [
    "suite", "trial_id", "attack", "attack_params", "defense", "defense_params", "model", "dataset", "batch_size",
    "seed", "status", "mse", "psnr", "ssim", "lpips", "label_acc", "verdict", "seconds", "error",
    "cosine", "grad_dist", "matched", "image", "extra", "case", "threat_model", "rpsnr", "iip", "feat_mse",
]  # fmt: skip
METRIC_COLUMNS = {
    "mse": "REAL", "psnr": "REAL", "ssim": "REAL", "lpips": "REAL", "cosine": "REAL", "label_acc": "REAL",
    "grad_dist": "REAL", "matched": "INTEGER", "verdict": "TEXT", "image": "TEXT", "extra": "TEXT",
    "rpsnr": "REAL", "iip": "REAL", "feat_mse": "REAL",
}  # fmt: skip

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS trials (
    trial_id TEXT PRIMARY KEY,
    suite TEXT, attack TEXT, attack_params TEXT, defense TEXT, defense_params TEXT,
    model TEXT, dataset TEXT, batch_size INTEGER, seed INTEGER, "case" TEXT, config TEXT,
    status TEXT NOT NULL, error TEXT, traceback TEXT, seconds REAL, finished_at REAL,
    {", ".join(f"{k} {v}" for k, v in METRIC_COLUMNS.items())}
);
CREATE TABLE IF NOT EXISTS membership (position INTEGER PRIMARY KEY, trial_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
{case_table.TABLE_SQL}
"""
_ARRAYS_TABLE = "reconstructions (trial_id TEXT PRIMARY KEY, arrays BLOB NOT NULL, digest TEXT)"
_ARRAYS_SCHEMA = f"CREATE TABLE IF NOT EXISTS {_ARRAYS_TABLE};"
_UTILITY_SCHEMA = """
CREATE TABLE IF NOT EXISTS utility (
    utility_id TEXT PRIMARY KEY, defense TEXT, defense_params TEXT, dataset TEXT, model TEXT, config TEXT,
    status TEXT NOT NULL, error TEXT, traceback TEXT, accuracy REAL, epsilon REAL, seconds REAL, extra TEXT,
    finished_at REAL
)
"""
def arrays_digest(trial_id: str, arrays: bytes) -> str:
    """The digest stored beside a reconstruction's arrays: SHA-256 of the trial id and the bytes, so that arrays moved
    to another trial's row (or edited) are told apart from the trial's own when read (`Store.reconstructions`)."""
    import hashlib

    return hashlib.sha256(trial_id.encode() + b"\0" + arrays).hexdigest()


def _json(d: Any) -> str:
    return json.dumps(d, sort_keys=True, default=str)


def _stored_case_and_config(cfg: TrialConfig, cases: dict[str, str]) -> tuple[str, str]:
    """The trial's case and config as a row stores them (the case by key); the cases-table entries they name are
    added to `cases` (gleak.orchestration.case_table)."""
    case, config, entries = case_table.compact(_json(cfg.case.to_dict()), cfg.to_json())
    cases.update(entries)
    return case, config


def _record(cfg: TrialConfig, row: dict[str, Any], cases: dict[str, str]) -> dict[str, Any]:
    """The trials-table row of a finished trial; the entries of the cases table it names are added to `cases`."""
    case, config = _stored_case_and_config(cfg, cases)
    rec = {
        "trial_id": cfg.trial_id, "suite": cfg.suite, "attack": cfg.attack, "attack_params": _json(cfg.attack_params),
        "defense": cfg.defense, "defense_params": _json(cfg.defense_params), "model": cfg.case.model,
        "dataset": cfg.case.dataset, "batch_size": cfg.case.batch_size, "seed": cfg.seed,
        "case": case, "config": config, "status": row["status"],
        "error": row.get("error"), "traceback": row.get("traceback"), "seconds": row.get("seconds"),
        "finished_at": time.time(),
    }  # fmt: skip
    for k in METRIC_COLUMNS:
        rec[k] = row.get(k)
    return rec


# Identity keys that mark a change of what a trial computes (gleak.contracts.config.TrialConfig.identity): a stored
# config without one that its new identity has was computed under the earlier rule, so `rekey` leaves it to be
# recomputed rather than give its old result the new id.
RECOMPUTED_BY = ("observed",)


def _recomputes(config: str, cfg: TrialConfig) -> bool:
    stored = json.loads(config)
    return any(k in cfg.identity() and k not in stored for k in RECOMPUTED_BY)


class Store:
    """Results of one output folder. Opening checks the files (`check_store`: InputError, files untouched, when one
    is not gleak's) and creates them when absent (create=True; the arrays file also when an older store's arrays
    move into it)."""

    def __init__(self, folder: str | Path, create: bool = True):
        self.folder = Path(folder)
        self.path = self.folder / DB_NAME
        if not check_store(self.folder):
            if not create:
                raise InputError(f"{self.folder}: no results here (expected {DB_NAME}; run `gleak run` first)")
            self.folder.mkdir(parents=True, exist_ok=True)
            create_file(self.path, APPLICATION_ID, SCHEMA_VERSION, _SCHEMA)
        # check_same_thread=False: a run hands its connection to a CommitThread (used by one thread at a time).
        self.db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
        # A committed trial survives power loss, not just SIGKILL. Write-ahead logging: one fsync per commit instead
        # of the rollback journal's three (a commit costs ~6 ms instead of ~20 ms here), and readers (gleak
        # leaderboard, progress checks) never block the run. A killed writer's log is replayed on the next open.
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        if self.db.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:  # a store from before the id
            self.db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        self.db.executescript(_SCHEMA)
        self.arrays_path = self.folder / ARRAYS_NAME
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        legacy_arrays = "reconstructions" in self._tables("main")  # versions 1-4 kept the arrays in this file
        self._attach_arrays(create or legacy_arrays)
        if version < SCHEMA_VERSION:
            self._upgrade(legacy_arrays)

    def _tables(self, schema: str) -> set[str]:
        return {r[0] for r in self.db.execute(f"SELECT name FROM {schema}.sqlite_master WHERE type = 'table'")}

    def _attach_arrays(self, create: bool) -> None:
        """Attach the arrays file as schema `arrays`: created when absent and `create`; absent otherwise (a published
        folder that does not commit its arrays), an empty table in memory, so that every reader works and finds none."""
        self.has_arrays = check_arrays_file(self.folder)
        if not self.has_arrays and create:
            create_file(self.arrays_path, ARRAYS_APPLICATION_ID, ARRAYS_VERSION, _ARRAYS_SCHEMA)
            self.has_arrays = True
        if self.has_arrays:
            self.db.execute("ATTACH DATABASE ? AS arrays", (str(self.arrays_path),))
            self.db.execute("PRAGMA arrays.journal_mode=WAL")
            self.db.execute("PRAGMA arrays.synchronous=FULL")
        else:
            self.db.execute("ATTACH DATABASE ':memory:' AS arrays")
            self.db.execute(f"CREATE TABLE arrays.{_ARRAYS_TABLE}")

    def _upgrade(self, legacy_arrays: bool) -> None:
        """Bring a store of an earlier version to this one: version 1 kept arrays without a digest, so each is stamped
        with its trial's now (trusted as stored then, as every row of that version was); version 2 had no registered
        PSNR and IIP columns (added empty: `gleak rescore` fills them), version 3 no feature-space MSE (added empty:
        it needs the attacked model, which the store does not keep; a rerun fills it); versions 1-5 held each row's
        case inline twice (now once, in the cases table: gleak.orchestration.case_table); versions 1-4 kept the arrays
        in results.sqlite: they are copied into the arrays file (committed), then dropped from the store in the
        transaction that raises its version, so a kill in between leaves a store that repeats the copy when next
        opened, never one that lost arrays; the store file is then compacted."""
        if legacy_arrays:
            with self.db:
                self.db.execute("BEGIN")
                cols = {r[1] for r in self.db.execute("PRAGMA main.table_info(reconstructions)")}
                digest = "digest" if "digest" in cols else "NULL"
                self.db.execute("INSERT OR REPLACE INTO arrays.reconstructions (trial_id, arrays, digest) "
                                f"SELECT trial_id, arrays, {digest} FROM main.reconstructions")  # fmt: skip
            rows = self.db.execute("SELECT trial_id, arrays FROM arrays.reconstructions WHERE digest IS NULL").fetchall()
            with self.db:
                self.db.execute("BEGIN")
                self.db.executemany("UPDATE arrays.reconstructions SET digest = ? WHERE trial_id = ?",
                                    [(arrays_digest(t, a), t) for t, a in rows])  # fmt: skip
        with self.db:
            self.db.execute("BEGIN")
            have = {r[1] for r in self.db.execute("PRAGMA main.table_info(trials)")}
            for col, kind in METRIC_COLUMNS.items():
                if col not in have:
                    self.db.execute(f'ALTER TABLE main.trials ADD COLUMN "{col}" {kind}')
            if legacy_arrays:
                self.db.execute("DROP TABLE main.reconstructions")
            self._hold_cases_once()
            self.db.execute(f"PRAGMA main.user_version = {SCHEMA_VERSION}")
        self.db.execute("VACUUM main")  # the arrays' and the repeated cases' pages back to the file system

    def _hold_cases_once(self) -> None:
        """Versions 1-5 held each row's case inline, twice: now a key into the cases table (inside the caller's
        transaction; a row already holding a key, or one gleak did not write, is left as it is)."""
        cases: dict[str, str] = {}
        updates = []
        for trial_id, case, config in self.db.execute('SELECT trial_id, "case", config FROM main.trials').fetchall():
            done = case_table.compact_stored(case, config)
            if done is not None:
                cases.update(done[2])
                updates.append((done[0], done[1], trial_id))
        self._put_cases(cases)
        self.db.executemany('UPDATE main.trials SET "case" = ?, config = ? WHERE trial_id = ?', updates)

    @staticmethod
    def exists(folder: str | Path) -> bool:
        return (Path(folder) / DB_NAME).is_file()

    @staticmethod
    def open_existing(folder: str | Path) -> "Store":
        """The folder's store, checked; InputError when there is none or it is not a gleak store."""
        if not Path(folder).is_dir():
            raise InputError(f"{folder}: no such folder")
        return Store(folder, create=False)

    # -- paths read from the store ------------------------------------------------------------------------
    def image_path(self, image: Any) -> Path | None:
        """FOLDER/images/IMAGE when `image` (a value of the image column) is a plain file name there (no folder
        part, no link leading out of images/); None otherwise: a path from a store is never followed elsewhere."""
        if not isinstance(image, str) or not _IMAGE_NAME.match(image):
            return None
        images = self.folder / "images"
        p = images / image
        try:
            if images.is_symlink() or p.is_symlink():
                return None
            if images.exists() and images.resolve().parent != self.folder.resolve():
                return None
        except OSError:
            return None
        return p

    # -- writing ------------------------------------------------------------------------------------------
    def set_membership(self, trials: Iterable[TrialConfig]) -> None:
        """Record which trials (and in which order) the folder's suite holds now; trial rows are untouched."""
        rows = [(i, t.trial_id) for i, t in enumerate(trials)]
        if self.db.execute("SELECT position, trial_id FROM membership ORDER BY position").fetchall() == rows:
            return  # unchanged: a rerun with nothing to do leaves the file as it was (a committed store stays clean)
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM membership")
            self.db.executemany("INSERT INTO membership VALUES (?, ?)", rows)

    def set_meta(self, key: str, value: Any) -> None:
        text = _json(value)
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None or row[0] != text:  # unchanged: no write (see set_membership)
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, text))

    def verdict_rule(self) -> str:
        """The suite's verdict rule as stored (gleak.mechanics.verdicts.VERDICT_RULES); InputError where the store
        holds another value (an edited store)."""
        from gleak.mechanics.verdicts import VERDICT_RULES

        rule = self.get_meta("verdict", "margin") or "margin"
        if rule not in VERDICT_RULES:
            raise InputError(f"{self.path}: its verdict rule is {rule!r}, not one of {', '.join(VERDICT_RULES)} "
                             "(the store was edited)")  # fmt: skip
        return rule

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return meta_value(key, row[0], f"{self.path}:") if row else default

    def put(self, cfg: TrialConfig, row: dict[str, Any]) -> None:
        """Write one finished trial (replacing an earlier failed attempt of the same trial) in one transaction."""
        self.put_many([(cfg, row)])

    def put_many(self, finished: list[tuple[TrialConfig, dict[str, Any]]]) -> None:
        """Write several finished trials: their arrays in one transaction, then their rows in one (two fsyncs in all):
        every row or, if killed, none, and never a row before its arrays."""
        if not finished:
            return
        cases: dict[str, str] = {}
        recs = [_record(cfg, row, cases) for cfg, row in finished]
        cols = ", ".join(f'"{k}"' for k in recs[0])
        marks = ", ".join("?" for _ in recs[0])
        arrays = [(cfg.trial_id, row["reconstruction"], arrays_digest(cfg.trial_id, row["reconstruction"]))
                  for cfg, row in finished if row.get("reconstruction")]  # fmt: skip
        if arrays:  # the reconstructions' arrays (gleak.orchestration.reconstructions) first: see the module's docstring
            with self.db:
                self.db.execute("BEGIN")
                self.db.executemany("INSERT OR REPLACE INTO arrays.reconstructions (trial_id, arrays, digest) "
                                    "VALUES (?, ?, ?)", arrays)  # fmt: skip
        with self.db:
            self.db.execute("BEGIN")
            self._put_cases(cases)
            self.db.executemany(f"INSERT OR REPLACE INTO trials ({cols}) VALUES ({marks})", [list(r.values()) for r in recs])

    def _put_cases(self, cases: dict[str, str]) -> None:
        """Add entries to the cases table (inside the caller's transaction); an entry already there is kept."""
        self.db.executemany('INSERT OR IGNORE INTO cases (key, "case") VALUES (?, ?)', list(cases.items()))

    def update_scores(self, rows: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
        """`gleak rescore`: new metric values and extra of stored trials, (trial_id, {column: value}, extra), in one
        transaction. Only METRIC_COLUMNS change; the attack's output is untouched."""
        with self.db:
            self.db.execute("BEGIN")
            for trial_id, cols, extra in rows:
                cols = {k: v for k, v in cols.items() if k in METRIC_COLUMNS}
                cols["extra"] = _json(extra)
                sets = ", ".join(f'"{k}" = ?' for k in cols)
                self.db.execute(f"UPDATE trials SET {sets} WHERE trial_id = ?", [*cols.values(), trial_id])

    def rekey(self) -> list[tuple[str, str]]:
        """Give every stored trial the id its stored config has under the current code (and rename its image).

        A trial's id hashes its identity (TrialConfig.identity). When that rule changes for a case where nothing
        computed changes (a new CaseConfig field listed in LATER_FIELDS, which drops it at its default), trials
        stored before keep their old ids and would be recomputed. This maps them to the new ids; the results are
        untouched. A row whose new id is already taken keeps its old id (the newer row wins). Call under the lock.
        Returns the (old, new) pairs changed."""
        changed, stale, updates, cases = [], [], [], {}
        stored = self._cases()
        rows = self.db.execute("SELECT trial_id, config, image FROM trials").fetchall()
        taken = {r[0] for r in rows}
        for old, config, image in rows:
            config = case_table.expand_config(config, stored)
            cfg = TrialConfig.from_json(config)
            new = cfg.trial_id
            if new == old or new in taken or _recomputes(config, cfg):
                continue
            new_image = image
            src = self.image_path(image)
            if image and src is None:
                new_image = None  # not a name of gleak's images: forget it, touch nothing
            elif image:  # a second link under the new name now, the old name goes after the commit: never lost
                new_image = f"{new}.png"
                dst = self.folder / "images" / new_image
                if src.is_file() and not dst.exists() and self.image_path(new_image) is not None:
                    os.link(src, dst)
                    stale.append(src)
            case, compact_config = _stored_case_and_config(cfg, cases)
            updates.append((new, compact_config, case, new_image, old))
            taken.add(new)
            changed.append((old, new))
        if not changed:
            return changed
        # The arrays are copied to their new ids first, the rows moved next, the old copies dropped last (three
        # commits: the two files cannot share one), so that a kill at any point leaves each row's arrays under its id.
        # They are re-bound to the new id only where they were the old id's: arrays that were not stay refused.
        with self.db:
            self.db.execute("BEGIN")
            for old, new in changed:
                for arrays, digest in self.db.execute("SELECT arrays, digest FROM arrays.reconstructions WHERE trial_id = ?",
                                                      (old,)).fetchall():  # fmt: skip
                    ok = digest == arrays_digest(old, arrays)
                    self.db.execute("INSERT OR REPLACE INTO arrays.reconstructions (trial_id, arrays, digest) VALUES (?, ?, ?)",
                                    (new, arrays, arrays_digest(new, arrays) if ok else digest))  # fmt: skip
        with self.db:
            self.db.execute("BEGIN")
            self._put_cases(cases)
            self.db.executemany('UPDATE trials SET trial_id = ?, config = ?, "case" = ?, image = ? WHERE trial_id = ?', updates)
            self.db.executemany("UPDATE membership SET trial_id = ? WHERE trial_id = ?", [(new, old) for old, new in changed])
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("DELETE FROM arrays.reconstructions WHERE trial_id = ?", [(old,) for old, _ in changed])
        for p in stale:
            p.unlink(missing_ok=True)
        return changed

    def clean_partial_files(self) -> list[Path]:
        """Delete the temporary files that a killed writer of gleak's left (see gleak.orchestration.output_folder). Call only while
        holding the lock: no other gleak run is writing here then."""
        from gleak.orchestration.output_folder import clean_partial_files

        return clean_partial_files(self.folder)

    # -- reading ------------------------------------------------------------------------------------------
    def finished_ids(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT trial_id FROM trials WHERE status IN (?, ?)", DONE)}

    def frame(self, members_only: bool = True):
        """The trials as a pandas DataFrame in suite order (the current suite's trials when members_only)."""
        import pandas as pd

        if members_only and self.db.execute("SELECT COUNT(*) FROM membership").fetchone()[0]:
            q = 'SELECT t.* FROM membership m JOIN trials t ON t.trial_id = m.trial_id ORDER BY m.position'
        else:
            q = "SELECT * FROM trials ORDER BY finished_at"
        df = pd.read_sql_query(q, self.db)
        cases = self._cases()
        if cases and len(df):  # each row's case and config as they were written, the case's JSON put back
            df["case"] = [case_table.expand_case(v, cases) for v in df["case"]]
            df["config"] = [case_table.expand_config(v, cases) for v in df["config"]]
        odd = df[~df["status"].isin(STATUSES)]
        if len(odd):  # an edited store: a guess (failed? ok?) would move a cell in or out of the ranking unseen
            tid, status = odd.iloc[0][["trial_id", "status"]]
            raise InputError(f"{self.path}: trial {tid} has status {status!r}, not one of {', '.join(STATUSES)} "
                             "(the store was edited); rerun the suite into a new folder")  # fmt: skip
        # An image name that is not a plain name in images/ is dropped here, so that no reader (results.csv, the
        # figures, the HTML page) ever opens a path a store names elsewhere.
        df["image"] = [v if self.image_path(v) is not None else None for v in df["image"]]
        return df

    def count(self, members_only: bool = True) -> int:
        """How many trial rows `frame(members_only)` holds."""
        if members_only and self.db.execute("SELECT COUNT(*) FROM membership").fetchone()[0]:
            q = "SELECT COUNT(*) FROM membership m JOIN trials t ON t.trial_id = m.trial_id"
        else:
            q = "SELECT COUNT(*) FROM trials"
        return int(self.db.execute(q).fetchone()[0])

    def failed_members(self) -> int:
        """Trials of the folder's current suite stored as failed (not ok, not not-applicable)."""
        return int(self.db.execute(
            "SELECT COUNT(*) FROM membership m JOIN trials t ON t.trial_id = m.trial_id WHERE t.status NOT IN (?, ?)", DONE
        ).fetchone()[0])  # fmt: skip

    def image_names(self) -> list[str]:
        """The stored trials' image names that are valid (see image_path)."""
        rows = self.db.execute("SELECT image FROM trials WHERE image IS NOT NULL").fetchall()
        return [r[0] for r in rows if self.image_path(r[0]) is not None]

    # -- utility runs (gleak.orchestration.utility) -------------------------------------------------------------------
    def put_utility(self, rec: dict[str, Any]) -> None:
        """Write one utility run's row (replacing an earlier attempt of the same run)."""
        self.db.execute(_UTILITY_SCHEMA)
        cols = ", ".join(f'"{k}"' for k in rec)
        self.db.execute(f"INSERT OR REPLACE INTO utility ({cols}) VALUES ({', '.join('?' for _ in rec)})", list(rec.values()))

    def utility_ok_ids(self) -> set[str]:
        self.db.execute(_UTILITY_SCHEMA)
        return {r[0] for r in self.db.execute("SELECT utility_id FROM utility WHERE status = 'ok'")}

    def utility_failed(self, ids: list[str]) -> int:
        """How many of the utility runs `ids` are stored as failed."""
        self.db.execute(_UTILITY_SCHEMA)
        marks = ", ".join("?" for _ in ids)
        return int(self.db.execute(f"SELECT COUNT(*) FROM utility WHERE status != 'ok' AND utility_id IN ({marks})", ids).fetchone()[0])

    def utility_rows(self) -> list[dict[str, Any]]:
        """Every stored utility run, as dicts of its columns."""
        self.db.execute(_UTILITY_SCHEMA)
        cur = self.db.execute("SELECT * FROM utility")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]

    def named_image_ids(self) -> set[str]:
        """The trials whose row names a reconstruction PNG, whether or not that name is usable now (`frame` drops a
        name whose file is a link): a figure draws those from their stored arrays instead."""
        return {r[0] for r in self.db.execute("SELECT trial_id FROM trials WHERE image IS NOT NULL")}

    def configs(self) -> dict[str, str]:
        """trial_id -> its stored config (JSON text, gleak.contracts.config.TrialConfig.from_json)."""
        cases = self._cases()
        rows = self.db.execute("SELECT trial_id, config FROM trials WHERE config IS NOT NULL").fetchall()
        return {t: case_table.expand_config(c, cases) for t, c in rows}

    def _cases(self) -> dict[str, str]:
        """The cases table: key -> the case's JSON text (gleak.orchestration.case_table)."""
        return dict(self.db.execute('SELECT key, "case" FROM cases').fetchall())

    def reconstructions(self, trial_ids: Iterable[str] | None = None,
                        on_mismatch: Callable[[str], None] | None = None) -> list[tuple[str, bytes, str | None]]:  # fmt: skip
        """(trial_id, arrays, extra JSON) of the current suite's finished trials that stored a reconstruction (of
        `trial_ids` only, when given). Arrays whose digest is not their trial's (moved from another trial's row, or
        edited) are InputError, one line naming the trial; or, with on_mismatch, that line is handed to it and the
        row left out."""
        q = ("SELECT t.trial_id, r.arrays, t.extra, r.digest FROM arrays.reconstructions r JOIN trials t "
             "ON t.trial_id = r.trial_id WHERE t.status = 'ok'")  # fmt: skip
        args: list[str] = []
        if self.db.execute("SELECT COUNT(*) FROM membership").fetchone()[0]:
            q += " AND t.trial_id IN (SELECT trial_id FROM membership)"
        if trial_ids is not None:  # only these rows' blobs are read (a figure's few panels, not the whole store)
            args = sorted(set(trial_ids))
            q += f" AND t.trial_id IN ({', '.join('?' for _ in args)})"
        out = []
        for trial_id, arrays, extra, digest in self.db.execute(q, args):
            if digest != arrays_digest(trial_id, arrays):
                line = (f"{self.arrays_path}: table reconstructions, trial {trial_id[:40]!r}: its arrays do not match their "
                        "digest (another trial's, or edited); rerun the trial or restore the store")  # fmt: skip
                if on_mismatch is None:
                    raise InputError(line)
                on_mismatch(line)
                continue
            out.append((trial_id, arrays, extra))
        return out

    def close(self) -> None:
        self.db.close()


class CommitThread:
    """Commits finished trials to a store on a thread of its own, so that the caller goes on (the next trial runs
    during the fsync), and what finishes meanwhile shares one transaction. `put` returns at once; `close` waits until
    everything put is committed, and re-raises what stopped the thread. Between the two, only this thread uses the
    store. A process killed meanwhile loses what was put and not yet committed: trials in flight, like the running
    ones. `on_stored(batch)` is called on this thread after each commit."""

    def __init__(self, store: Store, on_stored: Callable[[list[tuple[TrialConfig, dict[str, Any]]]], None]):
        self.store, self.on_stored = store, on_stored
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="gleak-store", daemon=True)
        self.thread.start()

    def put(self, finished: list[tuple[TrialConfig, dict[str, Any]]]) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(finished)

    def _loop(self) -> None:
        stop = False
        while not stop:
            item = self.queue.get()
            if item is None:
                return
            batch = list(item)
            while True:  # everything that arrived during the last commit goes into this one
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch += more
            try:
                self.store.put_many(batch)
                self.on_stored(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by put / close
                self.error = exc
                return

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
