"""Data sets the benchmark draws private batches from.

Names (a case's `dataset` key; `gleak list datasets`; more with the `register_dataset` decorator or the
entry-point group ``gleak.datasets``):
  skimage        the embedded default: 10 colour photographs bundled with scikit-image (astronaut, cat, coffee,
                 rocket, ...), each cut into a 5x5 grid of overlapping square crops, each crop resized once to the
                 case's resolution (default 32x32); the label is the photograph. 250 real images, no download.
  lfw            scikit-image's lfw_subset: 200 25x25 grey images, faces and non-faces (2 classes).
  fashion-mnist  gzip IDX files from a local folder (default /usr/share/datasets/fashion-mnist, where Debian's
                 dataset-fashion-mnist puts them).
  mnist, cifar10, cifar100
                 torchvision data sets under a local root (case key data_root, or $GLEAK_DATA, default ~/.gleak/data);
                 downloaded only when the case sets download = true.
  folder:PATH    an image folder (torchvision's ImageFolder): one sub-folder per class, searched recursively; with
                 PATH/train/ and PATH/test/ (the usual CIFAR-as-PNG layout) those are the splits, else every fifth
                 image is the test split. Images keep their own size unless the case sets `resolution`.
  uniform        synthetic pixels U[0, 1] with uniform random labels (the closed-form notes' closed-form setting); not real data.

Images are float tensors in [0, 1], shape (N, C, H, W). `resolution` resizes to resolution x resolution
(antialiased; a folder's images are centre-cropped to a square first), `channels` converts grey <-> RGB. Each split
comes with the per-channel mean and std of the train split, used to normalise inputs.

Client shards for federated training (`client_shards`): IID, or label-skewed by a Dirichlet(alpha) draw per class.
"""
from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gleak.contracts.errors import DatasetMissing, InputError

FASHION_MNIST_DEFAULT = Path("/usr/share/datasets/fashion-mnist")
SKIMAGE_PHOTOS = (
    "astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
    "retina", "immunohistochemistry", "colorwheel", "logo", "stereo_motorcycle",
)  # fmt: skip
SKIMAGE_RESOLUTION = 32  # the embedded crops' size when the case does not set one


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

    def model_input(self, idx: Tensor | slice | None, dtype: torch.dtype) -> Tensor:
        """What the model reads of these samples: normalised images in `dtype` (a text data set gives token ids)."""
        return self.normalized(idx).to(dtype)


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


# -- the registry -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataRequest:
    """What a loader is asked for. `arg` is the part after the colon of a parametrised name (folder:PATH)."""

    name: str
    split: str
    root: Path | None
    download: bool
    resolution: int | None
    channels: int | None
    arg: str | None = None


# A loader returns (x, y, classes, test_mask): x (N, C, H, W) in [0, 1]. test_mask None: x is the requested split;
# else x holds both splits and test_mask marks the test one. A loader may return its images at req.resolution
# already (cut or generated at that size); otherwise they are resized after it.
Loaded = tuple[Tensor, Tensor, tuple[str, ...], "Tensor | None"]


@dataclass(frozen=True)
class DatasetEntry:
    name: str  # as listed: "skimage", or "folder:PATH" for a parametrised one
    loader: Callable[[DataRequest], Loaded]
    summary: str
    source: str = "builtin"

    @property
    def key(self) -> str:  # the part a case's dataset name is looked up by: "skimage", "folder:"
        return self.name.split(":", 1)[0] + ":" if ":" in self.name else self.name


_DATASETS: dict[str, DatasetEntry] = {}
_discovered = False


def register_dataset(name: str, summary: str | None = None, *, source: str = "builtin"):
    """Decorator for a loader ``f(req: DataRequest) -> (x, y, classes, test_mask)``, registered under `name`; a name
    with a colon ("folder:PATH") is parametrised: a case's "folder:/data/x" reaches the loader as req.arg "/data/x"."""

    def deco(fn: Callable[[DataRequest], Loaded]) -> Callable[[DataRequest], Loaded]:
        doc = (fn.__doc__ or "").strip().splitlines()
        entry = DatasetEntry(name, fn, summary or (doc[0] if doc else ""), source)
        old = _DATASETS.get(entry.key)
        if old is not None and (old.loader.__module__, old.loader.__qualname__) != (fn.__module__, fn.__qualname__):
            raise InputError(f"dataset {name!r} is registered twice ({old.loader!r} and {fn!r})")
        _DATASETS[entry.key] = entry
        return fn

    return deco


