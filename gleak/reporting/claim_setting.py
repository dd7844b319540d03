"""What the image and the text claims share: which rows are at a claim's setting, the verdicts that leak, the
least number of deciding victims, and the interval of a recovered share (gleak.reporting.claims,
gleak.reporting.text_claims, gleak.reporting.comparison_claims)."""
from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any

LEAKING = ("partial", "recovered")
CASE_COLUMNS = ("dataset", "model", "batch_size")  # the aggregated frame's own case columns; other keys: its `case`
MIN_VICTIMS = 5  # a claim that no input is recovered needs at least this many deciding trials


def params_of(js: Any) -> dict[str, Any]:
    return json.loads(js) if isinstance(js, str) and js else {}


def params_match(params_js: Any, wanted: dict[str, Any]) -> bool:
    have = params_of(params_js)
    return all(k in have and have[k] == v for k, v in wanted.items())


def case_matches(r: Any, case: dict[str, Any]) -> bool:
    full = params_of(r.get("case")) if isinstance(r.get("case"), str) else {}
    return all((r[k] == v) if k in CASE_COLUMNS else (full.get(k) == v) for k, v in case.items())


def row_at_setting(r: Any, claim: dict[str, Any], attack_params: dict[str, Any]) -> bool:
    """Whether a row (a trial or an aggregated cell) is at the claim's setting: its defense parameters, case and
    the given attack parameters (partial matches)."""
    return (params_match(r["defense_params"], claim.get("defense_params", {})) and case_matches(r, claim.get("case", {}))
            and params_match(r["attack_params"], attack_params))  # fmt: skip


def rows_at_setting(t: Any, claim: dict[str, Any], attacks: list[str], attack_params: dict[str, Any]) -> Any:
    """The trials of a frame (pandas) by one of `attacks` at the claim's defense and setting."""
    import pandas as pd

    keep = [r["attack"] in attacks and r["defense"] == claim["defense"] and row_at_setting(r, claim, attack_params)
            for _, r in t.iterrows()]  # fmt: skip
    return t[pd.Series(keep, index=t.index, dtype=bool)] if len(t) else t


def wilson(k: int, n: int) -> tuple[float, float] | None:
    """The 95% Wilson score interval of a share k / n (None for n = 0)."""
    if n <= 0:
        return None
    z, p = 1.959963984540054, k / n
    centre, half = (p + z * z / (2 * n)), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


@lru_cache(maxsize=256)
def param_defaults(attack: str) -> dict[str, Any]:
    from gleak.contracts.registry import create

    try:
        return json.loads(json.dumps(create("attack", attack).get_params(), default=str))
    except Exception:  # noqa: BLE001 - an attack not loadable now: its variant unnamed
        return {}


def variant_text(attack: str, params_js: Any) -> str:
    """The attack's parameters that differ from its defaults ('gain=1000000.0'), so that a row names the variant
    that decides it; defense_aware is said in words by the caller."""
    base = param_defaults(attack)
    diff = [f"{k}={v}" for k, v in sorted(params_of(params_js).items())
            if k != "defense_aware" and k in base and (base[k] or None) != (v or None)]  # {} and None: both unset
    return f" [{', '.join(diff)}]" if diff else ""
