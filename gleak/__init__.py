"""gleak: a benchmarking suite for gradient-leakage attacks and defenses.

The public API in one place (gleak.api; README "Python")::

    import gleak
    gleak.list_plugins("attack")                   # ['closed-form', 'idlg', ...]
    atk = gleak.create("attack", "closed-form")    # a configured plugin instance
    r = gleak.run_trial(attack="closed-form", defense={"name": "topk", "ratio": 0.9}, batch_size=4)
    r.metrics["psnr"], r.truth, r.reconstruction   # a TrialResult; r.plot() draws truth above reconstruction
    gleak.run_trial(config)                        # or a gleak.contracts.config.TrialConfig
    s = gleak.run("quick", out="/tmp/q")           # a suite, as `gleak run` (a RunResult: counts, out, rows)
    gleak.run_trial(attack="dlg", device="auto")   # device: auto, cpu, cuda[:N] (gleak.mechanics.device; not in the trial id)
    df = gleak.results("results/quick")            # an output folder as a DataFrame, one column per parameter
    gleak.list_datasets()                          # data sets; gleak.register_dataset adds one
    m, d = gleak.case_model(model="mlp"), gleak.case_data(model="mlp")   # a case's model and data (a checkpoint)
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

from gleak.contracts import compat as _compat  # noqa: E402

_compat.install()  # old module paths and the checkout's plugin folders: one module per file

from gleak.contracts.errors import GleakError, InputError, UnknownPluginError, UnsupportedCase  # noqa: E402
from gleak.contracts.registry import (  # noqa: E402
    create,
    list_plugins,
    register_attack,
    register_defense,
    register_model,
    register_protocol,
)  # fmt: skip

_API = ("run_trial", "run", "results", "trial_config", "case_data", "case_model", "TrialResult", "RunResult", "TrialFailed")
_DATA = ("register_dataset", "list_datasets")
# What a plugin author writes against, wherever it lives inside gleak: the base classes and the wire's types.
_PLUGIN_API = {"Attack": "gleak.contracts.plugin", "Defense": "gleak.contracts.plugin",
               "Protocol": "gleak.mechanics.protocol", "Update": "gleak.contracts.wire",
               "Observation": "gleak.contracts.wire", "Reconstruction": "gleak.contracts.wire",
               "get_tags": "gleak.contracts.tags", "Tags": "gleak.contracts.tags"}  # fmt: skip


def __getattr__(name: str):  # the API imports pandas and the data module torch: only when asked (the CLI starts fast)
    if name in _API:
        from gleak import api

        return getattr(api, name)
    if name in _DATA:
        from gleak.mechanics import data

        return getattr(data, name)
    if name in _PLUGIN_API:
        import importlib

        return getattr(importlib.import_module(_PLUGIN_API[name]), name)
    raise AttributeError(f"module 'gleak' has no attribute {name!r}")


__all__ = [
    "GleakError",
    "InputError",
    "UnknownPluginError",
    "UnsupportedCase",
    "create",
    *_API,
    *_DATA,
    *_PLUGIN_API,
    "list_plugins",
    "register_attack",
    "register_defense",
    "register_model",
    "register_protocol",
    "__version__",
]
