"""Each distinct case held once in a store (schema version 6): the trials table's `case` column and the `case` of
its `config` name an entry of the `cases` table by key instead of repeating the case's JSON on every row.

A suite runs many trials per case (the closed-form sweep: 5,560 rows, 4 cases), and the case's JSON is most of a
row: held twice per row it made that store 7.9 MB, over what a repository should track. Readers see the rows as
before: `expand_case` and `expand_config` put the case's text back, byte for byte what was stored inline (the same
`json.dumps(..., sort_keys=True, default=str)` of the same dict).

A value that names no entry is left as it is (a store of an earlier version, or a row edited by hand holds the JSON
itself), so the checks of gleak.orchestration.stored_values judge what a reader would get.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

TABLE_SQL = 'CREATE TABLE IF NOT EXISTS cases (key TEXT PRIMARY KEY, "case" TEXT NOT NULL);'


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def case_key(case_text: str) -> str:
    """The key of a case's JSON text: the first 16 hex digits of its SHA-256 (the trial ids' length)."""
    return hashlib.sha256(case_text.encode()).hexdigest()[:16]


def compact(case_text: str, config_text: str) -> tuple[str, str, dict[str, str]]:
    """(the case column's key, the config with its case as a key, {key: case text} to store in the cases table)."""
    config = json.loads(config_text)
    config_case = _dumps(config["case"])
    entries = {case_key(case_text): case_text, case_key(config_case): config_case}
    return case_key(case_text), _dumps({**config, "case": case_key(config_case)}), entries


def expand_case(value: Any, cases: dict[str, str]) -> Any:
    """A case column's value as the case's JSON text where it names an entry of `cases`; unchanged otherwise."""
    return cases.get(value, value) if isinstance(value, str) else value


def expand_config(text: Any, cases: dict[str, str]) -> Any:
    """A config column's value with its case's JSON put back where the case names an entry of `cases`; the text
    unchanged otherwise (not JSON, not an object, or a case held inline)."""
    if not isinstance(text, str) or not cases:
        return text
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):
        return text
    key = config.get("case") if isinstance(config, dict) else None
    if not isinstance(key, str) or key not in cases:
        return text
    try:
        case = json.loads(cases[key])
    except (ValueError, RecursionError):
        return text
    return _dumps({**config, "case": case})


def compact_stored(case_value: Any, config_value: Any) -> tuple[str, str, dict[str, str]] | None:
    """`compact` for a row an earlier version stored with its case inline; None where either value is not the JSON
    object gleak wrote (left as it is: the store's checks have judged it already)."""
    try:
        case, config = json.loads(case_value), json.loads(config_value)
    except (TypeError, ValueError, RecursionError):
        return None
    if not isinstance(case, dict) or not isinstance(config, dict) or not isinstance(config.get("case"), dict):
        return None
    return compact(_dumps(case), _dumps(config))
