"""Data sets the benchmark draws private batches from.

Names (a case's `dataset` key):
  skimage        the embedded default: 10 colour photographs bundled with scikit-image (astronaut, cat, coffee,
                 rocket, ...), each cut into a 5x5 grid of overlapping square crops resized to 32x32; the label is
                 the photograph. 250 real images, no download.
  lfw            scikit-image's lfw_subset: 200 25x25 grey images, faces and non-faces (2 classes).
  fashion-mnist  gzip IDX files from a local folder (default /usr/share/datasets/fashion-mnist, where Debian's
                 dataset-fashion-mnist puts them).
  mnist, cifar10, cifar100
                 torchvision data sets under a local root (case key data_root, or $GLEAK_DATA, default ~/.gleak/data);
                 downloaded only when the case sets download = true.
  folder:PATH    an image folder: one sub-folder per class.
  uniform        synthetic pixels U[0, 1] with uniform random labels (seed 002's closed-form setting); not real data.

Images are float tensors in [0, 1], shape (N, C, H, W). `resolution` resizes (antialiased), `channels` converts
grey <-> RGB. Each split comes with the per-channel mean and std of the train split, used to normalise inputs.
"""
from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gleak.errors import DatasetMissing, InputError

FASHION_MNIST_DEFAULT = Path("/usr/share/datasets/fashion-mnist")
SKIMAGE_PHOTOS = (
    "astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
    "retina", "immunohistochemistry", "colorwheel", "logo", "stereo_motorcycle",
)  # fmt: skip
BUILTIN = ("skimage", "lfw", "fashion-mnist", "mnist", "cifar10", "cifar100", "uniform", "folder:PATH")
SUMMARIES = {
    "skimage": "embedded default: 250 real 32x32 colour crops of 10 scikit-image photographs (10 classes)",
    "lfw": "scikit-image lfw_subset: 200 grey 25x25 faces and non-faces (2 classes)",
    "fashion-mnist": "Fashion-MNIST from local gzip IDX files (Debian: apt-get install dataset-fashion-mnist)",
    "mnist": "torchvision MNIST from a local root (download = true to fetch)",
    "cifar10": "torchvision CIFAR-10 from a local root (download = true to fetch)",
    "cifar100": "torchvision CIFAR-100 from a local root (download = true to fetch)",
    "uniform": "synthetic U[0,1] pixels and random labels (seed 002's setting; not real data)",
    "folder:PATH": "an image folder with one sub-folder per class",
}


@dataclass(frozen=True)
class ImageDataset:
    name: str
    x: Tensor  # (N, C, H, W) float in [0, 1]
    y: Tensor  # (N,) long
    classes: tuple[str, ...]
    mean: Tensor  # (C,) of the train split
    std: Tensor  # (C,)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.x.shape[1:])  # type: ignore[return-value]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def normalized(self, idx: Tensor | slice | None = None) -> Tensor:
        x = self.x if idx is None else self.x[idx]
        return (x - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)


def default_root() -> Path:
    return Path(os.environ.get("GLEAK_DATA", Path.home() / ".gleak" / "data"))


def _square_crops(img: np.ndarray, grid: int) -> list[np.ndarray]:
    """A grid x grid set of overlapping square crops covering the image (side = 1/2 of the shorter edge)."""
    h, w = img.shape[:2]
    side = min(h, w) // 2
    ys = np.linspace(0, h - side, grid).round().astype(int)
    xs = np.linspace(0, w - side, grid).round().astype(int)
    return [img[y : y + side, x : x + side] for y in ys for x in xs]


def _to_tensor_images(arrs: list[np.ndarray]) -> list[Tensor]:
    out = []
    for a in arrs:
        t = torch.as_tensor(np.ascontiguousarray(a), dtype=torch.float32)
        if a.dtype == np.uint8:
            t = t / 255.0
        if t.dim() == 2:
            t = t.unsqueeze(-1)
        out.append(t.permute(2, 0, 1))
    return out


def _resize(x: Tensor, size: int) -> Tensor:
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False).clamp(0, 1)


