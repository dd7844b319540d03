"""What a stored trial row and the store's meta values may hold: checked where the store is read (gleak.orchestration.store.
check_store), before anything uses or rewrites them.

A store is a file anyone can edit. A value that gleak did not write (text where JSON was, a list where an object
was, an MSE below zero, an SSIM of -inf) would otherwise crash a reader with a traceback, or worse be judged as
if measured (an MSE of -1 scored "recovered"). Such a store is refused with one line naming the table, the trial
and the column; the file is left untouched.
"""
from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any

from gleak.contracts.errors import InputError
from gleak.orchestration.case_table import expand_case, expand_config

# JSON columns of the trials table and the type each holds (None allowed where gleak stores NULL).
JSON_COLUMNS = {"config": dict, "attack_params": dict, "defense_params": dict, "case": dict, "extra": dict}
CONFIG_KEYS = ("suite", "attack", "attack_params", "defense", "defense_params", "case", "seed")
# The metric columns and the closed range of each (PSNR may be +inf in stores written before the ceiling).
RANGES = {"mse": (0.0, math.inf), "psnr": (0.0, math.inf), "ssim": (-1.0, 1.0), "cosine": (-1.0, 1.0),
          "lpips": (0.0, math.inf), "label_acc": (0.0, 1.0), "grad_dist": (0.0, math.inf), "seconds": (0.0, math.inf),
          "matched": (0, math.inf), "rpsnr": (0.0, math.inf), "iip": (0.0, 1.0),
          "feat_mse": (0.0, math.inf)}  # fmt: skip
SLACK = 1e-9  # float round-off at a bound (a cosine of 1.0000000000000004 is stored)
STATUSES = ("ok", "failed", "not-applicable")
VERDICTS = (None, "recovered", "partial", "defended")
# Meta keys and the JSON type of each value (gleak.orchestration.runner, gleak.orchestration.utility write them).
META_TYPES = {"suite": str, "description": str, "verdict": str, "claims": list, "utility": (dict, type(None)),
              "set_params": dict}  # fmt: skip


def set_params_ok(value: Any) -> bool:
    """Whether a set_params value has the shape gleak writes: kind -> plugin name -> list of parameter names."""
    return isinstance(value, dict) and all(
        isinstance(names, dict) and all(isinstance(keys, list) and all(isinstance(k, str) for k in keys)
                                        for keys in names.values())
        for names in value.values())  # fmt: skip


def check_rows(con: sqlite3.Connection, where: str) -> None:
    """InputError (one line) at the first trial row or meta value gleak could not have written."""
    cases = _cases(con, where)
    cols = {r[1] for r in con.execute('PRAGMA table_info("trials")')}
    wanted = [c for c in (*JSON_COLUMNS, *RANGES, "verdict", "status", "image") if c in cols]
    query = f'SELECT trial_id, {", ".join(f"{chr(34)}{c}{chr(34)}" for c in wanted)} FROM trials'
    for trial_id, *values in con.execute(query):
        row = dict(zip(wanted, values))
        if cases:  # judged as a reader gets them: the case's JSON put back where the row names it by key
            row["case"] = expand_case(row.get("case"), cases)
            row["config"] = expand_config(row.get("config"), cases)
        problem = row_problem(row)
        if problem:
            raise InputError(f"{where} table trials, trial {str(trial_id)[:40]!r}: {problem}; restore the store from a copy")
    for key, text in con.execute("SELECT key, value FROM meta"):
        meta_value(key, text, where)


def _cases(con: sqlite3.Connection, where: str) -> dict[str, str]:
    """The cases table (schema version 6; empty before), each entry checked to be a JSON object."""
    if not con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'cases'").fetchone():
        return {}
    cases = {}
    for key, text in con.execute('SELECT key, "case" FROM cases'):
        if not isinstance(key, str) or not isinstance(text, str) or not isinstance(_json(text), dict):
            raise InputError(f"{where} table cases, key {str(key)[:40]!r}: not the JSON object gleak writes there; "
                             "restore the store from a copy")  # fmt: skip
        cases[key] = text
    return cases


