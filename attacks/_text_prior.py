"""A language-model prior for text attacks: gleak's small causal LM (text-lm, gleak.mechanics.text.models) trained on public text.

LAMP (Balunovic, Dimitrov, Jovanović and Vechev, NeurIPS 2022) ranks candidate orderings of a reconstructed text by
their perplexity under an auxiliary language model (GPT-2 trained on WikiText-103, sharing the victim's tokenizer).
Here the auxiliary model is gleak's text-lm over the victim's vocabulary, trained as `model_state = "trained"`
trains a case's model (gleak.mechanics.pretrain.train: SGD with momentum over the whole split), on the attacker's public
data: the training split, which the victims (held-out texts) are not drawn from. Its weights are a function of the
public texts and the training settings alone; they are cached in memory and beside the pretrained models on disk.
"""
from __future__ import annotations

import hashlib
import io
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from filelock import FileLock
from torch import Tensor, nn

from gleak.mechanics.text.data import IGNORE

PRIOR_FORMAT = 1
_MEMORY: dict[str, tuple[dict[str, Tensor], float]] = {}


def _key(public_x: Tensor, vocab: int, steps: int, lr: float, dtype: torch.dtype) -> str:
    h = hashlib.sha256(f"{PRIOR_FORMAT}|{vocab}|{steps}|{lr}|{dtype}|{tuple(public_x.shape)}".encode())
    h.update(public_x.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _train(public_x: Tensor, vocab: int, steps: int, lr: float, dtype: torch.dtype) -> tuple[dict[str, Tensor], float]:
    from gleak.contracts.seeds import derive_seed
    from gleak.mechanics.models import create_model
    from gleak.mechanics.pretrain import train
    from gleak.mechanics.text.data import TextDataset

    seq_len = int(public_x.shape[1])
    y = torch.cat([public_x[:, 1:], torch.full((len(public_x), 1), IGNORE)], 1)  # next-token targets
    ds = TextDataset("public", public_x, y, (), ("",) * vocab, "")
    model = create_model("text-lm", (seq_len, vocab), vocab, seed=derive_seed(0, "lamp-prior"), dtype=dtype)
    settings = SimpleNamespace(train_seed=0, train_steps=steps, train_lr=lr, train_batch_size=32)
    info = train(model, ds, settings)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, float(info["train_loss"])


def language_prior(public_x: Tensor, vocab: int, steps: int, lr: float, dtype: torch.dtype) -> tuple[nn.Module, float]:
    """The causal LM trained `steps` SGD steps at `lr` on the public token ids (N, L), in eval mode, and its final
    training loss (mean next-token cross entropy)."""
    from gleak.mechanics.models import create_model
    from gleak.mechanics.pretrain import cache_dir

    key = _key(public_x, vocab, steps, lr, dtype)
    if key not in _MEMORY:
        folder = cache_dir() / "models"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"lamp-prior-{key}.pt"
        with FileLock(folder / f"lamp-prior-{key}.lock", thread_local=False):  # a second worker waits, then reads
            if path.is_file():
                saved = torch.load(path, map_location="cpu", weights_only=True)
                state, loss = saved["state"], float(saved["loss"])
            else:
                state, loss = _train(public_x, vocab, steps, lr, dtype)
                buf = io.BytesIO()
                torch.save({"state": state, "loss": torch.tensor(loss)}, buf)
                from gleak.mechanics.atomic_files import atomic_write_bytes

                atomic_write_bytes(path, buf.getvalue())
        _MEMORY[key] = (state, loss)
    state, loss = _MEMORY[key]
    model = create_model("text-lm", (int(public_x.shape[1]), vocab), vocab, dtype=dtype)
    model.load_state_dict(state)
    return model.eval().requires_grad_(False), loss


def perplexity(lm: nn.Module, ids: Tensor) -> Tensor:
    """Mean next-token cross entropy of token ids (B, L) under the LM (the log of its perplexity), as LAMP scores."""
    logits = lm(ids)  # (B, V, L)
    return F.cross_entropy(logits[:, :, :-1], ids[:, 1:])


def sequence_nll(lm: nn.Module, ids: Tensor) -> Tensor:
    """Each sequence's summed next-token cross entropy (B,) under the LM: `perplexity` of a batch is their sum over
    its B x (L - 1) predicted positions, so candidates differing in one sequence are scored in one batched call."""
    logits = lm(ids)  # (B, V, L)
    return F.cross_entropy(logits[:, :, :-1], ids[:, 1:], reduction="none").sum(1)

