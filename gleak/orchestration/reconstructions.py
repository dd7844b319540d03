"""Reconstructions kept as arrays, and `gleak rescore`: metrics recomputed from them without rerunning attacks.

Each trial that returns images stores, in the results store's `reconstructions` table, one compressed NumPy archive:
the victim's images and labels as they entered its gradient (what was sent: a transforming defense's output, such
as ATS's), the attack's images and labels, the blind guess and, where a defense transformed the batch, the
client's untransformed images ("original"), all in [0, 1] as float32
(float32, not float16: an exact recovery must still score at the PSNR ceiling when rescored; a 32x32 RGB batch of
4 costs about 50 KB before compression). `rescore` scores them again with the current metrics, so that a metric
added later (LPIPS once its backbone is on the machine, a new one) covers results already published.
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import Tensor

from gleak.contracts.errors import InputError

# What `rescore` can recompute, and the score() outputs each one updates.
RESCORABLE = {
    "mse": ("mse",), "psnr": ("psnr",), "ssim": ("ssim",), "cosine": ("cosine",), "lpips": ("lpips",),
    "label_acc": ("label_acc",), "rpsnr": ("rpsnr",), "iip": ("iip",), "verdict": ("verdict", "matched", "half_mse"),
    "blind": ("blind_mse", "blind_psnr", "blind_ssim", "half_mse"), "share_psnr40": ("share_psnr40",),
}  # fmt: skip


def pack(truth: Tensor, truth_y: Tensor, rec: Tensor, rec_y: Tensor | None, blind: Tensor,
         original: Tensor | None = None) -> bytes:  # fmt: skip
    """One trial's arrays as compressed .npz bytes (`truth`: what was sent; `original`: the untransformed images
    where a defense transformed them, else None)."""
    arrays: dict[str, np.ndarray] = {
        "truth": truth.detach().float().cpu().numpy(), "truth_y": truth_y.detach().long().cpu().numpy(),
        "rec": rec.detach().float().cpu().numpy(), "blind": blind.detach().float().cpu().numpy(),
    }  # fmt: skip
    if rec_y is not None:
        arrays["rec_y"] = rec_y.detach().long().cpu().numpy()
    if original is not None:
        arrays["original"] = original.detach().float().cpu().numpy()
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


MAX_LABEL = 1 << 20  # a stored label at or above this is damage (and would make label scoring allocate gigabytes)


def unpack(blob: bytes, trial_id: str = "") -> dict[str, Tensor | None]:
    """One trial's arrays from `pack`'s bytes, checked: InputError (one line naming the trial) unless they are the
    arrays `pack` writes (a store is a file anyone can edit; a pickled array is never loaded)."""
    where = f"reconstructions.sqlite: table reconstructions, trial {trial_id[:40]!r}:"
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as exc:  # noqa: BLE001 - random bytes, a truncated archive, a pickled array: all damage
        raise InputError(f"{where} damaged arrays ({type(exc).__name__}); rerun the trial or restore the store") from None
    problem = _arrays_problem(arrays)
    if problem:
        raise InputError(f"{where} {problem}; rerun the trial or restore the store")
    out: dict[str, Tensor | None] = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    out.setdefault("rec_y", None)
    out.setdefault("original", None)
    return out


def _arrays_problem(a: dict[str, np.ndarray]) -> str | None:
    missing = [k for k in ("truth", "truth_y", "rec", "blind") if k not in a]
    if missing or set(a) - {"truth", "truth_y", "rec", "blind", "rec_y", "original"}:
        return f"not gleak's arrays (keys {', '.join(sorted(a))})"
    for k in ("truth", "rec", "blind", *(("original",) if "original" in a else ())):
        if a[k].dtype.kind != "f" or a[k].ndim != 4 or not np.isfinite(a[k]).all():
            return f"array {k} is not a finite (n, C, H, W) floating array"
    shape = a["truth"].shape[1:]
    if a["rec"].shape[1:] != shape or a["blind"].shape != (1, *shape) or a.get("original", a["truth"]).shape != a["truth"].shape:
        return f"arrays of shapes {a['truth'].shape}, {a['rec'].shape}, {a['blind'].shape} do not match"
    for k in ("truth_y", "rec_y"):
        y = a.get(k)
        if y is not None and (y.dtype.kind not in "iu" or y.ndim != 1 or (y.size and not 0 <= y.min() <= y.max() < MAX_LABEL)):
            return f"array {k} is not a 1-D array of class indices"
    if len(a["truth_y"]) != len(a["truth"]):
        return f"{len(a['truth_y'])} labels for {len(a['truth'])} images"
    return None


def stored_images(folder: str | Path, trial_ids: Iterable[str],
                  on_bad: Callable[[str], None] | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """trial_id -> its reconstruction PNG's pixels (gleak.orchestration.images.reconstruction_image), drawn again
    from the arrays in FOLDER's store, for the trials that stored arrays: what `gleak plot` draws where images/
    lost a trial's PNG. Arrays that are not the trial's or are damaged: InputError naming the trial, or, with
    on_bad, that line handed to it and the trial left out."""
    from gleak.orchestration.images import reconstruction_image
    from gleak.orchestration.store import Store

    if not Store.exists(folder):
        return {}
    store = Store.open_existing(folder)
    try:
        rows = store.reconstructions(trial_ids, on_bad)
    finally:
        store.close()
    out = {}
    for trial_id, blob, _ in rows:
        try:
            a = unpack(blob, trial_id)
        except InputError as exc:
            if on_bad is None:
                raise
            on_bad(str(exc))
            continue
        out[trial_id] = reconstruction_image(a["truth"], a["rec"])
    return out


def parse_metrics(text: str | None) -> list[str]:
    """--metrics 'lpips,ssim' as a list (all of them when empty); unknown names are bad input."""
    if not text:
        return list(RESCORABLE)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if "feat_mse" in names:  # a metric of the trial's model, not of the stored arrays
        raise InputError("--metrics: feat_mse needs the model the victim computed its update at, which the store does "
                         "not keep: rerun the trials (gleak run SUITE --out NEW_FOLDER)")  # fmt: skip
    bad = [n for n in names if n not in RESCORABLE]
    if bad:
        raise InputError(f"--metrics: unknown metric(s) {', '.join(bad)} (known: {', '.join(RESCORABLE)})")
    return names


def rescore_rows(items: Iterable[tuple[str, bytes, str | None]], metrics: list[str], lpips_weights: str | None = None,
                 rule: str = "margin", search: Callable[[str], tuple[Tensor, Tensor] | None] | None = None,
                 ) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:  # fmt: skip
    """For each (trial_id, arrays, stored extra JSON): (trial_id, new column values, new extra) for `metrics`, scored
    against the stored truth (what was sent); where untransformed images are stored too, their `*_original` scores
    in extra as well (gleak.mechanics.metrics.original_scores). The verdict keeps the rule stored with the row (extra
    verdict_rule); `rule` judges rows stored without one. search(trial_id): the images and labels of the split the
    trial's victims came from, for iip (None: iip stays empty)."""
    from gleak.mechanics.metrics import ORIGINAL_METRICS, original_scores, score

    keys = {k for m in metrics for k in RESCORABLE[m]}
    out = []
    for trial_id, blob, extra_js in items:
        a = unpack(blob, trial_id)
        extra = json.loads(extra_js) if extra_js else {}
        row_rule = extra.get("verdict_rule") or rule
        pool = search(trial_id) if search is not None and "iip" in keys else None
        s = score(a["truth"], a["truth_y"], a["rec"], a["rec_y"], lpips_weights, a["blind"], row_rule, search=pool,
                  targets=a["original"], registered="rpsnr" in keys)  # fmt: skip
        flat = {**s, **s.pop("blind")}
        cols = {}
        for k in keys:
            if k in ("blind_mse", "blind_psnr", "blind_ssim", "half_mse", "share_psnr40"):
                extra[k] = flat[k]
            else:
                cols[k] = flat[k]
        if "verdict" in keys and flat["verdict"] is not None:
            extra["verdict_rule"] = row_rule  # the stored verdict's rule, as the trial records it
        if a["original"] is not None:
            again = original_scores(a["original"], a["truth_y"], a["rec"], a["rec_y"], lpips_weights, a["blind"], row_rule)
            extra.update({f"{m}_original": again[f"{m}_original"] for m in ORIGINAL_METRICS
                          if m in keys and f"{m}_original" in again})  # fmt: skip
        out.append((trial_id, cols, extra))
    return out


