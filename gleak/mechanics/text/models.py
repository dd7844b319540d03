"""Small transformers for the text modality: an encoder classifier and a causal language model.

A text data set's input shape is (L, V): L token positions over a vocabulary of V (gleak.mechanics.text.data). Both models take
either token ids (B, L) (what a client trains on) or a relaxed input (B, L, V), a distribution over the vocabulary
at each position (what an optimisation attack such as TAG feeds): the token embedding is then the distribution's
mix of embedding rows, so the same weights compute both. Token id 0 is padding: its embedding row is zero and
fixed (padding_idx) and padded positions are masked out of attention and pooling.

The attention is written out with plain tensor operations (no fused kernel), so that per-example gradients
(DP-SGD's vmap) and double backpropagation (gradient matching) work through it.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gleak.contracts.registry import register_model

PAD_ID = 0


class Block(nn.Module):
    """A pre-norm transformer block: multi-head self-attention and a GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"embedding {dim} must be a multiple of heads {heads}")
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, h: Tensor, allowed: Tensor) -> Tensor:
        """allowed: (B, 1, L, L) bool, True where a query position may attend to a key position."""
        b, n, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~allowed, -1e9).softmax(-1)
        h = h + self.out((att @ v).transpose(1, 2).reshape(b, n, d))
        return h + self.mlp(self.norm2(h))


class TextTransformer(nn.Module):
    """Token and learned positional embeddings, `layers` blocks, a final LayerNorm; `causal` masks the future."""

    def __init__(self, seq_len: int, vocab: int, dim: int, layers: int, heads: int, causal: bool):
        super().__init__()
        self.seq_len, self.vocab, self.causal = seq_len, vocab, causal
        self.tok = nn.Embedding(vocab, dim, padding_idx=PAD_ID)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, 4 * dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def embed(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(embeddings (B, L, D), keep mask (B, L): False at padding) of ids (B, L) or a relaxed input (B, L, V)."""
        if x.dtype.is_floating_point:
            e = x @ self.tok.weight  # a mix of embedding rows; padding mass mixes in the zero row
            keep = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        else:
            e = self.tok(x)
            keep = x != PAD_ID
        n = e.shape[1]
        return e + self.pos.weight[:n].unsqueeze(0), keep

    def hidden(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.encode(*self.embed(x))

    def forward_embeddings(self, e: Tensor) -> Tensor:
        """The model's output on token embeddings (B, L, D) given directly, no padding: what LAMP optimises
        (Balunovic et al., NeurIPS 2022: the dummy text lives in embedding space, projected to tokens at the end)."""
        keep = torch.ones(e.shape[:2], dtype=torch.bool, device=e.device)
        return self.readout(*self.encode(e + self.pos.weight[: e.shape[1]].unsqueeze(0), keep))

    def readout(self, h: Tensor, keep: Tensor) -> Tensor:
        raise NotImplementedError

    def encode(self, h: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """The blocks and the final norm on positioned embeddings h (B, L, D); keep (B, L): False at padding."""
        n = h.shape[1]
        allowed = keep[:, None, None, :]
        if self.causal:
            allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=h.device).tril()
        allowed = allowed | torch.eye(n, dtype=torch.bool, device=h.device)  # a padded query attends to itself
        for blk in self.blocks:
            h = blk(h, allowed)
        return self.norm(h), keep


class TextClassifier(TextTransformer):
    """The encoder classifier: mean of the non-padding positions' outputs, then a linear layer to the classes."""

    def __init__(self, seq_len: int, vocab: int, num_classes: int, dim: int, layers: int, heads: int):
        super().__init__(seq_len, vocab, dim, layers, heads, causal=False)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.readout(*self.hidden(x))

    def readout(self, h: Tensor, keep: Tensor) -> Tensor:
        w = keep.to(h.dtype).unsqueeze(-1)
        return self.head((h * w).sum(1) / w.sum(1).clamp_min(1.0))


class CausalLM(TextTransformer):
    """The causal language model: logits (B, V, L) of the next token at each position, in the layout
    F.cross_entropy takes with targets (B, L) (gleak.mechanics.text.data: a language-model case's labels are the next tokens,
    -100 where there is none)."""

    def __init__(self, seq_len: int, vocab: int, dim: int, layers: int, heads: int):
        super().__init__(seq_len, vocab, dim, layers, heads, causal=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.readout(*self.hidden(x))

    def readout(self, h: Tensor, keep: Tensor) -> Tensor:
        return self.head(h).transpose(1, 2)


def _text_shape(input_shape: tuple[int, ...], name: str) -> tuple[int, int]:
    if len(input_shape) != 2:
        raise ValueError(f"model {name!r} needs a text data set (input shape (seq_len, vocab)), got {tuple(input_shape)}")
    return int(input_shape[0]), int(input_shape[1])


@register_model("text-classifier")
def text_classifier(input_shape: tuple[int, ...], num_classes: int, dim: int = 64, layers: int = 2, heads: int = 4) -> nn.Module:
    """Transformer encoder classifier on token ids: learned token and positional embeddings, pre-norm blocks, mean pooling."""
    seq_len, vocab = _text_shape(input_shape, "text-classifier")
    return TextClassifier(seq_len, vocab, num_classes, dim, layers, heads)


@register_model("text-lm")
def text_lm(input_shape: tuple[int, ...], num_classes: int, dim: int = 64, layers: int = 2, heads: int = 4) -> nn.Module:
    """Causal transformer language model on token ids (next-token logits; num_classes is ignored: it predicts the vocabulary)."""
    seq_len, vocab = _text_shape(input_shape, "text-lm")
    return CausalLM(seq_len, vocab, dim, layers, heads)
