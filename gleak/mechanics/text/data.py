"""Text data sets, encoded: token-id sequences of the texts of gleak.contracts.vocabulary's corpora.

A sample is the first `seq_len` tokens of one text that has at least that many, so that the victims' batches carry
no padding (every position is private text); the text models mask padding (id 0) where a caller pads. Labels are
the text's class (its topic), or for a language model (`targets = "next"`) the next token at each position, -100
at the last (F.cross_entropy's ignore_index), so that every loss in gleak stays cross entropy of model(x) and y.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import Tensor

from gleak.contracts.errors import InputError
from gleak.contracts.vocabulary import (
    DEFAULT_SEQ_LEN,
    DEFAULT_VOCAB_SIZE,
    FORTUNE_TOPICS,
    PAD_ID,
    corpus,
    is_held_out,
    tokenizer,
    vocab_digest,
)

IGNORE = -100  # F.cross_entropy's ignore_index: a language model's target where there is no next token


@dataclass(frozen=True)
class TextDataset:
    """Token-id sequences (N, L) with class labels; `vocab[i]` is token i's string."""

    name: str
    x: Tensor  # (N, L) long token ids
    y: Tensor  # (N,) long class indices, or (N, L) next-token targets
    classes: tuple[str, ...]
    vocab: tuple[str, ...]
    vocab_sha256: str
    # No per-channel statistics: token ids are not normalised. One-element tensors keep the client's bind_data
    # and the gate's data_stats well defined.
    mean: Tensor = field(default_factory=lambda: torch.zeros(1))
    std: Tensor = field(default_factory=lambda: torch.ones(1))
    modality: str = "text"

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.x.shape[1])

    @property
    def input_shape(self) -> tuple[int, int]:
        """(sequence length, vocabulary size): each sample is L tokens out of V (the models read both)."""
        return (self.seq_len, len(self.vocab))

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def normalized(self, idx: Tensor | slice | None = None) -> Tensor:
        """The model's input: token ids (nothing to normalise)."""
        return self.x if idx is None else self.x[idx]

    def model_input(self, idx: Tensor | slice | None, dtype: torch.dtype) -> Tensor:
        """Token ids, whatever the case's float dtype (ids index the embedding)."""
        return self.normalized(idx)

    def tokens(self, ids: Tensor) -> list[list[str]]:
        """Each row of ids as its token strings, padding dropped."""
        return [[self.vocab[int(i)] for i in row if int(i) != PAD_ID] for row in ids.reshape(-1, ids.shape[-1])]


@lru_cache(maxsize=16)
def _split(name: str, root: str | None, vocab_size: int, seq_len: int, split: str):
    items, vocab = corpus(name, root, vocab_size)
    tok = tokenizer(vocab)
    xs, ys = [], []
    for label, i, text in items:
        if is_held_out(i) != (split == "test"):
            continue
        ids = tok.encode(text).ids
        if len(ids) >= seq_len:
            xs.append(ids[:seq_len])
            ys.append(label)
    if not xs:
        raise InputError(f"dataset {name!r}: no {split} text has {seq_len} tokens")
    return torch.tensor(xs, dtype=torch.long), torch.tensor(ys, dtype=torch.long), vocab


def load_text_dataset(name: str, split: str = "train", *, root: str | None = None, seq_len: int = DEFAULT_SEQ_LEN,
                      vocab_size: int = DEFAULT_VOCAB_SIZE, targets: str = "class") -> TextDataset:  # fmt: skip
    """A split of a text data set: its texts of at least seq_len tokens, cut to seq_len; cached per process.
    targets: "class" (the topic) or "next" (a language model's next-token targets)."""
    if targets not in ("class", "next"):
        raise InputError(f"targets must be 'class' or 'next', got {targets!r}")
    if split not in ("train", "test"):
        raise InputError(f"split must be 'train' or 'test', got {split!r}")
    if seq_len < 2:
        raise InputError(f"seq_len must be >= 2, got {seq_len}")
    x, y, vocab = _split(name, root, vocab_size, seq_len, split)
    if targets == "next":
        y = torch.cat([x[:, 1:], torch.full((len(x), 1), IGNORE)], 1)
    return TextDataset(name, x.clone(), y.clone(), FORTUNE_TOPICS, vocab, vocab_digest(vocab))


def frequent_tokens(ds: TextDataset, n: int) -> Tensor:
    """The blind guess of a text: the n most frequent non-padding tokens of the data set's texts (ties: lower id),
    most frequent first."""
    counts = torch.bincount(ds.x.reshape(-1), minlength=len(ds.vocab)).double()
    counts[PAD_ID] = -1
    order = sorted(range(len(counts)), key=lambda i: (-float(counts[i]), i))
    return torch.tensor(order[:n], dtype=torch.long)
