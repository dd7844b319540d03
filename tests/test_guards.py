"""Guarantees the product makes, tested on values: the gate withholds the victim's weights (value by value), secret
sharing shows the aggregator uniform shares and only their sum, a trial's epsilon is the accountant's after the
noisy steps it took, a resumed run retries its failed trials, and CGD's engines agree on unequal blocks."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gleak.contracts.seeds import derive_seed
from gleak.mechanics.gate import guess_values, observer_model
from gleak.mechanics.models import create_model

ARCH = SimpleNamespace(needs=frozenset({"architecture", "batch_size"}))
WHITE_BOX = SimpleNamespace(needs=frozenset({"architecture", "parameters"}))


class Custom(nn.Module):
    """A module of its own: raw nn.Parameters and a buffer, no reset_parameters."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.mix = nn.Parameter(torch.randn(16, 100) * 0.3)
        self.register_buffer("centre", torch.linspace(-1, 1, 16))
        self.register_buffer("steps", torch.tensor(7))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.scale * (x.flatten(1)[:, :100] @ self.mix.T - self.centre))


def models():
    torch.manual_seed(0)
    bn = create_model("resnet20", (3, 16, 16), 10, seed=1, width=1)
    trained_bn = copy.deepcopy(bn)
    with torch.no_grad():  # as after training: BatchNorm's affine and running statistics away from their init
        for m in trained_bn.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5), m.bias.normal_(), m.running_mean.normal_(), m.running_var.uniform_(0.5, 2)
    return {"mlp": create_model("mlp", (1, 8, 8), 10, seed=2), "resnet20-bn": bn, "resnet20-bn-trained": trained_bn,
            "custom": Custom(), "linear-normal": create_model("linear", (1, 8, 8), 10, seed=3, init="normal")}  # fmt: skip