def victims_of(store: Any) -> Callable[[str], tuple[Tensor, Tensor] | None]:
    """trial_id -> the images and labels of the split its victims were drawn from, loaded once per data set and
    split (gleak.mechanics.modality.victims_split); None where the data set cannot be loaded here (its iip stays
    empty, the rest is rescored)."""
    from gleak.contracts.config import TrialConfig
    from gleak.mechanics.modality import modality_of, victims_split

    configs = store.configs()
    loaded: dict[str, tuple[Tensor, Tensor] | None] = {}

    def search(trial_id: str) -> tuple[Tensor, Tensor] | None:
        text = configs.get(trial_id)
        if text is None:
            return None
        c = TrialConfig.from_json(text).case
        split = victims_split(c)
        key = json.dumps([c.dataset, c.data_root, c.resolution, c.channels, split])  # what loading the split reads
        if key not in loaded:
            try:
                ds = modality_of(c).load(c, split)
                loaded[key] = (ds.x, ds.y)
            except InputError:
                loaded[key] = None
        return loaded[key]

    return search


def rescore(folder: str | Path, metrics: list[str], lpips_weights: str | None = None, then=None) -> int:
    """Recompute `metrics` of every stored reconstruction in FOLDER's store, under its lock; returns how many.
    then(): called still under the lock once the scores are stored (`gleak rescore` writes the reports there)."""
    return rescore_counts(folder, metrics, lpips_weights, then)[0]


