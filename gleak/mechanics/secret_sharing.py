"""Additive secret sharing over Z_2^32 with fixed-point encoding: the secure sum of Confined Gradient Descent (Zhang, Bai, Li, Nepal and Ko; CGD, Appendix A;
Bogdanov et al. 2008, Sharemind), reusable by any protocol that needs a sum of private vectors.

    fp = FixedPoint(frac_bits=24)
    enc = fp.encode(values, addends=m)          # (m, ...) ring elements; raises EncodingOverflow, never wraps
    total = secure_sum(enc, rng)                # the full protocol: share, add what you hold, reconstruct
    fp.decode(total)                            # == fp.decode(enc.sum(0) mod 2^32), bit for bit

Encoding. A real x becomes round(x * 2^f) in two's complement modulo 2^32 (f = `frac_bits`, stated by whoever uses
it; resolution 2^-f). A sum of m encodings is representable only if it lies in [-2^31, 2^31), so `encode` checks
every value against the per-addend limit floor((2^31 - 1) / m) and raises EncodingOverflow naming the largest
magnitude and the limit when it is exceeded. With that check the reconstructed ring sum equals the plain integer
sum of the encodings exactly (no silent wrap-around), and decoding is exact.

Sharing. A secret s is split into m shares: m - 1 drawn uniformly from Z_2^32, the last s minus their sum. Any m - 1
of them are independent and uniform, so they reveal nothing about s. For a sum, party i shares its secret among all
parties, party j adds the shares it holds (E^j), and the aggregator adds the E^j. A coalition of up to m - 2 parties
plus the aggregator sees only uniform shares and the E^j, whose joint law given the sum of the honest secrets does
not depend on how that sum is split (tests/test_secret_sharing.py checks this statistically).

The full protocol costs m^2 ring elements per coordinate. `sum_encoded` (the integer sum of the encodings) gives
the same result bit for bit at m times less cost; protocols use it where m^2 is too large and say so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gleak.contracts.errors import GleakError

RING_BITS = 32
MODULUS = 1 << RING_BITS
_HALF = 1 << (RING_BITS - 1)


class EncodingOverflow(GleakError, OverflowError):
    """A value does not fit the fixed-point ring for the number of addends of the sum it enters."""


@dataclass(frozen=True)
class FixedPoint:
    """Fixed-point encoding into Z_2^32 with `frac_bits` fractional bits (resolution 2^-frac_bits)."""

    frac_bits: int = 24

    def __post_init__(self):
        if not 0 <= self.frac_bits < RING_BITS - 1:
            raise ValueError(f"frac_bits must be in [0, {RING_BITS - 2}], got {self.frac_bits}")

    @property
    def scale(self) -> float:
        return float(1 << self.frac_bits)

    def limit(self, addends: int = 1) -> int:
        """The largest |encoded integer| one addend may have so that a sum of `addends` never leaves the ring."""
        if addends < 1:
            raise ValueError(f"addends must be >= 1, got {addends}")
        return (_HALF - 1) // addends

    def max_value(self, addends: int = 1) -> float:
        """The largest |real value| one addend may have (limit / 2^frac_bits)."""
        return self.limit(addends) / self.scale

    def to_integers(self, x: Tensor, addends: int = 1) -> Tensor:
        """round(x * 2^f) as exact integers in float64 (|v| < 2^31, so float64 holds them and their sums exactly).
        Raises EncodingOverflow when a value exceeds the per-addend limit, and on NaN or infinity."""
        v = x.detach().to(torch.float64, copy=True).mul_(self.scale).round_()
        if v.numel():
            lo, hi = torch.aminmax(v)  # NaN propagates into both
            worst = max(-float(lo), float(hi))
            if not math.isfinite(worst):
                raise EncodingOverflow("cannot encode NaN or infinity in fixed point")
            lim = self.limit(addends)
            if worst > lim:
                raise EncodingOverflow(
                    f"fixed-point overflow: |value| up to {worst / self.scale:.6g} but a sum of {addends} addends in "
                    f"Z_2^{RING_BITS} with {self.frac_bits} fractional bits allows at most {lim / self.scale:.6g} per "
                    f"addend (use fewer fractional bits)"
                )
        return v

    def encode(self, x: Tensor, addends: int = 1) -> Tensor:
        """Ring elements (int64 in [0, 2^32)) of round(x * 2^f), two's complement."""
        return torch.remainder(self.to_integers(x, addends).to(torch.int64), MODULUS)

    def decode(self, ring: Tensor) -> Tensor:
        """Ring elements back to reals (float64): values >= 2^31 are negative."""
        r = torch.remainder(ring.to(torch.int64), MODULUS)
        signed = torch.where(r >= _HALF, r - MODULUS, r)
        return signed.to(torch.float64) / self.scale


