"""The output folder is gleak's: a manifest of the files gleak wrote there, and the rules that follow from it.

- A folder is gleak's when it holds `gleak-manifest.json` (written at the first run, updated by every run and every
  `gleak leaderboard` / `gleak plot`), or, for folders written before manifests existed, a results.sqlite that
  gleak's store recognises (its files at gleak's names are then adopted into a new manifest).
- `gleak run --out DIR` at a folder that is not empty and not gleak's is refused with one line; `--force` accepts it,
  and gleak then writes its files beside the user's. Even then a user's file at a path gleak writes (results.csv,
  utility.csv, ...) is refused, never overwritten.
- gleak deletes only files its manifest lists (a stale figure, utility.csv), and cleans temporary files only where
  they are its own (`.NAME.gleak-tmp-XXXXXXXX` beside a NAME it writes).
- Every file-system problem with the folder (a file in the way, read-only, a name too long or with NUL, a full disk)
  is one line (InputError) before anything is written.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable

from gleak.contracts.errors import InputError
from gleak.mechanics.atomic_files import refuse_link  # noqa: F401 - public here too: the folder's writers call it

MANIFEST = "gleak-manifest.json"
FORMAT = 1
# Files at the folder's top level that gleak writes or may write (the store's side files included).
# The store's side files, and its arrays file with its own (a reader opening an older store writes it, unlisted
# until a run lists it): gleak's wherever the store is.
STORE_SIDE = (
    "results.sqlite-wal", "results.sqlite-shm", "results.sqlite-journal", "reconstructions.sqlite",
    "reconstructions.sqlite-wal", "reconstructions.sqlite-shm", "reconstructions.sqlite-journal",
)  # fmt: skip
TOP_FILES = (
    "results.sqlite", *STORE_SIDE, ".lock", MANIFEST,
    "results.csv", "utility.csv", "leaderboard.md", "leaderboard.html", "leaderboard.csv", "leaderboard_by_case.csv",
    "leaderboard.tex", "suite.json",
)  # fmt: skip
REPORT_FILES = ("results.csv", "utility.csv", "leaderboard.md", "leaderboard.html", "leaderboard.csv",
                "leaderboard_by_case.csv", "leaderboard.tex", "suite.json")
# Written by gleak before its manifests listed them: in a folder that was gleak's already, not a user's file.
LISTED_LATER = ("suite.json",)
# Files below: images/<trial id>.png, figures/<one of gleak's prefixes>*.png.
_IMAGE = re.compile(r"^[0-9a-f]{8,64}\.png$")
FIGURE_PREFIXES = ("reconstructions_", "strength_", "frontier", "utility_curves", "setting_")
# files.atomic_write_bytes: tempfile.mkstemp(prefix=".NAME.gleak-tmp-") -> the prefix and 8 of [a-z0-9_].
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.gleak-tmp-[a-z0-9_]{8}$")
MIN_FREE_BYTES = 16 << 20  # a run needs room for its store and reports; less is a full disk


def is_gleak_name(rel: str) -> bool:
    """Whether `rel` (relative to the folder, '/'-separated) is a path at which gleak writes."""
    parts = rel.split("/")
    if len(parts) == 1:
        return parts[0] in TOP_FILES
    if len(parts) == 2 and parts[0] == "images":
        return bool(_IMAGE.match(parts[1]))
    if len(parts) == 2 and parts[0] == "figures":
        return parts[1].endswith(".png") and parts[1].startswith(FIGURE_PREFIXES)
    return False


def _os_problem(path: Path, exc: OSError) -> InputError:
    why = {errno.ENAMETOOLONG: "a name in the path is too long for the file system", errno.EROFS: "read-only file system",
           errno.EACCES: "permission denied", errno.ENOSPC: "no space left on the device",
           errno.ENOTDIR: "a part of the path is a file, not a folder"}.get(exc.errno, exc.strerror or str(exc))  # fmt: skip
    return InputError(f"{path}: cannot use as the output folder: {why}")


def check_not_a_link(folder: Path) -> None:
    """InputError when the output folder itself is a symbolic link: everything gleak writes there (the store first)
    would land wherever the link points, outside the folder the user named."""
    if folder.is_symlink():
        raise InputError(f"{folder}: the output folder is a symbolic link (to {os.readlink(folder)}); gleak writes "
                         "only into a real folder: name the folder it points to, or another --out; nothing written")  # fmt: skip


def check_path(folder: Path) -> None:
    """The folder can be created and written: not a file, not under a file, writable, a valid name, room left."""
    text = str(folder)
    if "\0" in text:
        raise InputError(f"{text!r}: the output folder's name contains a NUL character")
    check_not_a_link(folder)
    try:
        if folder.exists() and not folder.is_dir():
            raise InputError(f"{folder}: the output folder is a file (or a device), not a folder")
        probe = folder
        while not probe.exists():  # the first ancestor that exists must be a writable folder
            if probe.parent == probe:
                break
            probe = probe.parent
        if not probe.is_dir():
            raise InputError(f"{folder}: cannot create the output folder: {probe} is a file, not a folder")
        for part in folder.parts:
            if len(os.fsencode(part)) > 255:
                raise InputError(f"{folder}: cannot use as the output folder: a name in the path is too long for the file system")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise InputError(f"{folder}: cannot write the output folder: {probe} is read-only for this user")
        if shutil.disk_usage(probe).free < MIN_FREE_BYTES:
            raise InputError(f"{folder}: the disk is full (under {MIN_FREE_BYTES >> 20} MiB free at {probe})")
    except OSError as exc:
        raise _os_problem(folder, exc) from None


def user_files(folder: Path) -> list[str]:
    """Every file in the folder, relative and '/'-separated (the folder must exist)."""
    out = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        out += [str((rel / f).as_posix()) if str(rel) != "." else f for f in files]
    return sorted(out)


class Manifest:
    """The files gleak wrote in one output folder (paths relative to it)."""

    def __init__(self, folder: str | Path, files: Iterable[str] = (), others: Iterable[str] = ()):
        self.folder = Path(folder)
        self.files = set(files)
        # Files that were there when gleak was let in (--force): never cleaned up, whatever their names look like.
        self.others = set(others) - self.files

    @classmethod
    def load(cls, folder: str | Path) -> "Manifest | None":
        """The folder's manifest, None when it has none; InputError when it is not one gleak can read."""
        path = Path(folder) / MANIFEST
        if not path.is_file():
            return None
        try:
            doc = json.loads(path.read_bytes())
            assert isinstance(doc, dict) and isinstance(doc.get("files"), list)
            fmt = int(doc.get("format", 0))
        except (OSError, ValueError, AssertionError, TypeError):
            raise InputError(f"{path}: damaged (not gleak's manifest of the folder's files); move it away or use another --out") from None
        if fmt > FORMAT:
            raise InputError(f"{path}: written by a newer gleak (manifest format {fmt}, this gleak reads {FORMAT}); upgrade gleak")
        others = doc.get("others", [])
        return cls(folder, (f for f in doc["files"] if isinstance(f, str) and is_gleak_name(f)),
                   (f for f in others if isinstance(f, str)) if isinstance(others, list) else ())  # fmt: skip

    def owns(self, path: str | Path) -> bool:
        rel = _rel(self.folder, path)
        return rel is not None and rel in self.files

    def add(self, paths: Iterable[str | Path]) -> None:
        for p in paths:
            rel = _rel(self.folder, p)
            if rel is not None and is_gleak_name(rel):
                self.files.add(rel)

    def save(self) -> None:
        from gleak.mechanics.atomic_files import atomic_write_bytes

        self.files.add(MANIFEST)
        # Listed before they are written (a kill in between must not make gleak's next run take them for a user's).
        doc = {"format": FORMAT, "about": "the files gleak wrote in this folder: it deletes or overwrites only these",
               "files": sorted(self.files)}  # fmt: skip
        if self.others:
            doc["others"] = sorted(self.others)
        atomic_write_bytes(self.folder / MANIFEST, (json.dumps(doc, indent=1) + "\n").encode())


