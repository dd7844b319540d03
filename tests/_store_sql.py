"""A test's own SQL on an output folder's store: results.sqlite with its arrays file attached, so that a statement
naming `reconstructions` edits the arrays where gleak keeps them (gleak.orchestration.store)."""
import sqlite3
from pathlib import Path


def connect(folder) -> sqlite3.Connection:
    db = sqlite3.connect(Path(folder) / "results.sqlite")
    db.execute("ATTACH DATABASE ? AS arrays", (str(Path(folder) / "reconstructions.sqlite"),))
    return db