def share(secret: Tensor, parties: int, rng: torch.Generator) -> Tensor:
    """Split ring elements `secret` into `parties` additive shares, shape (parties, *secret.shape): parties - 1
    uniform in Z_2^32, the last one the secret minus their sum (mod 2^32)."""
    if parties < 1:
        raise ValueError(f"parties must be >= 1, got {parties}")
    secret = secret.to(torch.int64)
    rand = torch.randint(0, MODULUS, (parties - 1, *secret.shape), generator=rng, dtype=torch.int64)
    last = torch.remainder(secret - rand.sum(0), MODULUS)
    return torch.cat([rand, last.unsqueeze(0)])


def reconstruct(shares: Tensor) -> Tensor:
    """The secret (or sum) from all shares: their sum mod 2^32. Shape (parties, ...) -> (...)."""
    return torch.remainder(shares.to(torch.int64).sum(0), MODULUS)


@dataclass(frozen=True)
class Transcript:
    """Everything that crosses the wire in one secure sum. shares[i, j]: the share of party i's secret that party j
    receives; partial[j]: E^j, the sum of the shares party j holds, sent to the aggregator; total: the reconstruction."""

    shares: Tensor  # (parties, parties, ...)
    partial: Tensor  # (parties, ...)
    total: Tensor  # (...)


def run_protocol(secrets: Tensor, rng: torch.Generator) -> Transcript:
    """One secure sum with its full transcript (secrets: ring elements, one row per party)."""
    m = secrets.shape[0]
    shares = torch.stack([share(s, m, rng) for s in secrets])  # [i, j]: party i's secret, share for party j
    partial = torch.remainder(shares.sum(0), MODULUS)  # E^j = sum_i shares[i, j]
    return Transcript(shares, partial, reconstruct(partial))


def secure_sum(secrets: Tensor, rng: torch.Generator, max_elements: int = 1 << 24) -> Tensor:
    """The sum of the parties' secrets (ring elements, shape (parties, ...)) computed by the protocol: each party
    shares, each adds what it holds, the aggregator reconstructs. Processed in coordinate chunks so that at most
    `max_elements` shares exist at once."""
    m = secrets.shape[0]
    flat = secrets.reshape(m, -1).to(torch.int64)
    step = max(1, max_elements // (m * m))
    out = torch.empty(flat.shape[1], dtype=torch.int64)
    for lo in range(0, flat.shape[1], step):
        out[lo : lo + step] = run_protocol(flat[:, lo : lo + step], rng).total
    return out.view(secrets.shape[1:])


def sum_encoded(secrets: Tensor) -> Tensor:
    """The ring sum of encodings without running the protocol (the protocol's output, bit for bit)."""
    return torch.remainder(secrets.to(torch.int64).sum(0), MODULUS)


def fixed_point_sum(values: Tensor, fp: FixedPoint, rng: torch.Generator | None = None) -> Tensor:
    """Decode(secure sum of encode(values)) over the leading axis (one row per party), float64.

    With `rng` the full share protocol runs; without it the encodings are summed directly (identical result, used
    where m^2 shares per coordinate would be too many)."""
    enc = fp.encode(values, addends=values.shape[0])
    total = secure_sum(enc, rng) if rng is not None else sum_encoded(enc)
    return fp.decode(total)
