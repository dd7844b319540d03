"""Deprecated: CGD's training engine moved beside its protocol, to gleak.protocols.cgd_training (with
reference_train in gleak.protocols.cgd_reference and invert_preactivation_wire in gleak.protocols.cgd_vertical).

Its names stay importable from here for one release; each import warns (DeprecationWarning) and gives the moved
object itself.
"""
from __future__ import annotations

import warnings

_ENGINE = ("ConfinedMLP", "INIT_LAWS", "InitLaw", "Layout", "PREACT_FRAC_BITS", "Partition", "TrainResult",
           "VERTICAL_READINGS", "Vertical", "blocks", "init_deltas", "init_unit", "make_layout", "participant_init",
           "step_size", "train")  # fmt: skip
__all__ = [*_ENGINE, "invert_preactivation_wire", "reference_train"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "reference_train":
        from gleak.protocols import cgd_reference as home
    elif name == "invert_preactivation_wire":
        from gleak.protocols import cgd_vertical as home
    else:
        from gleak.protocols import cgd_training as home
    warnings.warn(f"gleak.defenses.cgd_training is deprecated: import {name} from {home.__name__}", DeprecationWarning,
                  stacklevel=2)  # fmt: skip
    return getattr(home, name)
