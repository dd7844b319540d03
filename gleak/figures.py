"""Figures: per-trial reconstruction grids (PIL, cheap enough to write from every trial) and suite-level plots."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from torch import Tensor


def image_grid(rows: list[Tensor], scale: int = 4, pad: int = 2) -> np.ndarray:
    """Stack rows of (N, C, H, W) images in [0, 1] into one uint8 RGB array, upscaled by `scale` (nearest)."""
    n = max(len(r) for r in rows)
    c, h, w = rows[0].shape[1:]
    hs, ws = h * scale, w * scale
    canvas = np.full((len(rows) * (hs + pad) + pad, n * (ws + pad) + pad, 3), 255, dtype=np.uint8)
    for i, r in enumerate(rows):
        for j, img in enumerate(r):
            a = img.detach().double().clamp(0, 1).cpu().numpy()
            a = np.repeat(a, 3, axis=0) if a.shape[0] == 1 else a[:3]
            a = np.moveaxis(a, 0, -1).repeat(scale, 0).repeat(scale, 1)
            y, x = pad + i * (hs + pad), pad + j * (ws + pad)
            canvas[y : y + hs, x : x + ws] = (a * 255).round().astype(np.uint8)
    return canvas


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be read by others
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_reconstruction(truth: Tensor, rec: Tensor, path: str | Path) -> None:
    """PNG grid: the true batch above, the reconstruction below (matched order is not implied)."""
    import io

    from PIL import Image

    from gleak.metrics import match

    ti, ri = match(truth, rec)
    order_t = list(ti) + [i for i in range(len(truth)) if i not in set(ti)]
    order_r = list(ri) + [i for i in range(len(rec)) if i not in set(ri)]
    grid = image_grid([truth[order_t], rec[order_r]], scale=max(1, 96 // truth.shape[-1]))
    buf = io.BytesIO()
    Image.fromarray(grid).save(buf, format="PNG")
    atomic_write_bytes(Path(path), buf.getvalue())
