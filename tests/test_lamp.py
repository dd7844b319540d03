"""LAMP (Balunovic et al., NeurIPS 2022): its pieces (the transformations, the discrete step's use of the
language-model prior, the gradient loss) and the whole attack through a trial on the trained text classifier."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("rouge_score")

from gleak.contracts.config import CaseConfig, TrialConfig  # noqa: E402
from gleak.contracts.vocabulary import FORTUNE_TOPICS, FORTUNES_DIR  # noqa: E402

needs_fortunes = pytest.mark.skipif(not all((FORTUNES_DIR / t).is_file() for t in FORTUNE_TOPICS),
                                    reason="Debian's fortunes is not installed (apt-get install -y fortunes)")  # fmt: skip

# A small budget: 200 steps, 3 discrete steps (after the 10% burn-in, every 60), a prior trained 100 steps (its
# training is most of a cold test's time; with 100 or 300 steps seeds 0-2 give the same mean ROUGE-1 gain over the
# blind guess, 0.60 cos and 0.65 l2-l1).
# gleak's re-tuning for its small classifier (attacks/lamp.py) at a small budget: the machinery, not the defaults
SMALL = {"steps": 200, "init_candidates": 20, "swap_candidates": 40, "swap_every": 60, "prior_steps": 100,
         "lr": 0.05, "coeff_perplexity": 0.01, "vocabulary": "token-set"}
TRAINED = {"model_state": "trained", "train_steps": 500, "train_lr": 0.05}  # the text suite's classifier


def _trial(params, seed, defense="none", **case):
    from gleak.orchestration.trial import run_trial

    c = CaseConfig(**{"dataset": "fortunes", "model": "text-classifier", "seq_len": 16, **TRAINED, **case})
    row = run_trial(TrialConfig("text", "lamp", params, defense, {}, c, seed))
    assert row["status"] == "ok", row.get("traceback") or row.get("error")
    return json.loads(row["extra"])


@pytest.mark.parametrize("kind", ["swap", "move-token", "move-span", "prefix-to-end"])
def test_every_transformation_is_a_permutation_and_moves_something(kind):
    from gleak.attacks.lamp import transform

    rng = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 16):
        perms = [transform(n, kind, rng) for _ in range(50)]
        assert all(sorted(p.tolist()) == list(range(n)) for p in perms), (kind, n)
        if n >= 5:
            assert any(p.tolist() != list(range(n)) for p in perms), (kind, n)


def test_the_discrete_step_reorders_by_the_language_model_prior():
    """With a gradient loss that cannot tell orders apart, the discrete step moves each sequence towards the order
    the prior scores best (here: a 'perplexity' counting descents, lowest for the sorted order)."""
    from gleak.attacks.lamp import LAMP

    vocab, n = 12, 8
    emb = torch.eye(vocab, dtype=torch.float64)[:, 1:] * 3.0  # row v is a distinct direction (padding row 0: zero)
    cand = torch.arange(1, vocab)
    attack = LAMP(swap_candidates=60, coeff_perplexity=1.0)
    rng = torch.Generator().manual_seed(0)
    descents = lambda _lm, ids: (ids[:, 1:] < ids[:, :-1]).sum().double()  # noqa: E731
    row_descents = lambda ids: (ids[:, 1:] < ids[:, :-1]).sum(1).double()  # noqa: E731 - per sequence, as sequence_nll
    start = torch.tensor([[5, 3, 8, 1, 7, 2, 6, 4], [9, 8, 7, 6, 5, 4, 3, 2]])
    x = emb[start].clone()
    before = float(descents(None, start))
    for _ in range(4):
        attack._discrete_step(x, lambda _x, _s, rows: [0.0] * len(rows), row_descents, emb, cand, rng)
    after_ids = cand[(x @ emb[cand].T).argmax(-1)]
    assert sorted(after_ids[0].tolist()) == sorted(start[0].tolist())  # only reordered
    assert float(descents(None, after_ids)) <= before - 6, (start, after_ids)


@pytest.mark.parametrize("loss", ["cos", "l2-l1"])
def test_a_candidate_sequence_is_scored_as_the_whole_batch_with_it_in_place(loss):
    """candidate_losses adds the other sequences' gradient, computed once, to each candidate's own: it must equal
    the gradient loss of the whole batch's mean gradient with the candidate in place (mutations caught: the other
    sequences left out, the sum not divided by the batch size)."""
    import torch.nn.functional as F

    from gleak.attacks._text_prior import sequence_nll
    from gleak.attacks.lamp import candidate_losses, gradient_loss
    from gleak.mechanics.text.models import text_classifier, text_lm

    torch.manual_seed(0)
    model = text_classifier((6, 20), 3).double().eval()
    params = [p for p in model.parameters()]
    labels = torch.tensor([0, 2, 1])
    x = torch.randn(3, 6, 64, dtype=torch.float64)
    target = [torch.randn_like(p) for p in params]

    def summed(xx, yy):
        return torch.autograd.grad(F.cross_entropy(model.forward_embeddings(xx), yy, reduction="sum"), params, allow_unused=True)

    rows = torch.randn(4, 6, 64, dtype=torch.float64)
    for s in range(3):
        got = candidate_losses(summed, x, labels, s, rows, target, loss, 0.01)
        for row, value in zip(rows, got):
            whole = x.clone()
            whole[s] = row
            mean = torch.autograd.grad(F.cross_entropy(model.forward_embeddings(whole), labels), params, allow_unused=True)
            assert value == pytest.approx(float(gradient_loss(mean, target, loss, 0.01)), rel=1e-9)
    lm = text_lm((6, 20), 20).double().eval()
    ids = torch.randint(1, 20, (3, 6))
    with torch.no_grad():
        logits = lm(ids)
        batch_ppl = float(F.cross_entropy(logits[:, :, :-1], ids[:, 1:]))
        assert float(sequence_nll(lm, ids).sum()) / (3 * 5) == pytest.approx(batch_ppl, rel=1e-12)


def test_the_gradient_loss_is_zero_at_the_target_and_skips_what_the_dummy_does_not_reach():
    from gleak.attacks.lamp import gradient_loss

    t = [torch.randn(3, 4), torch.randn(5), torch.zeros(2)]
    g = (t[0].clone(), t[1].clone(), torch.ones(2))
    assert float(gradient_loss(g, t, "cos", 0.0)) == pytest.approx(0.0, abs=1e-6)  # the zeroed tensor is left out
    assert float(gradient_loss((None, -t[1], None), t, "cos", 0.0)) == pytest.approx(2.0)
    assert float(gradient_loss((t[0] + 1, None, None), t, "l2-l1", 0.5)) == pytest.approx(12 + 0.5 * 12)


@needs_fortunes
@pytest.mark.parametrize("loss", ["cos", "l2-l1"])
def test_lamp_recovers_a_short_sentence_at_batch_1_on_the_trained_classifier_over_seeds(loss):
    runs = [_trial({**SMALL, "loss": loss}, seed) for seed in range(3)]
    recovered = sum(e["rouge1"] >= 0.75 for e in runs)
    assert recovered >= 2, [(e["rouge1"], e["text_reconstruction"]) for e in runs]
    assert statistics.mean(e["rouge1"] - e["blind_rouge1"] for e in runs) >= 0.35, runs
    assert all(e["token_set_fallback"] is False and e["candidates"] <= 16 for e in runs)


@needs_fortunes
def test_lamp_through_dgp_searches_the_whole_vocabulary_and_is_scored():
    e = _trial({**SMALL, "steps": 5, "init_candidates": 2, "swap_candidates": 3}, 0, defense="dgp")
    assert e["token_set_fallback"] is True and e["candidates"] == 3999, e
