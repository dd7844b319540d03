"""Attack verdicts attributed to the configuration they were measured on (a confined protocol's partition).

A confined protocol (cgd, local-training) has a `partition` that shapes its utility runs, (rows x cols)
participants, while its attack trials take their participants from the case: `clients` participants holding whole
samples (Algorithm 1; with cgd's split_features each client is a sample block of the partition's cols feature
blocks), with `colluders` of them on the adversary's side (None: clients - 2). A trial whose case does
not match its partition (4 clients under partition = "100x49") measured the protocol at (4x1), not at (100x49), and
must not be reported as breaking (or protecting) the (100x49) partition. `attribute_measured_configuration`
rewrites, for the report only, such a trial's partition to the one it was measured at and its default colluders
(None) to the number the protocol used, so every table built from the aggregate labels each verdict with its own (partition,
participants, colluders), and a configuration's utility row only meets the attack trials run at it. Stored
results and trial ids are untouched.
"""
from __future__ import annotations

import json
from typing import Any

import pandas as pd

CONFINED_PROTOCOLS = ("cgd", "local-training")


def measured_partition(clients: int, cols: int = 1) -> str:
    """The partition an attack trial measures: its case's clients as sample blocks, whole samples each (cols 1),
    or split into the partition's cols feature blocks (cgd's split_features)."""
    return f"{int(clients)}x{int(cols)}"


def _attributed(name: str, params: dict[str, Any], clients: int) -> dict[str, Any] | None:
    """The parameters as measured, or None where they already say what the trial measured: the protocol's own
    reading of its partition and colluders (its `attack_cols` and `colluders_at`), never a copy of it here."""
    from gleak.contracts import registry
    from gleak.contracts.errors import UnsupportedCase

    try:
        proto = registry.create("protocol", name, **params)
    except Exception:  # noqa: BLE001 - a configuration this gleak cannot build is reported as stored
        return None
    cols = proto.attack_cols() if hasattr(proto, "attack_cols") else 1
    if measured_partition(clients, cols) == str(proto.partition).lower().replace(" ", ""):
        return None  # measured at its own partition: kept as stored, so that its utility row meets it
    out = {**params, "partition": measured_partition(clients, cols)}
    if "colluders" in params and params["colluders"] is None and hasattr(proto, "colluders_at"):
        try:
            out["colluders"] = proto.colluders_at(int(clients))
        except UnsupportedCase:  # the trial itself was not applicable: its default stays as stored
            pass
    return out


def attribute_measured_configuration(df: pd.DataFrame) -> pd.DataFrame:
    """The trial frame with each confined-protocol trial's partition (and default colluders) set to the
    configuration it was measured at: in defense_params for the defense spelling (`[[defense]] name = "cgd"`), in
    the case's protocol_params for the case spelling (`[case] protocol = "cgd"`)."""
    if df.empty or "case" not in df.columns:
        return df
    df = df.copy()
    for i, r in df.iterrows():
        case = json.loads(r["case"]) if isinstance(r["case"], str) and r["case"] else {}
        clients = int(case.get("clients", 1))
        name = str(r["defense"])
        if name in CONFINED_PROTOCOLS:
            params = json.loads(r["defense_params"]) if isinstance(r["defense_params"], str) and r["defense_params"] else {}
            new = _attributed(name, params, clients)
            if new is not None:
                df.at[i, "defense_params"] = json.dumps(new, sort_keys=True, default=str)
        elif case.get("protocol") in CONFINED_PROTOCOLS:
            new = _attributed(case["protocol"], dict(case.get("protocol_params") or {}), clients)
            if new is not None:
                df.at[i, "case"] = json.dumps({**case, "protocol_params": new}, sort_keys=True, default=str)
    return df


def undefended_baseline(utility: pd.DataFrame | None) -> float | None:
    """The federated run without a defense (the utility table's "none" row), not whichever row's baseline comes
    first: a confined protocol's row carries its own centralized run as its baseline."""
    if utility is None or not len(utility) or "baseline_accuracy" not in utility:
        return None
    none = utility[(utility["defense"] == "none") & utility["accuracy"].notna()]
    if len(none):
        return float(none["accuracy"].iloc[0])
    own = utility["defense"].isin(CONFINED_PROTOCOLS)
    base = utility.loc[~own, "baseline_accuracy"].dropna()
    return float(base.iloc[0]) if len(base) else None
