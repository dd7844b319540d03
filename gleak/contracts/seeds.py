"""The seed streams of a trial: every random draw of a trial (its data, model, clients, defense, attack) comes from
its own generator, derived from the trial's seed and the draw's purpose, so that one purpose's draws never shift
another's and a trial's result is a function of its config and seed.
"""
from __future__ import annotations

import hashlib


def derive_seed(seed: int, purpose: str) -> int:
    """An independent 63-bit seed for one purpose (data, model, defense, attack) of a trial."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{purpose}".encode()).digest()[:8], "big") >> 1


def generator(seed: int, purpose: str):
    import torch

    return torch.Generator().manual_seed(derive_seed(seed, purpose))
