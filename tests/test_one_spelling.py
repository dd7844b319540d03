"""One computation, one trial id: a protocol named in the case with no client defense is written in its defense
spelling before the id is computed (gleak.orchestration.suite.one_spelling), the spelling the published trials have."""
import pytest

from gleak.orchestration.suite import load_suite

CASE = """
[suite]
name = "spell"
seeds = [0, 1]
[case]
dataset = "skimage"
model = "mlp"
model_params = { hidden = [8] }
resolution = 8
batch_size = 1
clients = 4
"""


def _trials(tmp_path, case_extra: str, defense: str):
    p = tmp_path / f"s{len(list(tmp_path.iterdir()))}.toml"
    p.write_text(CASE + case_extra + '\n[[attack]]\nname = "closed-form"\n[[defense]]\n' + defense + "\n")
    return load_suite(p).trials


@pytest.mark.parametrize("params", ["", 'partition = "4x1"\ncolluders = 0', 'colluders = 1\nconfined = false\ndelta = 0.05'])
def test_both_spellings_of_a_cgd_trial_are_one_trial(tmp_path, params):
    legacy = _trials(tmp_path, "", 'name = "cgd"\n' + params)
    inline = "{ " + ", ".join(params.splitlines()) + " }"
    case = _trials(tmp_path, 'protocol = "cgd"\nprotocol_params = ' + inline, 'name = "none"')
    assert case == legacy and [t.trial_id for t in case] == [t.trial_id for t in legacy]
    assert {(t.defense, t.case.protocol) for t in case} == {("cgd", "fedsgd")}


def test_a_protocol_with_a_client_defense_keeps_the_case_spelling(tmp_path):
    (t, _) = _trials(tmp_path, 'protocol = "cgd"\nprotocol_params = { colluders = 0 }', 'name = "noise"\nsigma = 0.1')
    assert (t.defense, t.case.protocol, t.case.protocol_params["colluders"]) == ("noise", "cgd", 0)


def test_a_protocol_without_a_defense_spelling_keeps_the_case_spelling(tmp_path):
    (t, _) = _trials(tmp_path, 'protocol = "fedavg"\nprotocol_params = { local_steps = 2 }', 'name = "none"')
    assert (t.defense, t.case.protocol, t.case.protocol_params["local_steps"]) == ("none", "fedavg", 2)
    sa = _trials(tmp_path, 'protocol = "secure-aggregation"', 'name = "none"')
    assert sa == _trials(tmp_path, "", 'name = "secure-aggregation"')  # it has one: written so


def test_the_one_spelling_runs_what_the_case_spelling_ran(tmp_path):
    from gleak.contracts.config import CaseConfig
    from gleak.contracts.registry import check_params
    from gleak.mechanics.protocol_setup import trial_setup

    (t, _) = _trials(tmp_path, 'protocol = "cgd"\nprotocol_params = { colluders = 1 }', 'name = "none"')
    as_written = CaseConfig(protocol="cgd", protocol_params=check_params("protocol", "cgd", {"colluders": 1}))
    assert trial_setup(t.case, t.defense, t.defense_params) == trial_setup(as_written, "none", {})
