"""Code tests of the sign and low-rank compressors (defenses/sign.py, defenses/powersgd.py) and of NVIDIA FLARE's
privacy filters (defenses/nvflare_filters.py): each against what its paper or FLARE's documented algorithm says it
sends, on updates whose answer is known."""
import math

import numpy as np
import pytest
import torch

from gleak.contracts.registry import create
from gleak.contracts.wire import Update

SEEDS = (0, 1, 2)


def _update(seed: int, shapes=((6, 5), (6,), (3, 4, 2, 2)), scale: float = 1.0) -> Update:
    g = torch.Generator().manual_seed(seed)
    names = [f"layer{i}.{'weight' if len(s) > 1 else 'bias'}" for i, s in enumerate(shapes)]
    return Update({n: scale * torch.randn(s, generator=g, dtype=torch.float64) for n, s in zip(names, shapes)})


def _rng(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- sign ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_sign_sends_the_signs_and_the_scaled_sign_has_the_tensors_mean_magnitude(seed):
    u = _update(seed)
    u.tensors["layer1.bias"][0] = 0.0
    raw = create("defense", "sign").transform(u, _rng())
    scaled = create("defense", "sign", scale="mean").transform(u, _rng())
    for n in u.names():
        assert torch.equal(raw[n], torch.sign(u[n]))
        assert torch.allclose(scaled[n], torch.sign(u[n]) * u[n].abs().mean())
    assert raw["layer1.bias"][0] == 0 and set(raw.flat().unique().tolist()) == {-1.0, 0.0, 1.0}


def test_sign_with_error_feedback_loses_nothing_over_rounds():
    d = create("defense", "sign", scale="mean", error_feedback=True)
    d.reset()
    total_in, total_out = None, None
    for r in range(6):
        u = _update(r)
        sent = d.transform(u, _rng(r))
        total_in = u.flat() if total_in is None else total_in + u.flat()
        total_out = sent.flat() if total_out is None else total_out + sent.flat()
    residual = torch.cat([d._feedback.residual[n].reshape(-1) for n in u.names()])
    assert torch.allclose(total_out + residual, total_in)
    assert not torch.allclose(total_out, total_in)  # something was delayed, not sent


# -- PowerSGD --------------------------------------------------------------------------------------------------------


def _rank(r: int, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g, dtype=torch.float64) @ torch.randn(r, k, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("seed", SEEDS)
def test_powersgd_sends_a_matrix_of_its_rank_exactly_and_a_fuller_one_at_that_rank(seed):
    exact = Update({"w": _rank(2, 12, 9, seed), "b": torch.ones(12, dtype=torch.float64)})
    d = create("defense", "powersgd", rank=2, error_feedback=False)
    d.reset()
    sent = d.transform(exact, _rng(seed))
    assert torch.allclose(sent["w"], exact["w"], atol=1e-10) and torch.equal(sent["b"], exact["b"])
    full = Update({"w": _rank(6, 12, 9, seed)})
    d.reset()
    out = d.transform(full, _rng(seed))["w"]
    assert torch.linalg.matrix_rank(out) == 2 and not torch.allclose(out, full["w"], atol=1e-3)


@pytest.mark.parametrize("seed", SEEDS)
def test_powersgd_warm_started_rounds_reach_the_best_approximation_of_its_rank(seed):
    """Warm-started power iteration on a fixed matrix converges to its best rank-r approximation (the truncated SVD:
    Eckart-Young); restarting from a new random Q every round does not get there in one step."""
    m = _rank(8, 16, 10, seed) + 0.01 * _rank(10, 16, 10, seed + 100)
    u, s, vh = torch.linalg.svd(m)
    best = u[:, :2] @ torch.diag(s[:2]) @ vh[:2]
    warm = create("defense", "powersgd", rank=2, error_feedback=False)
    cold = create("defense", "powersgd", rank=2, error_feedback=False, warm_start=False)
    warm.reset(), cold.reset()
    rng_w, rng_c = _rng(seed), _rng(seed)
    for _ in range(60):
        w_out = warm.transform(Update({"w": m}), rng_w)["w"]
        c_out = cold.transform(Update({"w": m}), rng_c)["w"]
    best_err = float((m - best).norm())
    assert float((m - w_out).norm()) == pytest.approx(best_err, rel=1e-6)
    assert float((m - c_out).norm()) > best_err * (1 + 1e-3)


def test_powersgd_error_feedback_loses_nothing_over_rounds():
    d = create("defense", "powersgd", rank=1)
    d.reset()
    total_in = total_out = 0
    for r in range(5):
        u = _update(r)
        sent = d.transform(u, _rng(r))
        total_in, total_out = total_in + u.flat(), total_out + sent.flat()
    residual = torch.cat([d._feedback.residual[n].reshape(-1) for n in u.names()])
    assert torch.allclose(total_out + residual, total_in)


# -- NVIDIA FLARE's filters ------------------------------------------------------------------------------------------


def _flare_percentile(tensors: dict, percentile: float, gamma: float) -> dict:
    """FLARE's PercentilePrivacy on one update, in numpy, written from its documented algorithm (steps s = 1)."""
    allabs = np.concatenate([np.abs(v.numpy()).ravel() for v in tensors.values()])
    cutoff = np.percentile(allabs, q=percentile)
    out = {}
    for k, v in tensors.items():
        d = v.numpy().copy()
        if d.ndim == 0:
            out[k] = d
            continue
        d[(d > -cutoff) & (d < cutoff)] = 0
        out[k] = np.clip(d, -gamma, gamma)
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("percentile, gamma", [(10, 0.01), (50, 0.5), (90, 2.0), (0, 1e-3), (100, 1.0)])
def test_percentile_is_flares_percentile_privacy(seed, percentile, gamma):
    u = _update(seed, scale=0.3)
    u.tensors["scalar"] = torch.tensor(0.7, dtype=torch.float64)
    sent = create("defense", "percentile", percentile=percentile, gamma=gamma).transform(u, _rng())
    ref = _flare_percentile(u.tensors, percentile, gamma)
    for n in u.names():
        np.testing.assert_array_equal(sent[n].numpy(), ref[n])


def test_percentile_by_hand():
    u = Update({"w": torch.tensor([0.001, -0.002, 0.5, -0.3], dtype=torch.float64)})
    sent = create("defense", "percentile", percentile=50, gamma=0.01).transform(u, _rng())
    # cut-off: the median of (0.001, 0.002, 0.3, 0.5) = 0.151; kept entries clipped to +-0.01
    assert sent["w"].tolist() == [0.0, 0.0, 0.01, -0.01]


def test_exclude_vars_zeros_the_named_parameters_by_name_or_by_pattern():
    u = _update(0)
    by_name = create("defense", "exclude-vars", exclude=["layer0.weight"]).transform(u, _rng())
    by_pattern = create("defense", "exclude-vars", exclude="^layer[02]").transform(u, _rng())
    unanchored = create("defense", "exclude-vars", exclude="bias").transform(u, _rng())
    for n in u.names():
        assert torch.equal(by_name[n], torch.zeros_like(u[n]) if n == "layer0.weight" else u[n])
        assert torch.equal(by_pattern[n], torch.zeros_like(u[n]) if n[5] in "02" else u[n])
        assert torch.equal(unanchored[n], torch.zeros_like(u[n]) if n.endswith("bias") else u[n])
    nothing = create("defense", "exclude-vars").transform(u, _rng())
    assert all(torch.equal(nothing[n], u[n]) for n in u.names())


def test_exclude_vars_that_match_nothing_fail_naming_the_parameters():
    u = _update(0)
    for exclude in ("^fc", ["layer0.weight", "head.weight"]):
        with pytest.raises(ValueError, match="layer0.weight, layer1.bias"):
            create("defense", "exclude-vars", exclude=exclude).transform(u, _rng())
    from gleak.contracts.registry import ParamError

    with pytest.raises(ParamError, match="exclude is not a regular expression"):
        create("defense", "exclude-vars", exclude="(")


def test_laplace_draws_have_the_scale_asked():
    from gleak.defenses.noise import sample_noise  # the Laplace sampler SVT shares with the noise defense

    x = sample_noise(torch.Size([400_000]), 0.3, "laplace", _rng(0), torch.float64)
    assert float(x.abs().mean()) == pytest.approx(0.3, rel=0.01) and abs(float(x.mean())) < 0.003


@pytest.mark.parametrize("seed", SEEDS)
def test_svt_releases_at_most_its_fraction_clipped_plus_noise_and_zeros_elsewhere(seed):
    u = _update(seed, shapes=((40, 25), (40,)), scale=1e-3)
    n = u.flat().numel()
    c = math.ceil(0.1 * n)
    for replace in (True, False):
        d = create("defense", "svt", replace=replace)
        sent = d.transform(u, _rng(seed)).flat()
        released = int((sent != 0).sum())
        assert released == c if not replace else 0.5 * c < released <= c
    # With the release noise made negligible (a vast release budget), a released entry is its clipped value.
    quiet = create("defense", "svt", noise_var=1e12, gamma=1e-4).transform(u, _rng(seed)).flat()
    on = quiet != 0
    assert torch.allclose(quiet[on], u.flat()[on].clamp(-1e-4, 1e-4), atol=1e-12)


def test_svt_selects_the_large_entries_when_its_selection_budget_is_large():
    """With a large selection budget the query noise is small against the entries, so the c entries above the
    threshold are those accepted; with FLARE's default budget the choice is close to random."""
    g = _rng(0)
    w = torch.full((1000,), 1e-6, dtype=torch.float64)
    big = torch.randperm(1000, generator=g)[:100]
    w[big] = 1.0
    u = Update({"w": w})
    hits = []
    for eps in (1e4, 0.1):
        sent = create("defense", "svt", fraction=0.1, selection_epsilon=eps, gamma=1.0, tau=0.5, noise_var=1e12).transform(u, _rng(1))
        hits.append(float((sent["w"][big] != 0).float().sum()) / float((sent["w"] != 0).sum()))
    assert hits[0] == 1.0 and hits[1] < 0.5, hits
