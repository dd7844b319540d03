"""The `gleak` commands that look at plugins, not at results: `list`, `show` and `check-plugin` (gleak.cli parses
their arguments). `list` and `show` of a built-in read its source and import no torch (gleak.contracts.catalogue).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gleak.contracts.errors import InputError
from gleak.contracts.escaping import strip_controls

EXIT_OK, EXIT_FAILED_TRIALS, EXIT_BAD_INPUT = 0, 1, 2  # the command line's exit statuses (gleak.cli's docstring)


def load_plugins(files: list[str] | None) -> None:
    from gleak.contracts.registry import load_plugin_file

    for f in files or []:
        load_plugin_file(f)


def cmd_list(args: argparse.Namespace) -> int:
    from gleak.contracts import registry

    what = args.what
    if what in ("attacks", "defenses", "protocols", "models", "attack", "defense", "protocol", "model"):
        import fnmatch

        from gleak.contracts.catalogue import builtin_summaries

        kind = what.rstrip("s")
        table = builtin_summaries(kind)  # from the source: no torch import (None: entry points, ask the registry)
        if table is None:
            table = {n: registry.plugin_info(kind, n).summary for n in registry.list_plugins(kind)}
        names = sorted(n for n in table if fnmatch.fnmatch(n, args.pattern))
        width = max((len(n) for n in names), default=0)
        for n in names:
            print(strip_controls(f"{n:<{width}}  {table[n]}"))  # a plugin's summary is its text: no escape sequences
    elif what == "datasets":
        from gleak.mechanics.data import list_datasets

        for n, s in list_datasets():
            print(strip_controls(f"{n:<14} {s}"))
    elif what == "suites":
        import tomllib
        from importlib import resources

        files = {f.name: f for f in resources.files("gleak.suites").iterdir() if f.name.endswith(".toml")}
        if Path("suites").is_dir():
            files.update({f.name: f for f in Path("suites").glob("*.toml")})
        for name in sorted(files):
            meta = tomllib.loads(files[name].read_text()).get("suite", {})
            desc = (meta.get("description") or "").strip().splitlines()
            print(strip_controls(f"{name[:-5]:<20} {desc[0] if desc else ''}"))  # a suite's text: no escape sequences
    else:
        raise InputError(f"gleak list: unknown {what!r} (attacks, defenses, protocols, models, datasets, suites)")
    return EXIT_OK


def cmd_check_plugin(args: argparse.Namespace) -> int:
    from gleak.contracts import registry
    from gleak.contracts.tags import get_tags
    from gleak.orchestration.workers import check_plugin_isolated

    target = args.target
    args.plugin_file = None
    if not (args.timeout > 0):
        raise InputError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    if target.endswith(".py") or Path(target).is_file():
        args.plugin_file = str(Path(target).resolve())
        pairs = [p for p in registry.load_plugin_file(target) if p[0] in ("attack", "defense", "protocol", "model")]
        # A protocol registered as a defense too (as_defense) is checked once, as the protocol.
        pairs = [p for p in pairs if not (p[0] == "defense" and registry.plugin_info("defense", p[1]).protocol)]
        if not pairs:
            raise InputError(f"{target}: registers no attack, defense, protocol or model")
    else:
        kinds = [args.kind] if args.kind else ["attack", "defense", "protocol", "model"]
        pairs = [(k, target) for k in kinds if target in registry.list_plugins(k)]
        if not args.kind and ("protocol", target) in pairs:  # cgd is both: check it once, as the protocol
            pairs = [p for p in pairs if p[0] != "defense"]
        if not pairs:
            import difflib

            from gleak.contracts.errors import UnknownPluginError

            known = [n for k in kinds for n in registry.list_plugins(k)]
            close = difflib.get_close_matches(target, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise UnknownPluginError(f"unknown {' or '.join(kinds)} {target!r}{hint} (known: {', '.join(sorted(known))})")
    failed = 0
    for kind, name in pairs:
        quick = {} if args.full else get_tags(registry.plugin_info(kind, name).obj).fast_params
        said = f" (quick: {', '.join(f'{k}={v!r}' for k, v in quick.items())}; --full runs its defaults)" if quick else ""
        print(strip_controls(f"{kind} {name}:{said}"))
        for c in check_plugin_isolated(kind, name, args.plugin_file, args.timeout, args.full):
            failed += not c.passed
            mark = "PASS" if c.passed else "FAIL"
            # the detail quotes the plugin's own errors: its text, printed without escape sequences
            print(strip_controls(f"  {mark}  {c.name}" + (f" ({c.detail})" if c.detail else "")))
    print("all checks passed" if not failed else f"{failed} check(s) failed")
    return EXIT_OK if not failed else EXIT_FAILED_TRIALS


# -- show / compare (the researcher's workflow) --------------------------------------------------------
def _plugin_for_show(kind: str, name: str):
    """(kind the plugin was found under, its PluginInfo). Until Protocol plugins exist a protocol is a
    defense (secure-aggregation, cgd): `show protocol NAME` then looks among the defenses."""
    from gleak.contracts import registry

    try:
        return kind, registry.plugin_info(kind, name)
    except InputError:
        if kind != "protocol" or "protocol" in registry.KINDS:
            raise
    return "defense", registry.plugin_info("defense", name)


def show_text(kind: str, name: str) -> str:
    """What `gleak show KIND NAME` prints: the parameters (type or choices, default), needs, flags, the docstring."""
    import inspect

    from gleak.contracts import registry
    from gleak.contracts.tags import get_tags

    found, info = _plugin_for_show(kind, name)
    obj = info.obj
    module = getattr(obj, "__module__", "?")
    where = f"{module}.{getattr(obj, '__qualname__', '?')}"
    source = info.source
    if module.startswith("gleak_plugin_"):  # loaded from a file (gleak.contracts.registry.load_plugin_file): say which
        source, where = "plugin file", f"{getattr(sys.modules.get(module), '__file__', '?')}: {obj.__qualname__}"
    lines = [f"{found} {info.name}" + (" (a protocol defense)" if found != kind else "") + f"  [{source}: {where}]",
             f"  {info.summary}", "", "parameters:"]  # fmt: skip
    reserved = registry._registry(found).reserved
    shown = [p for p in info.params.values() if p.name not in reserved]
    width = max((len(p.name) for p in shown), default=0)
    for p in shown:
        default = "required" if p.default is inspect.Parameter.empty else f"default {p.default!r}"
        lines.append(f"  {p.name:<{width}}  {registry.type_name(p.annotation)}; {default}")
    if not shown:
        lines.append("  (none)")
    if found in ("attack", "defense"):
        try:
            instance = registry.create(found, info.name)
        except InputError:  # required parameters: read the class
            instance = obj
        tags = get_tags(instance)
        if found == "attack":
            needs = sorted(tags.needs)
            lines += ["", f"needs: {', '.join(needs) or 'nothing'}", f"active: {'yes' if tags.active else 'no'}"]
        else:
            lines += ["", f"stateful: {'yes' if tags.stateful else 'no'}"]
        conf = tags.fast_params
        if conf:
            lines.append(f"check-plugin runs it with: {', '.join(f'{k}={v!r}' for k, v in conf.items())}")
    doc = (inspect.getdoc(obj) or "").strip()
    if doc.startswith(info.summary):  # printed at the top already
        doc = doc[len(info.summary) :].strip()
    if doc:
        lines += ["", doc]
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    if not args.plugin:  # a built-in, read from its source: no torch import (None: only the registry can tell)
        from gleak.contracts.plugin_source import show_text as from_source

        text = from_source(args.kind, args.name)
        if text is not None:
            print(text)
            return EXIT_OK
    load_plugins(args.plugin)
    print(strip_controls(show_text(args.kind, args.name)))  # the docstring and defaults are the plugin's text
    return EXIT_OK
