"""Code tests of small rules whose breaking no other test noticed: each names the wrong product it catches (a
mutation of the code it protects that every other test passed)."""

import numpy as np
import pandas as pd
import pytest
import torch

from gleak.contracts.registry import create
from gleak.contracts.wire import Update
from gleak.mechanics.gate import gate_update


def _update(n: int = 3, kind: str = "gradient") -> Update:
    return Update({"w": torch.arange(4.0)}, kind, n, {"lr": 0.1, "local_batch_size": 2})


def test_the_gate_gives_the_sample_count_and_batch_meta_only_to_an_attack_that_declares_batch_size():
    # kills: the gate passing num_samples (or the local batch size) to an attack without "batch_size"
    blind = gate_update(_update(), frozenset({"architecture", "parameters"}))
    told = gate_update(_update(), frozenset({"architecture", "batch_size"}))
    assert blind.num_samples is None and "local_batch_size" not in blind.meta and blind.meta["lr"] == 0.1
    assert told.num_samples == 3 and told.meta["local_batch_size"] == 2


def test_secure_aggregation_shows_the_sum_of_every_client_and_never_one_clients_update():
    # kills: secure aggregation returning only the victim's update (or the mean) as what the observer sees
    proto = create("protocol", "secure-aggregation")
    sent = [Update({"w": torch.full((3,), float(i + 1))}, "gradient", 2) for i in range(4)]
    seen = proto.observe(sent, torch.Generator().manual_seed(0))
    assert torch.equal(seen["w"], torch.full((3,), 10.0)) and seen.num_samples == 8


def test_the_spread_interval_is_the_two_sided_95_percent_student_t_interval_of_the_mean():
    # kills: the "[95%]" interval computed at another level, or mean ± std printed in its place
    from scipy import stats

    from gleak.reporting.aggregate import spread

    v = [10.0, 12.0, 15.0, 11.0]
    s = spread(v)
    lo, hi = stats.t.interval(0.95, len(v) - 1, loc=np.mean(v), scale=stats.sem(v))
    assert s["lo"] == pytest.approx(lo) and s["hi"] == pytest.approx(hi)
    assert s["std"] == pytest.approx(np.std(v, ddof=1))
    assert s["hi"] - s["mean"] != pytest.approx(s["std"])  # the interval is not the standard deviation


def test_the_matrix_shows_each_attacks_best_case_over_cases_not_its_worst():
    # kills: the leaderboard's attack x defense grid showing each attack's worst case instead of its best
    from gleak.reporting.documents.leaderboard import attack_defense_matrix

    agg = pd.DataFrame({"attack": ["dlg", "dlg"], "attack_params": ["{}", "{}"], "defense": ["none", "none"],
                        "defense_params": ["{}", "{}"], "psnr": [12.0, 48.0], "verdict": ["defended", "recovered"],
                        "label_acc": [None, None]})  # fmt: skip
    dr = pd.DataFrame({"defense": ["none"], "defense_params": ["{}"]})
    _, rows = attack_defense_matrix(agg, dr, {}, {})
    assert rows[0][2] == "48.00 (recovered)"


def test_dp_epsilon_is_spent_at_the_configured_delta():
    # kills: privacy_spent ignoring the configured delta (every other test used the default)
    from gleak.mechanics.accountant import PrivacyAccountant

    eps = {}
    for delta in (1e-5, 1e-3):
        d = create("defense", "noise", mode="dp", clip=1.0, noise_multiplier=1.0, delta=delta, sample_rate=0.01)
        d.reset()
        d.bind_accountant(PrivacyAccountant())
        model = torch.nn.Linear(4, 2)
        for _ in range(3):
            d.client_gradient(model, torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 0]), torch.Generator().manual_seed(0))
        eps[delta] = d.privacy_spent()
        assert eps[delta] == pytest.approx(d.epsilon(delta=delta, sample_rate=0.01, steps=3))
    assert eps[1e-3] < eps[1e-5]  # a looser delta buys a smaller epsilon


def test_claims_break_a_psnr_tie_toward_the_lower_mse_and_round_the_recovered_count():
    # kills: claims' strongest cell taking the higher MSE on a PSNR tie; the recovered count floored, not rounded
    from gleak.reporting.claims import _strongest, recovered_count

    g = pd.DataFrame({"attack": ["a", "b"], "psnr": [120.0, 120.0], "mse_median": [1e-3, 1e-9]})
    assert _strongest(g)["attack"] == "b"
    # 1 of 49 trials recovered, stored as the float share 1/49, which times 49 is 0.999...: 1, never 0
    share = float(np.mean([True] + [False] * 48))
    assert share * 49 < 1 and recovered_count({"recovered": share, "trials": 49, "failed": 0, "not_applicable": 0}) == (1, 49)


