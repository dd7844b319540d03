"""gleak's cache folder on disk ($GLEAK_CACHE, default ~/.cache/gleak): what is costly to compute and a function of
its key alone (trained models under models/, the embedded images under data/), shared by every process.

An entry is never trusted on its name: it holds its key and a digest of its tensors, and one whose key or digest
does not check (truncated, another key's, edited) is computed again and replaced. Entries are written whole or
not at all (gleak.mechanics.atomic_files).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

CACHE_ENV = "GLEAK_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gleak")


def key_of(ident: dict[str, Any]) -> str:
    """The hash that names an entry: of everything its content depends on."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over each tensor's name, dtype, shape and bytes (in name order)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def read_tensors(path: Path, key: str) -> dict[str, torch.Tensor] | None:
    """The tensors of the entry at `path` when it is whole and holds `key`; None otherwise (absent, unreadable,
    another key's, its digest not matching: the caller computes them again)."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any unreadable entry is computed again
        return None
    ok = (isinstance(saved, dict) and saved.get("key") == key and isinstance(saved.get("tensors"), dict)
          and all(isinstance(t, torch.Tensor) for t in saved["tensors"].values())
          and saved.get("sha256") == tensors_digest(saved["tensors"]))  # fmt: skip
    return saved["tensors"] if ok else None


def write_tensors(path: Path, key: str, tensors: dict[str, torch.Tensor]) -> bool:
    """Store `tensors` under `key` at `path`; False (nothing written) where the cache folder cannot be written: a
    cache is an optimisation, its absence never an error."""
    from gleak.mechanics.atomic_files import atomic_write_bytes

    buf = io.BytesIO()
    torch.save({"key": key, "tensors": tensors, "sha256": tensors_digest(tensors)}, buf)
    try:
        atomic_write_bytes(path, buf.getvalue())
    except OSError:
        return False
    return True