def row_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with one stored trial row (its columns by name), None when nothing is."""
    for col, kind in JSON_COLUMNS.items():
        text = row.get(col)
        if text is None:
            continue
        value = _json(text)
        if not isinstance(value, kind):
            return f"column {col} is not a JSON {kind.__name__}"
        if col == "config" and not all(k in value for k in CONFIG_KEYS):
            return "column config lacks " + ", ".join(k for k in CONFIG_KEYS if k not in value)
        if col == "config" and not isinstance(value["case"], dict):
            return "column config's case is not a JSON object (nor the key of one in table cases)"
    for col, (lo, hi) in RANGES.items():
        v = row.get(col)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"column {col} holds {type(v).__name__} {str(v)[:20]!r}, not a number"
        if math.isnan(v) or not lo - SLACK <= v <= hi + SLACK or (math.isinf(v) and col not in ("psnr", "rpsnr")):
            return f"column {col} = {v!r} is impossible (outside [{lo}, {hi}])"
    if row.get("verdict") not in VERDICTS:
        return f"column verdict = {str(row.get('verdict'))[:20]!r} is not one of recovered, partial, defended"
    for col in ("status", "image"):
        if row.get(col) is not None and not isinstance(row.get(col), str):
            return f"column {col} is not text"
    return None


def meta_value(key: str, text: Any, where: str) -> Any:
    """The meta value `key` decoded from its stored JSON text; InputError when it is not of its type."""
    value = _json(text) if isinstance(text, (str, bytes)) else _BAD
    kind = META_TYPES.get(key)
    if value is _BAD or (kind is not None and not isinstance(value, kind)):
        raise InputError(f"{where} table meta, key {key!r}: not the JSON value gleak writes there; restore the store from a copy")
    if key == "claims" and not all(isinstance(c, dict) for c in value):
        raise InputError(f"{where} table meta, key 'claims': an entry is not a table; restore the store from a copy")
    if key == "set_params" and not set_params_ok(value):
        raise InputError(f"{where} table meta, key 'set_params': not the JSON value gleak writes there; restore the store from a copy")
    return value


_BAD = object()


def _json(text: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return _BAD


# -- a published folder without its store: results.csv and suite.json (gleak.reporting.report rebuilds from them) ---------
CSV_NUMBERS = (*RANGES, "batch_size", "seed")
CSV_JSON = ("attack_params", "defense_params", "case", "extra")
SUITE_JSON_TYPES = {"suite": str, "description": str, "verdict": str, "claims": list, "utility_config": (dict, type(None)),
                    "set_params": dict}  # fmt: skip


def check_committed(folder: Path) -> None:
    """InputError (one line) unless FOLDER's results.csv and suite.json are files gleak could have written: read
    before a report is rewritten from them."""
    import csv
    import io
    import re

    meta = folder / "suite.json"
    if meta.is_file():
        doc = _json(_read_text(meta))
        if not isinstance(doc, dict):
            raise InputError(f"{meta}: damaged (not a JSON object); restore it from a copy")
        for key, kind in SUITE_JSON_TYPES.items():
            if key in doc and not isinstance(doc[key], kind):
                raise InputError(f"{meta}: key {key!r} is not the JSON value gleak writes there; restore it from a copy")
        if "set_params" in doc and not set_params_ok(doc["set_params"]):
            raise InputError(f"{meta}: key 'set_params' is not the JSON value gleak writes there; restore it from a copy")
    path = folder / "results.csv"
    reader = csv.DictReader(io.StringIO(_read_text(path)))
    missing = [c for c in ("trial_id", "status", "attack", "defense") if c not in (reader.fieldnames or [])]
    if missing:
        raise InputError(f"{path}: not gleak's results (no column {missing[0]}); restore it from a copy")
    plain = re.compile(r"^[0-9A-Za-z_-]{1,64}\.png$")
    try:
        for line, row in enumerate(reader, start=2):
            problem = _csv_row_problem(row, plain)
            if problem:
                raise InputError(f"{path}: line {line}: {problem}; restore it from a copy")
    except csv.Error as exc:
        raise InputError(f"{path}: damaged ({exc}); restore it from a copy") from None


def _csv_row_problem(row: dict[str, Any], plain) -> str | None:
    if None in row:  # more cells than the header names
        return "more cells than columns"
    for col in ("trial_id", "attack", "defense", "model", "dataset"):
        if not row.get(col):
            return f"column {col} is empty"
    if row.get("status") not in STATUSES:
        return f"column status = {str(row.get('status'))[:20]!r} is not one of {', '.join(STATUSES)}"
    values: dict[str, Any] = {}
    for col in CSV_NUMBERS:
        text = row.get(col)
        if text in (None, ""):
            continue
        try:
            values[col] = float(text)
        except ValueError:
            return f"column {col} = {text[:20]!r} is not a number"
    if "batch_size" in values or "seed" in values:
        if any(not (v.is_integer() and v >= 0) for v in (values.pop(c) for c in ("batch_size", "seed") if c in values)):
            return "column batch_size or seed is not a whole number"
    for col in CSV_JSON:
        if row.get(col):
            values[col] = row[col]
    values["verdict"] = row.get("verdict") or None
    problem = row_problem(values)
    if problem:
        return problem
    image = row.get("image")
    if image and not plain.match(image):
        return f"column image = {image[:40]!r} is not a plain file name in images/"
    return None


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file (not UTF-8); restore it from a copy") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror})") from None
