"""The text modality: Debian's fortunes tokenised by a vocabulary of the training split, the text models, the
token-set and TAG attacks through the whole trial, text scoring, and the suite's checks of a text case."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("rouge_score")

from gleak.contracts.config import CaseConfig, TrialConfig  # noqa: E402
from gleak.contracts.vocabulary import FORTUNE_TOPICS, FORTUNES_DIR  # noqa: E402

pytestmark = pytest.mark.skipif(not all((FORTUNES_DIR / t).is_file() for t in FORTUNE_TOPICS),
                                reason="Debian's fortunes is not installed (apt-get install -y fortunes)")  # fmt: skip


def _trial(attack, params=None, defense="none", dparams=None, seed=0, **case):
    from gleak.orchestration.trial import run_trial

    c = CaseConfig(**{"dataset": "fortunes", "model": "text-classifier", "seq_len": 16, **case})
    row = run_trial(TrialConfig("text", attack, params or {}, defense, dparams or {}, c, seed))
    assert row["status"] == "ok", row.get("traceback") or row.get("error")
    return row, json.loads(row["extra"])


def test_the_vocabulary_and_split_are_deterministic_and_built_from_the_training_split_only():
    from gleak.contracts import vocabulary as v
    from gleak.mechanics.text.data import load_text_dataset

    items, vocab = v.corpus("fortunes", None, 500)
    v.corpus.cache_clear()
    items2, vocab2 = v.corpus("fortunes", None, 500)
    assert vocab == vocab2 and items == items2 and len(vocab) == 500 and vocab[:2] == (v.PAD, v.UNK)
    train = [t for _, i, t in items if not v.is_held_out(i)]
    held = [t for _, i, t in items if v.is_held_out(i)]
    assert 0.15 < len(held) / len(items) < 0.25
    assert v.build_vocab(train, 500) == vocab != v.build_vocab(held, 500)
    tr, te = load_text_dataset("fortunes", "train", seq_len=16), load_text_dataset("fortunes", "test", seq_len=16)
    assert tr.input_shape == te.input_shape == (16, v.DEFAULT_VOCAB_SIZE) and tr.x.dtype == torch.long
    tok = v.tokenizer(v.corpus("fortunes", None, v.DEFAULT_VOCAB_SIZE)[1])
    long_enough = lambda texts: [tok.encode(t).ids[:16] for t in texts if len(tok.encode(t).ids) >= 16]  # noqa: E731
    assert te.x.tolist() == long_enough(held) and tr.x.tolist() == long_enough(train)  # the split is by quotation
    assert set(range(len(FORTUNE_TOPICS))) == set(tr.y.tolist()) == set(te.y.tolist())
    assert (tr.x != v.PAD_ID).all(), "victims' sequences carry no padding"


def test_the_vocabulary_hash_is_in_the_trial_id_and_image_ids_do_not_see_the_text_keys():
    base = TrialConfig("s", "token-set", {}, "none", {}, CaseConfig(dataset="fortunes", model="text-classifier"), 0)
    other = TrialConfig("s", "token-set", {}, "none", {}, CaseConfig(dataset="fortunes", model="text-classifier", vocab_size=500), 0)
    assert len(base.identity()["vocabulary_sha256"]) == 64
    assert base.identity()["vocabulary_sha256"] != other.identity()["vocabulary_sha256"] and base.trial_id != other.trial_id
    image = TrialConfig("s", "dlg", {}, "none", {}, CaseConfig(), 0)
    assert "vocabulary_sha256" not in image.identity() and "seq_len" not in image.identity()["case"]


def test_a_missing_corpus_says_which_package_to_install(tmp_path):
    from gleak.contracts.errors import DatasetMissing
    from gleak.mechanics.text.data import load_text_dataset

    with pytest.raises(DatasetMissing, match=r"apt-get install -y fortunes"):
        load_text_dataset("fortunes", root=str(tmp_path))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_the_token_set_is_recovered_exactly_undefended_over_seeds(batch_size):
    for seed in range(3):
        row, extra = _trial("token-set", seed=seed, batch_size=batch_size)
        assert extra["token_set_f1"] == 1.0, (seed, extra)
        assert extra["rouge1"] > extra["blind_rouge1"]


def test_the_token_set_fails_under_noise():
    f1 = [_trial("token-set", defense="noise", dparams={"sigma": 0.01}, seed=s)[1]["token_set_f1"] for s in range(3)]
    assert max(f1) < 0.3, f1


def test_tag_beats_the_blind_guess_and_the_unordered_token_set_undefended_at_batch_1():
    tag, bag = [], []
    for seed in range(3):
        _, e = _trial("tag", {"iterations": 300, "restarts": 1}, seed=seed)
        _, b = _trial("token-set", seed=seed)
        assert e["rouge1"] >= e["blind_rouge1"] + 0.3, (seed, e)
        assert e["text_truth"] and e["text_reconstruction"]
        tag.append(e)
        bag.append(b)
    # The token set gives the words; TAG's gradient matching also places some of them (and their repeats).
    assert statistics.mean(e["token_acc"] for e in tag) > statistics.mean(b["token_acc"] for b in bag) + 0.1
    assert statistics.mean(e["rouge1"] for e in tag) > statistics.mean(b["rouge1"] for b in bag)


def test_tag_degrades_under_a_strong_defense():
    small = {"iterations": 20, "restarts": 1, "vocabulary": "token-set"}
    _, clean = _trial("tag", small, seed=1)
    _, noisy = _trial("tag", small, defense="noise", dparams={"sigma": 0.01}, seed=1)
    assert noisy["rouge1"] < clean["rouge1"] - 0.4, (clean, noisy)


def test_text_scores_of_the_truth_and_of_a_shuffle():
    from gleak.mechanics.text.metrics import text_scores

    vocab = [str(i) for i in range(20)]
    truth = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    blind = torch.tensor([1, 1, 1, 1, 1, 1])
    exact = text_scores(truth, torch.nn.functional.one_hot(truth.flip(0), 20).float(), blind, vocab)  # rows swapped
    assert (exact["rouge1"], exact["rouge2"], exact["rougeL"], exact["token_acc"], exact["verdict"]) == (1.0, 1.0, 1.0, 1.0, "recovered")
    assert exact["bleu"] == pytest.approx(1.0) and exact["blind_bleu"] == 0.0  # BLEU pairs the rows as ROUGE-1 does
    one = text_scores(truth, torch.nn.functional.one_hot(truth[:1], 20).float(), blind, vocab)  # one row of two
    assert one["rouge1"] == 0.5 and one["matched"] == 1 and one["blind_rouge1"] == 0.0
    assert one["token_set_f1"] == pytest.approx(2 * 6 / (12 + 6))
    assert 0 < one["bleu"] < 1  # the missing row scored by the blind guess, which shares no word
    none = text_scores(truth, None, blind, vocab)
    assert none["rouge1"] is None and none["bleu"] is None and none["verdict"] is None


def test_the_language_model_trains_by_pretraining_on_next_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("GLEAK_CACHE", str(tmp_path))  # trained here, not read from an earlier run's cache
    from gleak.mechanics.modality import modality_of
    from gleak.mechanics.pretrain import build_model

    case = CaseConfig(dataset="fortunes", model="text-lm", seq_len=16, model_state="trained", train_steps=30, train_lr=0.1)
    ds = modality_of(case).load(case, "train")
    assert ds.y.shape == ds.x.shape and (ds.y[:, :-1] == ds.x[:, 1:]).all() and (ds.y[:, -1] == -100).all()
    _, info = build_model(case, ds, 0, torch.float32)
    assert info["model_train_loss"] < 7.0  # log(4000) = 8.3 at the start; 6.2 measured after 30 steps


def test_a_text_case_with_an_image_model_or_image_keys_is_refused_by_the_suite(tmp_path):
    from gleak.contracts.errors import InputError
    from gleak.orchestration.suite import load_suite

    for case, key in (('dataset = "fortunes"\nmodel = "mlp"', "model"), ('dataset = "fortunes"\nmodel = "text-classifier"\nresolution = 8', "resolution"),
                      ('model = "mlp"\nseq_len = 16', "seq_len")):  # fmt: skip
        f = tmp_path / "s.toml"
        f.write_text(f'[suite]\nname = "s"\n[case]\n{case}\n[[attack]]\nname = "token-set"\n[[defense]]\nname = "none"\n')
        with pytest.raises(InputError, match=key):
            load_suite(f)


def test_a_text_suite_runs_and_its_leaderboard_ranks_the_defenses_by_rouge_with_a_reconstruction_beside_its_truth(tmp_path):
    import gleak

    f = tmp_path / "t.toml"
    f.write_text('[suite]\nname = "t"\nseeds = [0, 1]\n[case]\ndataset = "fortunes"\nmodel = "text-classifier"\nseq_len = 16\n'
                 '[[attack]]\nname = "token-set"\n[[defense]]\nname = "none"\n[[defense]]\nname = "noise"\nsigma = 0.01\n')  # fmt: skip
    gleak.run(f, tmp_path / "out", progress=False)
    md = (tmp_path / "out" / "leaderboard.md").read_text()
    ranking = md[md.index("## Text: defenses ranked"):md.index("## Text: results by case")]
    lines = [ln for ln in ranking.splitlines() if ln.startswith("| 1 ") or ln.startswith("| 2 ")]
    assert "noise" in lines[0] and "none" in lines[1] and "1.000 ± 0.000" in lines[1]  # the token set: F1 1.0
    assert "| BLEU " in ranking and "sacreBLEU" in ranking  # shown where the trials have it
    shown = md[md.index("## Text: reconstructions beside their truth"):]
    assert "| token-set | B=1 L=16 |" in shown
    assert "partial" in md[md.index("## Text: results by case"):md.index("## Text: reconstructions")]


def test_a_text_sweep_draws_rouge_against_the_defense_strength(tmp_path):
    """The strength figure of a text suite draws each attack's worst-case ROUGE-1 against the defense parameter
    (the text analogue of the worst-case PSNR), and its caption says so."""
    import gleak
    from gleak.reporting.documents.text import worst_rouge_per_config
    from gleak.reporting.report import _load

    f = tmp_path / "t.toml"
    f.write_text('[suite]\nname = "t"\nseeds = [0, 1]\n[case]\ndataset = "fortunes"\nmodel = "text-classifier"\nseq_len = 16\n'
                 'batch_size = [1, 4]\n[[attack]]\nname = "token-set"\n[[defense]]\nname = "none"\n[[defense]]\nname = "noise"\n'
                 'sigma = [1e-4, 1.0]\n')  # fmt: skip
    gleak.run(f, tmp_path / "out", progress=False)
    md = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "figures/strength_noise_sigma.png" in md and "text trials: mean ROUGE-1" in md
    df = _load(tmp_path / "out")["df"]
    worst = worst_rouge_per_config(df)
    # the worst case is the most leaky of the two batch sizes (batch 1: the token set of one sentence, ROUGE-1 higher)
    ok = df[(df.status == "ok") & (df.defense == "none")]
    per_case = [statistics.mean(json.loads(e)["rouge1"] for e in g["extra"]) for _, g in ok.groupby("batch_size")]
    assert worst[("none", "{}", "token-set", ok.attack_params.iloc[0])][0] == pytest.approx(max(per_case))
    assert min(per_case) < max(per_case) - 0.1, per_case
    by_sigma = {json.loads(k[1]).get("sigma"): v[0] for k, v in worst.items() if k[0] == "noise"}
    assert by_sigma[1.0] < by_sigma[1e-4] - 0.3, by_sigma  # noise of sigma 1 hides the token set


def test_utility_runs_train_the_text_classifier_and_noise_costs_accuracy(tmp_path):
    import csv

    import gleak

    f = tmp_path / "u.toml"
    f.write_text('[suite]\nname = "u"\nseeds = [0]\n[case]\ndataset = "fortunes"\nmodel = "text-classifier"\nseq_len = 16\n'
                 '[[attack]]\nname = "token-set"\n[[defense]]\nname = "none"\n[[defense]]\nname = "noise"\nsigma = 1.0\n'
                 '[utility]\ndataset = "fortunes"\nmodel = "text-classifier"\nseq_len = 16\nclients = 2\n'
                 'training_rounds = 30\nserver_lr = 0.5\nbatch_size = 16\n')  # fmt: skip
    gleak.run(f, tmp_path / "out", progress=False)
    acc = {r["defense"]: float(r["accuracy"]) for r in csv.DictReader((tmp_path / "out" / "utility.csv").open())}
    # 30 FedSGD rounds take the classifier just to the held-out majority topic (135 of 416: 0.325; measured 0.327);
    # noise of sigma 1 swamps the gradient and ends below it (measured 0.255).
    assert set(acc) == {"none", "noise"} and all(0.0 <= a <= 1.0 for a in acc.values())
    assert acc["none"] >= 135 / 416 and acc["noise"] < acc["none"] - 0.03, acc
    # The leaderboard of a text-only suite: the text ranking carries each defense's accuracy and its change from the
    # undefended run; the image tables (all empty for text) are left out.
    md = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "## Defenses, ranked by their worst case" not in md and "## Results by case" not in md
    ranking = md[md.index("## Text: defenses ranked"):md.index("## Text: results by case")]
    rows = {ln.split("|")[2].strip(): ln for ln in ranking.splitlines() if ln.startswith("| ") and "rank" not in ln}
    assert "| accuracy " in ranking and f"{100 * acc['noise']:.1f}%" in rows["noise"], ranking
    assert f"{100 * (acc['noise'] - acc['none']):+.2f}" in rows["noise"] and "+0.00" in rows["none"], ranking


def test_tag_recovers_the_text_in_its_order_from_the_causal_language_model():
    # A language model's targets are its own next tokens, so its gradient gives the order away too.
    _, e = _trial("tag", {"iterations": 100, "restarts": 1}, seed=0, model="text-lm")
    assert e["rougeL"] >= 0.9 and e["token_acc"] >= 0.9, e


def test_every_built_in_defense_runs_on_a_text_batch_or_says_it_does_not_apply():
    """A defense written for images (ATS's transforms, Soteria's derivative in the input pixels) is not applicable
    to token ids, with its reason; it never fails the trial with torch's own error. The others run."""
    from gleak.contracts import registry

    statuses = {}
    builtins = {n for n in registry.list_plugins("defense") if registry.plugin_info("defense", n).obj.__module__.startswith("gleak.")}
    for name in sorted(builtins):  # the built-ins only: other tests register misbehaving defenses in this process
        if name in ("cgd", "local-training", "secure-aggregation"):  # protocols, tested as protocols
            continue
        from gleak.orchestration.trial import run_trial

        c = CaseConfig(dataset="fortunes", model="text-classifier", seq_len=16)
        row = run_trial(TrialConfig("text", "token-set", {}, name, {}, c, 0))
        statuses[name] = row["status"]
        assert row["status"] in ("ok", "not-applicable"), (name, row.get("error"))
        if row["status"] == "not-applicable":
            assert "token ids" in row["error"] or "text" in row["error"], (name, row["error"])
    assert statuses["ats"] == statuses["soteria"] == "not-applicable" and statuses["noise"] == "ok", statuses


