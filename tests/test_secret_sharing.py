"""Additive secret sharing over Z_2^32 (gleak.mechanics.secret_sharing): exactness, overflow, and what colluders see."""
import itertools

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from gleak.mechanics.secret_sharing import (
    MODULUS,
    EncodingOverflow,
    FixedPoint,
    fixed_point_sum,
    reconstruct,
    run_protocol,
    secure_sum,
    share,
    sum_encoded,
)  # fmt: skip


@pytest.mark.parametrize("m", [2, 3, 10, 100, 1000])
def test_reconstructed_sum_equals_the_plain_sum_of_encodings(m):
    g = torch.Generator().manual_seed(m)
    fp = FixedPoint(24)
    values = (torch.rand(m, 6, generator=g, dtype=torch.float64) - 0.5) * 2 * fp.max_value(m)  # up to the limit
    enc = fp.encode(values, addends=m)
    plain = fp.to_integers(values, addends=m).sum(0)  # the integers, summed without any ring
    total = secure_sum(enc, g)
    assert torch.equal(total, sum_encoded(enc))
    assert torch.equal(fp.decode(total), plain / fp.scale)  # exact: no rounding, no wrap-around
    assert torch.equal(fixed_point_sum(values, fp, g), plain / fp.scale)


def test_encoding_round_trip_and_resolution():
    fp = FixedPoint(16)
    x = torch.tensor([0.0, 1.0, -1.0, 1.5e-5, -2.0**-17, 12345.678], dtype=torch.float64)
    back = fp.decode(fp.encode(x))
    assert (back - x).abs().max() <= 2.0**-17
    assert back[0] == 0 and back[1] == 1 and back[2] == -1


def test_overflow_is_an_error_not_a_wrap():
    fp = FixedPoint(24)
    ok = torch.tensor([fp.max_value(10)], dtype=torch.float64)
    fp.encode(ok, addends=10)  # the limit itself fits
    with pytest.raises(EncodingOverflow, match="overflow"):
        fp.encode(ok * 1.001, addends=10)
    with pytest.raises(EncodingOverflow):
        fp.encode(torch.tensor([0.0, float("nan")]))
    # Ten addends at the limit sum to at most 2^31 - 1: the ring sum decodes to the true sum.
    enc = fp.encode(ok.expand(10, 1), addends=10)
    assert fp.decode(sum_encoded(enc)) == pytest.approx(10 * fp.max_value(10), rel=1e-12)


def _top_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    return (v >> (32 - bits)).long()


def _uniform_p(codes: torch.Tensor, bins: int) -> float:
    counts = torch.bincount(codes, minlength=bins).numpy()
    return float(chisquare(counts).pvalue)


def _shares_of(secret: int, m: int, draws: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return share(torch.full((draws,), secret, dtype=torch.int64), m, g)  # (m, draws)


def _subsets_uniform_p(shares: torch.Tensor) -> float:
    """Smallest p-value over every subset of m - 1 shares: joint top bits (2 per share) and each share's low bits."""
    m = shares.shape[0]
    ps = []
    for keep in itertools.combinations(range(m), m - 1):
        code = torch.zeros(shares.shape[1], dtype=torch.long)
        for i in keep:
            code = code * 4 + _top_bits(shares[i], 2)
        ps.append(_uniform_p(code, 4 ** (m - 1)))
        ps += [_uniform_p((shares[i] & 15).long(), 16) for i in keep]
    return min(ps)


@pytest.mark.parametrize("m", [2, 3, 4])
def test_any_m_minus_1_shares_are_uniform(m):
    for secret in (0, 123456789, MODULUS - 1):
        assert _subsets_uniform_p(_shares_of(secret, m, 20000, secret % 97 + m)) > 1e-4


def test_the_uniformity_test_catches_a_biased_sharing():
    g = torch.Generator().manual_seed(1)
    # Shares drawn from 31 bits only (a classic mistake): the top bit of the free shares is always 0.
    rand = torch.randint(0, MODULUS // 2, (3, 20000), generator=g, dtype=torch.int64)
    last = torch.remainder(7 - rand.sum(0), MODULUS)
    assert _subsets_uniform_p(torch.cat([rand, last.unsqueeze(0)])) < 1e-6


def _views(inputs: list[int], m: int, draws: int, seed: int, broken: bool = False) -> torch.Tensor:
    """What the t = m - 2 colluders (parties 2..m-1) and the aggregator see in `draws` independent runs, one row
    each: the shares the honest parties 0 and 1 sent them, the shares they sent themselves, every partial sum E^j,
    and what they can compute from these about each honest party j: E^j minus the colluders' shares to j. Their own
    inputs are the same in both worlds and are left out."""
    g = torch.Generator().manual_seed(seed)
    secrets = torch.tensor(inputs + [1000 * (i + 1) for i in range(m - len(inputs))], dtype=torch.int64)
    t = run_protocol(secrets.unsqueeze(1).expand(m, draws).contiguous(), g)  # shares (m, m, draws)
    shares = t.shares
    if broken:  # honest party 0 hands its input in the clear to the first colluder
        shares = shares.clone()
        shares[0] = 0
        shares[0, 2] = secrets[0]
    partial = torch.remainder(shares.sum(0), MODULUS)
    residual = torch.remainder(partial[:2] - shares[2:, :2].sum(0), MODULUS)
    return torch.cat([shares[:2, 2:].reshape(-1, draws), shares[2:].reshape(-1, draws), partial, residual]).T


def _same_law_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Smallest two-sample chi-square p-value over every view component and every pairwise difference (mod 2^32),
    each binned by its top 4 bits and by its low 4 bits."""
    feats = lambda v: [v[:, i] for i in range(v.shape[1])] + [  # noqa: E731
        torch.remainder(v[:, i] - v[:, j], MODULUS) for i, j in itertools.combinations(range(v.shape[1]), 2)
    ]
    ps = []
    for fa, fb in zip(feats(a), feats(b)):
        for code in (lambda v: _top_bits(v, 4), lambda v: (v & 15).long()):  # high and low bits
            table = torch.stack([torch.bincount(code(fa), minlength=16), torch.bincount(code(fb), minlength=16)])
            table = table[:, table.sum(0) > 0]  # bins neither world ever hits
            ps.append(1.0 if table.shape[1] == 1 else float(chi2_contingency(table.numpy())[1]))
    return min(ps)


def test_colluders_view_is_the_same_for_two_honest_splits_of_one_sum():
    m = 5  # t = m - 2 = 3 colluders plus the aggregator
    a = _views([10, 20], m, 20000, seed=1)
    b = _views([29, 1], m, 20000, seed=2)  # same sum 30
    assert _same_law_p(a, b) > 1e-5  # smallest p over ~800 tests
    # The check has teeth: a protocol that leaks one honest input is told apart.
    leaky_a = _views([10, 20], m, 20000, seed=3, broken=True)
    leaky_b = _views([29, 1], m, 20000, seed=4, broken=True)
    assert _same_law_p(leaky_a, leaky_b) < 1e-6
