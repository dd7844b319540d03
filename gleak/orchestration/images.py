"""A trial's reconstruction as a PNG (PIL, cheap enough to write from every trial): the true batch above, the
reconstruction below."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import Tensor

from gleak.mechanics.atomic_files import atomic_write_bytes


PAD = 2  # white pixels around and between a stored PNG's images


def image_grid(rows: list[Tensor], scale: int = 4, pad: int = PAD) -> np.ndarray:
    """Stack rows of (N, C, H, W) images in [0, 1] into one uint8 RGB array, upscaled by `scale` (nearest), `pad`
    white pixels around and between them (the layout of torchvision.utils.make_grid, laid out here: importing
    torchvision costs every worker over a second; a shorter row is filled with white images)."""
    import torch

    n = max(len(r) for r in rows)
    first = rows[0]
    h, w = first.shape[-2] * scale, first.shape[-1] * scale
    grid = torch.ones((3, len(rows) * (h + pad) + pad, n * (w + pad) + pad), dtype=torch.float64)
    for y, r in enumerate(rows):
        r = r.detach().double().clamp(0, 1).cpu()
        r = r.expand(-1, 3, -1, -1) if r.shape[1] == 1 else r[:, :3]
        r = r.repeat_interleave(scale, -2).repeat_interleave(scale, -1)
        for x, cell in enumerate(r):
            top, left = y * (h + pad) + pad, x * (w + pad) + pad
            grid[:, top : top + h, left : left + w] = cell
    return (grid * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


MISSING_GREY = 0.8  # the cell under a true image the attack returned no reconstruction for


def reconstruction_image(truth: Tensor, rec: Tensor) -> np.ndarray:
    """The PNG's pixels: the true batch above in its own order, the reconstruction below, each reconstruction under
    the true image it is paired with (gleak.mechanics.metrics.match, as it is scored); a grey cell under an image
    the attack returned nothing for, and reconstructions beyond the batch (other clients' samples) after it."""
    import torch

    from gleak.mechanics.metrics import match

    ti, ri = match(truth, rec) if len(rec) else ([], [])
    under = dict(zip((int(t) for t in ti), (int(r) for r in ri)))
    grey = torch.full((1, *truth.shape[1:]), MISSING_GREY, dtype=truth.dtype)
    below = [rec[under[i] : under[i] + 1].to(truth.dtype) if i in under else grey for i in range(len(truth))]
    below += [rec[r : r + 1].to(truth.dtype) for r in range(len(rec)) if r not in set(under.values())]
    return image_grid([truth, torch.cat(below)], scale=max(1, 96 // truth.shape[-1]))


def first_images(strip: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """A stored reconstruction PNG's pixels (`reconstruction_image`: two rows of square images) cut to its first k
    columns, and how many columns it holds: a batch of 256 drawn whole is too small to see in a figure."""
    pitch = (strip.shape[0] - PAD) // 2  # one image and its padding
    if pitch <= PAD:
        return strip, 1
    n = max(1, (strip.shape[1] - PAD) // pitch)
    return (strip[:, : PAD + k * pitch] if n > k else strip), n


def save_reconstruction(truth: Tensor, rec: Tensor, path: str | Path) -> None:
    """`reconstruction_image` as a PNG file."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(reconstruction_image(truth, rec)).save(buf, format="PNG")
    atomic_write_bytes(Path(path), buf.getvalue())
