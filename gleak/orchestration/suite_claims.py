"""A suite's [[claim]] tables: each a published claim about one defense against named attacks, validated key by
key where the suite is loaded (gleak.reporting.claims judges them against the stored trials)."""
from __future__ import annotations

from typing import Any

from gleak.contracts import registry
from gleak.contracts.config import CASE_FIELDS
from gleak.contracts.errors import UnknownPluginError, Where
from gleak.contracts.errors import did_you_mean as _close

CLAIM_KEYS = {"source", "claim", "setting", "defense", "defense_params", "attacks", "attack_params", "case", "expect",
              "quantifier", "than", "than_params", "metric", "factor", "margin"}
COMPARISON_KEYS = ("than", "than_params", "metric", "factor", "margin")  # an attack-against-attack claim's keys (expect = "beats")
# A claim's quantifier (gleak.reporting.claims): "no input" (expect defended: no deciding victim is recovered),
# "some input" (expect leaks: a deciding attack leaks), "most inputs" (expect leaks: more than half of the deciding
# samples are recovered exactly), "on average" (expect beats: the claim's attack's mean `metric` over the setting's
# trials is at least `factor` times the `than` attack's over the same victims, or `margin` above it).
QUANTIFIERS = {"defended": ("no input",), "leaks": ("some input", "most inputs"), "beats": ("on average",)}
EXPECT = tuple(QUANTIFIERS)  # a claim's `expect`: what its attacks' verdict must be (gleak.reporting.claims judges it)


def parse_claims(raw: Any, where: Where) -> list[dict[str, Any]]:
    """The [[claim]] tables: each a published claim about one defense against named attacks (gleak.reporting.claims),
    validated key by key; the defense and attack names resolved to their current names."""
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise where.error("claim", None, "must be an array of tables ([[claim]])")
    out = []
    for i, c in enumerate(raw, 1):
        t = f"claim #{i}"
        if not isinstance(c, dict):
            raise where.error(t, None, f"must be a table, got {c!r}")
        for k in c:
            if k not in CLAIM_KEYS:
                raise where.error(t, k, f"unknown key{_close(k, CLAIM_KEYS)} (keys: {', '.join(sorted(CLAIM_KEYS))})")
        for k in ("source", "claim", "defense", "attacks", "expect"):
            if k not in c:
                raise where.error(t, k, "missing")
        for k in ("source", "claim", "defense"):
            if not isinstance(c[k], str) or not c[k]:
                raise where.error(t, k, f"must be a non-empty string, got {c[k]!r}")
        if c["expect"] not in EXPECT:
            raise where.error(t, "expect", f"must be one of {', '.join(map(repr, EXPECT))}, got {c['expect']!r}")
        quantifier = c.get("quantifier", QUANTIFIERS[c["expect"]][0])
        if quantifier not in QUANTIFIERS[c["expect"]]:
            raise where.error(t, "quantifier", f"with expect = {c['expect']!r} must be one of "
                                               f"{', '.join(map(repr, QUANTIFIERS[c['expect']]))}, got {quantifier!r}")  # fmt: skip
        defense, params = _claim_defense(c, t, where)
        attacks = c["attacks"]
        if not isinstance(attacks, list) or not attacks or not all(isinstance(a, str) for a in attacks):
            raise where.error(t, "attacks", f"must be a non-empty list of attack names, got {attacks!r}")
        names = []
        for a in attacks:
            try:
                names.append(registry.resolve_name("attack", a))
                registry.plugin_info("attack", names[-1])
            except UnknownPluginError as exc:
                raise where.error(t, "attacks", str(exc)) from None
        attack_params = c.get("attack_params", {})
        if not isinstance(attack_params, dict):
            raise where.error(t, "attack_params", f"must be a table, got {attack_params!r}")
        known = set().union(*(registry.plugin_info("attack", a).params for a in names), {"defense_aware"})
        for k in attack_params:
            if k not in known:
                raise where.error(t, f"attack_params.{k}", f"no attack of the claim has a parameter {k!r}{_close(k, known)}")
        if "setting" in c and (not isinstance(c["setting"], str) or not c["setting"]):
            raise where.error(t, "setting", f"must be a non-empty string, got {c['setting']!r}")
        case = _claim_case(c.get("case", {}), t, where)
        comparison = _comparison(c, t, where)
        out.append({"source": c["source"], "claim": c["claim"], "setting": c.get("setting", ""), "defense": defense,
                    "defense_params": dict(params), "attacks": names, "attack_params": dict(attack_params),
                    "case": case, "expect": c["expect"], **comparison,
                    **({"quantifier": quantifier} if quantifier != QUANTIFIERS[c["expect"]][0] else {})})  # fmt: skip
    return out


