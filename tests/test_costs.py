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