def test_the_blind_guess_is_the_mean_image_of_the_split_the_victims_come_from():
    # kills: the blind guess drawn from the training split (or the whole data set) where a trained model is attacked
    # on held-out images
    import json

    from gleak.contracts.config import CaseConfig, TrialConfig
    from gleak.mechanics.metrics import mean_image, mse
    from gleak.orchestration.trial import DTYPES, draw_batches, load_case_data, run_trial

    case = CaseConfig(dataset="skimage", model="mlp", batch_size=2, model_state="trained", train_steps=2)
    cfg = TrialConfig("t", "closed-form", {}, "none", {}, case, 0)
    row = run_trial(cfg)
    assert row["status"] == "ok", row["error"]
    test, train = load_case_data(cfg, "test"), load_case_data(cfg, "train")
    victims = draw_batches(test, cfg, DTYPES[case.dtype])[0].images()
    want = float(mse(victims, mean_image(test.x)).mean())
    assert json.loads(row["extra"])["blind_mse"] == pytest.approx(want, rel=1e-6)
    assert float(mse(victims, mean_image(train.x)).mean()) != pytest.approx(want, rel=1e-6)


def test_a_store_frame_holds_the_current_suites_trials_only(tmp_path):
    # kills: Store.frame ignoring which trials belong to the current suite (a reused folder's old trials reported)
    from gleak.contracts.config import CaseConfig, TrialConfig
    from gleak.orchestration.store import Store

    case = CaseConfig(dataset="skimage", model="mlp", batch_size=1)
    old, new = (TrialConfig("s", a, {}, "none", {}, case, 0) for a in ("dlg", "closed-form"))
    store = Store(tmp_path)
    for cfg in (old, new):
        store.put(cfg, {"trial_id": cfg.trial_id, "config": cfg.to_json(), "status": "ok", "psnr": 20.0, "seconds": 0.1})
    store.set_membership([new])
    assert store.frame()["trial_id"].tolist() == [new.trial_id] and store.count() == 1
    assert set(store.frame(members_only=False)["trial_id"]) == {old.trial_id, new.trial_id}
    store.close()


def test_tags_distance_has_its_l1_term():
    # kills: TAG without its L1 term (alpha ||g - t||_1)
    from gleak.attacks.tag import tag_distance

    g, t = (torch.tensor([1.0, -2.0]),), [torch.tensor([0.0, 0.0])]
    assert float(tag_distance(g, t, 0.5)) == pytest.approx(5.0 + 0.5 * 3.0)


def test_lamp_reads_each_position_by_cosine_not_by_dot_product():
    # kills: LAMP choosing tokens by dot product instead of cosine (a long embedding row would win every position)
    from gleak.attacks.lamp import nearest_tokens

    emb = torch.tensor([[0.0, 0.0], [1.0, 0.0], [10.0, 10.0]])  # token 2: long, 45 degrees off
    x = torch.tensor([[[1.0, 0.05]]])
    assert nearest_tokens(x, emb, torch.tensor([1, 2])).tolist() == [[1]]


def test_searches_and_token_accuracy_leave_padding_out():
    # kills: TAG and LAMP searching the padding token; token accuracy counting padding positions
    from gleak.attacks.token_set import search_vocabulary
    from gleak.mechanics.text.metrics import PAD_ID, token_accuracy

    truth = torch.tensor([5, 6, PAD_ID, PAD_ID])
    assert token_accuracy(truth, torch.tensor([5, 7, PAD_ID, PAD_ID])) == 0.5  # 1 of the 2 real positions

    class Emb(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(6, 3)

    model = Emb()
    grad = torch.zeros(6, 3)
    grad[[PAD_ID, 2, 4]] = 1.0  # padding's row non-zero too, as a noised update would have it
    cand, fallback = search_vocabulary(Update({"embed.weight": grad}), model, 6)
    assert PAD_ID not in cand.tolist() and sorted(cand.tolist()) == [2, 4] and not fallback
    cand, fallback = search_vocabulary(Update({"embed.weight": torch.zeros(6, 3)}), model, 6)
    assert fallback and PAD_ID not in cand.tolist() and len(cand) == 5


def test_a_text_trials_matched_counts_rows_paired_not_rows_returned():
    # kills: a text trial's `matched` counting the rows the attack returned instead of the rows paired with a truth
    from gleak.mechanics.text.metrics import text_scores

    vocab = [f"w{i}" for i in range(8)]
    truth = torch.tensor([[1, 2, 3]])
    rec = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3], [4, 5, 6], [6, 7, 1]]), 8).double()
    out = text_scores(truth, rec, torch.tensor([1, 1, 1]), vocab)
    assert out["matched"] == 1 and out["rouge1"] == 1.0


