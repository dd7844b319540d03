"""LAMP: extracting text from gradients with language-model priors (Balunovic, Dimitrov, Jovanović and Vechev,
NeurIPS 2022).

The attacker holds the model, the client's gradient and public text. The dummy text lives in embedding space: one
free vector per position (B, L, D), fed to the model in place of its token embeddings (gleak.mechanics.text.models'
`forward_embeddings`). Two steps alternate, as in the paper's Algorithm 1 and its authors' code:

- continuous: Adam on the embeddings, minimising the gradient loss plus `coeff_reg` times the embedding-norm
  regulariser (the mean norm of the dummy embeddings minus the mean norm of the model's token embeddings, squared:
  it keeps the dummy where real tokens live). The gradient loss is the cosine distance (`loss = "cos"`, the
  paper's LAMP_cos: 1 - cos per parameter tensor, averaged) or the squared L2 plus `tag_factor` times the L1
  distance (`loss = "l2-l1"`, LAMP_L1+L2, TAG's distance). The token embedding's own gradient is not matched (the
  dummy does not pass through it), as in the authors' code.
- discrete, every `swap_every` steps after the first `swap_burnin` share of them: for each sequence of the batch,
  `swap_candidates` transformations of its positions (the identity, then in turn: swap two tokens, move a token,
  move a span, move a prefix to the end), each scored by the gradient loss of the permuted embeddings plus
  `coeff_perplexity` times the perplexity (mean next-token cross entropy) of its nearest tokens under the language
  model prior; the best replaces the current embeddings.

The initialisation is the best of `init_candidates` Gaussian draws by gradient loss, then the best of as many
random orderings of it, each position rescaled to the mean token-embedding norm. The steps keep the embeddings of
the smallest loss; each position's token is read at the end as the nearest token embedding by cosine among the
searched tokens: every token but padding (`vocabulary = "full"`, the authors' scripts), or the token set read from
the embedding gradient (`vocabulary = "token-set"`, attacks/token_set.py; the authors' `--use_embedding`, which
their Table 1 scripts do not pass); where the token set comes back empty (DGP zeroes every row) the search falls
back to every token, flagged `token_set_fallback` in the row's extra.

The language-model prior is gleak's small causal LM (text-lm) trained on the attacker's public text, the training
split (attacks/_text_prior.py; the paper's is GPT-2 on WikiText-103 with BERT's tokenizer).

Defaults are the authors' repository's LAMP_cos settings (lamp_cos.sh and args_factory.py: Adam at lr 0.01, the
rate decayed by `lr_decay` 0.89 every 50 steps, 2000 steps, regulariser weight 1, perplexity weight 0.2, 500
initial candidates, swaps every 75 steps after 10% burn-in, 200 candidates per sequence, the whole vocabulary).
Deviations, each named:

- Re-tuned for gleak's small classifier (an option, not the default): `lr` 0.05 (BERT's token embeddings have norm
  about 1.4, the text suite's trained classifier's 7.0, so a step of the same relative size is larger) and
  `coeff_perplexity` 0.01 (the classifier matches its gradient to a cosine distance of about 0.005, so 0.2 times
  the prior's perplexity differences outweighs the gradient loss and the discrete step reorders by the weak prior
  alone). Measured at batch 1, 16 tokens, seeds 0-2, 200 steps: mean ROUGE-L 0.73 at 0.2, 0.92 at 0, 0.94 at 0.01.
  The text suite runs both, so that a defense is credited only against the stronger.
- For LAMP_L1+L2 the paper's weights are perplexity 60, regulariser 25, `tag_factor` 0.01; set them with the loss.
- `prior_steps` 1000 and `prior_lr` 0.05: the LM prior's training (the paper's prior is a pretrained model).
- The classifier's labels are read from the sign of the head's bias gradient (attacks/idlg.py's "bias-sign", exact
  at batch size 1; the authors' code is given the true labels). A language model as victim is not attacked (the
  paper attacks classifiers): not applicable.
- The victims' texts carry no padding and no special tokens (gleak.mechanics.text.data), so every position is free (the
  authors keep [CLS], [SEP] and known padding fixed).
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

TRANSFORMS = ("swap", "move-token", "move-span", "prefix-to-end")


def gradient_loss(grads: tuple[Tensor | None, ...], target: list[Tensor], loss: str, tag_factor: float) -> Tensor:
    """LAMP's reconstruction loss over the parameters the dummy reaches (None: the token embedding). cos: the mean
    of 1 - cos(g, t), leaving out tensors the defense zeroed (no direction to match); l2-l1: sum ||g - t||^2 +
    tag_factor ||g - t||_1."""
    terms = []
    for g, t in zip(grads, target):
        if g is None:
            continue
        if loss == "cos":
            tn = t.norm()
            if tn == 0:
                continue
            terms.append(1.0 - (g * t).sum() / (g.norm() * tn + 1e-12))
        else:
            terms.append((g - t).pow(2).sum() + tag_factor * (g - t).abs().sum())
    if not terms:
        raise UnsupportedCase("the update has no non-zero tensor the dummy text's gradient reaches")
    total = torch.stack(terms)
    return total.mean() if loss == "cos" else total.sum()


def _randint(lo: int, hi: int, rng: torch.Generator) -> int:
    """Uniform in [lo, hi)."""
    return lo + int(torch.randint(hi - lo, (1,), generator=rng))


def transform(n: int, kind: str, rng: torch.Generator) -> Tensor:
    """A random permutation of n positions of one of LAMP's kinds (the authors' swap_tokens, positions 0..n-1)."""
    p = torch.arange(n)
    if kind == "swap":  # two tokens trade places
        i, j = _randint(0, n, rng), _randint(0, n, rng)
        p[i], p[j] = p[j].clone(), p[i].clone()
        return p
    if kind == "move-token":  # one token moves to another place
        i, j = _randint(0, n, rng), _randint(0, n + 1, rng)
        if i < j:
            return torch.cat([p[:i], p[i + 1 : j], p[i : i + 1], p[j:]])
        return torch.cat([p[:j], p[i : i + 1], p[j:i], p[i + 1 :]])
    if kind == "move-span":  # a span [b, e) moves before position q (outside it)
        b, e = sorted((_randint(0, n + 1, rng), _randint(0, n + 1, rng)))
        q = _randint(0, n + 1 - (e - b), rng)
        if q >= b:
            q += e - b
        if q < b:
            return torch.cat([p[:q], p[b:e], p[q:b], p[e:]])
        return torch.cat([p[:b], p[e:q], p[b:e], p[q:]])
    k = _randint(0, n, rng)  # prefix-to-end: a prefix moves behind the rest
    return torch.cat([p[k:], p[:k]])


def candidate_losses(summed_grads, x: Tensor, labels: Tensor, s: int, rows: Tensor, target: list[Tensor], loss: str,
                     tag_factor: float) -> list[float]:  # fmt: skip
    """The gradient loss of the batch x (B, L, D) with its sequence s replaced by each of rows (C, L, D), without
    recomputing the other sequences' gradients for every candidate: the batch's loss is the mean of its sequences'
    and these models mix no information across sequences, so the batch gradient is the other sequences' summed
    gradient (computed once) plus the candidate's own, over B. summed_grads(x, y): the gradient of the summed loss."""
    batch = x.shape[0]
    rest = [j for j in range(batch) if j != s]
    base = summed_grads(x[rest], labels[rest]) if rest else (None,) * len(target)
    out = []
    for row in rows:
        own = summed_grads(row[None], labels[s : s + 1])
        both = tuple(None if g is None else (g if b is None else b + g) / batch for b, g in zip(base, own))
        out.append(float(gradient_loss(both, target, loss, tag_factor)))
    return out


