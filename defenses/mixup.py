"""MixUp (Zhang, Cisse, Dauphin, Lopez-Paz, "mixup: Beyond Empirical Risk Minimization", ICLR 2018) as a defense
against gradient inversion, in the k-way form Huang et al. evaluate (NeurIPS 2021, "Evaluating Gradient Inversion
Attacks and Defenses in Federated Learning"; Princeton-SysML/GradAttack, gradattack/defenses/mixup.py)."""
from __future__ import annotations

import torch
from torch import Tensor

from gleak.contracts.registry import register_defense
from gleak.defenses._mixing import Mixing


@register_defense("mixup")
class MixUp(Mixing):
    """The client computes its gradient on k-way mixtures of its batch and their mixed one-hot labels.

    Parameters (defaults: Huang et al.'s evaluation, their example scripts' --k 4 --c_1 0 --c_2 0.65; with gradient
    pruning they mix k = 6)
    ----------
    k: how many distinct examples each encoding mixes (4). Zhang et al.'s MixUp mixes two with lambda ~ Beta(a, a):
        k = 2 with alpha_first = 1 and bounds [0, 1] is that law for a = 1.
    lower, upper: every mixing coefficient lies in [lower, upper] (their c_1, c_2: 0 and 0.65), rows redrawn until so.
    alpha_first: the Dirichlet's first concentration, the others 1 (3, as GradAttack's code sets it).
    num_classes: the labels' classes; by default the runner's (Defense.bind_classes).
    prune: the share of each parameter tensor's gradient entries pruned after mixing (0: none; Huang et al.'s
        combination with gradient pruning uses 0.9 with k = 6): see gleak.defenses._mixing.Mixing.

    See gleak.defenses._mixing.Mixing for how its trials are scored (against the private images) and the one
    deviation (the pool is the client's batch, not its whole training set).
    """

    def gradient_batch(self, x: Tensor, y: Tensor, rng: torch.Generator) -> tuple[Tensor, Tensor]:
        return self.mixed(x, y, rng)