def _rel(folder: Path, path: str | Path) -> str | None:
    """`path` (a path in `folder`: the folder joined with a name, as the caller has it) as the name the manifest
    lists; None for a path outside the folder. Whole path components are compared, never text: with --out r,
    results.sqlite is not r/esults.sqlite."""
    folder, p = Path(folder), Path(path)
    if p.is_absolute() != folder.is_absolute():
        folder, p = folder.absolute(), p.absolute()
    try:
        rel = p.relative_to(folder).as_posix()
    except ValueError:
        return None
    return None if rel in (".", "..") or rel.startswith("../") or "/../" in rel else rel


def adopt(folder: Path) -> Manifest:
    """A manifest for a folder gleak wrote before manifests existed (its store is gleak's): gleak's files by name."""
    return Manifest(folder, [f for f in user_files(folder) if is_gleak_name(f)])


def claim(folder: str | Path, force: bool = False, check_store=None) -> Manifest:
    """Decide, reading only, whether a run may write `folder`; return its manifest (not yet saved).

    check_store(folder) -> bool says whether the folder's results.sqlite is gleak's (raising InputError when it is
    damaged, foreign or newer). Raises InputError, having changed nothing, when the folder is not gleak's and not
    empty (unless `force`), or a user's file sits at a path that gleak writes."""
    folder = Path(folder)
    check_path(folder)
    if not folder.exists():
        return Manifest(folder)
    check_no_links(folder)
    for sub in ("images", "figures"):  # gleak's folders: a file in their place would fail each trial after its work
        if (folder / sub).exists() and not (folder / sub).is_dir():
            raise InputError(f"{folder / sub}: a file where gleak writes its {sub}/ folder; move it away or use another --out")
    if not force and not (folder / MANIFEST).exists() and not (folder / "results.sqlite").exists():
        foreign = _foreign_entry(folder)  # `--out /` or a home folder: refused without walking it
        if foreign is not None:
            raise InputError(f"{folder}: not a gleak output folder (no {MANIFEST}) and not empty ({foreign} is not "
                             f"gleak's); use a new or empty folder, or --force to add gleak's files beside them")  # fmt: skip
    try:  # the lock file is gleak's wherever it is (a run creates it before its second look)
        files = [f for f in user_files(folder) if f != ".lock"]
    except OSError as exc:
        raise _os_problem(folder, exc) from None
    manifest = Manifest.load(folder)
    has_store = "results.sqlite" in files
    gleaks = has_store and check_store is not None and check_store(folder)
    if manifest is None and gleaks:
        manifest = adopt(folder)
    ours_before = manifest is not None  # then images/ and figures/ are gleak's own folders (a kill can leave a file
    # there that the manifest does not list yet); at the top level only listed files are gleak's
    # Only gleak's temporary files (a run killed while creating its store): gleak's own remnants, an empty folder.
    remnants_only = all(_is_partial(f) for f in files)
    if manifest is None and remnants_only:
        manifest = Manifest(folder)
    if manifest is None:
        if files and not force:
            raise InputError(
                f"{folder}: not a gleak output folder (no {MANIFEST}) and not empty ({len(files)} files); "
                f"use a new or empty folder, or --force to add gleak's files beside them"
            )
        manifest = Manifest(folder, others=files)
    if has_store and not gleaks and "results.sqlite" not in manifest.files:
        raise InputError(f"{folder / 'results.sqlite'}: not written by gleak; move it away or use another --out")
    ours = set(manifest.files) | (set(STORE_SIDE) if "results.sqlite" in manifest.files or gleaks else set())
    clash = [f for f in files if is_gleak_name(f) and f not in ours and not (ours_before and ("/" in f or f in LISTED_LATER))]
    if clash:
        more = f" and {len(clash) - 1} more" if len(clash) > 1 else ""
        raise InputError(f"{folder / clash[0]}{more}: a file gleak did not write, at a path gleak writes; move it away or use another --out")
    return manifest


