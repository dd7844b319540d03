"""gleak: a benchmarking suite for gradient-leakage attacks and defenses.

The public API in one place::

    import gleak
    gleak.list_plugins("attack")                 # ['closed-form', 'idlg', ...]
    atk = gleak.create("attack", "closed-form")  # a configured plugin instance
    result = gleak.run_trial(config)             # one trial, end to end (see gleak.trial)
"""
from __future__ import annotations

from pathlib import Path as _Path

__version__ = "0.1.0"

# Built-in plugins live at the top of the checkout (attacks/, defenses/, suites/) and are installed as
# gleak.attacks / gleak.defenses / gleak.suites. When gleak is imported straight from a checkout (for example
# tests run beside a non-editable install), let the package find them there too.
_root = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).resolve().parent / "attacks").exists() and (_root / "attacks" / "__init__.py").exists():
    __path__.append(str(_root))  # type: ignore[name-defined]  # noqa: F821

from gleak.errors import GleakError, InputError, UnknownPluginError, UnsupportedCase  # noqa: E402
from gleak.registry import (  # noqa: E402
    create, list_plugins, register_attack, register_defense, register_model, register_protocol,
)  # fmt: skip

__all__ = [
    "GleakError",
    "InputError",
    "UnknownPluginError",
    "UnsupportedCase",
    "create",
    "list_plugins",
    "register_attack",
    "register_defense",
    "register_model",
    "register_protocol",
    "__version__",
]
