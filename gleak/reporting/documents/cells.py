"""How a value is shown in a leaderboard cell: numbers to their shown precision, parameters as 'k=v', labels."""
from __future__ import annotations

import json
import math
from typing import Any

from gleak.contracts.errors import InputError
from gleak.contracts.escaping import strip_controls
from gleak.contracts.registry import plugin_info
from gleak.reporting.aggregate import as_float

# Text that is data (a plugin's name, parameters, error or description, the suite's text), marked where it is put
# into a block so that each renderer treats it as data: Markdown escapes what would be markup in it
# (gleak.reporting.documents.markdown), HTML escapes everything anyway; both drop control characters from it. The marks are
# two characters of Unicode's private use area, removed from the data itself first (data cannot forge them).
DATA_OPEN, DATA_CLOSE = "\ue000", "\ue001"
_MARKS = str.maketrans("", "", DATA_OPEN + DATA_CLOSE)


def data(value: Any) -> str:
    """`value` as text, marked as data for the renderers ('' stays '')."""
    text = str(value).translate(_MARKS)
    return f"{DATA_OPEN}{text}{DATA_CLOSE}" if text else ""


def unmarked(text: str) -> str:
    """Text with its data marks removed and control characters dropped from the data (what HTML renders)."""
    import re

    return re.sub(f"{DATA_OPEN}([^{DATA_CLOSE}]*){DATA_CLOSE}", lambda m: strip_controls(m.group(1)), str(text)).translate(_MARKS)


def params_text(js: str, kind: str | None = None, name: str | None = None, show: set[str] | None = None) -> str:
    """Parameters as 'k=v, ...': with kind and name, those that differ from the plugin's defaults plus `show`
    (the ones the suite varies), so that a sweep's rows all name their value."""
    d = json.loads(js) if isinstance(js, str) and js else {}
    if kind and name:
        try:
            defaults = plugin_info(kind, name).defaults()
            d = {k: v for k, v in d.items() if (k in (show or ()) and v is not None) or k not in defaults or defaults[k] != v}
        except InputError:  # a plugin that is not loaded now: show everything
            pass
    return ", ".join(f"{k}={format(v, '.6g') if isinstance(v, float) else v}" for k, v in d.items()) if d else "-"


def text_of(v: Any) -> str:
    """The value as text; '' where it is missing (None, NaN)."""
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)


def fmt(v: Any, kind: str = "g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if kind == "e":
        return f"{v:.3e}"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "2":
        return f"{v:.2f}"
    if kind == "3":
        return f"{v:.3f}"
    return str(v)


# The diagnostics an attack, a defense or the scoring leaves in a row's extra, said in words (means over the cell's
# trials); the most telling first. A key without a phrase here (a plugin's own) is shown as its words and value.
_SAID: dict[str, tuple[int, Any]] = {
    "share_psnr40": (0, lambda v: f"{v:.0%} of the batch exact (PSNR > 40 dB)"),
    "half_mse": (1, lambda v: f"half the batch at MSE <= {v:.3g}"),
    "observed_share_psnr40": (2, lambda v: f"{v:.0%} of all observed samples exact"),
    "observed_samples": (3, lambda v: f"{v:g} samples observed"),
    "psnr_original": (4, lambda v: f"PSNR {v:.2f} dB against the untransformed images"),
    "epsilon": (5, lambda v: f"epsilon {v:.3g}"),
    "model_train_acc": (6, lambda v: f"model trained to {v:.0%} accuracy"),
    "iterations": (7, lambda v: f"{v:.0f} iterations"),
    "grad_loss": (8, lambda v: f"gradient-matching loss {v:.3g}"),
    "restart": (9, lambda v: f"winning restart (mean index) {v:.2g}"),
    "usable_rows": (10, lambda v: f"{v:.3g} usable rows"),
    "rows_used": (11, lambda v: f"{v:.3g} rows used"),
    "row_kept": (12, lambda v: f"{v:.0%} of the read row's entries left by the defense"),
}
_UNSAID = ("mse_original", "ssim_original", "lpips_original", "model_train_loss")  # said by another entry already


def extras_text(d: dict[str, float]) -> str:
    """A cell's diagnostics in words: 'half the batch at MSE <= 0.012; 75% of the batch exact (PSNR > 40 dB)'."""
    keep = {k: v for k, v in d.items() if not k.startswith(("_", "blind_")) and k not in _UNSAID}
    order = sorted(keep, key=lambda k: (_SAID[k][0] if k in _SAID else len(_SAID), k))
    return "; ".join(_SAID[k][1](keep[k]) if k in _SAID else f"{k.replace('_', ' ')} {keep[k]:.3g}" for k in order)


def mean_std(r: Any, m: str, kind: str, ci: bool = False, mean_key: str | None = None) -> str:
    """'mean ± std' of metric m (with ' [lo, hi]', the 95% interval of the mean, when ci); '' when undefined."""
    mean = as_float(r.get(mean_key or f"{m}_mean"))
    if mean is None:
        return ""
    text = fmt(mean, kind)
    std = as_float(r.get(f"{m}_std"))
    text += f" ± {fmt(std, kind)}" if std is not None else " (1 trial)"
    lo, hi = as_float(r.get(f"{m}_lo")), as_float(r.get(f"{m}_hi"))
    if ci and lo is not None and hi is not None:
        text += f" [{fmt(lo, kind)}, {fmt(hi, kind)}]"
    return text


def accuracy_change(u: Any) -> str:
    """A utility run's accuracy change from the undefended run, in points ('+1.25'); '' where either is missing."""
    acc, base = as_float(u.get("accuracy")), as_float(u.get("baseline_accuracy"))
    return f"{100 * (acc - base):+.2f}" if acc is not None and base is not None else ""


def label_text(r: Any) -> str:
    acc = as_float(r.get("label_acc"))
    return "" if acc is None else f"{fmt(acc, '3')} ({data(r.get('label_attack'))})"


def defense_label(name: str, params_js: str, vd: dict[str, set[str]]) -> str:
    p = params_text(params_js, "defense", name, vd.get(name))
    return name if p == "-" else f"{name} {p}"


def attack_label(name: str, params_js: str, va: dict[str, set[str]]) -> str:
    p = params_text(params_js, "attack", name, va.get(name))
    return name if p == "-" else f"{name} {p}"


def worst_attack_text(r: Any, va: dict[str, set[str]]) -> str:
    """The worst attack with the parameters that tell it from its siblings in the suite (defense_aware=True for an
    adaptive variant), so a reader sees which of them broke the defense, and the threat model it needs in brackets
    (gleak.contracts.threat_model), so that a rank decided by a stronger adversary says so."""
    from gleak.contracts.threat_model import of_attack

    name, params_js = r.get("worst_attack"), r.get("worst_attack_params")
    if not isinstance(name, str):
        return ""
    label = attack_label(name, params_js, va) if isinstance(params_js, str) else name
    tm = of_attack(name, params_js if isinstance(params_js, str) else None)
    return f"{label} [{tm}]" if tm else label


def trials_text(r: Any) -> str:
    """'ran/all' of a cell, or n/a when its plugin cannot handle the case at all (UnsupportedCase)."""
    na = int(r.get("not_applicable", 0) or 0)
    return "n/a" if na and na == r["trials"] else f"{r['trials'] - r['failed'] - na}/{r['trials']}"

