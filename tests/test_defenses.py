import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gleak
from gleak.contracts.wire import Update


def _seed002_bf16(a: np.ndarray) -> np.ndarray:
    """seed 002's to_bf16, verbatim in behaviour: round-to-nearest-even on the float32 bits."""
    u = a.astype(np.float32).view(np.uint32)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
    return u.view(np.float32)


def _upd(*tensors):
    return Update({f"p{i}": t for i, t in enumerate(tensors)})


def test_bf16_is_round_to_nearest_even_like_seed_002():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(10000, generator=g) * torch.logspace(-6, 3, 10000)
    out = gleak.create("defense", "quantization", format="bf16").transform(_upd(a), g)["p0"]
    assert np.array_equal(out.numpy(), _seed002_bf16(a.numpy()))


def test_int8_symmetric_per_tensor():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g, dtype=torch.float64)
    out = gleak.create("defense", "quantization", format="int", bits=8).transform(_upd(a), g)["p0"]
    scale = a.abs().max() / 127
    q = out / scale
    assert torch.allclose(q, q.round(), atol=1e-9) and q.abs().max() <= 127 + 1e-9
    assert (out - a).abs().max() <= scale / 2 + 1e-12
    assert len(torch.unique(q.round())) <= 255


def test_stochastic_rounding_is_unbiased():
    a = torch.full((200000,), 0.3, dtype=torch.float64)
    a[0] = 1.0  # sets the scale to 1/127
    d = gleak.create("defense", "quantization", format="int", bits=8, stochastic=True)
    out = d.transform(_upd(a), torch.Generator().manual_seed(1))["p0"][1:]
    assert abs(float(out.mean()) - 0.3) < 1e-4
    assert len(torch.unique(out)) == 2


@pytest.mark.parametrize("dist,expected_std", [("gaussian", 0.1), ("laplace", 0.1 * 2**0.5)])
def test_noise_has_the_asked_scale(dist, expected_std):
    a = torch.zeros(400000, dtype=torch.float64)
    out = gleak.create("defense", "noise", sigma=0.1, distribution=dist).transform(_upd(a), torch.Generator().manual_seed(0))
    assert abs(float(out["p0"].std()) - expected_std) / expected_std < 0.01
    assert abs(float(out["p0"].mean())) < 1e-3


@settings(max_examples=60, deadline=None)
@given(n1=st.integers(1, 300), n2=st.integers(1, 300), ratio=st.floats(0, 1), layer=st.booleans(), ties=st.booleans())
def test_topk_prunes_exactly_the_ratio(n1, n2, ratio, layer, ties):
    g = torch.Generator().manual_seed(n1 * 1000 + n2)
    a, b = torch.randn(n1, generator=g), torch.randn(n2, generator=g)
    if ties:
        a, b = a.sign(), b.sign()  # all magnitudes equal
    d = gleak.create("defense", "topk", ratio=ratio, scope="layer" if layer else "global")
    out = d.transform(_upd(a, b), g)
    if layer:
        for src, dst in ((a, out["p0"]), (b, out["p1"])):
            assert int((dst != 0).sum()) == src.numel() - round(ratio * src.numel())
    else:
        n = n1 + n2
        assert int((out.flat() != 0).sum()) == n - round(ratio * n)
    kept = out.flat() != 0
    assert torch.equal(out.flat()[kept], torch.cat([a, b])[kept])  # survivors are unchanged
    groups = [(a, out["p0"]), (b, out["p1"])] if layer else [(torch.cat([a, b]), out.flat())]
    for src, dst in groups:  # every survivor is at least as large as every pruned entry of its group
        k = dst != 0
        if k.any() and (~k).any() and not ties:
            assert dst[k].abs().min() >= src[~k].abs().max()


def test_defenses_do_not_mutate_input_and_keep_dtype():
    for name, params in [("quantization", {}), ("quantization", {"format": "bf16"}), ("noise", {}), ("topk", {})]:
        a = torch.randn(50, dtype=torch.float64)
        keep = a.clone()
        out = gleak.create("defense", name, **params).transform(_upd(a), torch.Generator().manual_seed(0))
        assert torch.equal(a, keep) and out["p0"].dtype == torch.float64
