"""One name for one module: the old paths of moved modules, and the checkout's plugin folders imported from the top.

- gleak's modules sit in one subpackage per layer (docs/architecture.md). The flat paths they had before
  (`gleak.metrics`, `gleak.config`, ...) keep importing for one release: each is the moved module itself, not a
  copy, and warns (DeprecationWarning) with its new path.
- attacks/, defenses/ and protocols/ sit at the top of the checkout and are installed as gleak.attacks,
  gleak.defenses and gleak.protocols. Python run from the checkout root can also import them as the top-level
  `attacks`, ...: without this module that loads each file a second time, as a second module, and its plugin
  registers twice. Each plugin folder's __init__ makes the top-level name the installed package, and the finder
  below answers its submodules (`attacks.dlg`) with the installed module (`gleak.attacks.dlg`).

Both are served by one import hook placed first on sys.meta_path when gleak is imported.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# The flat paths of the modules that moved into the layer subpackages, and where each now lives.
MOVED = {
    "gleak.aggregate": "gleak.reporting.aggregate",
    "gleak.attribution": "gleak.reporting.attribution",
    "gleak.catalogue": "gleak.contracts.catalogue",
    "gleak.claims": "gleak.reporting.claims",
    "gleak.config": "gleak.contracts.config",
    "gleak.conformance": "gleak.orchestration.conformance",
    "gleak.contract": "gleak.contracts.attack_output",
    "gleak.data": "gleak.mechanics.data",
    "gleak.device": "gleak.mechanics.device",
    "gleak.documents": "gleak.reporting.documents",
    "gleak.dp_bound": "gleak.mechanics.dp_bound",
    "gleak.errors": "gleak.contracts.errors",
    "gleak.escaping": "gleak.contracts.escaping",
    "gleak.figures": "gleak.reporting.figures",
    "gleak.files": "gleak.mechanics.atomic_files",
    "gleak.folder": "gleak.orchestration.output_folder",
    "gleak.gate": "gleak.mechanics.gate",
    "gleak.guards": "gleak.mechanics.defense_output",
    "gleak.heap": "gleak.mechanics.allocator",
    "gleak.images": "gleak.orchestration.images",
    "gleak.metrics": "gleak.mechanics.metrics",
    "gleak.modality": "gleak.mechanics.modality",
    "gleak.models": "gleak.mechanics.models",
    "gleak.plugin": "gleak.contracts.plugin",
    "gleak.plugin_source": "gleak.contracts.plugin_source",
    "gleak.pretrain": "gleak.mechanics.pretrain",
    "gleak.progress": "gleak.mechanics.progress",
    "gleak.protocol": "gleak.mechanics.protocol",
    "gleak.ray_executor": "gleak.orchestration.ray_executor",
    "gleak.reconstructions": "gleak.orchestration.reconstructions",
    "gleak.registry": "gleak.contracts.registry",
    "gleak.report": "gleak.reporting.report",
    "gleak.runner": "gleak.orchestration.runner",
    "gleak.secret_sharing": "gleak.mechanics.secret_sharing",
    "gleak.store": "gleak.orchestration.store",
    "gleak.stored": "gleak.orchestration.stored_values",
    "gleak.suite": "gleak.orchestration.suite",
    "gleak.textdata": "gleak.mechanics.text.data",
    "gleak.textmetrics": "gleak.mechanics.text.metrics",
    "gleak.textmodels": "gleak.mechanics.text.models",
    "gleak.threat": "gleak.contracts.wire",
    "gleak.trial": "gleak.orchestration.trial",
    "gleak.utility": "gleak.orchestration.utility",
    "gleak.vocabulary": "gleak.contracts.vocabulary",
    "gleak.workers": "gleak.orchestration.workers",
    "gleak.documents.cells": "gleak.reporting.documents.cells",
    "gleak.documents.html": "gleak.reporting.documents.html",
    "gleak.documents.leaderboard": "gleak.reporting.documents.leaderboard",
    "gleak.documents.markdown": "gleak.reporting.documents.markdown",
    "gleak.documents.tables": "gleak.reporting.documents.tables",
    "gleak.documents.text": "gleak.reporting.documents.text",
}

# Modules whose names moved to several homes: old module -> (the names it forwards -> their new module). Each name
# imports for one release as the moved object itself, with a DeprecationWarning naming its new home; importing the
# old module alone (plugin discovery walks the folder it was in) is silent.
_CGD_ENGINE = ("ConfinedMLP", "INIT_LAWS", "InitLaw", "Layout", "PREACT_FRAC_BITS", "Partition", "TrainResult",
               "VERTICAL_READINGS", "Vertical", "blocks", "init_deltas", "init_unit", "make_layout", "participant_init",
               "step_size", "train")  # fmt: skip
SPLIT = {
    "gleak.defenses.cgd_training": {  # CGD's training engine, moved beside its protocol
        **{n: "gleak.protocols.cgd_training" for n in _CGD_ENGINE},
        "reference_train": "gleak.protocols.cgd_reference", "invert_preactivation_wire": "gleak.protocols.cgd_vertical",
    },
}  # fmt: skip

# The checkout's top-level plugin folders and the packages they are installed as.
PLUGIN_FOLDERS = {"attacks": "gleak.attacks", "defenses": "gleak.defenses", "protocols": "gleak.protocols"}


def as_installed_package(name: str) -> None:
    """Called by a plugin folder's __init__: imported as its top-level name (from the checkout root), it makes that
    name the installed package (`attacks` is `gleak.attacks`), so each of its files is one module."""
    if name in PLUGIN_FOLDERS:
        sys.modules[name] = importlib.import_module(PLUGIN_FOLDERS[name])


class _Alias(importlib.abc.Loader):
    """Loads a name as another module that already exists (imports it first)."""

    def __init__(self, target: str, deprecated: bool) -> None:
        self.target, self.deprecated = target, deprecated
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        if self.deprecated:
            warnings.warn(f"{spec.name} moved: import {self.target}", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # importlib has just set the alias's spec on the shared module: give it back its own (reload, pickling)
        module.__spec__ = self._spec


class _Split(importlib.abc.Loader):
    """Loads an old module whose names moved to several homes (SPLIT): a module that forwards each name."""

    def __init__(self, homes: dict[str, str]) -> None:
        self.homes = homes

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module; exec_module gives it its names

    def exec_module(self, module: ModuleType) -> None:
        homes = self.homes

        def forwarded(name: str):
            if name not in homes:
                raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
            warnings.warn(f"{module.__name__} is deprecated: import {name} from {homes[name]}", DeprecationWarning,
                          stacklevel=2)  # fmt: skip
            return getattr(importlib.import_module(homes[name]), name)

        module.__getattr__ = forwarded  # type: ignore[method-assign]  # PEP 562: only names not set on the module
        module.__all__ = sorted(homes)
        module.__doc__ = "Deprecated: " + "; ".join(sorted({f"names moved to {h}" for h in homes.values()}))


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if name in SPLIT:
            return importlib.machinery.ModuleSpec(name, _Split(SPLIT[name]))
        if name in MOVED:
            return importlib.machinery.ModuleSpec(name, _Alias(MOVED[name], deprecated=True))
        top, _, rest = name.partition(".")
        installed = PLUGIN_FOLDERS.get(top)
        if rest and installed and sys.modules.get(top) is not None and sys.modules.get(top) is sys.modules.get(installed):
            return importlib.machinery.ModuleSpec(name, _Alias(f"{installed}.{rest}", deprecated=False))
        return None


def install() -> None:
    """Put the finder first on sys.meta_path, once."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