def _discover() -> None:
    """Third-party data sets: modules named by the entry-point group gleak.datasets register on import."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    import sys
    from importlib import metadata

    for ep in metadata.entry_points(group="gleak.datasets"):
        try:
            loaded = ep.load()
        except Exception as exc:  # a broken third-party data set must not take the built-ins down
            print(f"gleak: warning: dataset entry point {ep.name!r} ({ep.value}) failed to load: {exc}", file=sys.stderr)
            continue
        if callable(loaded) and ep.name.split(":", 1)[0] + (":" if ":" in ep.name else "") not in _DATASETS:
            register_dataset(ep.name, source=f"entry point {ep.value}")(loaded)


def list_datasets() -> list[tuple[str, str]]:
    """(name, one-line summary) of every registered data set, in registration order, then the text data sets
    (gleak.contracts.vocabulary, loaded by gleak.mechanics.text.data)."""
    from gleak.contracts.vocabulary import TEXT_DATASETS

    _discover()
    return [(e.name, e.summary) for e in _DATASETS.values()] + list(TEXT_DATASETS.items())


def dataset_entry(name: str) -> tuple[DatasetEntry, str | None]:
    """The entry a case's dataset name refers to, and its argument (folder:PATH -> PATH). InputError if unknown."""
    _discover()
    if ":" in name:
        key, arg = name.split(":", 1)
        entry = _DATASETS.get(key + ":")
        if entry is not None:
            return entry, arg
    elif name in _DATASETS:
        return _DATASETS[name], None
    import difflib

    names = [e.name for e in _DATASETS.values()]
    close = difflib.get_close_matches(name, [k for k in _DATASETS if not k.endswith(":")], n=2, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise InputError(f"unknown dataset {name!r}{hint} (known: {', '.join(names)})")


# -- the built-in data sets ---------------------------------------------------------------------------------------
def _every_fifth_test(n: int) -> Tensor:
    return torch.arange(n) % 5 == 2


# Bump when the crops change (what is cut, how it is converted or resized), so that cached crops are not reused.
SKIMAGE_FORMAT = 1


@register_dataset("skimage", "embedded default: 250 real colour crops of 10 scikit-image photographs (10 classes), 32x32 "
                  "unless resolution says otherwise")  # fmt: skip
def _load_skimage(req: DataRequest) -> Loaded:
    size = req.resolution or SKIMAGE_RESOLUTION  # each crop resized once, to the size asked for
    x, y = _skimage_crops(size)
    # Every fifth crop is held out as the test split (public data for the attacker), the rest train.
    return x, y, tuple(SKIMAGE_PHOTOS), _every_fifth_test(len(y))


def _skimage_crops(size: int) -> tuple[Tensor, Tensor]:
    """The crops at `size` and their labels: from the disk cache (gleak.mechanics.disk_cache) or cut now and cached.
    Cutting them costs about a second of CPU (each crop converted and resized from up to 256x256), and every process
    that runs a trial on them would pay it; the cached tensors are the computed ones, bit for bit."""
    import skimage

    from gleak.mechanics import disk_cache

    key = disk_cache.key_of({"format": SKIMAGE_FORMAT, "size": size, "photos": SKIMAGE_PHOTOS,
                             "skimage": skimage.__version__, "torch": torch.__version__})  # fmt: skip
    path = disk_cache.cache_dir() / "data" / f"skimage-{size}-{key}.pt"
    saved = disk_cache.read_tensors(path, key)
    if saved is not None and set(saved) == {"x", "y"}:
        return saved["x"], saved["y"]
    x, y = _cut_skimage_crops(size)
    disk_cache.write_tensors(path, key, {"x": x, "y": y})
    return x, y


def _cut_skimage_crops(size: int) -> tuple[Tensor, Tensor]:
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
        xs += [_resize(c.unsqueeze(0), size)[0] for c in crops]
        ys += [label] * len(crops)
    return torch.stack(xs), torch.tensor(ys)


@register_dataset("lfw", "scikit-image lfw_subset: 200 grey 25x25 faces and non-faces (2 classes)")
def _load_lfw(req: DataRequest) -> Loaded:
    import skimage.data as skd

    faces = torch.as_tensor(skd.lfw_subset(), dtype=torch.float32).unsqueeze(1)  # first 100 faces, then 100 not
    y = (torch.arange(200) >= 100).long()
    return faces, y, ("face", "non-face"), _every_fifth_test(200)


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    zero, dtype_code, ndim = data[0:2], data[2], data[3]
    if zero != b"\x00\x00" or dtype_code != 0x08:
        raise InputError(f"{path}: not an unsigned-byte IDX file")
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


FASHION_CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")


@register_dataset("fashion-mnist", "Fashion-MNIST from local gzip IDX files (Debian: apt-get install dataset-fashion-mnist)")
def _load_fashion(req: DataRequest) -> Loaded:
    root = req.root or FASHION_MNIST_DEFAULT
    prefix = "train" if req.split == "train" else "t10k"
    img, lab = root / f"{prefix}-images-idx3-ubyte.gz", root / f"{prefix}-labels-idx1-ubyte.gz"
    for f in (img, lab):
        if not f.is_file():
            raise DatasetMissing(
                f"dataset 'fashion-mnist': {f} not found (apt-get install -y dataset-fashion-mnist, "
                f"or set data_root to a folder holding {img.name} and {lab.name})"
            )
    x = torch.from_numpy(_read_idx(img).copy()).float().div_(255).unsqueeze(1)
    y = torch.from_numpy(_read_idx(lab).astype(np.int64))
    return x, y, FASHION_CLASSES, None


# What torchvision looks for under the root, for the message when it is not there.
TORCHVISION_LAYOUT = {
    "mnist": "ROOT/MNIST/raw/ with train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
             "t10k-labels-idx1-ubyte (or their .gz)",
    "cifar10": "ROOT/cifar-10-batches-py/ with data_batch_1 ... data_batch_5 and test_batch (cifar-10-python.tar.gz "
               "extracted there)",
    "cifar100": "ROOT/cifar-100-python/ with train and test (cifar-100-python.tar.gz extracted there)",
}  # fmt: skip


def _load_torchvision(req: DataRequest) -> Loaded:
    import torchvision

    name, root = req.name, req.root or default_root()
    cls = {"mnist": torchvision.datasets.MNIST, "cifar10": torchvision.datasets.CIFAR10, "cifar100": torchvision.datasets.CIFAR100}[name]
    try:
        ds = cls(str(root), train=(req.split == "train"), download=req.download)
    except RuntimeError as exc:
        how = "the download failed" if req.download else "set download = true in the case where the internet is reachable"
        layout = TORCHVISION_LAYOUT[name].replace("ROOT", str(root))
        pngs = "" if name == "mnist" else "; images as PNG files work as folder:PATH (PATH/train/CLASS/*.png, PATH/test/CLASS/*.png)"
        raise DatasetMissing(f"dataset {name!r}: not found under {root}: expected {layout}; put it there, set data_root, "
                             f"or {how}{pngs}") from exc  # fmt: skip
    except Exception as exc:  # URLError and friends when downloading offline
        raise DatasetMissing(f"dataset {name!r}: could not be downloaded to {root}: {exc}") from exc
    data = ds.data if isinstance(ds.data, np.ndarray) else ds.data.numpy()
    x = torch.from_numpy(np.ascontiguousarray(data)).float().div_(255)
    x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)
    y = torch.as_tensor(np.asarray(ds.targets), dtype=torch.long)
    return x, y, tuple(str(c) for c in ds.classes), None


