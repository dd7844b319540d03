"""Code tests of the seam between a defense and the wire: a malformed update is the defense's failure, stored
under its name with what was wrong, never blamed on the attack that receives it nor a raw Python error."""
import pytest
import torch

from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.plugin import Defense
from gleak.contracts.registry import register_defense
from gleak.orchestration.trial import run_trial


@register_defense("test-malformed")
class Malformed(Defense):
    """Test defense that breaks what it returns in one named way."""

    def __init__(self, how: str = "int64"):
        self.how = how

    def transform(self, update, rng):
        if self.how == "none":
            return None
        names = list(update.tensors)
        if self.how == "int64":
            return update.map(lambda _, t: t.to(torch.int64))
        if self.how == "dropped":
            return type(update)({k: v for k, v in update.tensors.items() if k != names[0]}, update.kind, update.num_samples, update.meta)
        if self.how == "shape":
            return update.map(lambda n, t: t.flatten() if n == names[0] else t.clone())
        return update.map(lambda _, t: t.clone())


@pytest.mark.parametrize("how, said", [("int64", "torch.int64, not floating point"), ("none", "must return an Update, got NoneType"),
                                       ("dropped", "dropped"), ("shape", "changed the shape")])  # fmt: skip
def test_a_malformed_update_fails_the_trial_naming_the_defense_and_what_was_wrong(how, said):
    cfg = TrialConfig("t", "closed-form", {}, "test-malformed", {"how": how}, CaseConfig(dataset="skimage", model="mlp"), 0)
    row = run_trial(cfg)
    assert row["status"] == "failed" and row["error"].startswith("PluginContractError"), row["error"]
    assert "defense 'test-malformed' on client 0" in row["error"] and said in row["error"], row["error"]
    assert "attack" not in row["error"]


def test_a_well_formed_update_passes_the_seam():
    cfg = TrialConfig("t", "closed-form", {}, "test-malformed", {"how": "copy"}, CaseConfig(dataset="skimage", model="mlp"), 0)
    assert run_trial(cfg)["status"] == "ok"