@pytest.mark.parametrize("plain_at, kept", [(1.0, "plain"), (4.0, "polished")])
def test_dlg_keeps_the_better_of_the_plain_and_the_polished_start(monkeypatch, plain_at, kept):
    # kills: DLG's keep-the-better-of-plain-and-polished check removed (L-BFGS without line search need not
    # descend, so the polish can end worse than where it began), in the restart loop and in the batched run
    from types import SimpleNamespace

    from gleak.attacks.dlg import DLG

    attack = create("attack", "dlg", restarts=1)
    plain_x, polished_x = torch.ones(4), torch.full((4,), 2.0)
    monkeypatch.setattr(DLG, "_polish", lambda self, box: True)
    monkeypatch.setattr(DLG, "_one_start", lambda self, *a, box=None, start=None, **k:
                        (plain_x, None, 5.0, 1, 1) if start is None else (polished_x, None, 3.0, 1, 1))
    monkeypatch.setattr(DLG, "_distance_at", lambda self, *a, **k: plain_at)
    p = SimpleNamespace(model=None, params=[], target=[torch.ones(1)], k=None, dtype=torch.float64, y=None, box=object())
    x, _, run = attack._restarts_loop(p, torch.Generator())
    assert torch.equal(x, plain_x if kept == "plain" else polished_x) and run["match_loss"] == min(plain_at, 3.0)

    monkeypatch.setattr(DLG, "_draw", lambda self, k, dtype, rng: torch.zeros(4))
    monkeypatch.setattr(DLG, "_batched_run", lambda self, p, starts, box:
                        (plain_x[None], torch.tensor([5.0]), torch.tensor([1]), torch.tensor([1]), 1) if box is None
                        else (polished_x[None], torch.tensor([3.0], dtype=torch.float64), torch.tensor([1]), torch.tensor([1]), 1))
    monkeypatch.setattr(DLG, "_distance_at_flat", lambda self, p, row, box: plain_at)
    p.split = lambda flat: (flat, None)
    x, _, run = attack._restarts_batched(p, torch.Generator())
    assert torch.equal(x, plain_x if kept == "plain" else polished_x) and run["match_loss"] == min(plain_at, 3.0)


def test_rgaps_residual_is_zero_at_the_truth_and_not_elsewhere():
    # kills: R-GAP's gradient_residual diagnostic always 0
    from gleak.attacks.rgap import _gradient_residual

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, 3)).double()
    names = [n for n, _ in model.named_parameters()]
    x = torch.rand(1, 6, dtype=torch.float64)
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([1]))
    grads = dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))
    assert _gradient_residual(model, names, x, 1, grads) == pytest.approx(0.0, abs=1e-12)
    assert _gradient_residual(model, names, x + 0.5, 1, grads) > 0.05


@pytest.mark.parametrize("key, value, said", [
    ("train_steps", 10_000_000, "[case] key 'train_steps': must be <= 1_000_000"),
    ("warmup_rounds", 1_000_000, "[case] key 'warmup_rounds': must be <= 10_000"),
])  # fmt: skip
def test_sizes_past_their_stated_limits_are_refused_before_any_work(tmp_path, key, value, said):
    # kills: a training length or warm-up typed with too many zeros trained until killed or until the model diverged
    from gleak.contracts.errors import InputError
    from gleak.orchestration.suite import load_suite

    suite = tmp_path / "s.toml"
    suite.write_text(f'[suite]\nname = "s"\n[case]\ndataset = "skimage"\nmodel = "mlp"\nmodel_state = "trained"\n{key} = {value}\n'
                     '[[attack]]\nname = "closed-form"\n[[defense]]\nname = "none"\n')  # fmt: skip
    with pytest.raises(InputError, match=said.replace("[", r"\[").replace("]", r"\]")):
        load_suite(suite)


def test_imprint_bins_past_the_limit_are_refused_in_one_line(tmp_path):
    # kills: imprint bins = 10^8 accepted, then a 1.2 TB allocation inside the trial
    from gleak.contracts.errors import InputError
    from gleak.orchestration.suite import load_suite

    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "s"\n[case]\ndataset = "skimage"\nmodel = "mlp"\n'
                     '[[attack]]\nname = "imprint"\nbins = 100000000\n[[defense]]\nname = "none"\n')  # fmt: skip
    with pytest.raises(InputError) as err:
        load_suite(suite)
    assert "bins" in str(err.value) and "65536" in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_trial_timeout_with_ray_is_refused_in_one_line_before_anything_is_written(tmp_path):
    # kills: --trial-timeout with the Ray executor accepted silently and not applied
    import subprocess
    import sys

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "gleak", "run", "quick", "--executor", "ray", "--trial-timeout", "20",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2 and "--trial-timeout" in r.stderr and "ray" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
