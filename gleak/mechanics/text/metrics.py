"""Scores of a text reconstruction against the victim's token sequences.

A text reconstruction (gleak.contracts.wire.Reconstruction.x of a text case) is a float tensor (n, L, V): each position's
scores over the vocabulary; the token it reads is the argmax. Scoring rules (the leaderboard states them):

- Whole batch: every sequence of the victim's batch is scored; reconstructed rows are paired with the sequences by
  optimal assignment on ROUGE-1 F; a sequence left without a row is scored against the blind guess.
- ROUGE-1, ROUGE-2, ROUGE-L F-measures (Lin, ACL Workshop 2004; the `rouge-score` package) on the token strings,
  and token accuracy (the share of positions whose token is the truth's), each averaged over the batch; BLEU (corpus
  BLEU over the paired sequences, as sacreBLEU computes it: `bleu`).
- Token-set F1: the set of tokens of the whole reconstruction against the set of tokens of the whole batch
  (padding excluded): what the embedding gradient's non-zero rows reveal, in any order.
- Blind guess: the L most frequent tokens of the training split, most frequent first (the guess that needs no
  update). Its scores are stored beside the attack's (blind_rouge1, ...).
- Verdict: recovered when ROUGE-L >= RECOVERED_ROUGE_L (the text in its order); partial when ROUGE-1 >=
  PARTIAL_ROUGE_1 and at least PARTIAL_MARGIN above the blind guess's ROUGE-1 (the words, not their order);
  else defended (gleak.mechanics.verdicts.text_verdict, with the image rules).

>>> t = torch.tensor([[5, 6, 7, 8]]); r = torch.nn.functional.one_hot(torch.tensor([[5, 6, 8, 7]]), 10).float()
>>> s = text_scores(t, r, torch.tensor([2, 3, 4, 9]), [str(i) for i in range(10)])
>>> s["rouge1"], s["token_set_f1"], s["token_acc"], round(s["rougeL"], 3), s["verdict"]
(1.0, 1.0, 0.5, 0.75, 'partial')
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gleak.mechanics.verdicts import text_verdict

PAD_ID = 0
ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")
COMPARED = (*ROUGE_KEYS, "token_acc", "bleu", "token_set_f1")  # the scores a claim may compare attacks on (higher leaks)


class _Tokens:
    """rouge-score's tokenizer interface over our token strings: the text is already tokens joined by spaces
    (the Whitespace pre-tokenizer's tokens hold no space), so its default lower-casing and punctuation removal
    do not apply."""

    @staticmethod
    def tokenize(text: str) -> list[str]:
        return text.split()


@lru_cache(maxsize=1)
def _scorer():
    try:
        from rouge_score.rouge_scorer import RougeScorer
    except ImportError:
        raise ImportError("text scoring needs the rouge-score package: pip install 'gleak[text]'") from None
    return RougeScorer(list(ROUGE_KEYS), tokenizer=_Tokens())


def rouge(truth: list[str], guess: list[str]) -> dict[str, float]:
    """ROUGE-1, ROUGE-2, ROUGE-L F-measures of two token lists."""
    s = _scorer().score(" ".join(truth), " ".join(guess))
    return {k: float(s[k].fmeasure) for k in ROUGE_KEYS}


BLEU_ORDER = 4


def bleu(truths: list[list[str]], guesses: list[list[str]]) -> float:
    """Corpus BLEU in [0, 1] of paired token lists (Papineni et al., ACL 2002), computed as sacreBLEU computes it
    (Post, WMT 2018; `sacrebleu.corpus_bleu(guesses, [truths], tokenize="none")` / 100, which breaching reports as
    S-BLEU): clipped 1- to 4-gram precisions pooled over the pairs, their geometric mean, the brevity penalty, and
    sacreBLEU's default "exp" smoothing (an order with no match counts 1 / (2^k * total), k counting such orders;
    no unigram in common scores 0).
    Our tokens hold no space, so no further tokenisation applies."""
    from collections import Counter

    correct, total = [0] * BLEU_ORDER, [0] * BLEU_ORDER
    sys_len = ref_len = 0
    for t, g in zip(truths, guesses):
        sys_len, ref_len = sys_len + len(g), ref_len + len(t)
        for n in range(1, BLEU_ORDER + 1):
            gn = Counter(tuple(g[i : i + n]) for i in range(len(g) - n + 1))
            tn = Counter(tuple(t[i : i + n]) for i in range(len(t) - n + 1))
            correct[n - 1] += sum(min(c, tn[k]) for k, c in gn.items())
            total[n - 1] += max(0, len(g) - n + 1)
    if sys_len == 0 or correct[0] == 0:  # no word in common: 0, as sacreBLEU stops early
        return 0.0
    logs, smooth = [], 1.0
    for c, tot in zip(correct, total):
        if tot == 0:
            return 0.0  # a hypothesis too short for this order: sacreBLEU's log(0)
        if c == 0:
            smooth *= 2
            logs.append(math.log(1.0 / (smooth * tot)))
        else:
            logs.append(math.log(c / tot))
    bp = 1.0 if sys_len >= ref_len else math.exp(1 - ref_len / sys_len)
    return bp * math.exp(sum(logs) / BLEU_ORDER)


def read_tokens(rec: Tensor) -> Tensor:
    """The token ids a reconstruction (n, L, V) reads: each position's argmax."""
    return rec.argmax(-1)