def _foreign_entry(folder: Path) -> str | None:
    """The first entry of a folder without a manifest or store that is not one of gleak's remnants (its lock, its
    temporary files), reading its top level only (and images/ and figures/, gleak's own names); None if none."""
    try:
        with os.scandir(folder) as it:
            for e in it:
                if e.name in ("images", "figures") and e.is_dir(follow_symlinks=False):
                    rest = [f for f in user_files(Path(e.path)) if not _is_partial(f"{e.name}/{f}")]
                    if rest:
                        return f"{e.name}/{rest[0]}"
                elif e.name != ".lock" and not _is_partial(e.name):
                    return e.name
    except OSError as exc:
        raise _os_problem(folder, exc) from None
    return None


def check_no_links(folder: Path) -> None:
    """InputError when a path gleak writes in `folder` (images/, figures/, a top-level file) is a symbolic link: a
    write or a delete there would land wherever the link points, outside the folder."""
    for name in ("images", "figures", *TOP_FILES):
        p = folder / name
        if p.is_symlink():
            raise InputError(f"{p}: a symbolic link, where gleak writes its own files; replace it by a folder or file, "
                             "or use another --out")  # fmt: skip


def _is_partial(rel: str) -> bool:
    head, _, name = rel.rpartition("/")
    m = _PARTIAL.match(name)
    return bool(m) and head in ("", "images", "figures") and is_gleak_name(f"{head}/{m['name']}".lstrip("/"))


