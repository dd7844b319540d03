"""Plugin registry: decorators, `create`, `list_plugins`, entry points and plugin files.

Modelled on timm's model registry::

    @register_attack("my-attack")
    class MyAttack(Attack):
        '''One-line summary. Longer text citing the paper.'''
        def __init__(self, iterations: int = 100): ...

    create("attack", "my-attack", iterations=10)
    list_plugins("attack", "*dlg*")

Third-party packages register through the entry-point groups ``gleak.attacks``, ``gleak.defenses``,
``gleak.protocols`` and ``gleak.models`` (the entry point may point at a module, which registers on import, or at a
class, which is registered under the entry point's name). A single Python file can be loaded with `load_plugin_file`.

Renaming a plugin: ``register_attack("new-name", aliases=("old-name",))``. The old name keeps working (with a
DeprecationWarning) and trials keep the ids they had under it (`identity_name`: the first alias is the name trial
ids are computed with). A protocol registered with ``as_defense=True`` can also be named as a defense
(``[[defense]] name = "cgd"``): the suite's historical spelling, which selects that protocol with no client transform.
"""
from __future__ import annotations

import difflib
import fnmatch
import importlib
import importlib.util
import inspect
import math
import pkgutil
import sys
import types
import typing
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from gleak.contracts.errors import InputError, UnknownPluginError

KINDS = ("attack", "defense", "protocol", "model")
_BUILTIN_PACKAGES = {"attack": "gleak.attacks", "defense": "gleak.defenses", "protocol": "gleak.protocols",
                     "model": "gleak.mechanics.models"}  # fmt: skip
_ENTRY_POINT_GROUPS = {"attack": "gleak.attacks", "defense": "gleak.defenses", "protocol": "gleak.protocols",
                       "model": "gleak.models"}  # fmt: skip


class ParamError(InputError):
    """A bad plugin parameter; `key` names it so that a suite can point at the line."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Param:
    name: str
    annotation: Any
    default: Any  # inspect.Parameter.empty when required


@dataclass
class PluginInfo:
    kind: str
    name: str
    obj: Callable[..., Any]
    summary: str
    params: dict[str, Param] = field(default_factory=dict)
    source: str = "builtin"
    # A defense entry that is a protocol's historical spelling ([[defense]] name = "cgd"): the protocol's name.
    protocol: str | None = None
    # The name trial ids are computed with: the oldest name of a renamed plugin, else `name`.
    identity_name: str = ""

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params.values() if p.default is not inspect.Parameter.empty}


def _summary(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _signature_params(obj: Callable[..., Any]) -> dict[str, Param]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # unresolvable annotations: fall back to no type checks
        hints = {}
    out: dict[str, Param] = {}
    for p in inspect.signature(target).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out[p.name] = Param(p.name, hints.get(p.name, Any), p.default)
    return out


def type_name(tp: Any) -> str:
    """A parameter's annotation as a user reads it: 'int', "one of 'a', 'b'" for a Literal."""
    if typing.get_origin(tp) is typing.Literal:  # name the allowed values, not "Literal"
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_type_name = type_name  # the name this module uses


def _finite(value: float | int) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond any float
        return False


