"""The results store: one SQLite file in the output folder, one row per trial keyed by the trial's config hash.

Every finished trial is committed at once, so an interrupted run loses at most the trials in flight; a rerun skips
trials whose row says 'ok'. Rows are never deleted. A lock file keeps two runs from writing one folder at once.
"""
from __future__ import annotations

import fcntl
import json
import os
import queue
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from gleak.config import TrialConfig
from gleak.errors import InputError

DB_NAME = "results.sqlite"
LOCK_NAME = ".lock"
# tempfile.mkstemp(prefix=".NAME.") names: the prefix, then 8 characters from [a-z0-9_].
_PARTIAL = re.compile(r"^\..+\.(png|csv|md|tex|html|json|svg|pdf)\.[a-z0-9_]{8}$")

# Contract columns of results.csv first (DESIGN.md), then gleak's own.
CSV_COLUMNS = [
    "suite", "trial_id", "attack", "attack_params", "defense", "defense_params", "model", "dataset", "batch_size",
    "seed", "status", "mse", "psnr", "ssim", "lpips", "label_acc", "verdict", "seconds", "error",
    "cosine", "grad_dist", "matched", "image", "extra", "case",
]  # fmt: skip
METRIC_COLUMNS = {
    "mse": "REAL", "psnr": "REAL", "ssim": "REAL", "lpips": "REAL", "cosine": "REAL", "label_acc": "REAL",
    "grad_dist": "REAL", "matched": "INTEGER", "verdict": "TEXT", "image": "TEXT", "extra": "TEXT",
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
CREATE TABLE IF NOT EXISTS reconstructions (trial_id TEXT PRIMARY KEY, arrays BLOB NOT NULL);
"""


def _json(d: Any) -> str:
    return json.dumps(d, sort_keys=True, default=str)


def _record(cfg: TrialConfig, row: dict[str, Any]) -> dict[str, Any]:
    """The trials-table row of a finished trial."""
    rec = {
        "trial_id": cfg.trial_id, "suite": cfg.suite, "attack": cfg.attack, "attack_params": _json(cfg.attack_params),
        "defense": cfg.defense, "defense_params": _json(cfg.defense_params), "model": cfg.case.model,
        "dataset": cfg.case.dataset, "batch_size": cfg.case.batch_size, "seed": cfg.seed,
        "case": _json(cfg.case.to_dict()), "config": cfg.to_json(), "status": row["status"],
        "error": row.get("error"), "traceback": row.get("traceback"), "seconds": row.get("seconds"),
        "finished_at": time.time(),
    }  # fmt: skip
    for k in METRIC_COLUMNS:
        rec[k] = row.get(k)
    return rec


def take_lock(folder: str | Path):
    """Take FOLDER/.lock (an flock, released by the kernel when the process dies) or raise InputError naming the
    process that holds it. Creates the folder and the lock file only; writes this process's id into the lock file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / LOCK_NAME, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip()
        fh.close()
        who = f"pid {holder}" if holder else "another process"
        raise InputError(
            f"{folder}: another gleak run ({who}) is writing here; wait for it to finish or use another --out"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def release_lock(fh) -> None:
    if fh is not None:
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


class Store:
    """Results of one output folder."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / DB_NAME
        self.folder.mkdir(parents=True, exist_ok=True)
        # check_same_thread=False: a run hands its connection to a CommitThread (used by one thread at a time).
        self.db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
        # A committed trial survives power loss, not just SIGKILL. Write-ahead logging: one fsync per commit instead
        # of the rollback journal's three (a commit costs ~6 ms instead of ~20 ms here), and readers (gleak
        # leaderboard, progress checks) never block the run. A killed writer's log is replayed on the next open.
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)

    @staticmethod
    def exists(folder: str | Path) -> bool:
        return (Path(folder) / DB_NAME).is_file()

    @staticmethod
    def open_existing(folder: str | Path) -> "Store":
        if not Store.exists(folder):
            raise InputError(f"{folder}: no results here (expected {DB_NAME}; run `gleak run` first)")
        return Store(folder)

    # -- writing ------------------------------------------------------------------------------------------
    def set_membership(self, trials: Iterable[TrialConfig]) -> None:
        """Record which trials (and in which order) the folder's suite holds now; trial rows are untouched."""
        rows = [(i, t.trial_id) for i, t in enumerate(trials)]
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM membership")
            self.db.executemany("INSERT INTO membership VALUES (?, ?)", rows)

    def set_meta(self, key: str, value: Any) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, _json(value)))

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def put(self, cfg: TrialConfig, row: dict[str, Any]) -> None:
        """Write one finished trial (replacing an earlier failed attempt of the same trial) in one transaction."""
        self.put_many([(cfg, row)])

    def put_many(self, finished: list[tuple[TrialConfig, dict[str, Any]]]) -> None:
        """Write several finished trials in one transaction (one fsync): all of them or, if killed, none."""
        if not finished:
            return
        recs = [_record(cfg, row) for cfg, row in finished]
        cols = ", ".join(f'"{k}"' for k in recs[0])
        marks = ", ".join("?" for _ in recs[0])
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(f"INSERT OR REPLACE INTO trials ({cols}) VALUES ({marks})", [list(r.values()) for r in recs])
            arrays = [(cfg.trial_id, row["reconstruction"]) for cfg, row in finished if row.get("reconstruction")]
            if arrays:  # the reconstruction's arrays (gleak.reconstructions), in the same transaction as its row
                self.db.executemany("INSERT OR REPLACE INTO reconstructions VALUES (?, ?)", arrays)

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
        changed, stale = [], []
        rows = self.db.execute("SELECT trial_id, config, image FROM trials").fetchall()
        taken = {r[0] for r in rows}
        with self.db:
            self.db.execute("BEGIN")
            for old, config, image in rows:
                cfg = TrialConfig.from_json(config)
                new = cfg.trial_id
                if new == old or new in taken:
                    continue
                new_image = image
                if image:  # a second link under the new name now, the old name goes after the commit: never lost
                    src, new_image = self.folder / "images" / image, f"{new}{Path(image).suffix}"
                    dst = self.folder / "images" / new_image
                    if src.exists() and not dst.exists():
                        os.link(src, dst)
                        stale.append(src)
                self.db.execute(
                    'UPDATE trials SET trial_id = ?, config = ?, "case" = ?, image = ? WHERE trial_id = ?',
                    (new, cfg.to_json(), _json(cfg.case.to_dict()), new_image, old),
                )
                self.db.execute("UPDATE membership SET trial_id = ? WHERE trial_id = ?", (new, old))
                self.db.execute("UPDATE reconstructions SET trial_id = ? WHERE trial_id = ?", (new, old))
                taken.add(new)
                changed.append((old, new))
        for p in stale:
            p.unlink(missing_ok=True)
        return changed

    def clean_partial_files(self) -> list[Path]:
        """Delete the temporary files that a killed writer left (figures.atomic_write_bytes writes `.NAME.XXXXXXXX`
        beside NAME, then renames). Call only while holding the lock: no other gleak run is writing here then."""
        removed = []
        for folder in [self.folder] + [p for p in self.folder.iterdir() if p.is_dir()]:
            for p in folder.iterdir():
                if p.is_file() and _PARTIAL.match(p.name):
                    p.unlink(missing_ok=True)
                    removed.append(p)
        return removed

    # -- reading ------------------------------------------------------------------------------------------
    def finished_ids(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT trial_id FROM trials WHERE status = 'ok'")}

    def frame(self, members_only: bool = True):
        """The trials as a pandas DataFrame in suite order (the current suite's trials when members_only)."""
        import pandas as pd

        if members_only and self.db.execute("SELECT COUNT(*) FROM membership").fetchone()[0]:
            q = 'SELECT t.* FROM membership m JOIN trials t ON t.trial_id = m.trial_id ORDER BY m.position'
        else:
            q = "SELECT * FROM trials ORDER BY finished_at"
        return pd.read_sql_query(q, self.db)

    def reconstructions(self) -> list[tuple[str, bytes, str | None]]:
        """(trial_id, arrays, extra JSON) of the current suite's finished trials that stored a reconstruction."""
        q = ("SELECT t.trial_id, r.arrays, t.extra FROM reconstructions r JOIN trials t ON t.trial_id = r.trial_id "
             "WHERE t.status = 'ok'")  # fmt: skip
        if self.db.execute("SELECT COUNT(*) FROM membership").fetchone()[0]:
            q += " AND t.trial_id IN (SELECT trial_id FROM membership)"
        return [tuple(r) for r in self.db.execute(q)]

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
