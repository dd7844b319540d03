"""A client's privacy accountant, shaped as opacus keeps one: stepped where the noise is drawn, asked for epsilon.

The trial gives each client's defense an accountant of its own (`Defense.bind_accountant`) before the first round;
a defense that draws calibrated noise (DP-SGD, defenses/noise.py) steps it once per noisy step it actually takes,
and the trial asks the victim's for epsilon at the defense's delta. The defense keeps no count: what was spent is
the accountant's.

>>> acc = PrivacyAccountant()
>>> acc.step(noise_multiplier=1.0, sample_rate=0.01); acc.step(noise_multiplier=1.0, sample_rate=0.01)
>>> acc.history, len(acc)
([(1.0, 0.01, 2)], 2)
>>> round(acc.get_epsilon(1e-5), 3) == round(PrivacyAccountant.of(1.0, 0.01, 2).get_epsilon(1e-5), 3)
True
"""
from __future__ import annotations

import math
import warnings

MECHANISMS = ("rdp", "prv")  # opacus' accountants


class PrivacyAccountant:
    """The steps of the subsampled Gaussian mechanism one client took: history (noise_multiplier, sample_rate,
    steps), equal consecutive steps merged as opacus merges them."""

    def __init__(self) -> None:
        self.history: list[tuple[float, float, int]] = []

    @classmethod
    def of(cls, noise_multiplier: float, sample_rate: float, steps: int) -> "PrivacyAccountant":
        """An accountant that has taken `steps` equal steps (a horizon, not a run)."""
        acc = cls()
        if steps > 0:
            acc.history.append((float(noise_multiplier), float(sample_rate), int(steps)))
        return acc

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        z, q = float(noise_multiplier), float(sample_rate)
        if self.history and self.history[-1][:2] == (z, q):
            self.history[-1] = (z, q, self.history[-1][2] + 1)
        else:
            self.history.append((z, q, 1))

    def __len__(self) -> int:
        return sum(n for _, _, n in self.history)

    def get_epsilon(self, delta: float, mechanism: str = "rdp") -> float | None:
        """epsilon at `delta` of every step taken, from opacus' accountant `mechanism` (stepped as training stepped
        it); None before any step, infinity where a step drew no noise."""
        if not self.history:
            return None
        if any(z == 0 for z, _, _ in self.history):
            return math.inf
        from opacus.accountants import create_accountant

        acc = create_accountant(mechanism=mechanism)
        for z, q, n in self.history:
            for _ in range(n):
                acc.step(noise_multiplier=z, sample_rate=q)
        with warnings.catch_warnings():  # opacus' advice to widen its default orders; we report its default bound
            warnings.filterwarnings("ignore", message="Optimal order is the")
            return float(acc.get_epsilon(delta=delta))