def _load_skimage() -> tuple[Tensor, Tensor, tuple[str, ...], Tensor]:
    import skimage.data as skd

    xs, ys = [], []
    for label, name in enumerate(SKIMAGE_PHOTOS):
        img = getattr(skd, name)()
        if isinstance(img, tuple):  # stereo_motorcycle returns (left, right, disparity)
            img = img[0]
        if img.ndim == 3 and img.shape[2] == 4:  # logo is RGBA: composite on white
            alpha = img[..., 3:4] / 255.0
            img = (img[..., :3] * alpha + 255 * (1 - alpha)).astype(np.uint8)
        crops = _to_tensor_images(_square_crops(img, 5))
        xs += [_resize(c.unsqueeze(0), 32)[0] for c in crops]
        ys += [label] * len(crops)
    x = torch.stack(xs)
    y = torch.tensor(ys)
    # Every fifth crop is held out as the test split (public data for the attacker), the rest train.
    test = torch.arange(len(y)) % 5 == 2
    return x, y, tuple(SKIMAGE_PHOTOS), test


def _load_lfw() -> tuple[Tensor, Tensor, tuple[str, ...], Tensor]:
    import skimage.data as skd

    faces = torch.as_tensor(skd.lfw_subset(), dtype=torch.float32).unsqueeze(1)  # first 100 faces, then 100 not
    y = (torch.arange(200) >= 100).long()
    test = torch.arange(200) % 5 == 2
    return faces, y, ("face", "non-face"), test


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    zero, dtype_code, ndim = data[0:2], data[2], data[3]
    if zero != b"\x00\x00" or dtype_code != 0x08:
        raise InputError(f"{path}: not an unsigned-byte IDX file")
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


FASHION_CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")


def _load_fashion(root: Path | None, split: str) -> tuple[Tensor, Tensor, tuple[str, ...]]:
    root = Path(root) if root else FASHION_MNIST_DEFAULT
    prefix = "train" if split == "train" else "t10k"
    img, lab = root / f"{prefix}-images-idx3-ubyte.gz", root / f"{prefix}-labels-idx1-ubyte.gz"
    for f in (img, lab):
        if not f.is_file():
            raise DatasetMissing(
                f"dataset 'fashion-mnist': {f} not found (apt-get install -y dataset-fashion-mnist, "
                f"or set data_root to a folder holding {img.name} and {lab.name})"
            )
    x = torch.from_numpy(_read_idx(img).copy()).float().div_(255).unsqueeze(1)
    y = torch.from_numpy(_read_idx(lab).astype(np.int64))
    return x, y, FASHION_CLASSES


def _load_torchvision(name: str, root: Path | None, split: str, download: bool) -> tuple[Tensor, Tensor, tuple[str, ...]]:
    import torchvision

    root = Path(root) if root else default_root()
    cls = {"mnist": torchvision.datasets.MNIST, "cifar10": torchvision.datasets.CIFAR10, "cifar100": torchvision.datasets.CIFAR100}[name]
    try:
        ds = cls(str(root), train=(split == "train"), download=download)
    except RuntimeError as exc:
        how = "the download failed" if download else "set download = true in the case where the internet is reachable"
        raise DatasetMissing(f"dataset {name!r}: not found under {root} ({exc}); put it there, set data_root, or {how}") from exc
    except Exception as exc:  # URLError and friends when downloading offline
        raise DatasetMissing(f"dataset {name!r}: could not be downloaded to {root}: {exc}") from exc
    data = ds.data if isinstance(ds.data, np.ndarray) else ds.data.numpy()
    x = torch.from_numpy(np.ascontiguousarray(data)).float().div_(255)
    x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)
    y = torch.as_tensor(np.asarray(ds.targets), dtype=torch.long)
    return x, y, tuple(str(c) for c in ds.classes)


def _load_folder(path: Path) -> tuple[Tensor, Tensor, tuple[str, ...], Tensor]:
    from PIL import Image

    if not path.is_dir():
        raise DatasetMissing(f"dataset 'folder:{path}': no such folder")
    classes = sorted(d.name for d in path.iterdir() if d.is_dir())
    if not classes:
        raise DatasetMissing(f"dataset 'folder:{path}': no class sub-folders")
    xs, ys = [], []
    exts = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
    for label, c in enumerate(classes):
        for f in sorted((path / c).iterdir()):
            if f.suffix.lower() in exts:
                img = np.asarray(Image.open(f).convert("RGB"))
                side = min(img.shape[:2])
                top, left = (img.shape[0] - side) // 2, (img.shape[1] - side) // 2
                crop = _to_tensor_images([img[top : top + side, left : left + side]])[0]
                xs.append(_resize(crop.unsqueeze(0), 32)[0])
                ys.append(label)
    if not xs:
        raise DatasetMissing(f"dataset 'folder:{path}': no images found")
    y = torch.tensor(ys)
    return torch.stack(xs), y, tuple(classes), torch.arange(len(y)) % 5 == 2


