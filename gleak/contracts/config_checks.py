"""Range checks of a case and of a [utility] table: values of the right type that are out of range, and counts and
sizes past the stated upper bounds, each as (key, problem) for the suite's one located line.
"""
from __future__ import annotations

import os
from typing import Any

from gleak.contracts.config import CaseConfig, UtilityConfig


def check_case_values(case: CaseConfig) -> list[tuple[str, str]]:
    """(key, problem) pairs for values that have the right type but are out of range."""
    problems = []
    if case.batch_size < 1:
        problems.append(("batch_size", f"must be >= 1, got {case.batch_size}"))
    if case.clients < 1:
        problems.append(("clients", f"must be >= 1, got {case.clients}"))
    if case.resolution is not None and case.resolution < 4:
        problems.append(("resolution", f"must be >= 4, got {case.resolution}"))
    if case.channels not in (None, 1, 3):
        problems.append(("channels", f"must be 1 or 3, got {case.channels}"))
    if case.local_steps < 1:
        problems.append(("local_steps", f"must be >= 1, got {case.local_steps}"))
    if case.warmup_rounds < 0:
        problems.append(("warmup_rounds", f"must be >= 0, got {case.warmup_rounds}"))
    if case.server_lr is not None:
        if not case.server_lr > 0:
            problems.append(("server_lr", f"must be > 0, got {case.server_lr}"))
        elif case.update != "fedsgd":
            problems.append(("server_lr", "applies to FedSGD warm-up rounds (FedAvg's server applies the mean delta)"))
        elif case.local_lr != CaseConfig.local_lr:
            problems.append(("local_lr", "in a FedSGD case local_lr is the old name of server_lr: set server_lr only"))
    if case.model_state not in ("untrained", "trained"):
        path = case.model_state[len("file:"):] if case.model_state.startswith("file:") else None
        if path is None:
            problems.append(("model_state", f"must be 'untrained', 'trained' or 'file:PATH', got {case.model_state!r}"))
        elif not os.path.isfile(path):
            problems.append(("model_state", f"{path}: no such checkpoint file"))
    if case.train_steps < 1 or case.train_batch_size < 1 or case.train_lr <= 0:
        key = "train_steps" if case.train_steps < 1 else "train_batch_size" if case.train_batch_size < 1 else "train_lr"
        problems.append((key, f"must be > 0, got {getattr(case, key)}"))
    return problems + _over_bounds(case)


# Upper bounds of counts and sizes: far above any benchmark (the largest shipped suite uses a tenth or less), low
# enough that a value typed with too many zeros is refused at validation instead of running out of memory or time.
# Rounds and steps each cost a full pass of the model: 10_000 warm-up rounds or 1_000_000 training steps are hours
# on one core already (the shipped suites use at most 4 and 500).
UPPER_BOUNDS = {
    "batch_size": 100_000, "clients": 100_000, "resolution": 1024, "local_steps": 1_000_000, "warmup_rounds": 10_000,
    "training_rounds": 1_000_000,
    "train_steps": 1_000_000, "train_batch_size": 100_000, "seq_len": 4096, "vocab_size": 1_000_000,
}  # fmt: skip


def _over_bounds(cfg: Any) -> list[tuple[str, str]]:
    out = []
    for key, top in UPPER_BOUNDS.items():
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > top:
            out.append((key, f"must be <= {top:,}, got {v:,}".replace(",", "_")))
    seed = getattr(cfg, "seed", None)
    if isinstance(seed, int) and not 0 <= seed < 2**63:
        out.append(("seed", f"must be in [0, 2**63), got {seed}"))
    return out


def check_utility_values(u: UtilityConfig) -> list[tuple[str, str]]:
    """(key, problem) pairs for [utility] values that have the right type but are out of range."""
    problems = []
    for key in ("clients", "training_rounds", "batch_size", "local_steps"):
        if getattr(u, key) < 1:
            problems.append((key, f"must be >= 1, got {getattr(u, key)}"))
    for key in ("server_lr", "client_lr"):
        if getattr(u, key) is not None and not getattr(u, key) > 0:
            problems.append((key, f"must be > 0, got {getattr(u, key)}"))
    if u.algorithm == "fedavg" and u.server_lr is not None:
        problems.append(("server_lr", "applies to algorithm 'fedsgd' (FedAvg's server applies the mean delta): set client_lr"))
    if u.algorithm == "fedsgd" and u.client_lr is not None:
        problems.append(("client_lr", "applies to algorithm 'fedavg' only (FedSGD clients take no local step): set server_lr"))
    if not 0 < u.delta < 1:
        problems.append(("delta", f"must be in (0, 1), got {u.delta}"))
    if u.resolution is not None and u.resolution < 4:
        problems.append(("resolution", f"must be >= 4, got {u.resolution}"))
    if u.channels not in (None, 1, 3):
        problems.append(("channels", f"must be 1 or 3, got {u.channels}"))
    if u.dirichlet_alpha is not None and not u.dirichlet_alpha > 0:
        problems.append(("dirichlet_alpha", f"must be > 0, got {u.dirichlet_alpha}"))
    if u.algorithm == "fedsgd" and u.local_steps != 1:
        problems.append(("local_steps", "applies to algorithm 'fedavg' only"))
    return problems + _over_bounds(u)
