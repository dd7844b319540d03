"""LPIPS (Zhang et al., CVPR 2018), v0.1 on AlexNet: the perceptual distance the gradient-inversion literature reports,
and where its backbone's weights come from. Without real ImageNet weights there is no LPIPS (never a random
backbone): the column stays empty and the leaderboard says how to fill it."""
from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gleak.contracts.errors import InputError

LPIPS_ENV = "GLEAK_LPIPS_BACKBONE"
NO_DOWNLOAD_ENV = "GLEAK_LPIPS_NO_DOWNLOAD"  # set (to anything but "" or "0"): never fetch the backbone
_ALEXNET_FILE = "alexnet-owt-7be5be79.pth"  # torchvision's ImageNet AlexNet weights (AlexNet_Weights.IMAGENET1K_V1)
# The published digest: torchvision names each weights file by the first 8 hex digits of its SHA-256 and checks
# them on download (torch.hub's hash_prefix); the full digest is published nowhere else. A random or other backbone
# matches them by chance with probability 2^-32.
ALEXNET_SHA256_PREFIX = "7be5be79"
DOWNLOAD_TIMEOUT_S = 30  # a connection that answers nothing in this long is taken as offline
LPIPS_HOWTO = (
    "LPIPS needs torchvision's ImageNet AlexNet weights: gleak run fetches them into the torch hub cache "
    "($TORCH_HOME/hub/checkpoints) where the network allows; offline, put alexnet-owt-7be5be79.pth there "
    "(from torchvision.models.AlexNet_Weights.IMAGENET1K_V1.url) or name the file with $GLEAK_LPIPS_BACKBONE or "
    "--lpips-backbone"
)


def hub_weights_file() -> Path:
    """Where torchvision keeps the AlexNet weights it downloads: the torch hub cache."""
    return Path(torch.hub.get_dir()) / "checkpoints" / _ALEXNET_FILE


def weights_url() -> str:
    """The AlexNet weights' address, from torchvision's own weights API."""
    import torchvision

    return torchvision.models.AlexNet_Weights.IMAGENET1K_V1.url


@lru_cache(maxsize=8)
def _sha256(path: str, _mtime_ns: int, _size: int) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_of(path: str | os.PathLike) -> str:
    """The file's SHA-256 (hex), computed once per file version."""
    st = os.stat(path)
    return _sha256(os.path.abspath(path), st.st_mtime_ns, st.st_size)


def fetch_weights(say: Any = None) -> Path | None:
    """The AlexNet weights in the torch hub cache, downloaded there first where they are not (unless
    $GLEAK_LPIPS_NO_DOWNLOAD is set): the file, or None where it could not be had (offline), after one line
    through `say` saying why and what to do. A download is verified by its published digest before it is kept."""
    target = hub_weights_file()
    if target.is_file():
        return target
    if os.environ.get(NO_DOWNLOAD_ENV, "") not in ("", "0"):
        return None
    say = say or (lambda line: None)
    url = weights_url()
    say(f"LPIPS: fetching torchvision's ImageNet AlexNet weights (233 MB) into {target.parent} "
        f"(set ${NO_DOWNLOAD_ENV}=1 to skip)")  # fmt: skip
    import hashlib
    import tempfile
    import urllib.request

    partial = None  # the download's temporary file, removed unless it becomes the cached file
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as src, tempfile.NamedTemporaryFile(
            dir=target.parent, prefix=f".{_ALEXNET_FILE}.", delete=False
        ) as tmp:  # fmt: skip
            partial = tmp.name
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
                tmp.write(block)
        if not h.hexdigest().startswith(ALEXNET_SHA256_PREFIX):
            os.unlink(partial)
            say(f"LPIPS: the file fetched from {url} is not the published one (SHA-256 {h.hexdigest()[:8]}..., "
                f"expected {ALEXNET_SHA256_PREFIX}...): not kept; LPIPS stays empty")  # fmt: skip
            return None
        os.replace(partial, target)
    except OSError as exc:  # offline, refused, a read-only cache: LPIPS stays empty, the run goes on
        if partial is not None and os.path.exists(partial):
            os.unlink(partial)
        reason = getattr(exc, "reason", None) or exc.strerror or type(exc).__name__
        say(f"LPIPS: could not fetch the weights ({reason}); LPIPS stays empty. {LPIPS_HOWTO}")
        return None
    return target


def alexnet_weights_path(explicit: str | os.PathLike | None = None) -> Path | None:
    """Where the AlexNet backbone weights are, or None. Order: explicit path, $GLEAK_LPIPS_BACKBONE, hub cache."""
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"LPIPS backbone weights not found at {p}")
        return p
    env = os.environ.get(LPIPS_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"${LPIPS_ENV} names {p}, which does not exist")
        return p
    hub = hub_weights_file()
    return hub if hub.is_file() else None