def _load_uniform(resolution: int, channels: int, split: str) -> tuple[Tensor, Tensor, tuple[str, ...]]:
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    n = 2000
    x = torch.rand(n, channels, resolution, resolution, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y, tuple(str(i) for i in range(10))


def _convert_channels(x: Tensor, channels: int | None) -> Tensor:
    if channels is None or channels == x.shape[1]:
        return x
    if channels == 3 and x.shape[1] == 1:
        return x.expand(-1, 3, -1, -1).contiguous()
    if channels == 1 and x.shape[1] == 3:
        return (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)
    raise InputError(f"cannot convert {x.shape[1]} channels to {channels}")


@lru_cache(maxsize=16)
def _raw(name: str, root: str | None, split: str, download: bool, resolution: int | None, channels: int | None):
    test_mask = None
    if name == "skimage":
        x, y, classes, test_mask = _load_skimage()
    elif name == "lfw":
        x, y, classes, test_mask = _load_lfw()
    elif name == "fashion-mnist":
        x, y, classes = _load_fashion(Path(root) if root else None, split)
    elif name in ("mnist", "cifar10", "cifar100"):
        x, y, classes = _load_torchvision(name, Path(root) if root else None, split, download)
    elif name.startswith("folder:"):
        x, y, classes, test_mask = _load_folder(Path(name[len("folder:") :]).expanduser())
    elif name == "uniform":
        x, y, classes = _load_uniform(resolution or 8, channels or 1, split)
    else:
        import difflib

        close = difflib.get_close_matches(name, [b for b in BUILTIN if ":" not in b], n=2, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise InputError(f"unknown dataset {name!r}{hint} (known: {', '.join(BUILTIN)})")
    if test_mask is not None:
        keep = test_mask if split == "test" else ~test_mask
        x, y = x[keep], y[keep]
    x = _convert_channels(x, channels)
    if resolution is not None:
        x = _resize(x, resolution)
    return x, y, classes


def load_dataset(
    name: str,
    split: str = "train",
    *,
    root: str | None = None,
    resolution: int | None = None,
    channels: int | None = None,
    download: bool = False,
) -> ImageDataset:
    """Load a split of a data set; cached per process. Raises DatasetMissing with where it looked."""
    if split not in ("train", "test"):
        raise InputError(f"split must be 'train' or 'test', got {split!r}")
    x, y, classes = _raw(name, root, split, download, resolution, channels)
    # Keyed by torch's thread count too: the reductions' last bits depend on it, and a trial's result must not
    # depend on what ran before it in the process.
    mean, std = _train_stats(name, root, download, resolution, channels, torch.get_num_threads())
    return ImageDataset(name, x, y, classes, mean.clone(), std.clone())  # copies: a trial may not change the cache


@lru_cache(maxsize=16)
def _train_stats(name: str, root: str | None, download: bool, resolution: int | None, channels: int | None, _threads: int):
    """Per-channel mean and std of the training split (cached: every trial asks, and they cost ~15 ms a time)."""
    xt, _, _ = _raw(name, root, "train", download, resolution, channels)
    mean = xt.mean(dim=(0, 2, 3))
    std = xt.std(dim=(0, 2, 3)).clamp_min(1e-3)
    if name == "uniform":  # seed 002 works on raw pixels: no normalisation
        mean, std = torch.zeros_like(mean), torch.ones_like(std)
    return mean, std


def sample_indices(n: int, labels: Tensor, batch_size: int, gen: torch.Generator, distinct_labels: bool = False) -> Tensor:
    """Draw `batch_size` distinct indices; with distinct_labels, no two share a label (as far as classes allow)."""
    if batch_size > n:
        raise InputError(f"batch_size {batch_size} exceeds the {n} samples of the data set")
    perm = torch.randperm(n, generator=gen)
    if not distinct_labels:
        return perm[:batch_size]
    chosen, seen = [], set()
    for i in perm.tolist():
        c = int(labels[i])
        if c not in seen:
            chosen.append(i)
            seen.add(c)
            if len(chosen) == batch_size:
                break
    if len(chosen) < batch_size:
        raise InputError(f"batch_size {batch_size} with distinct labels exceeds the number of classes")
    return torch.tensor(chosen)