for _name, _what in (("mnist", "MNIST"), ("cifar10", "CIFAR-10"), ("cifar100", "CIFAR-100")):
    register_dataset(_name, f"torchvision {_what} from a local root (download = true to fetch)")(_load_torchvision)


def _square_crop(img: Tensor) -> Tensor:
    h, w = img.shape[-2:]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return img[..., top : top + side, left : left + side]


def _folder_images(class_dir: Path, top: Path, name: str, extensions: tuple[str, ...]) -> list[str]:
    """The image files under one class folder, in torchvision's order (folders sorted by path, files by name), each
    counted once and in the class where it lies: a link is followed only to a folder or file inside this class
    folder, and a folder only once (a link loop, or two links to one folder, adds nothing; a file reached twice is
    one image); a link to elsewhere in the data set (another class, the other split, the top) adds nothing, its
    images count where they are. A link whose target lies outside the data set's folder `top` is InputError naming
    it: the data set is the folder's own images (torchvision's ImageFolder follows every link, so a loop
    multiplied the images, silently)."""
    walked: list[tuple[str, list[str]]] = []
    seen_dirs: set[str] = set()
    home = os.path.realpath(class_dir)

    def outside(link: str) -> InputError:
        return InputError(f"dataset {name!r}: {link} is a symbolic link out of the folder ({os.path.realpath(link)}); "
                          f"copy the images in, or point the data set at the folder that holds them")  # fmt: skip

    def walk(d: str) -> None:
        real = os.path.realpath(d)
        if real in seen_dirs:
            return
        seen_dirs.add(real)
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        files = []
        for e in entries:
            if e.is_symlink():
                target = os.path.realpath(e.path)
                if not _inside(target, top):
                    raise outside(e.path)
                if not _inside(target, Path(home)):
                    continue  # elsewhere in the data set: counted where it lies
            if e.is_dir():  # a linked folder inside the data set too, once
                walk(e.path)
            elif e.is_file():
                files.append(e.name)
        walked.append((d, files))

    walk(str(class_dir))
    out, seen_files = [], set()
    for d, files in sorted(walked):
        for f in sorted(files):
            path = os.path.join(d, f)
            real = os.path.realpath(path)
            if real not in seen_files and path.lower().endswith(extensions):
                seen_files.add(real)
                out.append(path)
    return out


