"""DGP (seed 001): exact per-layer counts, which entries go, and error feedback that loses nothing."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gleak
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.wire import Update
from gleak.defenses.dgp import dgp_counts, dgp_keep_mask
from gleak.orchestration.trial import execute


def _layers(sizes, kind, g):
    out = {}
    for i, n in enumerate(sizes):
        if kind == "zeros":
            t = torch.zeros(n)
        elif kind == "ties":
            t = torch.randint(-2, 3, (n,), generator=g).float()  # few distinct magnitudes: ties everywhere
        else:
            t = torch.randn(n, generator=g)
        out[f"l{i}"] = t.reshape(n, 1) if i % 2 else t
    return Update(out)


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
    kind=st.sampled_from(["random", "ties", "zeros"]),
    k1=st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.25]),
    k2=st.sampled_from([0.0, 0.5, 0.75, 0.9]),
)
def test_dgp_drops_exactly_round_k1_n_plus_round_k2_n_per_layer(sizes, kind, k1, k2):
    if k1 + k2 > 1:
        return
    g = torch.Generator().manual_seed(sum(sizes))
    u = _layers(sizes, kind, g)
    out = gleak.create("defense", "dgp", k1=k1, k2=k2, error_feedback=False).transform(u, g)
    for name, a in u.tensors.items():
        n = a.numel()
        keep = dgp_keep_mask(a, k1, k2)
        # exactly round(k1 n) + round(k2 n); only with k1 + k2 = 1 can both round up past n, and then all go
        assert int((~keep).sum()) == min(n, round(k1 * n) + round(k2 * n)), (n, k1, k2)
        assert torch.equal(out[name], a * keep)  # survivors unchanged, the rest zero
        kept, dropped = a[keep].abs(), a[~keep].abs()
        if len(kept) and len(dropped):
            # every dropped entry is at least as large as the largest kept one or at most as small as the smallest
            assert bool(((dropped >= kept.max()) | (dropped <= kept.min())).all())
            # nothing kept is larger than the (round(k1 n) + 1)-th largest magnitude
            assert float(kept.max()) <= float(torch.sort(a.abs().reshape(-1), descending=True).values[round(k1 * n)])


def test_with_the_default_fractions_the_two_counts_never_need_capping():
    assert all(dgp_counts(n, 0.05, 0.75) == (round(0.05 * n), round(0.75 * n)) for n in range(1, 100_001))


def test_dgp_default_is_five_and_seventy_five_percent_on_real_layer_sizes():
    d = gleak.create("defense", "dgp")
    assert (d.k1, d.k2, d.error_feedback) == (0.05, 0.75, True)
    g = torch.Generator().manual_seed(0)
    u = Update({"w": torch.randn(256, 3072, generator=g), "b": torch.randn(256, generator=g), "c": torch.randn(10, generator=g)})
    out = d.transform(u, g)
    for name, n in (("w", 256 * 3072), ("b", 256), ("c", 10)):
        assert int((out[name] == 0).sum()) == round(0.05 * n) + round(0.75 * n)
    # the largest entries are gone: DGP never sends the top 5%
    w = u["w"].abs().reshape(-1)
    top = torch.topk(w, round(0.05 * w.numel())).indices
    assert bool((out["w"].reshape(-1)[top] == 0).all())


@pytest.mark.parametrize("name,params", [("dgp", {}), ("topk", {"ratio": 0.9, "error_feedback": True}),
                                         ("topk", {"ratio": 0.7, "scope": "layer", "error_feedback": True})])  # fmt: skip
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_error_feedback_sent_plus_residual_equals_the_true_sum(name, params, dtype, tol):
    d = gleak.create("defense", name, **params)
    d.reset()
    g = torch.Generator().manual_seed(1)
    shapes = {"a": (40, 30), "b": (40,), "c": (7, 40)}
    true_sum = {k: torch.zeros(s, dtype=dtype) for k, s in shapes.items()}
    sent_sum = {k: torch.zeros(s, dtype=dtype) for k, s in shapes.items()}
    for _ in range(12):
        u = Update({k: torch.randn(s, generator=g, dtype=dtype) * (1 + 10 * torch.rand(1, generator=g).item())
                    for k, s in shapes.items()})  # fmt: skip
        s = d.transform(u, g)
        for k in shapes:
            true_sum[k] += u[k]
            sent_sum[k] += s[k]
    residual = d._feedback.residual
    for k in shapes:
        scale = float(true_sum[k].abs().max())
        assert torch.allclose(sent_sum[k] + residual[k], true_sum[k], atol=tol * scale, rtol=0), k
        assert residual[k].abs().max() > 0  # something was held back: the test can fail
    d.reset()
    assert d._feedback.residual == {}


def test_error_feedback_changes_the_second_round_and_plain_topk_does_not():
    g = torch.Generator().manual_seed(2)
    u = Update({"a": torch.randn(100, generator=g)})
    plain, fed = gleak.create("defense", "topk", ratio=0.9), gleak.create("defense", "topk", ratio=0.9, error_feedback=True)
    assert torch.equal(plain.transform(u, g)["a"], plain.transform(u, g)["a"])
    first, second = fed.transform(u, g)["a"], fed.transform(u, g)["a"]
    assert torch.equal(first, plain.transform(u, g)["a"]) and not torch.equal(first, second)
    assert torch.equal(second, plain.transform(u.map(lambda _, t: 2 * t - first), g)["a"])  # p_2 = g + (g - C(g))


def test_dgp_gradient_distance_exceeds_topk_at_the_same_pruning_ratio():
    case = CaseConfig(dataset="skimage", model="mlp", batch_size=1)
    for seed in range(2):
        dgp = execute(TrialConfig("t", "closed-form", {}, "dgp", {}, case, seed))["grad_dist"]
        for scope in ("layer", "global"):
            topk = execute(TrialConfig("t", "closed-form", {}, "topk", {"ratio": 0.8, "scope": scope}, case, seed))["grad_dist"]
            assert dgp > topk + 0.2, (seed, scope, dgp, topk)


@pytest.mark.parametrize("seed", range(5))
def test_error_feedback_feeds_the_dropped_top_entries_back_as_the_paper_does(seed):
    """The review's toy case: a constant 1,000-entry gradient over 8 rounds. As in seed 001's convergence section
    (e_T = the sum of all that was not sent) and the public DGP code (error = grad - sent), the top 5% go back into
    the residual: there they only grow, stay on top and are never sent; the residual on them is t times the gradient
    after round t, and its norm grows about sixfold (24.6 -> 152.4 at seed 0)."""
    g = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
    top = torch.topk(g.abs(), 50).indices
    d = gleak.create("defense", "dgp")
    d.reset()
    ever_sent, norms = torch.zeros(1000, dtype=torch.bool), []
    for t in range(1, 9):
        sent = d.transform(Update({"w": g}), torch.Generator())["w"]
        ever_sent |= sent != 0
        residual = d._feedback.residual["w"]
        assert torch.allclose(residual[top], t * g[top], rtol=1e-6, atol=0)
        norms.append(float(residual.norm()))
    assert not bool(ever_sent[top].any())
    assert 22 < norms[0] < 26 and norms[-1] > 5.5 * norms[0], norms
    if seed == 0:
        assert (round(norms[0], 1), round(norms[-1], 1)) == (24.6, 152.4)
