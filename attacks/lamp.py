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
searched tokens: the token set read from the embedding gradient (attacks/token_set.py; the paper's
`--use_embedding`), or, where it comes back empty (DGP zeroes every row), every token but padding, flagged
`token_set_fallback` in the row's extra.

The language-model prior is gleak's small causal LM (text-lm) trained on the attacker's public text, the training
split (attacks/_text_prior.py; the paper's is GPT-2 on WikiText-103 with BERT's tokenizer).

Defaults are the paper's LAMP_cos settings (lamp_cos.sh and args_factory.py of the authors' code: Adam, the learning
rate decayed by `lr_decay` 0.89 every 50 steps, regulariser weight 1, swaps every 75 steps after 10% burn-in,
200 candidates per sequence), except where named here:

- `steps` 500 (paper 2000) and `init_candidates` 100 (paper 500), `swap_candidates` 100 (paper 200): budgets
  scaled to two CPU cores.
- `lr` 0.05 (paper 0.01 for BERT, whose token embeddings have norm about 1.4; the text suite's trained classifier's
  have norm 7.0, so a step of the same relative size is larger).
- `vocabulary = "full"` searches every token but padding (the authors' code without `--use_embedding`).
- `coeff_perplexity` 0.01 (paper 0.2): gleak's small classifier matches its gradient to a cosine distance of about
  0.005, so 0.2 times the prior's perplexity differences outweighs the gradient loss and the discrete step
  reorders by the (weak) prior alone. Measured at batch 1, 16 tokens, seeds 0-2, 200 steps: mean ROUGE-L 0.73 at
  0.2, 0.92 at 0 (no reordering accepted), 0.94 at 0.01.
- For LAMP_L1+L2 the paper's weights are perplexity 60, regulariser 25, `tag_factor` 0.01; set them with the loss.
- `prior_steps` 1000 and `prior_lr` 0.05: the LM prior's training (the paper's prior is a pretrained model).
- The classifier's labels are read from the sign of the head's bias gradient (attacks/idlg.py's "bias-sign", exact
  at batch size 1; the authors' code is given the true labels). A language model as victim is not attacked
  (the paper attacks classifiers): not applicable.
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

    def __init__(self, steps: int = 500, lr: float = 0.05, lr_decay: float = 0.89, loss: Literal["cos", "l2-l1"] = "cos",
                 tag_factor: float = 0.01, coeff_reg: float = 1.0, coeff_perplexity: float = 0.01,
                 init_candidates: int = 100, swap_every: int = 75, swap_burnin: float = 0.1,
                 swap_candidates: int = 100, prior_steps: int = 1000, prior_lr: float = 0.05,
                 vocabulary: Literal["token-set", "full"] = "token-set"):  # fmt: skip
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
        return float(params.get("steps", 500)) / 150.0  # about a TAG restart of 300 iterations per 450 steps

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        from gleak.attacks._gradmatch import attack_model, fixed_labels, observed_gradient
        from gleak.attacks._text_prior import language_prior, perplexity
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

        def rec_loss(x: Tensor, create_graph: bool = False) -> Tensor:
            out = model.forward_embeddings(x)
            grads = torch.autograd.grad(F.cross_entropy(out, labels), params, create_graph=create_graph, allow_unused=True)
            return gradient_loss(grads, target_list, self.loss, self.tag_factor)

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
                accepted += self._discrete_step(x, rec_loss, lm, perplexity, emb, cand, rng)
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

    def _discrete_step(self, x: Tensor, rec_loss, lm, perplexity, emb: Tensor, cand: Tensor, rng: torch.Generator) -> int:
        """LAMP's discrete step on each sequence in turn (the authors' swap_tokens): the best of the identity and
        swap_candidates - 1 transformations by gradient loss + coeff_perplexity x perplexity replaces it. Returns
        how many sequences changed."""
        changed = 0
        with torch.no_grad():
            ids = nearest_tokens(x, emb, cand)
        for s in range(x.shape[0]):
            best, best_total, best_at = None, float("inf"), 0
            for c in range(self.swap_candidates):
                perm = torch.arange(x.shape[1]) if c == 0 else transform(x.shape[1], TRANSFORMS[c % 4], rng)
                new_x, new_ids = x.detach().clone(), ids.clone()
                new_x[s], new_ids[s] = x.detach()[s, perm], ids[s, perm]
                with torch.no_grad():
                    ppl = float(perplexity(lm, new_ids))
                total = float(rec_loss(new_x)) + self.coeff_perplexity * ppl
                if total < best_total:
                    best, best_total, best_at = (new_x, new_ids), total, c
            with torch.no_grad():
                x.copy_(best[0])
            ids = best[1]
            changed += best_at != 0
        return changed