def check_published(path: str | os.PathLike, name: str) -> None:
    """InputError (one line naming `name` and the file) unless the file's SHA-256 begins with the published digest:
    a random or other backbone would score nothing perceptual."""
    digest = sha256_of(path)
    if not digest.startswith(ALEXNET_SHA256_PREFIX):
        raise InputError(f"{name}: {path} is not torchvision's ImageNet AlexNet weights {_ALEXNET_FILE} (its SHA-256 "
                         f"begins {digest[:8]}, the published file's {ALEXNET_SHA256_PREFIX})")  # fmt: skip


def check_lpips_weights(path: str | os.PathLike, name: str) -> None:
    """InputError (one line naming `name`, the flag, variable or cache that gave the file) unless `path` is the
    published AlexNet weights file (its SHA-256 begins with the published digest) that torch reads as AlexNet's
    state dict (every key of torchvision's AlexNet, each of its shape): checked once before any trial runs, so that
    a wrong file is one line and not a failure of every trial."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"{name}: {path} not found")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - random bytes, a truncated zip, a pickle of other objects: all one line
        raise InputError(f"{name}: {path} is not a weights file torch can read ({type(exc).__name__}); "
                         f"it must be torchvision's {_ALEXNET_FILE}") from None  # fmt: skip
    import torchvision

    with torch.device("meta"):  # the shapes only: nothing allocated
        want = {k: tuple(v.shape) for k, v in torchvision.models.alexnet().state_dict().items()}
    if not isinstance(state, dict):
        raise InputError(f"{name}: {path} holds a {type(state).__name__}, not AlexNet's state dict ({_ALEXNET_FILE})")
    for key, shape in want.items():
        got = state.get(key)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != shape or not got.is_floating_point():
            what = "missing" if got is None else f"of shape {tuple(getattr(got, 'shape', ()))}, not {shape}"
            raise InputError(f"{name}: {path} is not AlexNet's state dict ({_ALEXNET_FILE}): {key} is {what}")
    check_published(p, name)


@lru_cache(maxsize=2)
def _lpips_model(weights: str):
    import lpips
    import torchvision

    check_published(weights, "LPIPS backbone")  # never score with a random or foreign backbone

    # Build the LPIPS skeleton without fetching anything, then load the real backbone from `weights`:
    # the random initialisation below is overwritten before the model is used.
    skeleton = True
    model = lpips.LPIPS(net="alex", version="0.1", pretrained=True, pnet_rand=skeleton, verbose=False)
    alex = torchvision.models.alexnet()
    alex.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    feats = alex.features
    slices = [model.net.slice1, model.net.slice2, model.net.slice3, model.net.slice4, model.net.slice5]
    for sl in slices:
        for idx, layer in sl._modules.items():
            layer.load_state_dict(feats[int(idx)].state_dict())
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def lpips_available(explicit: str | None = None) -> bool:
    try:
        return alexnet_weights_path(explicit) is not None
    except FileNotFoundError:
        return False


# AlexNet's feature stack needs about 31 px; gradient-inversion papers report LPIPS on CIFAR's 32 px images.
LPIPS_MIN_SIDE = 32


def lpips(a: Tensor, b: Tensor, weights: str | os.PathLike | None = None, model: Any = None) -> Tensor | None:
    """Per-image LPIPS v0.1 (AlexNet), or None when the backbone weights are not on this machine.

    Images whose shorter side is under LPIPS_MIN_SIDE (32 px) are upsampled bilinearly (antialias off,
    align_corners False) until it is 32 px, aspect kept, before the backbone: the CIFAR size at which the
    gradient-inversion literature reports LPIPS (Geiping et al. 2020 and breaching compute it on 32 px images), and
    the usual way to score MNIST's 28 px and smaller images with the AlexNet backbone, which rejects them otherwise
    ("Output size is too small"). Grey images are repeated over three channels. `model`: an LPIPS module to use
    instead of the one built from `weights` (tests only)."""
    if model is None:
        path = alexnet_weights_path(weights)
        if path is None:
            return None
        model = _lpips_model(str(path))
    a3, b3 = a.float(), b.float()
    if a3.shape[1] == 1:
        a3, b3 = a3.expand(-1, 3, -1, -1), b3.expand(-1, 3, -1, -1)
    side = min(a3.shape[-2:])
    if side < LPIPS_MIN_SIDE:
        size = tuple(int(math.ceil(s * LPIPS_MIN_SIDE / side)) for s in a3.shape[-2:])
        up = lambda t: torch.nn.functional.interpolate(t, size=size, mode="bilinear", align_corners=False)  # noqa: E731
        a3, b3 = up(a3), up(b3)
    with torch.no_grad():
        return model(a3 * 2 - 1, b3 * 2 - 1).flatten().double()
