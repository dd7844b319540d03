"""The cost estimate (gleak.orchestration.runner.estimated_costs) counts what the attacks do, so that longest-first starts the
right trials first: DLG's L-BFGS evaluates the objective up to max_iter times per step, restarts multiply, and
inverting gradients' preset iterations count when `iterations` is left at None. The model pass is counted by
torch.utils.flop_counter.FlopCounterMode."""
from pathlib import Path

import pytest

from gleak.contracts.config import CaseConfig
from gleak.orchestration.runner import _model_pass_cost, _pass_flops, estimated_costs, longest_first
from gleak.orchestration.suite import load_suite

SUITE = """
[suite]
name = "costs"
seeds = [0, 1]
[case]
dataset = "skimage"
model = "mlp"
model_params = {{ hidden = [16] }}
resolution = 8
batch_size = 1
[[attack]]
name = "closed-form"
{attacks}
[[defense]]
name = "none"
"""


def _order(tmp_path: Path, attacks: str) -> list[str]:
    f = tmp_path / "costs.toml"
    f.write_text(SUITE.format(attacks=attacks))
    trials = load_suite(f).trials
    return [t.attack for t in longest_first(trials, estimated_costs(trials))]


def test_a_suite_mixing_dlg_and_inverting_gradients_starts_the_dlg_trials_first(tmp_path):
    # DLG's defaults: 300 steps x up to 20 evaluations x 16 restarts, batched on this small model (1 + 0.25 x 15
    # restarts' worth): 28,500 evaluations; inverting gradients here 10,000. Counting one evaluation per L-BFGS step
    # would start IG first.
    order = _order(tmp_path, """
[[attack]]
name = "inverting-gradients"
iterations = 10000
[[attack]]
name = "dlg"
""")
    assert order == ["dlg", "dlg", "inverting-gradients", "inverting-gradients", "closed-form", "closed-form"]


def test_restarts_multiply_and_the_ig_preset_iterations_count(tmp_path):
    # IG's paper preset: 24,000 iterations when iterations is None (read as one, it would start last but one)
    order = _order(tmp_path, """
[[attack]]
name = "dlg"
iterations = 300
max_iter = 20
restarts = 1
[[attack]]
name = "inverting-gradients"
""")
    assert order[:2] == ["inverting-gradients"] * 2 and order[2:4] == ["dlg"] * 2
    order = _order(tmp_path, """
[[attack]]
name = "dlg"
iterations = 300
max_iter = 20
restarts = 8
batch_restarts = "loop"
[[attack]]
name = "inverting-gradients"
restarts = 1
""")
    assert order[:2] == ["dlg"] * 2  # 48,000 > 24,000: restarts count


def test_model_pass_is_counted_by_flop_counter_once_per_shape():
    # A linear model on 8x8 RGB images, 10 classes: forward 2*192*10 flops per image, the weight gradient as many
    # (the input needs none), plus 20 per parameter for the work on the whole update.
    d, k = 3 * 8 * 8, 10
    _pass_flops.cache_clear()
    for b in (1, 2, 4):
        case = CaseConfig(dataset="skimage", model="linear", batch_size=b, resolution=8)
        assert _model_pass_cost(case) == pytest.approx(4 * d * k * b + 20 * (d * k + k))
    assert _pass_flops.cache_info().misses == 1  # measured once for the three batch sizes
    double = CaseConfig(dataset="skimage", model="linear", batch_size=1, resolution=8, dtype="float64")
    assert _model_pass_cost(double) == pytest.approx(2 * (4 * d * k + 20 * (d * k + k)))


@pytest.mark.parametrize("model, shape, params", [
    ("linear", (3, 8, 8), {}), ("mlp", (3, 16, 16), {"hidden": [64, 32]}), ("lenet", (3, 32, 32), {}),
    ("cnn6", (3, 32, 32), {}), ("convnet", (1, 28, 28), {}), ("resnet20", (3, 32, 32), {}), ("resnet18", (3, 32, 32), {}),
])  # fmt: skip
def test_the_layer_count_is_flop_counters_for_every_built_in_image_model(model, shape, params):
    """The estimate reads the layers' shapes instead of running FlopCounterMode (whose first use imports
    torch._dynamo, a second of every run's start): the same number for each built-in image model."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from gleak.mechanics.models import create_model
    from gleak.orchestration.runner import _layer_flops

    net = create_model(model, shape, 10, seed=0, dtype=torch.float32, **params)
    counted = _layer_flops(net, torch.zeros((1, *shape)))
    net = net.to("meta")
    with FlopCounterMode(display=False) as counter:
        net(torch.zeros((1, *shape), device="meta")).sum().backward()
    assert counted == counter.get_total_flops()


def test_a_model_with_a_layer_the_count_does_not_know_falls_back_to_flop_counter():
    import torch
    from torch import nn

    from gleak.orchestration.runner import _layer_flops

    class Bilinear(nn.Module):  # products in a module of its own: invisible to the layer count
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 4))

        def forward(self, x):
            return x @ self.w

    assert _layer_flops(nn.Sequential(nn.Flatten(), nn.Linear(16, 4), Bilinear()), torch.zeros(1, 1, 4, 4)) is None
    assert _layer_flops(nn.Sequential(nn.Flatten(), nn.Linear(16, 4)), torch.zeros(1, 1, 4, 4)) == 2 * 16 * 4 * 2
