"""The token set from the embedding gradient: which tokens a client's text holds, read off its update.

A token embedding is a lookup: the gradient of the loss with respect to row v of the embedding matrix is the sum,
over the positions holding token v, of the gradient at that position's embedding, and exactly zero for every token
the batch does not hold. The non-zero rows of the embedding's gradient are therefore the batch's token set (without
order or counts): the text analogue of iDLG's label read-out (Zhao, Mopuri and Bilen, arXiv 2020). It is the first
step of the text attacks since (Deng et al., TAG, Findings of EMNLP 2021; Balunovic et al., LAMP, NeurIPS 2022;
Fowl et al., Decepticons, ICLR 2023), and what they restrict their search to.

The tokens are ranked by their row's norm and laid out one per position (the batch's L positions per row, as many
rows as the set needs, at most the batch's); a reconstruction row is one-hot scores over the vocabulary. Under a
defense that fills every row (noise, DP-SGD), the ranking keeps the rows of largest norm, which is what an attacker
without a threshold would do; `threshold` (a share of the largest row norm) drops the rows below it.
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Observation, Reconstruction, Update
from gleak.mechanics.text.models import PAD_ID


def token_embedding(model: nn.Module, vocab: int) -> str:
    """The qualified name of the model's token-embedding weight: its first nn.Embedding with `vocab` rows."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.num_embeddings == vocab:
            return f"{name}.weight" if name else "weight"
    raise UnsupportedCase(f"the model has no token embedding of {vocab} rows (a text model is needed)")


def row_norms(update: Update, model: nn.Module, vocab: int) -> Tensor:
    """The norm of each row of the token embedding's gradient (or FedAvg delta: its rows are zero alike)."""
    name = token_embedding(model, vocab)
    if name not in update.tensors:
        raise UnsupportedCase(f"the update has no tensor for {name}")
    return update.tensors[name].detach().double().norm(dim=1).cpu()


def ranked_tokens(norms: Tensor, most: int, threshold: float = 0.0) -> Tensor:
    """Token ids whose row norm exceeds threshold x the largest (and is non-zero), largest first, at most `most`
    (ties: lower id)."""
    top = float(norms.max()) if len(norms) else 0.0
    keep = (norms > 0) & (norms > threshold * top)
    ids = torch.nonzero(keep).reshape(-1)
    order = sorted(ids.tolist(), key=lambda i: (-float(norms[i]), i))
    return torch.tensor(order[:most], dtype=torch.long)


def search_vocabulary(update: Update, model: nn.Module, vocab: int) -> tuple[Tensor, bool]:
    """The tokens an optimisation attack searches (TAG, LAMP): the token set, padding left out, and whether it fell
    back to the whole vocabulary (every token but padding) because the set came back empty: a defense that prunes
    or zeroes the embedding's gradient (DGP, Top-k on its rows) leaves no row to read, yet the attack can still
    search blind, as the papers' attacks do without the token set."""
    cand = ranked_tokens(row_norms(update, model, vocab), vocab)
    cand = cand[cand != PAD_ID]  # padding is never private text (a noised padding row is noise alone)
    return (cand, False) if len(cand) else (torch.arange(1, vocab), True)


def layout(tokens: Tensor, seq_len: int, vocab: int, rows: int) -> Tensor:
    """tokens one per position, row after row ((rows, seq_len) ids, padding id 0 after them), as one-hot scores."""
    ids = torch.zeros(rows * seq_len, dtype=torch.long)
    ids[: len(tokens)] = tokens
    return torch.nn.functional.one_hot(ids.view(rows, seq_len), vocab).double()


@register_attack("token-set")
class TokenSet(Attack):
    """The batch's token set from the non-zero rows of the token embedding's gradient (an iDLG analogue for text; TAG, Deng et al. 2021)."""

    needs = frozenset({"architecture", "batch_size"})
    modality: ClassVar[str] = "text"  # gleak check-plugin tries it on the text cases

    def __init__(self, threshold: float = 0.0):
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"threshold must be in [0, 1), got {threshold}")
        self.threshold = threshold

    @classmethod
    def estimated_cost(cls, params, case) -> float:
        return 1.0

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        k = observation.knowledge
        if len(k.input_shape) != 2:
            raise UnsupportedCase("the token set is read from a text model's embedding (the case is not text)")
        if observation.model is None:
            raise UnsupportedCase("the token set needs the model's architecture")
        seq_len, vocab = k.input_shape
        batch = int(k.batch_size or observation.update.num_samples or 1)
        norms = row_norms(observation.update, observation.model, vocab)
        tokens = ranked_tokens(norms, batch * seq_len, self.threshold)
        rows = max(1, math.ceil(len(tokens) / seq_len))
        x = layout(tokens, seq_len, vocab, rows).to(next(observation.model.parameters()).dtype)
        return Reconstruction(x=x, extra={"tokens_found": len(tokens), "nonzero_rows": int((norms > 0).sum())})