def _inside(real: str, top: Path) -> bool:
    return real == str(top) or real.startswith(str(top) + os.sep)


@register_dataset("folder:PATH", "an image folder: one sub-folder per class (searched recursively), PATH/train/ and "
                  "PATH/test/ as the splits where present; own size unless resolution is set")  # fmt: skip
def _load_folder(req: DataRequest) -> Loaded:
    from torchvision import datasets, transforms
    from torchvision.datasets.folder import IMG_EXTENSIONS

    path = Path(req.arg or "").expanduser()
    name = f"folder:{req.arg}"
    if not path.is_dir():
        raise DatasetMissing(f"dataset {name!r}: no such folder")
    top = Path(os.path.realpath(path))  # links are judged against where the folder really is
    split_roots = (path / "train").is_dir() and (path / "test").is_dir()
    steps: list[Callable] = [transforms.ToTensor()]  # PIL image (converted to RGB) -> float (C, H, W) in [0, 1]
    if req.resolution is not None:  # only when asked: centre square, then one antialiased resize
        steps += [_square_crop, lambda t: _resize(t.unsqueeze(0), req.resolution)[0]]
    tf = transforms.Compose(steps)

    def read(root: Path, classes: dict[str, int] | None = None) -> tuple[list[Tensor], list[int], dict[str, int]]:
        class Folder(datasets.ImageFolder):
            def find_classes(self, directory):  # the test split takes the train split's class indices
                return super().find_classes(directory) if classes is None else (sorted(classes), classes)

            def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
                # each image once, links out of the folder refused: _folder_images (torchvision follows every link)
                exts = tuple(e.lower() for e in (extensions or IMG_EXTENSIONS))
                samples = []
                for cls in sorted(class_to_idx):
                    d = Path(directory) / cls
                    if d.is_symlink() and not _inside(os.path.realpath(d), top):
                        raise InputError(f"dataset {name!r}: {d} is a symbolic link out of the folder "
                                         f"({os.path.realpath(d)}); copy the images in, or point the data set at "
                                         f"the folder that holds them")  # fmt: skip
                    if d.is_dir():
                        samples += [(f, class_to_idx[cls]) for f in _folder_images(d, top, name, exts)]
                if not samples and not allow_empty:
                    raise FileNotFoundError(f"Found no valid file for the classes {', '.join(sorted(class_to_idx))}")
                return samples

        try:
            ds = Folder(str(root), transform=tf, allow_empty=classes is not None)
        except (FileNotFoundError, OSError) as exc:
            layout = "PATH/CLASS/*.png or PATH/train/CLASS/*.png and PATH/test/CLASS/*.png"
            raise DatasetMissing(f"dataset {name!r}: {exc} (expected {layout})") from None
        xs, ys = [], []
        for i in range(len(ds)):
            x, y = ds[i]
            xs.append(x)
            ys.append(y)
        return xs, ys, ds.class_to_idx

    if split_roots:
        xs, ys, class_to_idx = read(path / "train")
        if req.split == "test":
            extra = {d.name for d in (path / "test").iterdir() if d.is_dir()} - set(class_to_idx)
            if extra:
                raise DatasetMissing(f"dataset {name!r}: test classes {', '.join(sorted(extra))} are not in train/")
            xs, ys, _ = read(path / "test", class_to_idx)
        mask = None
    else:
        xs, ys, class_to_idx = read(path)
        mask = _every_fifth_test(len(ys))
    if not xs:
        raise DatasetMissing(f"dataset {name!r}: no images in {path / req.split if split_roots else path}")
    sizes = sorted({tuple(x.shape[-2:]) for x in xs})
    if len(sizes) > 1:
        raise InputError(f"dataset {name!r}: the images differ in size ({sizes[0][0]}x{sizes[0][1]}, "
                         f"{sizes[-1][0]}x{sizes[-1][1]}, ...): set resolution in the case to resize them all")  # fmt: skip
    classes = tuple(sorted(class_to_idx, key=class_to_idx.get))
    return torch.stack(xs), torch.tensor(ys, dtype=torch.long), classes, mask