def nearest_tokens(x: Tensor, emb: Tensor, cand: Tensor) -> Tensor:
    """Each position's token (B, L): the candidate whose embedding row has the largest cosine with x (B, L, D)."""
    rows = F.normalize(emb[cand], dim=-1)
    return cand[(F.normalize(x, dim=-1) @ rows.T).argmax(-1)]


@register_attack("lamp")
class LAMP(Attack):
    """LAMP (Balunovic et al., NeurIPS 2022): embedding-space gradient matching alternating with reorderings ranked by a language-model prior."""

    needs = frozenset({"architecture", "parameters", "batch_size", "public_data"})
    modality: ClassVar[str] = "text"  # gleak check-plugin tries it on the text cases
    conformance_params: ClassVar[dict] = {"steps": 4, "init_candidates": 2, "swap_every": 2, "swap_candidates": 3,
                                          "prior_steps": 2}  # fmt: skip

    def __init__(self, steps: int = 2000, lr: float = 0.01, lr_decay: float = 0.89, loss: Literal["cos", "l2-l1"] = "cos",
                 tag_factor: float = 0.01, coeff_reg: float = 1.0, coeff_perplexity: float = 0.2,
                 init_candidates: int = 500, swap_every: int = 75, swap_burnin: float = 0.1,
                 swap_candidates: int = 200, prior_steps: int = 1000, prior_lr: float = 0.05,
                 vocabulary: Literal["token-set", "full"] = "full"):  # fmt: skip
        check_choice("loss", loss, ("cos", "l2-l1"))
        check_choice("vocabulary", vocabulary, ("token-set", "full"))
        if min(steps, init_candidates, swap_every, swap_candidates, prior_steps) < 1:
            raise ValueError("steps, init_candidates, swap_every, swap_candidates and prior_steps must be >= 1")
        if not (lr > 0 and 0 < lr_decay <= 1 and prior_lr > 0):
            raise ValueError(f"lr and prior_lr must be > 0 and lr_decay in (0, 1], got {lr}, {prior_lr}, {lr_decay}")
        if min(tag_factor, coeff_reg, coeff_perplexity) < 0 or not 0 <= swap_burnin <= 1:
            raise ValueError("tag_factor, coeff_reg and coeff_perplexity must be >= 0 and swap_burnin in [0, 1]")
        self.steps, self.lr, self.lr_decay, self.loss, self.tag_factor = steps, lr, lr_decay, loss, tag_factor
        self.coeff_reg, self.coeff_perplexity = coeff_reg, coeff_perplexity
        self.init_candidates, self.swap_every, self.swap_burnin = init_candidates, swap_every, swap_burnin
        self.swap_candidates, self.prior_steps, self.prior_lr, self.vocabulary = swap_candidates, prior_steps, prior_lr, vocabulary

    @classmethod
    def estimated_cost(cls, params, case) -> float:
        return float(params.get("steps", 2000)) / 150.0  # about a TAG restart of 300 iterations per 450 steps

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        from gleak.attacks._gradmatch import attack_model, fixed_labels, observed_gradient
        from gleak.attacks._text_prior import language_prior, perplexity, sequence_nll
        from gleak.attacks.token_set import search_vocabulary, token_embedding

        k = observation.knowledge
        if len(k.input_shape) != 2:
            raise UnsupportedCase("LAMP attacks a text model (the case is not text)")
        if k.public_x is None or k.public_x.dtype.is_floating_point:
            raise UnsupportedCase("LAMP's language-model prior needs public text (token ids)")
        model, names, params = attack_model(observation)
        if not hasattr(model, "forward_embeddings"):
            raise UnsupportedCase("LAMP feeds token embeddings: the model has no forward_embeddings")
        seq_len, vocab = k.input_shape
        batch = int(k.batch_size or 1)
        dtype = params[0].dtype
        target, info = observed_gradient(observation.update, names, dtype)
        target_list = [target[n] for n in names]
        emb = dict(model.named_parameters())[token_embedding(model, vocab)].detach()
        fallback = False
        if self.vocabulary == "token-set":  # an empty set (DGP zeroes every row) falls back to the whole vocabulary
            cand, fallback = search_vocabulary(observation.update, model, vocab)
        else:
            cand = torch.arange(1, vocab)
        cand = cand.to(emb.device)
        with torch.no_grad():
            if model(torch.zeros(1, seq_len, dtype=torch.long, device=emb.device) + 1).dim() == 3:
                raise UnsupportedCase("LAMP attacks a classifier (a language model's labels are its own next tokens)")
        labels = fixed_labels("bias-sign", target, model, k, batch, rng).to(emb.device)
        model.eval()
        lm, prior_loss = language_prior(k.public_x.cpu(), vocab, self.prior_steps, self.prior_lr, dtype)
        lm = lm.to(emb.device)
        init_size = float(emb[1:].norm(dim=-1).mean())  # the mean norm of a real token's embedding (padding's is 0)

        def summed_grads(x: Tensor, y: Tensor, create_graph: bool = False) -> tuple[Tensor | None, ...]:
            """The gradient of the summed (not mean) loss of x's sequences: per sequence, they add up."""
            out = model.forward_embeddings(x)
            return torch.autograd.grad(F.cross_entropy(out, y, reduction="sum"), params, create_graph=create_graph, allow_unused=True)

        def rec_loss(x: Tensor, create_graph: bool = False) -> Tensor:
            grads = summed_grads(x, labels, create_graph)
            return gradient_loss(tuple(None if g is None else g / batch for g in grads), target_list, self.loss, self.tag_factor)

        def swap_losses(x: Tensor, s: int, rows: Tensor) -> list[float]:
            return candidate_losses(summed_grads, x, labels, s, rows, target_list, self.loss, self.tag_factor)

        x = self._initial(rec_loss, (batch, seq_len, emb.shape[1]), init_size, rng, dtype).to(emb.device)
        x.requires_grad_(True)
        opt = torch.optim.Adam([x], lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=self.lr_decay)
        best_x, best_loss, accepted = x.detach().clone(), float("inf"), 0
        for it in range(self.steps):
            opt.zero_grad()
            total = rec_loss(x, create_graph=True) + self.coeff_reg * (x.norm(dim=-1).mean() - init_size).square()
            total.backward(inputs=[x])
            if float(total.detach()) <= best_loss:  # the embeddings this loss was computed at
                best_loss, best_x = float(total.detach()), x.detach().clone()
            opt.step()
            sched.step()
            if it >= self.swap_burnin * self.steps and it % self.swap_every == 1:
                accepted += self._discrete_step(x, swap_losses, lambda ids: sequence_nll(lm, ids), emb, cand, rng)
        ids = nearest_tokens(best_x, emb, cand)
        with torch.no_grad():
            final_ppl = float(perplexity(lm, ids))
        out = F.one_hot(ids, vocab).to(dtype)
        return Reconstruction(x=out, extra={"match_loss": best_loss, "candidates": len(cand), "steps_run": self.steps,
                                            "token_set_fallback": fallback, "swaps_accepted": accepted,
                                            "prior_train_loss": prior_loss, "perplexity": final_ppl, **info})  # fmt: skip

    def _initial(self, rec_loss, shape: tuple[int, int, int], init_size: float, rng: torch.Generator, dtype) -> Tensor:
        """The best of init_candidates Gaussian draws by gradient loss, then of as many orderings of its positions,
        each position rescaled to init_size (the authors' init.py, random initialisation)."""
        best, best_loss = None, float("inf")
        for _ in range(self.init_candidates):
            x = torch.randn(shape, generator=rng, dtype=dtype)
            loss = float(rec_loss(x))
            if loss < best_loss:
                best, best_loss = x, loss
        for _ in range(self.init_candidates):
            x = best[:, torch.randperm(shape[1], generator=rng)]
            loss = float(rec_loss(x))
            if loss < best_loss:
                best, best_loss = x, loss
        return best / best.norm(dim=-1, keepdim=True) * init_size

    def _discrete_step(self, x: Tensor, swap_losses, nll, emb: Tensor, cand: Tensor, rng: torch.Generator) -> int:
        """LAMP's discrete step on each sequence in turn (the authors' swap_tokens): the best of the identity and
        swap_candidates - 1 transformations by gradient loss + coeff_perplexity x perplexity replaces it (the
        perplexity of the whole batch, its other sequences as they stand). swap_losses(x, s, rows): the gradient
        loss of each candidate sequence s (candidate_losses); nll(ids): each sequence's summed next-token cross
        entropy under the prior (_text_prior.sequence_nll). Returns how many sequences changed."""
        changed = 0
        n, length = x.shape[:2]
        with torch.no_grad():
            ids = nearest_tokens(x, emb, cand)
        for s in range(n):
            perms = [torch.arange(length) if c == 0 else transform(length, TRANSFORMS[c % 4], rng) for c in range(self.swap_candidates)]
            rows, row_ids = x.detach()[s][torch.stack(perms)], ids[s][torch.stack(perms)]  # (C, L, D), (C, L)
            with torch.no_grad():
                rest = [j for j in range(n) if j != s]
                rest_nll = float(nll(ids[rest]).sum()) if rest else 0.0
                ppl = (nll(row_ids) + rest_nll) / (n * (length - 1))
            totals = [loss + self.coeff_perplexity * float(p) for loss, p in zip(swap_losses(x.detach(), s, rows), ppl)]
            best_at = min(range(len(totals)), key=totals.__getitem__)  # the first of equal totals, as before
            with torch.no_grad():
                x[s].copy_(rows[best_at])
            ids = ids.clone()
            ids[s] = row_ids[best_at]
            changed += best_at != 0
        return changed