def token_accuracy(truth: Tensor, guess: Tensor) -> float:
    """Share of the truth's non-padding positions where the guess has the same token."""
    keep = truth != PAD_ID
    return float((truth[keep] == guess[keep]).double().mean()) if keep.any() else 0.0


def token_set_f1(truth: Tensor, guess: Tensor) -> float:
    """F1 of the set of non-padding tokens of `guess` (any shape) against that of `truth`."""
    t = set(truth.reshape(-1).tolist()) - {PAD_ID}
    g = set(guess.reshape(-1).tolist()) - {PAD_ID}
    hit = len(t & g)
    return 0.0 if not hit else 2 * hit / (len(t) + len(g))


def _words(ids: Tensor, vocab: list[str] | tuple[str, ...]) -> list[str]:
    return [vocab[int(i)] for i in ids if int(i) != PAD_ID]


def _one(truth: Tensor, guess: Tensor, vocab: list[str] | tuple[str, ...]) -> dict[str, float]:
    out = rouge(_words(truth, vocab), _words(guess, vocab))
    out["token_acc"] = token_accuracy(truth, guess)
    return out


def text_scores(truth: Tensor, rec: Tensor | None, blind: Tensor, vocab: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Score a reconstruction (n, L, V) of the batch `truth` (B, L) token ids against the blind guess `blind` (L,)
    (module docstring). Returns rouge1, rouge2, rougeL, token_acc, bleu, token_set_f1, verdict, matched, text (the
    first sequence's reconstruction, as tokens, for the leaderboard), and blind_* (the blind guess's scores,
    blind_bleu among them); the metrics None where the attack returned no sequence (rec None)."""
    b = len(truth)
    blind_scores = [_one(t, blind, vocab) for t in truth]
    out: dict[str, Any] = {f"blind_{k}": float(np.mean([s[k] for s in blind_scores])) for k in (*ROUGE_KEYS, "token_acc")}
    out["blind_bleu"] = bleu([_words(t, vocab) for t in truth], [_words(blind, vocab)] * b)
    if rec is None:
        return {**dict.fromkeys((*ROUGE_KEYS, "token_acc", "token_set_f1", "bleu")), "verdict": None, "matched": 0, **out}
    ids = read_tokens(rec)
    rows = [*ids, *[blind] * max(0, b - len(ids))]  # the blind guess fills in for a missing row
    table = [[_one(t, r, vocab) for r in rows] for t in truth]
    from scipy.optimize import linear_sum_assignment  # imported where used (0.35 s)

    ti, ri = linear_sum_assignment(-np.array([[s["rouge1"] for s in row] for row in table]))
    picked = [table[i][j] for i, j in zip(ti, ri)]
    for k in (*ROUGE_KEYS, "token_acc"):
        out[k] = float(np.mean([s[k] for s in picked]))
    out["bleu"] = bleu([_words(truth[i], vocab) for i in ti], [_words(rows[j], vocab) for j in ri])
    out["token_set_f1"] = token_set_f1(truth, ids)
    out["matched"] = int((ri < len(ids)).sum())
    out["verdict"] = text_verdict(out["rouge1"], out["rougeL"], out["blind_rouge1"])
    first = int(ri[list(ti).index(0)])
    out["text"] = " ".join(vocab[int(i)] for i in rows[first] if int(i) != PAD_ID)
    return out
