"""The built-in plugins' names and one-line summaries, read from their source files without importing them.

`gleak list attacks` needs only these, and importing the built-ins imports torch (about 2 s of CPU, 5-10 s on a
loaded machine) for text that sits in the source as literals: the registering decorator's first argument and the
first line of the class's docstring. Where the source does not say it that plainly (a name that is not a literal, a
`summary=` that is not one, a class without its own docstring) or where third-party packages register plugins
(entry points), `builtin_summaries` returns None and the caller asks the registry, which imports everything.
tests/test_catalogue.py checks that this reading equals the registry's for every kind.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
from importlib import metadata
from pathlib import Path

# The decorators and the kinds they register into (register_protocol adds a defense with as_defense=True).
_DECORATORS = {"register_attack": "attack", "register_defense": "defense", "register_protocol": "protocol",
               "register_model": "model"}  # fmt: skip
_ENTRY_POINT_GROUPS = {"attack": "gleak.attacks", "defense": "gleak.defenses", "protocol": "gleak.protocols",
                       "model": "gleak.models"}  # fmt: skip


class _NotPlain(Exception):
    """The source registers a plugin in a way this reader does not follow: ask the registry."""


def _literal(node: ast.AST | None):
    try:
        return ast.literal_eval(node) if node is not None else None
    except ValueError:
        raise _NotPlain from None


def parsed(path: Path) -> ast.Module:
    """The module's syntax tree, parsed once per version of the file (callers only read it): `gleak list` and
    `gleak show` read the same dozens of files for every plugin they describe."""
    st = path.stat()
    return _parse(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=256)
def _parse(path: str, mtime_ns: int, size: int) -> ast.Module:
    return ast.parse(Path(path).read_text(), path)


def _registrations(path: Path) -> list[tuple[str, str, str]]:
    """(kind, name, summary) of every decorated class or function of one module."""
    st = path.stat()
    return list(_registrations_of(str(path), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=256)
def _registrations_of(path: str, mtime_ns: int, size: int) -> tuple[tuple[str, str, str], ...]:
    out = []
    for node in ast.walk(_parse(path, mtime_ns, size)):
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name) and deco.func.id in _DECORATORS):
                continue
            kw = {k.arg: k.value for k in deco.keywords}
            name = _literal(deco.args[0]) if deco.args else None
            summary = _literal(kw.get("summary"))
            if summary is None:
                doc = ast.get_docstring(node, clean=True)  # inspect.getdoc's cleaning, without inheritance
                if not doc or not doc.strip():
                    raise _NotPlain
                summary = doc.strip().splitlines()[0]
            if not isinstance(name, str):
                raise _NotPlain
            kind = _DECORATORS[deco.func.id]
            out.append((kind, name, summary))
            if kind == "protocol" and _literal(kw.get("as_defense")):
                out.append(("defense", name, summary))
    return tuple(out)


def _builtin_files() -> list[Path]:
    """The modules the registry's discovery imports: every public module of the built-in packages, and the models
    module with the text models it imports."""
    files = []
    for pkg in ("gleak.attacks", "gleak.defenses", "gleak.protocols"):
        spec = importlib.util.find_spec(pkg)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            files += sorted(p for p in Path(folder).glob("*.py") if not p.name.startswith("_"))
    return files + [module_file("gleak.mechanics.models"), module_file("gleak.mechanics.text.models")]


def module_file(name: str) -> Path:
    """A gleak module's source file, found without importing the module (its package's __init__ only)."""
    return Path(importlib.util.find_spec(name).origin)


def builtin_summaries(kind: str) -> dict[str, str] | None:
    """name -> one-line summary of every plugin of `kind` (attack, defense, protocol, model), or None where only the
    registry can tell (see the module docstring)."""
    if kind not in _ENTRY_POINT_GROUPS or list(metadata.entry_points(group=_ENTRY_POINT_GROUPS[kind])):
        return None
    table: dict[str, str] = {}
    try:
        for path in _builtin_files():
            for k, name, summary in _registrations(path):
                if k == kind:
                    table.setdefault(name, summary)
    except (_NotPlain, OSError, SyntaxError):
        return None
    return table