def expected(tp: Any, value: Any) -> str:
    """'TYPE, got VALUE (type)' for an error message; NaN, infinity and out-of-range integers said as such."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"a finite number, got {value!r}"
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        return f"a 64-bit integer, got {value!r}"
    return f"{_type_name(tp)}, got {value!r} ({type(value).__name__})"


def check_value(tp: Any, value: Any) -> bool:
    """True when `value` is acceptable for annotation `tp` (the subset of typing that plugin params use)."""
    if tp is Any or tp is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(check_value(a, value) for a in args)
    if tp is type(None):
        return value is None
    if tp is float:  # NaN and infinity are never a setting (gleak.contracts.errors: bad input is refused, not run)
        return isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
    if tp is int:  # what the store's INTEGER columns (and torch's seeds) hold: 64-bit signed
        return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if not args:
            return True
        if origin is tuple and len(args) != 2 or (origin is tuple and args[1] is not Ellipsis):
            return len(args) == len(value) and all(check_value(a, v) for a, v in zip(args, value))
        return all(check_value(args[0], v) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


class Registry:
    """The plugins of one kind."""

    def __init__(self, kind: str, reserved: tuple[str, ...] = (), also: tuple[str, ...] = ()):
        self.kind = kind
        # Arguments the framework passes itself (a model's input_shape and num_classes): never set by a user.
        self.reserved = reserved
        # Kinds whose discovery can add entries here (protocols registered as defenses too).
        self.also = also
        self._plugins: dict[str, PluginInfo] = {}
        self._aliases: dict[str, str] = {}  # deprecated name -> current name
        self._discovered = False

    # -- registration -------------------------------------------------------------------------------------
    def register(
        self, name: str | None = None, *, summary: str | None = None, source: str = "builtin",
        aliases: tuple[str, ...] = (), protocol: str | None = None, set_name: bool = True,
    ):  # fmt: skip
        def deco(obj):
            key = name or getattr(obj, "name", None) or obj.__name__.lower()
            if key in self._plugins and self._plugins[key].obj is not obj:
                old = self._plugins[key].obj
                # Re-importing a module (plugin file loaded twice) re-creates the class: accept the same origin.
                if (getattr(old, "__qualname__", None), getattr(old, "__module__", None)) != (
                    getattr(obj, "__qualname__", None),
                    getattr(obj, "__module__", None),
                ):
                    raise InputError(f"{self.kind} {key!r} is registered twice ({old!r} and {obj!r})")
            scored = getattr(obj, "scored_against", "sent") if self.kind == "defense" else "sent"
            if scored not in ("sent", "private"):
                raise InputError(f"defense {key!r}: scored_against must be 'sent' or 'private', got {scored!r}")
            for old in aliases:
                if old in self._plugins:
                    raise InputError(f"{self.kind} alias {old!r} of {key!r} is already a registered {self.kind}")
                self._aliases[old] = key
            self._plugins[key] = PluginInfo(
                self.kind, key, obj, summary or _summary(obj), _signature_params(obj), source, protocol,
                aliases[0] if aliases else key,
            )
            if set_name:
                try:
                    obj.registered_name = key
                except (AttributeError, TypeError):
                    pass
            return obj

        return deco

    # -- discovery ----------------------------------------------------------------------------------------
    def discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        for other in self.also:
            _REGISTRIES[other].discover()
        pkg_name = _BUILTIN_PACKAGES[self.kind]
        pkg = importlib.import_module(pkg_name)
        if hasattr(pkg, "__path__"):
            for mod in pkgutil.iter_modules(pkg.__path__):
                if not mod.name.startswith("_"):
                    importlib.import_module(f"{pkg_name}.{mod.name}")
        for ep in metadata.entry_points(group=_ENTRY_POINT_GROUPS[self.kind]):
            try:
                loaded = ep.load()
            except Exception as exc:  # a broken third-party plugin must not take the built-ins down
                print(f"gleak: warning: entry point {ep.name!r} ({ep.value}) failed to load: {exc}", file=sys.stderr)
                continue
            if inspect.isclass(loaded) or inspect.isfunction(loaded):
                if ep.name not in self._plugins:
                    self.register(ep.name, source=f"entry point {ep.value}")(loaded)

    # -- lookup -------------------------------------------------------------------------------------------
    def names(self, pattern: str = "*") -> list[str]:
        self.discover()
        return sorted(n for n in self._plugins if fnmatch.fnmatch(n, pattern))

    def resolve(self, name: str) -> str:
        """The current name of `name` (a deprecated alias warns and maps to its plugin's current name)."""
        self.discover()
        if name in self._aliases and name not in self._plugins:
            new = self._aliases[name]
            warnings.warn(f"{self.kind} {name!r} is deprecated: it is now called {new!r}", DeprecationWarning, stacklevel=3)
            return new
        return name

    def identity_name(self, name: str) -> str:
        """The name a trial's id is computed with (unchanged by a rename); unknown names map to themselves."""
        self.discover()
        name = self._aliases.get(name, name) if name not in self._plugins else name
        info = self._plugins.get(name)
        return info.identity_name if info is not None else name

    def info(self, name: str) -> PluginInfo:
        name = self.resolve(name)
        if name not in self._plugins:
            close = difflib.get_close_matches(name, list(self._plugins), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            known = ", ".join(sorted(self._plugins))
            raise UnknownPluginError(f"unknown {self.kind} {name!r}{hint} (known: {known}); a plugin in a file needs "
                                     "--plugin FILE (in Python: plugins=[FILE])")  # fmt: skip
        return self._plugins[name]

    def check_params(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        """Validate `params` against the plugin's signature; return them merged over the defaults."""
        info = self.info(name)
        for key, value in params.items():
            if key in self.reserved:
                raise ParamError(f"{self.kind} {name!r}: {key!r} is set by gleak from the case, not by hand", key)
            if key not in info.params:
                close = difflib.get_close_matches(key, list(info.params), n=2, cutoff=0.5)
                hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise ParamError(
                    f"{self.kind} {name!r} has no parameter {key!r}{hint} (parameters: {', '.join(info.params) or 'none'})",
                    key,
                )
            ann = info.params[key].annotation
            if not check_value(ann, value):
                raise ParamError(f"{self.kind} {name!r} parameter {key!r} must be {expected(ann, value)}", key)
        missing = [
            p.name
            for p in info.params.values()
            if p.default is inspect.Parameter.empty and p.name not in params and p.name not in self.reserved
        ]
        if missing:
            raise ParamError(f"{self.kind} {name!r} needs parameter(s) {', '.join(missing)}", missing[0])
        full = {**info.defaults(), **params}
        # A plugin may leave out of its stored parameters (so out of trial ids) those added after its first release
        # where they change nothing: earlier trial ids then stay valid (as CaseConfig.LATER_FIELDS does for cases).
        identity = getattr(info.obj, "identity_params", None)
        if not callable(identity):
            return full
        stored = identity(full)
        # The stored form is what a trial is rebuilt from: a parameter left out must be one its default restores
        # (or one that changes nothing), else a stored trial would silently run another configuration.
        rebuilt = identity({**info.defaults(), **stored})
        if rebuilt != stored:
            diff = sorted(k for k in {*stored, *rebuilt} if stored.get(k, "<absent>") != rebuilt.get(k, "<absent>"))
            raise RuntimeError(f"{self.kind} {name!r}: identity_params leaves out {', '.join(diff)}, which the defaults "
                               "do not restore: a stored configuration would rebuild as another one")
        return stored

    def create(self, name: str, *args: Any, **params: Any) -> Any:
        from gleak.contracts.plugin_guards import exit_text, no_exit, sigint_watch

        self.check_params(name, params)
        obj = self.info(name).obj
        try:
            with sigint_watch() as ctrl_c, no_exit():
                return obj(*args, **params)
        except KeyboardInterrupt:
            if ctrl_c:  # the user's Ctrl-C while the plugin was built: theirs to stop the run
                raise
            raise ParamError(f"{self.kind} {name!r}: __init__ raised KeyboardInterrupt (not a Ctrl-C: the plugin raised "
                             "it)") from None
        except SystemExit as exc:  # sys.exit or os._exit in __init__: the plugin's failure, never gleak's exit
            raise ParamError(f"{self.kind} {name!r}: __init__ {exit_text(exc)}") from None
        except (ValueError, TypeError) as exc:
            raise ParamError(f"{self.kind} {name!r}: {exc}") from exc
        except InputError:
            raise
        except Exception as exc:  # any other error of a plugin's __init__ is bad input too, named, in one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ParamError(f"{self.kind} {name!r}: __init__ raised {type(exc).__name__}" + (f": {first}" if first else "")) from exc


_REGISTRIES = {
    "attack": Registry("attack"),
    "defense": Registry("defense", also=("protocol",)),  # protocols registered as defenses (cgd) appear there
    "protocol": Registry("protocol"),
    "model": Registry("model", reserved=("input_shape", "num_classes")),
}


def _registry(kind: str) -> Registry:
    kind = kind.rstrip("s") if kind.endswith("s") and kind.rstrip("s") in _REGISTRIES else kind
    if kind not in _REGISTRIES:
        raise InputError(f"unknown plugin kind {kind!r} (kinds: {', '.join(KINDS)})")
    return _REGISTRIES[kind]


def register_attack(name: str | None = None, **kw: Any):
    """Class decorator: register an attack under a short kebab-case name."""
    return _REGISTRIES["attack"].register(name, **kw)


def register_defense(name: str | None = None, **kw: Any):
    """Class decorator: register a defense under a short kebab-case name."""
    return _REGISTRIES["defense"].register(name, **kw)


def register_protocol(
    name: str | None = None, *, as_defense: bool = False, defense_params: tuple[str, ...] | None = None, **kw: Any
):  # fmt: skip
    """Class decorator: register a protocol (a gleak.mechanics.protocol.Protocol) under a short kebab-case name.

    as_defense: also accept the name as a defense (``[[defense]] name = NAME``), which selects this protocol with no
    client transform; the leaderboard ranks it as a defense, and its trial ids are those that spelling always had.
    defense_params: the parameters that spelling accepts (None: all). A parameter a protocol gained after its
    defense spelling existed must stay out of it, or its default would enter every such trial's id."""

    def deco(obj):
        _REGISTRIES["protocol"].register(name, **kw)(obj)
        if as_defense:
            key = name or obj.registered_name
            reg = _REGISTRIES["defense"]
            reg.register(key, protocol=key, set_name=False, source="protocol", aliases=kw.get("aliases", ()))(obj)
            if defense_params is not None:
                info = reg._plugins[key]
                info.params = {k: v for k, v in info.params.items() if k in defense_params}
        return obj

    return deco


def resolve_name(kind: str, name: str) -> str:
    """The current name of plugin `name` of `kind` (a deprecated alias warns and maps to it)."""
    return _registry(kind).resolve(name)


def identity_name(kind: str, name: str) -> str:
    """The name trial ids are computed with for plugin `name` of `kind` (a renamed plugin keeps its old ids)."""
    return _registry(kind).identity_name(name)


def register_model(name: str | None = None, **kw: Any):
    """Decorator for a model factory ``f(input_shape, num_classes, **params) -> nn.Module``."""
    return _REGISTRIES["model"].register(name, **kw)


def create(kind: str, name: str, *args: Any, **params: Any) -> Any:
    """Build the plugin `name` of `kind` ('attack', 'defense', 'protocol' or 'model') with `params` over its defaults."""
    return _registry(kind).create(name, *args, **params)


def list_plugins(kind: str, pattern: str = "*") -> list[str]:
    """Registered names of `kind`, filtered by a shell-style wildcard: ``list_plugins('attack', '*dlg*')``."""
    return _registry(kind).names(pattern)


def plugin_info(kind: str, name: str) -> PluginInfo:
    return _registry(kind).info(name)


def check_params(kind: str, name: str, params: dict[str, Any]) -> dict[str, Any]:
    return _registry(kind).check_params(name, params)


def load_plugin_file(path: str | Path) -> list[tuple[str, str]]:
    """Import a Python file that registers plugins; return the (kind, name) pairs it added.

    Raises InputError with one line naming the file when it is missing or fails to import.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: plugin file not found")
    for reg in _REGISTRIES.values():
        reg.discover()  # so that what the file adds can be told apart from the built-ins
    before = {(k, n) for k, r in _REGISTRIES.items() for n in r._plugins}
    mod_name = f"gleak_plugin_{path.stem}_{abs(hash(str(path.resolve()))) % 10**8}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"{path}: not an importable Python file")
    from gleak.contracts.plugin_guards import exit_text, no_exit, sigint_watch

    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        with sigint_watch() as ctrl_c, no_exit():
            spec.loader.exec_module(module)
    except InputError as exc:
        sys.modules.pop(mod_name, None)
        raise InputError(f"{path}: {exc}") from exc
    except BaseException as exc:  # SyntaxError, ImportError, anything: one line, the file named
        sys.modules.pop(mod_name, None)
        if isinstance(exc, KeyboardInterrupt) and ctrl_c:  # the user's Ctrl-C during the import: not the file's fault
            raise
        line = getattr(exc, "lineno", None)
        where = f"{path}:{line}" if line else str(path)
        if isinstance(exc, SystemExit):
            raise InputError(f"{where}: plugin file failed to import: it {exit_text(exc)}") from None
        raise InputError(f"{where}: plugin file failed to import: {type(exc).__name__}: {exc}") from exc
    after = {(k, n) for k, r in _REGISTRIES.items() for n in r._plugins}
    return sorted(after - before)