@register_dataset("uniform", "synthetic U[0,1] pixels and random labels (the closed-form notes' setting; not real data)")
def _load_uniform(req: DataRequest) -> Loaded:
    g = torch.Generator().manual_seed(0 if req.split == "train" else 1)
    n = 2000
    x = torch.rand(n, req.channels or 1, req.resolution or 8, req.resolution or 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y, tuple(str(i) for i in range(10)), None


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
    entry, arg = dataset_entry(name)
    req = DataRequest(name, split, Path(root) if root else None, download, resolution, channels, arg)
    x, y, classes, test_mask = entry.loader(req)
    if test_mask is not None:
        keep = test_mask if split == "test" else ~test_mask
        x, y = x[keep], y[keep]
    x = _convert_channels(x, channels)
    if resolution is not None:
        x = _resize(x, resolution)  # a no-op where the loader cut its images at this size
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
    if name == "uniform":  # the closed-form notes work on raw pixels: no normalisation
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


def client_shards(labels: Tensor, clients: int, gen: torch.Generator, alpha: float | None = None,
                  min_size: int = 1, tries: int = 1000) -> list[Tensor]:  # fmt: skip
    """Indices of each client's shard of a training split with these labels.

    alpha None: IID, the indices shuffled once (torch.randperm with `gen`) and dealt into `clients` equal shards,
    the remainder unused. alpha > 0: label-skewed non-IID shards after Hsu et al. 2019 ("Measuring the effects of
    non-identical data distribution for federated visual classification"): for each class, a share of the clients
    q ~ Dirichlet(alpha, ..., alpha) is drawn and the class's samples (in random order) are dealt out in those
    shares, so every sample belongs to one client; small alpha gives each client few classes, large alpha tends to
    IID. As in the usual implementations (Yurochkin et al. 2019's and Li et al. 2022's NIID-Bench code), the draw
    is repeated until every shard holds at least `min_size` samples (InputError after `tries` draws).
    """
    n = int(labels.shape[0])
    if clients < 1:
        raise InputError(f"clients must be >= 1, got {clients}")
    if alpha is None:
        perm = torch.randperm(n, generator=gen)
        size = n // clients
        return [perm[i * size : (i + 1) * size] for i in range(clients)]
    if not alpha > 0:
        raise InputError(f"dirichlet_alpha must be > 0, got {alpha}")
    # numpy's Dirichlet sampler, seeded from the given generator (torch's has no generator argument).
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=gen)))
    y = labels.cpu().numpy()
    by_class = [np.flatnonzero(y == c) for c in np.unique(y)]
    for _ in range(tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for idx in by_class:
            idx = rng.permutation(idx)
            q = rng.dirichlet(np.full(clients, float(alpha)))
            cuts = (np.cumsum(q)[:-1] * len(idx)).round().astype(int)
            for part, piece in zip(parts, np.split(idx, cuts)):
                part.append(piece)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in shards) >= min_size:
            return [torch.from_numpy(rng.permutation(s).astype(np.int64)) for s in shards]
    raise InputError(f"dirichlet_alpha = {alpha}: no draw in {tries} gave each of {clients} clients {min_size} samples "
                     f"of {n}; raise dirichlet_alpha or lower clients")  # fmt: skip
