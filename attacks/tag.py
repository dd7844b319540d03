"""TAG: gradient attack on transformer-based language models (Deng, Wang, Li, Shang, Wang, Ding, Jiang and Zhang,
Findings of EMNLP 2021).

The attacker holds the model and the client's gradient. It optimises a dummy text, relaxed: at each position a
softmax over the vocabulary, whose embedding is the softmax's mix of the embedding rows (gleak.mechanics.text.models takes
such an input), so that the gradient of the model on the dummy can be matched to the observed one by gradient
descent. TAG's distance is the squared L2 distance plus alpha times the L1 distance, summed over the parameters
(the L1 term weighs the many small entries the squared distance ignores); the tokens are read at the end by the
nearest embedding row to each position's mixed embedding.

The search covers the whole vocabulary but padding, as the paper does (`vocabulary = "full"`, the default). Beside
the paper:
- `vocabulary = "token-set"` (an option) searches only the tokens whose embedding-gradient row is non-zero
  (attacks/token_set.py), the restriction LAMP (Balunovic et al., NeurIPS 2022) offers as `--use_embedding`. It
  hands TAG the batch's bag of words for free (the token-set read-out alone scores that much), so it is not TAG as
  published. Where the token set comes back empty (a defense such as DGP zeroes every row of the embedding's
  gradient) the search falls back to the whole vocabulary, and the row's extra says so (`token_set_fallback`), so
  the trial is scored rather than not applicable.
- The classifier's labels are read from the sign of the head's bias gradient (attacks/idlg.py's "bias-sign",
  exact at batch size 1) rather than optimised; a language model's labels are its next tokens, so its dummy loss
  takes the relaxed next tokens as soft targets.
The best of `restarts` runs (the smallest final distance) is returned.
"""
from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, check_choice
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import Observation, Reconstruction


def tag_distance(grads: tuple[Tensor, ...], target: list[Tensor], alpha: float) -> Tensor:
    """sum over parameters of ||g - t||^2 + alpha ||g - t||_1 (TAG's objective)."""
    return torch.stack([(g - t).pow(2).sum() + alpha * (g - t).abs().sum() for g, t in zip(grads, target)]).sum()


def soft_next_token_loss(logits: Tensor, relaxed: Tensor) -> Tensor:
    """A language model's loss on a relaxed text: cross entropy of each position's logits (B, V, L) against the
    next position's distribution (soft targets), averaged over the B x (L - 1) positions that have one (equal to
    gleak's loss on token ids when the text is one-hot)."""
    logp = torch.log_softmax(logits[:, :, :-1], dim=1)
    return -(relaxed[:, 1:, :].transpose(1, 2) * logp).sum(1).mean()


@register_attack("tag")
class TAG(Attack):
    """TAG (Deng et al., Findings of EMNLP 2021): L2 + alpha L1 gradient matching over softmax-relaxed tokens, read by nearest embedding."""

    needs = frozenset({"architecture", "parameters", "batch_size"})
    modality: ClassVar[str] = "text"  # gleak check-plugin tries it on the text cases
    conformance_params: ClassVar[dict] = {"iterations": 5, "restarts": 1}

    def __init__(self, iterations: int = 300, lr: float = 0.1, alpha: float = 0.01, restarts: int = 2,
                 vocabulary: Literal["token-set", "full"] = "full"):  # fmt: skip
        if iterations < 1 or restarts < 1:
            raise ValueError(f"iterations and restarts must be >= 1, got {iterations}, {restarts}")
        if not lr > 0 or alpha < 0:
            raise ValueError(f"lr must be > 0 and alpha >= 0, got {lr}, {alpha}")
        check_choice("vocabulary", vocabulary, ("token-set", "full"))
        self.iterations, self.lr, self.alpha, self.restarts, self.vocabulary = iterations, lr, alpha, restarts, vocabulary

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        from gleak.attacks._gradmatch import attack_model, fixed_labels, observed_gradient
        from gleak.attacks.token_set import search_vocabulary, token_embedding

        k = observation.knowledge
        if len(k.input_shape) != 2:
            raise UnsupportedCase("TAG attacks a text model (the case is not text)")
        model, names, params = attack_model(observation)
        seq_len, vocab = k.input_shape
        batch = int(k.batch_size or 1)
        dtype = params[0].dtype
        target, info = observed_gradient(observation.update, names, dtype)
        target_list = [target[n] for n in names]
        emb = dict(model.named_parameters())[token_embedding(model, vocab)]
        fallback = False
        if self.vocabulary == "token-set":  # an empty set (DGP zeroes every row) falls back to the whole vocabulary
            cand, fallback = search_vocabulary(observation.update, model, vocab)
        else:
            cand = torch.arange(1, vocab)  # every token but padding
        cand = cand.to(emb.device)
        with torch.no_grad():
            probe = model(torch.zeros(1, seq_len, vocab, dtype=dtype, device=emb.device))
        language_model = probe.dim() == 3
        labels = None if language_model else fixed_labels("bias-sign", target, model, k, batch, rng).to(emb.device)
        model.eval()  # no dropout or batch statistics in these models; the client's mode would not change the maths

        def relax(z: Tensor) -> Tensor:  # the candidates' softmax placed in their columns of the (B, L, V) input
            return torch.zeros(*z.shape[:-1], vocab, dtype=dtype, device=z.device).index_copy(-1, cand, torch.softmax(z, -1))

        def loss_of(relaxed: Tensor) -> Tensor:
            logits = model(relaxed)
            return soft_next_token_loss(logits, relaxed) if language_model else F.cross_entropy(logits, labels)

        best, best_loss, steps = None, float("inf"), 0
        for _ in range(self.restarts):
            z = torch.randn(batch, seq_len, len(cand), generator=rng, dtype=dtype).to(emb.device).requires_grad_(True)
            opt = torch.optim.Adam([z], lr=self.lr)
            for _ in range(self.iterations):
                opt.zero_grad()
                relaxed = relax(z)
                grads = torch.autograd.grad(loss_of(relaxed), params, create_graph=True)
                d = tag_distance(grads, target_list, self.alpha)
                d.backward(inputs=[z])
                opt.step()
                steps += 1
            with torch.no_grad():
                relaxed = relax(z)
            grads = torch.autograd.grad(loss_of(relaxed), params)
            final = float(tag_distance(grads, target_list, self.alpha))
            if final < best_loss:
                best, best_loss = relaxed.detach(), final
        with torch.no_grad():  # each position's token: the candidate whose embedding is nearest to its mixed embedding
            mixed = best @ emb  # (B, L, D)
            rows = emb[cand]  # (K, D)
            nearest = cand[torch.cdist(mixed.reshape(-1, mixed.shape[-1]), rows).argmin(-1)].view(batch, seq_len)
        x = F.one_hot(nearest, vocab).to(dtype)
        return Reconstruction(x=x, extra={"match_loss": best_loss, "candidates": len(cand), "steps_run": steps,
                                              "token_set_fallback": fallback, **info})