def coverage(rows: list[tuple[str, dict[str, Any], dict[str, Any]]], metrics: list[str],
             lpips_weights: str | None = None) -> dict[str, tuple[int, str | None]]:  # fmt: skip
    """metric -> (how many of the rescored rows got a value, why the others did not, None where all did): a count
    of rows rescored says nothing when LPIPS gave none of them a value for want of its backbone weights."""
    from gleak.mechanics.perceptual import lpips_available

    out: dict[str, tuple[int, str | None]] = {}
    for m in metrics:
        key = RESCORABLE[m][0]
        got = sum((cols.get(key) if key in cols else extra.get(key)) is not None for _, cols, extra in rows)
        why = None
        if got < len(rows):
            if m == "lpips" and not lpips_available(lpips_weights):
                why = "no backbone weights: pass --lpips-backbone"
            elif m == "label_acc":
                why = "the attack recovered no labels"
            else:
                why = "undefined for those reconstructions"
        out[m] = (got, why)
    return out


def coverage_text(n: int, cov: dict[str, tuple[int, str | None]]) -> str:
    """'lpips: 0 of 24 trials (no backbone weights: pass --lpips-backbone); psnr: 24 of 24 trials'."""
    return "; ".join(f"{m}: {got} of {n} trials" + (f" ({why})" if why else "") for m, (got, why) in cov.items())


def check_stored_arrays(folder: str | Path) -> None:
    """Every stored reconstruction of FOLDER read and checked (its digest, its arrays): InputError, one line naming
    the first trial whose arrays are not its own or are damaged."""
    from gleak.orchestration.store import Store

    if not Store.exists(folder):
        raise InputError(f"{folder}: no results here (expected results.sqlite; run `gleak run` first)")
    store = Store(folder, create=False)
    try:
        if not store.has_arrays and store.named_image_ids():
            raise InputError(f"{store.arrays_path}: absent, so the reconstructions cannot be scored again (a published "
                             "folder keeps its arrays only where they are small); rerun the suite into a new folder "
                             "to score them")  # fmt: skip
        for trial_id, blob, _ in store.reconstructions():
            unpack(blob, trial_id)
    finally:
        store.close()


def rescore_counts(folder: str | Path, metrics: list[str], lpips_weights: str | None = None, then=None,
                   checked: bool = False) -> tuple[int, dict[str, tuple[int, str | None]]]:  # fmt: skip
    """`rescore`, with how many of the rescored trials got each metric and why any did not (`coverage`). checked:
    the caller ran `check_stored_arrays` already (`gleak rescore`, before it fetches weights)."""
    from gleak.orchestration.folder_lock import release_lock, take_lock
    from gleak.orchestration.store import Store

    folder = Path(folder)
    if not checked:  # before the lock is taken: damaged arrays change nothing, not even the lock's holder
        check_stored_arrays(folder)
    lock = take_lock(folder, "wait for it to finish, then rescore")
    try:
        store = Store(folder)
        try:
            rule = store.verdict_rule()
            rows = rescore_rows(store.reconstructions(), metrics, lpips_weights, rule, victims_of(store))
            store.update_scores(rows)
        finally:
            store.close()
        if then is not None:
            then()
    finally:
        release_lock(lock, tidy=True)  # a lock file it had to create (a fresh clone's folder) goes again
    return len(rows), coverage(rows, metrics, lpips_weights)
