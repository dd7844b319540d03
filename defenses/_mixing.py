"""The k-way mixing behind MixUp and InstaHide as Huang et al. evaluate them (NeurIPS 2021, "Evaluating Gradient
Inversion Attacks and Defenses in Federated Learning"; their repository Princeton-SysML/GradAttack,
gradattack/defenses/mixup.py and instahide.py): every encoded example is a convex combination of k distinct
examples, its label the same combination of their one-hot labels.

Their drawing, kept here: the k examples of encoding i are row i of k independent random permutations of the pool
(a row that repeats an example is redrawn uniformly); the coefficients are Dirichlet(3, 1, ..., 1), each row redrawn
until every coefficient lies in [lower, upper] (their c_1, c_2; 0 and 0.65 in their scripts). The pool is the
client's batch (see `Mixing`'s docstring for why)."""
from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Defense
from gleak.contracts.wire import Update
from gleak.defenses.topk import keep_largest

MAX_DRAWS = 100_000  # rejection sampling of one row's coefficients; a feasible [lower, upper] needs a handful


def draw_mixing(size: int, k: int, alpha: list[float], lower: float, upper: float,
                rng: torch.Generator) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(coefficients (size, k) float64, selections (size, k) long) as GradAttack's generate_mapping draws them, from a
    numpy generator seeded by `rng` (numpy has the Dirichlet law; the draw stays a function of `rng`)."""
    g = np.random.default_rng(int(torch.randint(2**62, (), generator=rng)))
    selects = np.stack([g.permutation(size) for _ in range(k)], axis=1)
    for i in range(size):
        while len(set(selects[i].tolist())) != k:
            selects[i] = g.integers(0, size, k)
    lams = g.dirichlet(alpha, size=size)
    for i in range(size):
        for _ in range(MAX_DRAWS):
            if k == 1 or (lams[i].max() <= upper and lams[i].min() >= lower):
                break
            lams[i] = g.dirichlet(alpha)
        else:
            raise RuntimeError(f"no mixing coefficients in [{lower}, {upper}] after {MAX_DRAWS} draws")
    return torch.from_numpy(lams), torch.from_numpy(selects).long()


def mix(x: Tensor, y: Tensor, lams: Tensor, selects: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """(sum_j lams[:, j] x[selects[:, j]], sum_j lams[:, j] onehot(y[selects[:, j]])): the encoded batch in x's
    dtype and its soft labels (B, num_classes), rows summing to 1."""
    lam = lams.to(x.dtype)
    shape = (-1,) + (1,) * (x.dim() - 1)
    mixed = sum(lam[:, j].view(shape) * x[selects[:, j]] for j in range(lams.shape[1]))
    onehot = F.one_hot(y.long(), num_classes).to(x.dtype)
    soft = sum(lam[:, j, None] * onehot[selects[:, j]] for j in range(lams.shape[1]))
    return mixed, soft


class Mixing(Defense):
    """The client trains on k-way mixtures of its batch with soft labels (base of MixUp and InstaHide).

    Trials of these defenses are scored against the client's private images (`scored_against = "private"`): the
    encodings are what was sent, but an attack that recovers an encoding has not yet recovered anyone's image; the
    scores against the encodings are kept beside (psnr_sent, mse_sent, ssim_sent, lpips_sent in the row's extra). An
    attack given the labels ("labels" in its needs) is handed the soft labels that entered the gradient, as Huang et
    al.'s attacker is (their strong setting gives the attack the mixed labels).

    prune: the fraction of each parameter's gradient entries, smallest magnitude first, set to zero after the mixed
    gradient is computed (0, the default: none). Huang et al. combine MixUp and InstaHide with gradient pruning
    (their GradPruneDefense, --defense_gradprune --p; with pruning they mix k = 6 at p = 0.9): a threshold per
    parameter tensor at the p-quantile of its magnitudes, entries below it zeroed. Here the round(p * n) smallest
    of each tensor are zeroed (an exact count, as `topk` with scope = "layer"; the quantile keeps ties at the
    threshold). Left out of trial ids at 0.

    Deviation, named: GradAttack mixes each encoding from the client's whole training set (re-drawn each epoch); a
    gleak client computes its gradient on its batch alone, so the pool is the batch: the batch needs at least k
    examples (a smaller one is a case this defense does not apply to, said in the row). Every encoding then mixes
    images of the attacked batch, which is what is scored.
    """

    scored_against: ClassVar[str] = "private"
    conformance_params: ClassVar[dict[str, Any]] = {"num_classes": 3}  # its probes' labels are 0..2, with no runner

    def __init__(self, k: int = 4, lower: float = 0.0, upper: float = 0.65, alpha_first: float = 3.0,
                 num_classes: int | None = None, prune: float = 0.0):  # fmt: skip
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        if not 0 <= lower <= upper <= 1:
            raise ValueError(f"need 0 <= lower <= upper <= 1, got lower={lower}, upper={upper}")
        if k > 1 and not (k * lower < 1 < k * upper or k * lower == 1 == k * upper):
            raise ValueError(f"no {k} coefficients summing to 1 lie in [lower, upper] = [{lower}, {upper}]")
        if alpha_first <= 0:
            raise ValueError(f"alpha_first must be positive, got {alpha_first}")
        if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 2):
            raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        if not 0.0 <= prune < 1.0:
            raise ValueError(f"prune must be in [0, 1), got {prune}")
        self.k, self.lower, self.upper, self.alpha_first, self.num_classes = k, lower, upper, alpha_first, num_classes
        self.prune = prune
        self._classes: int | None = None

    @classmethod
    def identity_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The stored parameters: `prune` only where set (trials stored before it keep their ids)."""
        return {k: v for k, v in params.items() if k != "prune" or v != 0.0}

    def transform(self, update: Update, rng: torch.Generator) -> Update:
        if self.prune == 0.0:
            return update
        return update.map(lambda _, a: keep_largest(a, self.prune))

    def bind_classes(self, num_classes: int) -> None:
        self._classes = int(num_classes)

    def classes(self) -> int:
        if self.num_classes is not None:
            return self.num_classes
        if self._classes is None:
            raise RuntimeError(f"{self.registered_name or type(self).__name__}: the number of classes was not given "
                               "(num_classes, or Defense.bind_classes from the runner)")  # fmt: skip
        return self._classes

    def mixed(self, x: Tensor, y: Tensor, rng: torch.Generator) -> tuple[Tensor, Tensor]:
        if not x.is_floating_point():
            raise UnsupportedCase(f"{self.registered_name or 'mixing'} mixes images; this case's inputs are token ids")
        if len(x) < self.k:
            raise UnsupportedCase(f"{self.registered_name or 'mixing'} mixes k = {self.k} distinct examples of the "
                                  f"client's batch; the batch has {len(x)}")  # fmt: skip
        lams, selects = draw_mixing(len(x), self.k, [self.alpha_first] + [1.0] * (self.k - 1), self.lower, self.upper, rng)
        return mix(x.detach(), y, lams, selects, self.classes())