def _tensors(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("name", list(models()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_without_parameters_no_value_of_the_victims_model_reaches_the_attack(name, seed):
    victim = models()[name]
    mine = observer_model(ARCH, victim, seed)
    theirs = _tensors(victim)
    for k, t in _tensors(mine).items():
        assert t.shape == theirs[k].shape and t.dtype == theirs[k].dtype
        if t.is_floating_point():
            assert (t != theirs[k]).all(), f"{name}: {k} keeps {int((t == theirs[k]).sum())} of the victim's values"
    assert observer_model(WHITE_BOX, victim, seed) is not victim
    for k, t in _tensors(observer_model(WHITE_BOX, victim, seed)).items():
        assert torch.equal(t, theirs[k])  # "parameters" declared: the victim's values


def test_the_guess_is_a_function_of_the_seed_and_of_public_scales():
    victim = Custom()
    a, b = (observer_model(ARCH, victim, s) for s in (4, 4))
    assert all(torch.equal(x, y) for x, y in zip(_tensors(a).values(), _tensors(b).values()))
    c = observer_model(ARCH, victim, 5)
    assert not torch.equal(a.mix, c.mix)
    # a custom weight is N(0, 1 / fan_in): fan_in 100, so std 0.1 whatever the victim's own scale (0.3)
    draws = torch.cat([observer_model(ARCH, victim, s).mix.detach().flatten() for s in range(5)])
    assert abs(float(draws.std()) - 0.1) < 0.01 and abs(float(draws.mean())) < 0.01
    assert int(a.steps) == 7  # an integer counter is not data: kept


def test_a_shipped_architecture_gets_the_former_guess_bit_for_bit():
    """mlp and linear (every architecture-only attack of the shipped suites): only nn.Linear layers, whose reset
    re-draws every value, so the guess is the reset alone, as before: no published number moves."""
    for victim in (create_model("mlp", (1, 28, 28), 10, seed=0, hidden=[256]),
                   create_model("linear", (1, 8, 8), 10, seed=0, init="normal")):  # fmt: skip
        former = copy.deepcopy(victim)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(3, "attacker-guess"))
            for m in former.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        mine = observer_model(ARCH, victim, 3)
        assert all(torch.equal(x, y) for x, y in zip(_tensors(mine).values(), _tensors(former).values()))


def test_guess_values_keeps_a_variance_positive():
    bn = nn.BatchNorm1d(8)
    mine = copy.deepcopy(bn)
    guess_values(mine, bn, 0)
    assert (mine.running_var > 1).all() and (mine.weight > 1).all() and (mine.bias > 0).all()


# ---- secret sharing: the transcript the parties exchange --------------------------------------------------------
def _uniform_p(values, bits: int = 4) -> float:
    """Chi-square p-value that ring elements are uniform, by their top and by their low `bits` bits (the smaller)."""
    from scipy.stats import chisquare

    from gleak.mechanics.secret_sharing import RING_BITS

    codes = [(values >> (RING_BITS - bits)).long(), (values & ((1 << bits) - 1)).long()]
    return min(float(chisquare(torch.bincount(c, minlength=1 << bits).numpy()).pvalue) for c in codes)


def _run(secrets, draws, seed):
    from gleak.mechanics.secret_sharing import run_protocol

    g = torch.Generator().manual_seed(seed)
    return run_protocol(torch.tensor(secrets, dtype=torch.int64).unsqueeze(1).expand(len(secrets), draws).contiguous(), g)


def test_what_each_party_and_the_aggregator_receive_is_uniform_and_only_the_sum_is_revealed():
    from gleak.mechanics.secret_sharing import MODULUS

    secrets = [5, 77, 123456, 2**31 + 9]
    t = _run(secrets, 20000, 0)
    m = len(secrets)
    assert torch.equal(t.total, torch.full((20000,), sum(secrets) % MODULUS))  # the sum, exactly
    # the aggregator received E^j, the sum of the shares party j received: read from the transcript, not rebuilt
    assert torch.equal(t.partial, torch.remainder(t.shares.sum(0), MODULUS))
    for j in range(m):
        assert not torch.equal(t.partial[j], torch.full_like(t.partial[j], secrets[j]))  # no secret in the clear
    for j in range(m - 1):  # any m - 1 partial sums are uniform (the last is fixed by the total)
        assert _uniform_p(t.partial[j]) > 1e-4, j
        assert _uniform_p(torch.remainder(t.partial[j] - t.partial[j + 1], MODULUS)) > 1e-4, j
    for i in range(m):  # each share party i sends another party is uniform
        for j in range(m - 1):
            assert _uniform_p(t.shares[i, j]) > 1e-4, (i, j)


def test_the_aggregators_view_has_one_law_for_two_splits_of_one_sum():
    from scipy.stats import chi2_contingency

    a, b = _run([10, 20, 30, 40], 20000, 1), _run([99, 1, 0, 0], 20000, 2)  # both sum to 100
    for j in range(3):
        for code in (lambda v: (v >> 28).long(), lambda v: (v & 15).long()):
            table = torch.stack([torch.bincount(code(a.partial[j]), minlength=16), torch.bincount(code(b.partial[j]), minlength=16)])
            assert float(chi2_contingency(table.numpy())[1]) > 1e-4, j


def test_cgd_runs_the_share_protocol_and_its_aggregator_sees_only_the_honest_sum(monkeypatch):
    """Through CGD's own secure sum (the protocol's observe): every transcript it runs shows the aggregator uniform
    partial sums, and the view is the fixed-point sum of the honest participants' scaled gradients."""
    from gleak.contracts.registry import create
    from gleak.contracts.wire import Update
    from gleak.mechanics import secret_sharing

    seen = []
    real = secret_sharing.run_protocol
    monkeypatch.setattr(secret_sharing, "run_protocol", lambda s, g: seen.append(real(s, g)) or seen[-1])
    g = torch.Generator().manual_seed(0)
    sent = [Update({"w": torch.randn(40, 50, generator=g, dtype=torch.float64)}, "gradient", n) for n in (1, 2, 3, 4)]
    proto = create("protocol", "cgd", colluders=1)
    view = proto.observe(sent, torch.Generator().manual_seed(1))
    assert seen and all(t.shares.shape[:2] == (4, 4) for t in seen)
    partial = torch.cat([t.partial for t in seen], 1)  # (4 parties, 2000 coordinates)
    for j in range(3):
        assert _uniform_p(partial[j]) > 1e-4
    honest = sum(u.flat() * u.num_samples / 10 for u in sent[:3])  # grad_scale "data": n_i / n; the colluder's removed
    assert torch.allclose(view.flat(), honest, atol=4 * 2.0**-24) and view.num_samples == 6


# ---- privacy spent: a trial's epsilon ---------------------------------------------------------------------------
def _stepped_epsilon(z: float, steps: int, delta: float = 1e-5) -> float:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(steps):  # opacus' accountant stepped once per noisy step, as its PrivacyEngine does
        acc.step(noise_multiplier=z, sample_rate=1.0)
    return float(acc.get_epsilon(delta=delta))


@pytest.mark.parametrize("case, steps", [
    ({"warmup_rounds": 0}, 1),
    ({"warmup_rounds": 3}, 4),  # FedSGD: one noisy step per round, three warm-up rounds and the attacked one
    ({"warmup_rounds": 1, "update": "fedavg", "local_steps": 3}, 6),  # FedAvg: every local step is noisy
])  # fmt: skip
def test_a_trials_epsilon_is_the_accountants_after_the_noisy_steps_it_took(case, steps):
    import json

    from gleak.api import trial_config
    from gleak.orchestration.trial import run_trial

    cfg = trial_config("closed-form", {"name": "noise", "mode": "dp", "noise_multiplier": 1.3}, dataset="skimage",
                       model="mlp", model_params={"hidden": [16]}, resolution=8, batch_size=2, **case)  # fmt: skip
    row = run_trial(cfg)
    assert row["status"] == "ok", row["error"]
    eps = json.loads(row["extra"])["epsilon"]
    assert eps == pytest.approx(_stepped_epsilon(1.3, steps), rel=1e-9)
    assert eps != pytest.approx(_stepped_epsilon(1.3, steps + 1), rel=1e-3)


# ---- resume: a rerun retries what failed ------------------------------------------------------------------------
RESUME_SUITE = """
[suite]
name = "resume"
seeds = [0, 1, 2]
save_images = false
[case]
dataset = "skimage"
model = "mlp"
model_params = { hidden = [8] }
resolution = 8
batch_size = 1
[[attack]]
name = "closed-form"
[[defense]]
name = "none"
"""


def test_a_rerun_retries_the_failed_trials_and_only_them(tmp_path):
    import sqlite3

    from gleak.orchestration.runner import run_suite
    from gleak.orchestration.suite import load_suite

    (tmp_path / "s.toml").write_text(RESUME_SUITE)
    suite = load_suite(tmp_path / "s.toml")
    out = tmp_path / "out"
    first = run_suite(suite, out, progress=False, in_process=True)
    assert (first.ran, first.skipped, first.failed) == (3, 0, 0)
    victim = suite.trials[1].trial_id
    with sqlite3.connect(out / "results.sqlite") as db:  # as if it had failed (a crash, a time limit)
        db.execute("UPDATE trials SET status = 'failed', error = 'killed', mse = NULL WHERE trial_id = ?", (victim,))
    again = run_suite(suite, out, progress=False, in_process=True)
    assert (again.ran, again.skipped, again.failed) == (1, 2, 0)
    with sqlite3.connect(out / "results.sqlite") as db:
        assert db.execute("SELECT status, mse IS NOT NULL FROM trials WHERE trial_id = ?", (victim,)).fetchone() == ("ok", 1)
    assert run_suite(suite, out, progress=False, in_process=True).ran == 0  # nothing left to do


def test_rescore_writes_back_what_it_recomputes_into_the_stored_extra(tmp_path):
    import json
    import sqlite3

    from gleak.orchestration.reconstructions import rescore
    from gleak.orchestration.runner import run_suite
    from gleak.orchestration.suite import load_suite

    (tmp_path / "s.toml").write_text(RESUME_SUITE.replace("seeds = [0, 1, 2]", "seeds = [0]"))
    out = tmp_path / "out"
    run_suite(load_suite(tmp_path / "s.toml"), out, progress=False, in_process=True)
    with sqlite3.connect(out / "results.sqlite") as db:
        before = json.loads(db.execute("SELECT extra FROM trials").fetchone()[0])
        db.execute("UPDATE trials SET extra = '{}'")  # as stored by a gleak before the blind guess was scored
    assert rescore(out, ["blind", "verdict"]) == 1
    with sqlite3.connect(out / "results.sqlite") as db:
        after = json.loads(db.execute("SELECT extra FROM trials").fetchone()[0])
    for k in ("blind_mse", "blind_psnr", "half_mse", "verdict_rule"):
        assert after[k] == pytest.approx(before[k]) if k != "verdict_rule" else after[k] == before[k] == "margin"


# ---- CGD: the engine against Algorithm 2 on unequal sample blocks ------------------------------------------------
@pytest.mark.parametrize("n, rows, cols", [(11, 3, 1), (10, 4, 1), (11, 3, 2)])
@pytest.mark.parametrize("secure_sum", ["float", "protocol"])
def test_the_cgd_engine_is_algorithm_2_on_unequal_sample_blocks(n, rows, cols, secure_sum):
    """Each sample block's gradient enters the sum weighted n_i / n (its share of the data): blocks of unequal size
    tell that apart from 1 / m per block, which equal blocks cannot."""
    from gleak.protocols.cgd_reference import reference_train
    from gleak.protocols.cgd_training import ConfinedMLP, Partition, init_deltas, make_layout, step_size

    g = torch.Generator().manual_seed(n + rows)
    x, y = torch.randn(n, 7, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    part, sizes, seed, iters = Partition(rows, cols), [7, 5, 3], 2, 3
    layout = make_layout(x, y, part)
    assert len(set(layout.counts.tolist())) > 1  # the blocks are unequal
    deltas = init_deltas(part.m, 0.05, None, seed)
    alphas = [step_size(k, 0.5) for k in range(1, iters + 1)]
    net = ConfinedMLP(layout, sizes, deltas, seed, mode="cgd", secure_sum=secure_sum, dtype=torch.float64)
    for a in alphas:
        net.step(a)
    ref = reference_train(x, y, partition=part, sizes=sizes, deltas=deltas, seed=seed, alphas=alphas, mode="cgd",
                          secure_sum=secure_sum)  # fmt: skip
    for l in range(part.m):
        for got, want in zip(net.participant_params(l), ref[l]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_the_accountant_counts_the_noisy_steps_and_a_new_run_gets_a_new_one():
    from gleak.contracts.registry import create
    from gleak.mechanics.accountant import PrivacyAccountant

    d = create("defense", "noise", mode="dp", noise_multiplier=1.3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    x, y, g = torch.randn(2, 1, 2, 2), torch.tensor([0, 2]), torch.Generator().manual_seed(0)
    d.client_gradient(model, x, y, g)
    assert d.privacy_spent() is None  # no accountant given: the defense counts nothing itself
    first = PrivacyAccountant()
    d.bind_accountant(first)
    for _ in range(3):
        d.client_gradient(model, x, y, g)
    assert len(first) == 3 and d.privacy_spent() == pytest.approx(_stepped_epsilon(1.3, 3), rel=1e-9)
    d.bind_accountant(PrivacyAccountant())  # a new trial or training run: a fresh accountant
    assert d.privacy_spent() is None
    d.client_gradient(model, x, y, g)
    assert d.privacy_spent() == pytest.approx(_stepped_epsilon(1.3, 1), rel=1e-9) and len(first) == 3
