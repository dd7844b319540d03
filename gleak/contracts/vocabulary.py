"""The text corpora and their tokenizer vocabularies: what a text trial's id is computed from (gleak.contracts.config).

  fortunes   Debian's `fortunes` package (fortune-mod's data files, installed under /usr/share/games/fortunes):
             real quotations in topic files; four topic files are the classes (FORTUNE_TOPICS). apt-get install -y
             fortunes.

The split is fixed per quotation: every fifth quotation of each topic file (index % 5 == 2, as the image sets) is
held out. The tokenizer (the `tokenizers` package: a WordLevel model behind NFKC + lower-case normalisation and
the Whitespace pre-tokenizer) is rebuilt deterministically from the training split: [PAD] (id 0), [UNK] (id 1),
then the `vocab_size - 2` most frequent words, ties broken by the word. Its vocabulary's sha256 is part of a text
trial's id, so a release of the data package (or of `tokenizers`) that changes the vocabulary makes new trials.

This module sits with the contracts because the trial id depends on it; the encoded data sets are gleak.mechanics.text.data.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

from gleak.contracts.errors import DatasetMissing, InputError

FORTUNES_DIR = Path("/usr/share/games/fortunes")
# Topic files of Debian's `fortunes` with the most prose (not ASCII art), several hundred quotations each.
FORTUNE_TOPICS = ("computers", "politics", "science", "work")
PAD, UNK = "[PAD]", "[UNK]"
PAD_ID, UNK_ID = 0, 1
DEFAULT_SEQ_LEN = 16
DEFAULT_VOCAB_SIZE = 4000  # about 8% of the training split's words are then [UNK]
TEXT_DATASETS = {"fortunes": "Debian fortunes: quotations of 4 topic files (computers, politics, science, work), "
                             "the topic as label (apt-get install -y fortunes)"}  # fmt: skip


def is_text_dataset(name: str) -> bool:
    return name in TEXT_DATASETS


MAX_TOPIC_BYTES = 64 << 20  # Debian's topic files are a few hundred KB each


def _fortune_text(path: Path) -> str:
    """A topic file's text; InputError in one line where the path is not a regular file (a folder, a device), is
    larger than any fortune file, or is not text (undecodable bytes, no quotation separator)."""
    if not path.is_file():
        raise InputError(f"dataset 'fortunes': {path} is not a regular file")
    if path.stat().st_size > MAX_TOPIC_BYTES:
        raise InputError(f"dataset 'fortunes': {path} is {path.stat().st_size:,} bytes, larger than any fortune file")
    raw = path.read_text(encoding="utf-8", errors="replace")
    bad = raw.count("\ufffd") + sum(1 for c in raw if ord(c) < 32 and c not in "\n\t\r")
    if raw and bad > 0.01 * len(raw):
        raise InputError(f"dataset 'fortunes': {path} is not text ({bad / len(raw):.0%} undecodable or control bytes)")
    if raw.strip() and "\n%\n" not in raw and not raw.strip().endswith("%"):
        raise InputError(f"dataset 'fortunes': {path} holds no quotation separator (a line '%'): not a fortune file")
    return raw


def read_fortunes(root: Path | None = None) -> list[tuple[int, int, str]]:
    """(topic index, index in its file, text) of every quotation of the FORTUNE_TOPICS files, whitespace collapsed."""
    folder = root or FORTUNES_DIR
    out = []
    for label, topic in enumerate(FORTUNE_TOPICS):
        path = folder / topic
        if not path.exists():
            raise DatasetMissing(f"dataset 'fortunes': {path} not found (apt-get install -y fortunes, or set data_root "
                                 f"to a folder holding the fortune files {', '.join(FORTUNE_TOPICS)})")  # fmt: skip
        raw = _fortune_text(path)
        for i, chunk in enumerate(raw.split("\n%\n")):
            text = re.sub(r"\s+", " ", chunk.replace("%", " ")).strip()
            if text:
                out.append((label, i, text))
    return out


def is_held_out(index: int) -> bool:
    """The split, per quotation: every fifth of each topic file is held out."""
    return index % 5 == 2


def tokenizer(vocab: tuple[str, ...]):
    """The `tokenizers` Tokenizer of a vocabulary (id = position)."""
    try:
        from tokenizers import Tokenizer, normalizers, pre_tokenizers
        from tokenizers.models import WordLevel
    except ImportError:
        raise DatasetMissing("text data sets need the tokenizers package: pip install 'gleak[text]'") from None
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def build_vocab(texts: list[str], vocab_size: int) -> tuple[str, ...]:
    """[PAD], [UNK], then the vocab_size - 2 most frequent words of `texts` (ties: by the word): deterministic."""
    if vocab_size < 3:
        raise InputError(f"vocab_size must be >= 3, got {vocab_size}")
    tok = tokenizer((PAD, UNK))
    words = (w for t in texts for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(t)))
    counts = Counter(words)
    return (PAD, UNK, *sorted(counts, key=lambda w: (-counts[w], w))[: vocab_size - 2])


def vocab_digest(vocab: tuple[str, ...]) -> str:
    return hashlib.sha256(json.dumps(list(vocab)).encode()).hexdigest()


@lru_cache(maxsize=8)
def corpus(name: str, root: str | None, vocab_size: int) -> tuple[list[tuple[int, int, str]], tuple[str, ...]]:
    """The data set's texts (label, index, text) and the vocabulary built from its training split."""
    if name != "fortunes":
        raise InputError(f"unknown text dataset {name!r} (known: {', '.join(TEXT_DATASETS)})")
    items = read_fortunes(Path(root) if root else None)
    return items, build_vocab([t for _, i, t in items if not is_held_out(i)], vocab_size)


def text_vocab_digest(name: str, root: str | None = None, vocab_size: int | None = None) -> str:
    """sha256 of a text data set's vocabulary ('' where the data is missing: the suite's checks report that)."""
    try:
        return vocab_digest(corpus(name, root, vocab_size or DEFAULT_VOCAB_SIZE)[1])
    except (DatasetMissing, InputError):
        return ""
