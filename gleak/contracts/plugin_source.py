"""`gleak show KIND NAME` for a built-in plugin, read from its source file without importing it.

Importing a built-in imports torch (seconds on a loaded machine) for what the source states plainly: the
registering decorator, the `__init__` signature (annotations and literal defaults), the class attributes `needs`,
`active`, `stateful` and `conformance_params`, and the docstring. `needs` is what an instance made with the defaults
has: the class's set, and the `self.needs = self.needs | {...}` lines of `__init__` whose conditions read only
parameters at their defaults. Wherever the source says it less plainly (a base class other than Attack, Defense or
Protocol, a default that is not a literal, an annotation naming more than builtins and typing, `needs` computed
otherwise, a protocol registered as a defense, a name that is an alias, third-party entry points) `show_text`
returns None and the caller asks the registry. tests/test_catalogue.py checks that every answer equals the
registry's, for every built-in.
"""
from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path
from typing import Any

from gleak.contracts.catalogue import _DECORATORS, _builtin_files, _literal, _NotPlain, builtin_summaries, module_file, parsed

# The plugin kinds' base classes, by the name a built-in subclasses them with, and the module that defines them.
_BASES = {"Attack": "gleak.contracts.plugin", "Defense": "gleak.contracts.plugin", "Protocol": "gleak.mechanics.protocol"}
# What an annotation may name: the builtins and typing's plain forms (anything else: ask the registry).
_TYPE_NAMES = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict, "tuple": tuple,
               "None": None, "Any": Any, "Literal": typing.Literal, "Optional": typing.Optional,
               "Union": typing.Union}  # fmt: skip


_GLEAK = module_file("gleak").parent


def _module_name(path: Path) -> str:
    # a module of gleak itself (gleak/mechanics/models.py) is named by its place in the package; a built-in plugin's
    # file (attacks/dlg.py at the checkout's top) by its folder, installed as a subpackage of gleak
    if path.is_relative_to(_GLEAK):
        return ".".join(["gleak", *path.relative_to(_GLEAK).with_suffix("").parts])
    return f"gleak.{path.parent.name}.{path.stem}"


def _find(kind: str, name: str) -> tuple[Path, ast.AST, str]:
    """(file, node, summary) of the module-level class or function registered as `name` under `kind`."""
    for path in _builtin_files():
        tree = parsed(path)
        for node in tree.body:
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                continue
            for deco in node.decorator_list:
                if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name) and deco.func.id in _DECORATORS):
                    continue
                if _DECORATORS[deco.func.id] != kind or not deco.args or _literal(deco.args[0]) != name:
                    continue
                kw = {k.arg: k.value for k in deco.keywords}
                summary = _literal(kw.get("summary"))
                if summary is None:
                    doc = ast.get_docstring(node, clean=True)
                    if not doc or not doc.strip():
                        raise _NotPlain
                    summary = doc.strip().splitlines()[0]
                return path, node, summary
    raise _NotPlain  # not a built-in's literal name (an alias, or unknown): the registry says which


def _annotation(node: ast.AST | None, aliases: dict[str, Any] | None = None) -> Any:
    """The annotation's value, built from the builtins, typing's plain forms and the module's `aliases`."""
    if node is None:
        return Any
    known = {**_TYPE_NAMES, **(aliases or {})}
    text = ast.unparse(node)
    names = {n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)}
    if not names <= set(known):
        raise _NotPlain
    try:
        return eval(compile(text, "<annotation>", "eval"), {"__builtins__": {}}, known)  # noqa: S307
    except Exception:  # noqa: BLE001 - an annotation this reader cannot build: ask the registry
        raise _NotPlain from None


def _aliases(tree: ast.Module) -> dict[str, Any]:
    """The module's type aliases that this reader can build (`LabelStrategy = Literal["idlg", ...]`)."""
    out: dict[str, Any] = {}
    for stmt in tree.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else getattr(stmt, "target", None)
        value = getattr(stmt, "value", None)
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Name) and value is not None:
            if isinstance(value, (ast.Subscript, ast.BinOp)) or (isinstance(value, ast.Name) and value.id in _TYPE_NAMES):
                try:
                    out[target.id] = _annotation(value, out)
                except _NotPlain:
                    pass
    return out