def owns(folder: str | Path, path: str | Path) -> bool:
    """Whether gleak wrote `path` in `folder` (its manifest says so). The report deletes only such files."""
    try:
        m = Manifest.load(folder)
    except InputError:
        return False
    return m is not None and m.owns(path)


def remove_owned(folder: str | Path, path: str | Path) -> bool:
    """Delete `path` if gleak wrote it (per the manifest); a user's file is left alone. Returns whether deleted."""
    rel = _rel(Path(folder), path)
    if rel is not None and owns(folder, path):
        target = Path(folder) / rel
        refuse_link(target)
        target.unlink(missing_ok=True)
        return True
    return False


def clean_partial_files(folder: str | Path) -> list[Path]:
    """Delete the temporary files a killed writer of gleak's left (`.NAME.gleak-tmp-XXXXXXXX` beside NAME, where NAME
    is a path gleak writes), in the folder, images/ and figures/ only. Call only while holding the folder's lock."""
    folder = Path(folder)
    try:
        keep = (Manifest.load(folder) or Manifest(folder)).others
    except InputError:
        return []
    removed = []
    for sub in ("", "images", "figures"):
        d = folder / sub if sub else folder
        if not d.is_dir() or d.is_symlink():
            continue
        for p in d.iterdir():
            m = _PARTIAL.match(p.name)
            rel = f"{sub}/{p.name}".lstrip("/")
            if m and rel not in keep and p.is_file() and not p.is_symlink() and is_gleak_name(f"{sub}/{m['name']}".lstrip("/")):
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def record(folder: str | Path, written: Iterable[str | Path]) -> None:
    """Add `written` (paths in `folder`) to the folder's manifest and save it (dropping files no longer there)."""
    m = Manifest.load(folder) or Manifest(folder)
    m.add(written)
    m.save()


def claim_results(folder: str | Path, check_store) -> Manifest:
    """The manifest of a folder that holds results gleak can read (its store, or a published folder's results.csv
    and suite.json, each checked: gleak.orchestration.stored_values) and whose report paths hold no user's file; InputError otherwise,
    having changed nothing. What `leaderboard`, `plot` and `rescore` check before they write."""
    from gleak.orchestration.stored_values import (
        check_committed,  # (check_store is passed in: the store module imports this one)
    )

    folder = Path(folder)
    check_not_a_link(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: no such folder")
    if not check_store(folder):
        if not (folder / "results.csv").is_file():
            raise InputError(f"{folder}: no results here (expected results.sqlite or results.csv; run `gleak run` first)")
        check_committed(folder)  # a published folder rebuilds from its csv
    return claim(folder, False, check_store)  # gleak's folder, no user file where a report goes

