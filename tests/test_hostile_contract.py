"""A hostile attack's output is refused before it is scored, and a plugin's change to torch's global state does not
reach the next trial (gleak.contracts.attack_output)."""
import textwrap

import pytest
import torch

from gleak.contracts.registry import load_plugin_file
from gleak.orchestration.suite import load_suite
from gleak.orchestration.trial import run_trial


PLUGIN = textwrap.dedent('''
    import torch

    from gleak import register_attack
    from gleak.contracts.plugin import Attack
    from gleak.contracts.wire import Reconstruction


    @register_attack("hostile-output")
    class HostileOutput(Attack):
        """Test attack that returns what `mode` names, or changes torch's global state."""

        needs = frozenset({"architecture"})

        def __init__(self, mode: str = "float"):
            self.mode = mode

        def reconstruct(self, observation, rng):
            shape, n = observation.knowledge.input_shape, observation.knowledge.num_classes
            m = self.mode
            if m == "dtype64":
                torch.set_default_dtype(torch.float64)
            if m == "no-grad":
                torch.set_grad_enabled(False)
            if m == "deterministic":
                torch.use_deterministic_algorithms(True)
            x = {"int": torch.zeros((1, *shape), dtype=torch.int64), "bool": torch.zeros((1, *shape), dtype=torch.bool),
                 "many": torch.rand((5000, *shape)), "wrong-shape": torch.zeros((1, 3, 2, 2)),
                 "numpy": torch.zeros((1, *shape)).numpy()}.get(m, torch.zeros((1, *shape)))
            y = {"every-class": torch.arange(n), "float-labels": torch.zeros(1), "huge-label": torch.tensor([10**9]),
                 "negative-label": torch.tensor([-1]), "list-labels": [0], "2d-labels": torch.zeros((1, 1), dtype=torch.long),
                 "bool-labels": torch.zeros(1, dtype=torch.bool)}.get(m, torch.zeros(1, dtype=torch.long))
            return Reconstruction(x=x, y=y)
''')

SUITE = textwrap.dedent('''
    [suite]
    name = "hostile"
    save_images = false
    [case]
    dataset = "uniform"
    model = "linear"
    [[attack]]
    name = "{attack}"
    {params}
    [[defense]]
    name = "none"
''')


def _cfg(tmp_path, attack, params=""):
    (tmp_path / "s.toml").write_text(SUITE.format(attack=attack, params=params))
    return load_suite(tmp_path / "s.toml").trials[0]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "hostile_output.py"
    path.write_text(PLUGIN)
    load_plugin_file(path)


BAD = {"int": "dtype torch.int64", "bool": "dtype torch.bool", "many": "5000 images", "wrong-shape": "shape (1, 3, 2, 2)",
       "numpy": "type ndarray", "every-class": "labels of shape", "float-labels": "dtype torch.float32",
       "huge-label": "label 1000000000", "negative-label": "label -1", "list-labels": "type list",
       "2d-labels": "shape (1, 1)", "bool-labels": "dtype torch.bool"}  # fmt: skip


@pytest.mark.parametrize("mode", sorted(BAD))
def test_an_output_outside_the_contract_is_the_trials_failure_in_one_line(tmp_path, plugin, mode):
    row = run_trial(_cfg(tmp_path, "hostile-output", f'mode = "{mode}"'))
    assert row["status"] == "failed", (mode, row.get("psnr"), row.get("label_acc"))
    assert row["error"].startswith("PluginContractError: attack 'hostile-output' returned"), row["error"]
    assert BAD[mode] in row["error"] and "\n" not in row["error"]


def test_an_output_inside_the_contract_is_scored(tmp_path, plugin):
    row = run_trial(_cfg(tmp_path, "hostile-output"))
    assert row["status"] == "ok" and row["label_acc"] in (0.0, 1.0) and row["mse"] > 0


def _numbers(row):
    return {k: row.get(k) for k in ("status", "mse", "psnr", "ssim", "cosine", "grad_dist", "label_acc", "extra")}


@pytest.mark.parametrize("mode", ["dtype64", "no-grad", "deterministic"])
def test_a_plugin_changing_torchs_global_state_does_not_change_the_next_trial(tmp_path, plugin, mode):
    """As on one worker: a closed-form trial, a plugin trial that changes the process-wide state, the same
    closed-form trial again (its stored numbers must be identical, bit for bit); the caller's state is restored."""
    honest = _cfg(tmp_path, "closed-form")
    first = _numbers(run_trial(honest))
    run_trial(_cfg(tmp_path, "hostile-output", f'mode = "{mode}"'))
    assert _numbers(run_trial(honest)) == first
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_state_a_caller_set_is_not_the_trials(tmp_path):
    """An API user's own default dtype neither changes a trial's numbers nor is lost."""
    honest = _cfg(tmp_path, "closed-form")
    first = _numbers(run_trial(honest))
    torch.set_default_dtype(torch.float64)
    try:
        assert _numbers(run_trial(honest)) == first
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)
