"""FedLeak (attacks/fedleak.py): partial gradient matching matches only the candidate gradient's largest entries,
the gradient regularization mixes in the signed gradient one optimizer step ahead (0.7 / 0.3), parameters are
checked with one clear error, FedAvg deltas are matched through the simulated local training, the attack beats the
blind guess over seeds, and it passes conformance."""
from __future__ import annotations

import statistics

import pytest
import torch

import gleak
from gleak.attacks import fedleak as fl


def test_partial_mask_keeps_the_largest_share_of_each_tensor():
    g = torch.tensor([0.1, -5.0, 0.3, 2.0, -0.2, 4.0])
    assert fl.partial_mask(g, 0.5).tolist() == [False, True, False, True, False, True]
    assert fl.partial_mask(g, 1.0).all()
    assert fl.partial_mask(g, 1 / 6 + 1e-9).tolist() == [False, True, False, False, False, False]
    big = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    m = fl.partial_mask(big, 0.5)
    assert int(m.sum()) == 500 and float(big[m].abs().min()) >= float(big[~m].abs().max())


def test_partial_distance_is_the_codes_l1_plus_cosine_on_the_kept_entries():
    """D = mean|m(t - g)| + 1 - cos(m t, m g) per tensor, summed; m from the candidate g (default) or the target."""
    g = [torch.tensor([1.0, -3.0, 0.5, 2.0]), torch.tensor([[0.2, -0.1], [4.0, 0.3]])]
    t = [torch.tensor([0.5, -1.0, 7.0, 1.0]), torch.tensor([[9.0, 1.0], [1.0, -2.0]])]

    def by_hand(mask_by):
        total = 0.0
        for gi, ti in zip(g, t):
            a = (gi if mask_by == "candidate" else ti).abs().flatten()
            thr = a.sort().values[len(a) // 2 - 1: len(a) // 2 + 1].mean()  # the median of an even count
            m = ((gi if mask_by == "candidate" else ti).abs() >= thr).double()
            gm, tm = gi.double() * m, ti.double() * m
            total += float((tm - gm).abs().mean() + 1 - (gm * tm).sum() / (gm.norm() * tm.norm()))
        return total

    for mask_by in ("candidate", "observed"):
        assert float(fl.partial_distance(g, t, 0.5, mask_by)) == pytest.approx(by_hand(mask_by), rel=1e-5)


def test_partial_matching_ignores_the_entries_it_leaves_out_and_matching_all_does_not():
    """Changing the observed gradient where the candidate's entries are small leaves the partial distance as it was;
    with keep 1 (everything matched) or where the entries are large it changes."""
    gen = torch.Generator().manual_seed(1)
    g = [torch.randn(40, generator=gen), torch.randn(6, 5, generator=gen)]
    t = [torch.randn(40, generator=gen), torch.randn(6, 5, generator=gen)]
    small = [~fl.partial_mask(x, 0.5) for x in g]
    moved = [ti + 3.0 * s.to(ti.dtype) for ti, s in zip(t, small)]
    moved_big = [ti + 3.0 * (~s).to(ti.dtype) for ti, s in zip(t, small)]
    base = float(fl.partial_distance(g, t, 0.5))
    assert float(fl.partial_distance(g, moved, 0.5)) == pytest.approx(base, abs=1e-6)
    assert abs(float(fl.partial_distance(g, moved_big, 0.5)) - base) > 1e-2
    assert abs(float(fl.partial_distance(g, moved, 1.0)) - float(fl.partial_distance(g, t, 1.0))) > 1e-2
    # and the gradient of the distance is zero on the candidate's left-out entries
    gg = [x.clone().requires_grad_(True) for x in g]
    grads = torch.autograd.grad(fl.partial_distance(gg, t, 0.5), gg)
    assert all(float(d[s].abs().max()) == 0.0 and float(d[~s].abs().max()) > 0 for d, s in zip(grads, small))


def _reference(x0, s_at, mode, alpha=0.3, lr=0.1):
    """The iteration written out: AdamW step along s0, probe, restore, AdamW step along the mix."""
    x = x0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([x], lr=lr)
    s0 = s_at(x0)
    x.grad = s0.clone()
    opt.step()
    probe = x.detach().clone() if mode == "lookahead" else 2 * x0 - x.detach()
    s1 = s_at(probe)
    with torch.no_grad():
        x.copy_(x0)
    x.grad = (1 - alpha) * s0 + alpha * s1
    opt.step()
    return probe, x.detach()


@pytest.mark.parametrize("mode", ["lookahead", "ascent", "none"])
def test_the_regularization_mixes_in_the_signed_gradient_one_step_ahead(mode):
    """lookahead (the code): the second direction is taken at the point one optimizer step ahead (downhill) and the
    update goes along 0.7 s0 + 0.3 s1 from the restored point; ascent probes the reflected (uphill) point; none takes
    one plain step. Some entries of x sit within one step of the minimum, so s1 differs from s0 there."""
    c = torch.tensor([0.05, -0.04, 1.0, -1.0, 0.0, 0.3])
    x0 = torch.zeros(6)
    calls = []

    def s_at(x):
        calls.append(x.detach().clone())
        return torch.sign(x - c) + 0.5 * torch.sign(x - 2 * c)  # not a plain sign: probes show in the mix

    x = x0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([x], lr=0.1)
    fl.regularized_step(x, opt, s_at, 0.3, mode)
    got_calls = list(calls)
    calls.clear()
    if mode == "none":
        ref = x0.clone().requires_grad_(True)
        o = torch.optim.AdamW([ref], lr=0.1)
        ref.grad = s_at(x0)
        o.step()
        assert len(got_calls) == 1 and torch.allclose(x.detach(), ref.detach())
        return
    probe, want = _reference(x0, s_at, mode)
    assert len(got_calls) == 2 and torch.equal(got_calls[0], x0) and torch.allclose(got_calls[1], probe)
    assert torch.allclose(x.detach(), want, atol=1e-7)
    # the look-ahead probe lies downhill (x moved towards c), the ascent probe uphill
    step = got_calls[1] - x0
    assert (torch.sign(step) == (torch.sign(c - x0) if mode == "lookahead" else -torch.sign(c - x0)))[c.abs() > 0].all()
    plain_x = x0.clone().requires_grad_(True)
    o = torch.optim.AdamW([plain_x], lr=0.1)
    plain_x.grad = s_at(x0)
    o.step()
    if mode == "lookahead":  # here the probe crosses minima, so the regularization changes the update
        assert not torch.allclose(x.detach(), plain_x.detach())


CASE = dict(dataset="skimage", resolution=8, model="mlp", model_params={"hidden": [32]}, batch_size=4)


def test_the_attack_runs_both_techniques_with_the_codes_defaults(monkeypatch):
    """The default attack evaluates partial_distance with keep 0.5 on the candidate's magnitudes and steps through
    regularized_step in look-ahead mode with alpha 0.3; the ablations turn each off."""
    seen = {"keep": set(), "step": set()}
    real_d, real_s = fl.partial_distance, fl.regularized_step
    monkeypatch.setattr(fl, "partial_distance", lambda g, t, keep, by="candidate": seen["keep"].add((keep, by)) or real_d(g, t, keep, by))
    monkeypatch.setattr(fl, "regularized_step", lambda x, o, d, a, m, p=None: seen["step"].add((a, m)) or real_s(x, o, d, a, m, p))
    r = gleak.run_trial(attack={"name": "fedleak", "iterations": 2}, seed=0, **CASE)
    assert seen == {"keep": {(0.5, "candidate")}, "step": {(0.3, "lookahead")}} and r.extra["matched"] == "gradient"
    seen["keep"].clear(), seen["step"].clear()
    gleak.run_trial(attack={"name": "fedleak", "iterations": 2, "keep": 1.0, "regularization": "none"}, seed=0, **CASE)
    assert seen == {"keep": {(1.0, "candidate")}, "step": {(0.3, "none")}}


@pytest.mark.parametrize("bad, word", [({"keep": 0.0}, "keep"), ({"keep": 1.5}, "keep"), ({"alpha": -0.1}, "alpha"),
                                       ({"iterations": 0}, "iterations"), ({"lr": 0.0}, "lr"), ({"tv": -1.0}, "tv"),
                                       ({"median": 4}, "median"), ({"restarts": 0}, "restarts"),
                                       ({"regularization": "sam"}, "regularization"), ({"mask_by": "both"}, "mask_by"),
                                       ({"labels": "soft"}, "labels"), ({"fedavg": "unroll"}, "fedavg")])  # fmt: skip
def test_parameters_are_checked_with_one_clear_error(bad, word):
    with pytest.raises(ValueError, match=rf"^{word} must"):
        fl.FedLeak(**bad)
    attack = fl.FedLeak()
    for k, v in bad.items():
        setattr(attack, k, v)  # stored as given: checked again at use
    with pytest.raises(ValueError, match=rf"^{word} must"):
        attack._validate()


def test_given_labels_add_the_need():
    assert "labels" in fl.FedLeak(labels="given").needs and "labels" not in fl.FedLeak().needs


@pytest.mark.parametrize("fedavg, matched", [("simulate", "simulated-delta"), ("one-gradient", "delta-as-gradient")])
def test_fedavg_deltas_are_matched_through_the_simulated_client(fedavg, matched):
    case = dict(CASE, protocol={"name": "fedavg", "local_steps": 2, "local_batch_size": 2})
    r = gleak.run_trial(attack={"name": "fedleak", "iterations": 2, "fedavg": fedavg}, seed=0, **case)
    assert r.extra["matched"] == matched and r.row["psnr"] == r.row["psnr"]


def test_it_beats_the_blind_guess_over_seeds():
    """Skimage photographs at 8x8, batch 4, the MLP of 32 units, FedSGD, 150 iterations, its own labels: median PSNR
    over seeds 0-2 at least 6 dB above the blind guess."""
    gains = []
    for seed in range(3):
        r = gleak.run_trial(attack={"name": "fedleak", "iterations": 150}, seed=seed, **CASE)
        gains.append(r.row["psnr"] - r.extra["blind_psnr"])
    assert statistics.median(gains) >= 6.0, gains


def test_it_passes_conformance():
    from gleak.orchestration.conformance import check_plugin

    failed = [f"{c.name}: {c.detail}" for c in check_plugin("attack", "fedleak") if not c.passed]
    assert not failed
