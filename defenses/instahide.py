"""InstaHide (Huang, Song, Li, Arora, "InstaHide: Instance-hiding Schemes for Private Distributed Learning", ICML
2020), inside-dataset form, as Huang et al. evaluate it against gradient inversion (NeurIPS 2021;
Princeton-SysML/GradAttack, gradattack/defenses/instahide.py): a k-way MixUp whose every entry's sign is flipped at
random."""
from __future__ import annotations

import torch
from torch import Tensor

from gleak.contracts.registry import register_defense
from gleak.defenses._mixing import Mixing


def sign_mask(shape: torch.Size, rng: torch.Generator, dtype: torch.dtype) -> Tensor:
    """+1 or -1 with probability 1/2 each, independently per entry (every pixel of every channel)."""
    return torch.randint(2, tuple(shape), generator=rng).to(dtype) * 2 - 1


@register_defense("instahide")
class InstaHide(Mixing):
    """The client computes its gradient on k-way mixtures of its batch (as `mixup`), each entry multiplied by a
    random sign, and their mixed one-hot labels.

    Parameters (defaults: Huang et al.'s evaluation, their example scripts' --k 4 --c_1 0 --c_2 0.65)
    ----------
    k, lower, upper, alpha_first, num_classes, prune: as `mixup` (gleak.defenses.mixup.MixUp).

    The mask is drawn per encoding and entry, on the normalised inputs, as GradAttack's instahide_batch does (after
    the data's normalisation, per pixel and channel). The InstaHide paper's cross-dataset variant (mixing in public
    images) is not built; its inside-dataset variant is the one Huang et al. attack. Carlini et al.'s decoding of
    InstaHide encodings (their second stage, over many training steps) is not an attack here: a trial is scored
    against the private images, so an attack that stops at the encodings is scored as far as it got.
    """

    def gradient_batch(self, x: Tensor, y: Tensor, rng: torch.Generator) -> tuple[Tensor, Tensor]:
        mixed, soft = self.mixed(x, y, rng)
        return mixed * sign_mask(mixed.shape, rng, mixed.dtype), soft