def _claim_defense(c: dict[str, Any], t: str, where: Where) -> tuple[str, dict]:
    """The claim's defense as the leaderboard names it: a defense, or 'PROTOCOL+DEFENSE' where the trials' case
    names a protocol (FedAvg's local training, gleak.reporting.aggregate.protocol_pairs); defense_params are the
    defense's, the protocol's parameters go in the claim's case (protocol_params)."""
    protocol, plus, rest = c["defense"].partition("+")
    if not plus:
        return _plugin_and_params(c, "defense", "defense", "defense_params", t, where)
    try:
        protocol = registry.resolve_name("protocol", protocol)
        registry.plugin_info("protocol", protocol)
    except UnknownPluginError as exc:
        raise where.error(t, "defense", str(exc)) from None
    name, params = _plugin_and_params({**c, "defense": rest}, "defense", "defense", "defense_params", t, where)
    return f"{protocol}+{name}", params


def _plugin_and_params(c: dict[str, Any], kind: str, key: str, params_key: str, t: str, where: Where) -> tuple[str, dict]:
    """The plugin named by c[key] (its current name) and c[params_key], each parameter one it has."""
    try:
        name = registry.resolve_name(kind, c[key])
        info = registry.plugin_info(kind, name)
    except UnknownPluginError as exc:
        raise where.error(t, key, str(exc)) from None
    params = c.get(params_key, {})
    if not isinstance(params, dict):
        raise where.error(t, params_key, f"must be a table, got {params!r}")
    for k in params:
        if k not in info.params:
            raise where.error(t, f"{params_key}.{k}", f"{kind} {name!r} has no parameter {k!r}{_close(k, info.params)}")
    return name, params


def comparable_metrics() -> tuple[str, ...]:
    """The scores a claim may compare attacks on, each higher where it leaks more: the text scores and the image
    metrics declared leaks_higher (PSNR, SSIM, ...)."""
    from gleak.mechanics.metrics import METRICS
    from gleak.mechanics.text.metrics import COMPARED

    return (*COMPARED, *(m.name for m in METRICS.values() if m.leaks_higher))


def _comparison(c: dict[str, Any], t: str, where: Where) -> dict[str, Any]:
    """An attack-against-attack claim's keys (expect = "beats"): the attack it beats (`than`, resolved, with
    `than_params`), the metric compared, and how much better: `factor` times (default 1: better on average) or
    `margin` above, in the metric's own units (dB for PSNR); not both."""
    if c["expect"] != "beats":
        for k in COMPARISON_KEYS:
            if k in c:
                raise where.error(t, k, 'only a claim with expect = "beats" compares attacks')
        return {}
    for k in ("than", "metric"):
        if k not in c:
            raise where.error(t, k, 'missing (expect = "beats" compares the claim\'s attacks with the attack `than` on `metric`)')
    if not isinstance(c["than"], str) or not c["than"]:
        raise where.error(t, "than", f"must be an attack name, got {c['than']!r}")
    than, params = _plugin_and_params(c, "attack", "than", "than_params", t, where)
    metrics = comparable_metrics()
    if c["metric"] not in metrics:
        raise where.error(t, "metric", f"must be one of {', '.join(metrics)} (higher leaks more), got {c['metric']!r}")
    if "factor" in c and "margin" in c:
        raise where.error(t, "margin", "give factor (times the other's score) or margin (above it), not both")
    if "margin" in c:
        margin = c["margin"]
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
            raise where.error(t, "margin", f"must be a number >= 0 (in the metric's units), got {margin!r}")
        return {"than": than, "than_params": dict(params), "metric": c["metric"], "margin": float(margin)}
    factor = c.get("factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise where.error(t, "factor", f"must be a number > 0, got {factor!r}")
    return {"than": than, "than_params": dict(params), "metric": c["metric"], "factor": float(factor)}


def _claim_case(case: Any, t: str, where: Where) -> dict[str, Any]:
    """A claim's case: keys of [case] (gleak.contracts.config.CaseConfig), matched against each cell's trials' case."""
    if not isinstance(case, dict):
        raise where.error(t, "case", f"must be a table, got {case!r}")
    for k, v in case.items():
        if k not in CASE_FIELDS:
            raise where.error(t, f"case.{k}", f"not a [case] key{_close(k, CASE_FIELDS)}")
        if k == "batch_size" and (not isinstance(v, int) or isinstance(v, bool)):
            raise where.error(t, "case.batch_size", f"must be an integer, got {v!r}")
    return dict(case)