def test_an_empty_token_set_falls_back_to_the_whole_vocabulary_and_tag_through_dgp_is_scored():
    """DGP zeroes every row of the embedding's gradient: no token set to read. TAG then searches every token but
    padding, says so in the row (token_set_fallback), and the trial is scored rather than not applicable."""
    from gleak.attacks.token_set import search_vocabulary
    from gleak.contracts.wire import Update
    from gleak.mechanics.text.models import text_classifier

    model = text_classifier((4, 10), 2)
    zero = Update({n: torch.zeros_like(p) for n, p in model.named_parameters()})
    cand, fallback = search_vocabulary(zero, model, 10)
    assert fallback and cand.tolist() == list(range(1, 10))
    for seed in range(2):
        _, e = _trial("tag", {"iterations": 5, "restarts": 1, "vocabulary": "token-set"}, defense="dgp", seed=seed)
        assert e["token_set_fallback"] is True and e["candidates"] == 3999, e  # the 4,000-word vocabulary but padding
        assert 0.0 <= e["rouge1"] <= 1.0 and e["text_truth"]
    _, clean = _trial("tag", {"iterations": 5, "restarts": 1, "vocabulary": "token-set"}, seed=0)
    assert clean["token_set_fallback"] is False and clean["candidates"] < 100, clean
    _, whole = _trial("tag", {"iterations": 5, "restarts": 1}, seed=0)  # the default: the whole vocabulary, as published
    assert whole["token_set_fallback"] is False and whole["candidates"] == 3999, whole


@pytest.mark.parametrize("bad, said", [("folder", "not a regular file"), ("random bytes", "is not text"),
                                       ("no separator", "no quotation separator")])  # fmt: skip
def test_a_topic_file_that_is_not_a_fortune_file_is_named_for_what_it_is(tmp_path, bad, said):
    import os

    from gleak.contracts.errors import InputError
    from gleak.contracts.vocabulary import FORTUNE_TOPICS, read_fortunes

    for topic in FORTUNE_TOPICS:
        (tmp_path / topic).write_text("A quotation.\n%\nAnother one.\n%\n")
    first = tmp_path / FORTUNE_TOPICS[0]
    first.unlink()
    if bad == "folder":
        first.mkdir()
    elif bad == "random bytes":
        first.write_bytes(os.urandom(4096))
    else:
        first.write_text("one long text without any separator line\n" * 20)
    with pytest.raises(InputError, match=said) as err:
        read_fortunes(tmp_path)
    assert "not found" not in str(err.value) and str(first) in str(err.value)
