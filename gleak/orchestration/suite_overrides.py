"""`gleak run SUITE --set KEY=VALUE`: one setting of a suite changed from the command line, as breaching's config
overrides do, then validated like the file itself (gleak.orchestration.suite.load_suite).

KEY names where the value goes:
- `seeds`, `name`, `verdict`, ... (a [suite] key) or `suite.KEY`: the [suite] table;
- `case.KEY`: the file's [case] table and every [[grid]]'s case table that sets KEY (the override wins everywhere);
- `attack.KEY`, `defense.KEY`: every [[attack]] / [[defense]] table, the file's and the grids', whose plugin has a
  parameter KEY (`defense.sigma=0.1` changes the noise defenses and leaves the undefended baseline as it is);
- `utility.KEY`: the [utility] table.
VALUE is read as a TOML value (`4`, `[1, 2]`, `"text"`, `true`); a bare word that is not one (`skimage`) is a string.
"""
from __future__ import annotations

import copy
import tomllib
from typing import Any, Iterable

from gleak.contracts.errors import InputError

TABLES = ("suite", "case", "attack", "defense", "utility")


def parse_override(text: str, suite_keys: Iterable[str]) -> tuple[str, str, Any]:
    """(table, key, value) of one `KEY=VALUE`; InputError naming it when it is not one."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise InputError(f"--set {text!r}: expected KEY=VALUE (for example seeds=1 or case.batch_size=4)")
    table, dot, name = key.partition(".")
    if not dot:
        if key not in set(suite_keys):
            raise InputError(f"--set {text!r}: {key!r} is not a [suite] key; name its table: "
                             f"{', '.join(f'{t}.{key}' for t in TABLES[1:])}")  # fmt: skip
        table, name = "suite", key
    if table not in TABLES or not name or "." in name:
        raise InputError(f"--set {text!r}: the key must be one of {', '.join(TABLES)} and a key of that table "
                         "(for example case.batch_size)")  # fmt: skip
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word: the string it spells
    return table, name, value


def apply_overrides(doc: dict[str, Any], overrides: Iterable[str], suite_keys: Iterable[str]) -> dict[str, Any]:
    """A copy of the suite document `doc` with each `KEY=VALUE` of `overrides` applied, in order."""
    doc = copy.deepcopy(doc)
    for text in overrides:
        table, key, value = parse_override(text, suite_keys)
        if table in ("suite", "utility"):
            if table == "utility" and "utility" not in doc:
                raise InputError(f"--set {text!r}: the suite has no [utility] table")
            _table(doc, table, text)[key] = value
        elif table == "case":
            _table(doc, "case", text)[key] = value
            for grid in _grids(doc):
                if isinstance(grid.get("case"), dict) and key in grid["case"]:
                    grid["case"][key] = value
        else:
            entries = [e for t in [doc, *_grids(doc)] for e in _entries(t.get(table)) if _has_param(table, e, key)]
            if not entries:
                raise InputError(f"--set {text!r}: no [[{table}]] table of the suite names a {table} with a parameter "
                                 f"{key!r}")  # fmt: skip
            for entry in entries:
                entry[key] = value
    return doc


def _has_param(kind: str, entry: dict[str, Any], key: str) -> bool:
    """Whether the plugin an [[attack]] / [[defense]] table names has a parameter `key` (an unknown name: no; the
    suite's own check names it)."""
    from gleak.contracts import registry

    name = entry.get("name")
    if not isinstance(name, str):
        return False
    try:
        return key in registry.plugin_info(kind, registry.resolve_name(kind, name)).params
    except InputError:
        return False


def _table(doc: dict[str, Any], name: str, text: str) -> dict[str, Any]:
    table = doc.setdefault(name, {})
    if not isinstance(table, dict):
        raise InputError(f"--set {text!r}: [{name}] is not a table in the suite")
    return table


def _grids(doc: dict[str, Any]) -> list[dict[str, Any]]:
    grids = doc.get("grid")
    return [g for g in grids if isinstance(g, dict)] if isinstance(grids, list) else []


def _entries(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        return [value]
    return [e for e in value if isinstance(e, dict)] if isinstance(value, list) else []
