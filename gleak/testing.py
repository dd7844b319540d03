"""gleak's conformance checks in a plugin author's own pytest, as scikit-learn's `parametrize_with_checks`.

    # test_my_plugins.py
    from gleak.testing import parametrize_with_checks
    from my_attack import MeanImage                      # registered with @register_attack("mean-image")

    @parametrize_with_checks([MeanImage, ("defense", "clip-norm")])
    def test_gleak_conformance(plugin, check):
        check(plugin)

Each (plugin, check) pair is one pytest id, `attack:mean-image:output-shapes-and-dtypes`; a plugin's checks run once
(the first of its ids runs them all, on the plugin's quick settings as `gleak check-plugin` does) and each id
asserts its own. The checks are those of `gleak check-plugin` (gleak.orchestration.conformance: CHECK_NAMES lists
them per kind).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable

from gleak.contracts import registry
from gleak.contracts.errors import InputError
from gleak.orchestration.conformance import CHECK_NAMES, check_plugin


@dataclass(frozen=True)
class PluginUnderTest:
    """A registered plugin the checks run on: its kind, name and the parameters it is made with."""

    kind: str
    name: str
    params: tuple[tuple[str, Any], ...] = field(default=())

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


@functools.lru_cache(maxsize=None)
def _results(plugin: PluginUnderTest) -> dict[str, Any]:
    return {c.name: c for c in check_plugin(plugin.kind, plugin.name, dict(plugin.params) or None)}


@dataclass(frozen=True)
class Check:
    """One named check: called with the plugin, it fails the test with the check's detail where it does not pass."""

    name: str
    listed: tuple[str, ...]  # every check of the plugin's kind: the list the ids were made from

    def __call__(self, plugin: PluginUnderTest) -> None:
        results = _results(plugin)
        absent = next((c.detail for c in results.values() if not c.passed and "DatasetMissing" in (c.detail or "")), None)
        if absent is not None:  # an optional data set its checks run on is not installed: skipped, named
            import pytest

            pytest.skip(f"{plugin.kind} {plugin.name!r}: {absent}")
        assert set(results) == set(self.listed), (  # the list the ids come from is the list that runs
            f"{plugin.kind} {plugin.name!r} ran the checks {sorted(results)}, not {list(self.listed)}")
        result = results[self.name]
        assert result.passed, f"{plugin.kind} {plugin.name!r} fails {self.name!r}: {result.detail}"

    def __str__(self) -> str:
        return self.name.replace(" ", "-")


def _plugin(entry: Any) -> PluginUnderTest:
    """A class registered with gleak's decorators, or (kind, name) / (kind, name, params) of a registered plugin."""
    if isinstance(entry, type):
        for kind in registry.KINDS:
            for name in registry.list_plugins(kind):
                if registry.plugin_info(kind, name).obj is entry:
                    return PluginUnderTest(kind, name)
        raise InputError(f"{entry.__qualname__} is not a registered plugin: decorate it with register_attack, "
                         "register_defense, register_protocol or register_model")  # fmt: skip
    if isinstance(entry, tuple) and len(entry) in (2, 3):
        kind, name, params = (*entry, {}) if len(entry) == 2 else entry
        if kind not in CHECK_NAMES:
            raise InputError(f"kind must be one of {', '.join(CHECK_NAMES)}, got {kind!r}")
        registry.plugin_info(kind, name)  # an unknown name: one line with the close matches
        return PluginUnderTest(kind, registry.resolve_name(kind, name), tuple(sorted(dict(params).items())))
    raise InputError(f"a plugin is a registered class or (kind, name[, params]), got {entry!r}")


def checks_of(plugins: Iterable[Any]) -> list[tuple[PluginUnderTest, Check]]:
    """Every (plugin, check) pair of the plugins, in CHECK_NAMES order. A defense that is a protocol's historical
    spelling (cgd) is checked as the protocol it is."""
    out = []
    for entry in plugins:
        plugin = _plugin(entry)
        kind = plugin.kind
        if kind == "defense" and registry.plugin_info(kind, plugin.name).protocol:
            kind = "protocol"
        out += [(plugin, Check(name, tuple(CHECK_NAMES[kind]))) for name in CHECK_NAMES[kind]]
    return out


def parametrize_with_checks(plugins: Iterable[Any]):
    """pytest.mark.parametrize("plugin, check", ...) over every check of every plugin, one id each."""
    import pytest

    pairs = checks_of(plugins)
    return pytest.mark.parametrize("plugin, check", pairs, ids=[f"{p}:{c}" for p, c in pairs])