def _params(fn: ast.FunctionDef | None, is_method: bool, aliases: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(name, annotation, default or inspect.Parameter.empty) of the signature, as the registry lists them."""
    if fn is None:
        return []
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults)) + [_literal_default(d) for d in a.defaults]
    out = [(p.arg, _annotation(p.annotation, aliases), d) for p, d in zip(positional, defaults)]
    out += [(p.arg, _annotation(p.annotation, aliases), inspect.Parameter.empty if d is None else _literal_default(d))
            for p, d in zip(a.kwonlyargs, a.kw_defaults)]  # fmt: skip
    return out[1:] if is_method else out


def _literal_default(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise _NotPlain from None


def _class_attrs(cls: ast.ClassDef) -> dict[str, ast.AST]:
    out = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            out[stmt.targets[0].id] = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            out[stmt.target.id] = stmt.value
    return out


def _value(node: ast.AST, env: dict[str, Any]) -> Any:
    """A small expression's value: literals, names in `env` (parameters at their defaults, 'self.needs'), set
    union, comparisons, not/and/or, x if c else y, frozenset(...) / set(...)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        key = f"self.{node.attr}"
        if key in env:
            return env[key]
        raise _NotPlain
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        raise _NotPlain
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set"):
        if node.keywords or len(node.args) > 1:
            raise _NotPlain
        items = _value(node.args[0], env) if node.args else ()
        return frozenset(items) if node.func.id == "frozenset" else set(items)
    if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
        items = [_value(e, env) for e in node.elts]
        return set(items) if isinstance(node, ast.Set) else items
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _value(node.left, env) | _value(node.right, env)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _value(node.operand, env)
    if isinstance(node, ast.BoolOp):
        values = [_value(v, env) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.IfExp):
        return _value(node.body, env) if _value(node.test, env) else _value(node.orelse, env)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left, right, op = _value(node.left, env), _value(node.comparators[0], env), node.ops[0]
        ops = {ast.Eq: lambda: left == right, ast.NotEq: lambda: left != right, ast.Is: lambda: left is right,
               ast.IsNot: lambda: left is not right, ast.In: lambda: left in right, ast.NotIn: lambda: left not in right}
        if type(op) in ops:
            return ops[type(op)]()
        raise _NotPlain
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise _NotPlain from None


def _touches_needs(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "needs" for n in ast.walk(node))


def _needs_at_defaults(init: ast.FunctionDef | None, env: dict[str, Any], needs_methods: set[str]) -> frozenset:
    """`self.needs` after `__init__` ran with every parameter at its default (see the module docstring)."""
    if init is None:
        return env["self.needs"]
    rebound = {n.id for n in ast.walk(init) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    env = {k: v for k, v in env.items() if k not in rebound}  # a parameter rebound in the body: its default says nothing

    def run(stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                         and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"):  # fmt: skip
                if call.func.attr == "use_defense_knowledge":  # DefenseAware: adds "knows_defense" when set
                    if len(call.args) != 1 or _value(call.args[0], env):
                        raise _NotPlain
                elif call.func.attr in needs_methods:
                    raise _NotPlain  # a method of the class that sets needs
            if not _touches_needs(stmt):
                continue
            if isinstance(stmt, ast.If):
                run(stmt.body if _value(stmt.test, env) else stmt.orelse)
            elif isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == ["self.needs"]:
                env["self.needs"] = _value(stmt.value, env)
            elif isinstance(stmt, ast.AugAssign) and ast.unparse(stmt.target) == "self.needs" and isinstance(stmt.op, ast.BitOr):
                env["self.needs"] = env["self.needs"] | _value(stmt.value, env)
            else:
                raise _NotPlain

    run(init.body)
    return env["self.needs"]


def _base(cls: ast.ClassDef) -> tuple[str, dict[str, ast.AST]]:
    """The base class's name (Attack, Defense or Protocol) and its class attributes with those of Plugin."""
    bases = [ast.unparse(b).rpartition(".")[2] for b in cls.bases]
    if bases[:1] == ["DefenseAware"]:  # the defense_aware option's mixin: no __init__, it adds to needs when set
        bases = bases[1:]
    if len(bases) != 1 or cls.keywords or bases[0] not in _BASES:
        raise _NotPlain
    base = bases[0]
    tree = parsed(module_file(_BASES[base]))
    plugin = parsed(module_file("gleak.contracts.plugin"))
    classes = {n.name: n for t in (tree, plugin) for n in t.body if isinstance(n, ast.ClassDef)}
    attrs: dict[str, ast.AST] = {}
    for name in ("Plugin", base):
        c = classes.get(name)
        if c is None or any(isinstance(s, ast.FunctionDef) and s.name == "__init__" for s in c.body):
            raise _NotPlain  # a base with its own __init__: its signature is the plugin's
        attrs.update(_class_attrs(c))
    return base, attrs


def show_text(kind: str, name: str) -> str | None:
    """What `gleak show KIND NAME` prints for the built-in `name`, or None where only the registry can tell."""
    from gleak.contracts.registry import _REGISTRIES, type_name

    if kind not in _REGISTRIES or builtin_summaries(kind) is None:  # entry points: ask the registry
        return None
    try:
        return _show(kind, name, _REGISTRIES[kind].reserved, type_name)
    except (_NotPlain, OSError, SyntaxError):
        return None


def _show(kind: str, name: str, reserved: tuple[str, ...], type_name: Any) -> str:
    path, node, summary = _find(kind, name)
    is_class = isinstance(node, ast.ClassDef)
    init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None) if is_class else node
    base, base_attrs = _base(node) if is_class else ("", {})
    attrs = {**base_attrs, **(_class_attrs(node) if is_class else {})}
    params = _params(init, is_class, _aliases(parsed(path)))
    lines = [f"{kind} {name}  [builtin: {_module_name(path)}.{node.name}]", f"  {summary}", "", "parameters:"]
    shown = [p for p in params if p[0] not in reserved]
    width = max((len(p[0]) for p in shown), default=0)
    for pname, ann, default in shown:
        text = "required" if default is inspect.Parameter.empty else f"default {default!r}"
        lines.append(f"  {pname:<{width}}  {type_name(ann)}; {text}")
    if not shown:
        lines.append("  (none)")
    if kind in ("attack", "defense"):
        if (kind, base) not in (("attack", "Attack"), ("defense", "Defense")):
            raise _NotPlain
        env: dict[str, Any] = {}
        if kind == "attack":
            env["self.needs"] = _value(attrs["needs"], {}) if "needs" in attrs else frozenset()
            if any(d is inspect.Parameter.empty for _, _, d in params):  # show reads the class then
                needs = env["self.needs"]
            else:
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef) and f.name != "__init__" and _touches_needs(f)}
                needs = _needs_at_defaults(init, {**env, **{p: d for p, _, d in params}}, methods)
            active = _value(attrs["active"], {}) if "active" in attrs else False
            lines += ["", f"needs: {', '.join(sorted(needs)) or 'nothing'}", f"active: {'yes' if active else 'no'}"]
        else:
            # `gleak show` reads the class's flag (an instance may set its own: topk with error feedback)
            stateful = _value(attrs["stateful"], {}) if "stateful" in attrs else False
            lines += ["", f"stateful: {'yes' if stateful else 'no'}"]
        conf = _value(attrs["conformance_params"], {}) if "conformance_params" in attrs else None
        if conf:
            lines.append(f"check-plugin runs it with: {', '.join(f'{k}={v!r}' for k, v in conf.items())}")
    doc = (ast.get_docstring(node, clean=True) or "").strip()
    if not doc:
        raise _NotPlain  # inspect.getdoc would read a base class's
    if doc.startswith(summary):  # printed at the top already
        doc = doc[len(summary) :].strip()
    if doc:
        lines += ["", doc]
    return "\n".join(lines)
