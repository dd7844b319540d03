"""R-GAP on its reference's model family (JunyiZhu-AI/R-GAP's CNN6: LeakyReLU(0.2) convolutions without bias, a
linear classifier without bias), registered as `cnn6`, beside DLG's sigmoid LeNet."""
import statistics

import torch
from torch import nn

import gleak
from gleak.mechanics.models import create_model


def test_cnn6_is_the_reference_architecture():
    """At 32x32: the reference's six convolutions (kernels 4,3,3,3,3,3; strides 2,2,1,1,2,1; 12-36-36-36-64-128
    channels), LeakyReLU 0.2, no biases, and 3200 features into the classifier."""
    m = create_model("cnn6", (3, 32, 32), 10, seed=0)
    convs = [l for l in m.modules() if isinstance(l, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [12, 36, 36, 36, 64, 128]
    assert [c.kernel_size[0] for c in convs] == [4, 3, 3, 3, 3, 3] and [c.stride[0] for c in convs] == [2, 2, 1, 1, 2, 1]
    assert all(c.bias is None for c in convs) and m.fc.bias is None and m.fc.in_features == 3200
    assert all(a.negative_slope == 0.2 for a in m.modules() if isinstance(a, nn.LeakyReLU))
    assert torch.equal(create_model("cnn6", (3, 32, 32), 10, seed=0).fc.weight, m.fc.weight)


def test_rgap_recovers_undefended_on_cnn6():
    """Batch 1 at 16x16 (about a CPU second a trial): every layer's system has full rank and the median PSNR over 5
    seeds is above 40 dB in float32 (float64: the PSNR ceiling), where DLG's sigmoid LeNet at the same size is
    the fragile baseline."""
    psnrs = []
    for seed in range(5):
        r = gleak.run_trial(attack="rgap", dataset="skimage", model="cnn6", batch_size=1, resolution=16, seed=seed)
        assert r.extra["rank_deficiency"] == 0, (seed, r.extra)
        psnrs.append(r.row["psnr"])
    assert statistics.median(psnrs) >= 40, psnrs
