"""One declaration per plugin (gleak.contracts.tags): every reader (the gate, the threat model, `gleak show`,
conformance) sees the same Tags, an instance's parameters show in its own tags, and each kind is named by it."""
import inspect

import pytest

from gleak.contracts import registry
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.tags import Tags, get_tags

KINDS = ("attack", "defense", "protocol", "model")


def _builtins(kind: str) -> list[str]:
    """The shipped plugins of a kind (not those other tests of this process registered)."""
    return [n for n in registry.list_plugins(kind) if registry.plugin_info(kind, n).obj.__module__.startswith("gleak.")]


def _instance(kind: str, name: str, **params):
    info = registry.plugin_info(kind, name)
    fast = get_tags(info.obj).fast_params
    return registry.create(kind, name, **{**fast, **params})


@pytest.mark.parametrize("kind", KINDS)
def test_every_plugin_is_named_its_kind_by_its_tags(kind):
    for name in _builtins(kind):
        tags = get_tags(registry.plugin_info(kind, name).obj)
        assert isinstance(tags, Tags)
        # a protocol registered as a defense too (CGD, local training) is a protocol
        assert tags.kind == kind or (kind == "defense" and tags.kind == "protocol"), (kind, name, tags.kind)


def test_only_attacks_carry_needs_and_only_input_transforming_defenses_say_so():
    for name in _builtins("defense"):
        tags = get_tags(registry.plugin_info("defense", name).obj)
        assert tags.needs == frozenset()
        # ATS trains on augmented inputs (scored against them, as its authors score), MixUp and InstaHide on mixtures
        # (scored against the private images)
        assert tags.transforms_inputs == (name in ("ats", "mixup", "instahide")), name
        assert tags.scored_against == ("private" if name in ("mixup", "instahide") else "sent"), name
    text = {n for n in _builtins("attack") if get_tags(registry.plugin_info("attack", n).obj).modality == "text"}
    assert text == {"tag", "lamp", "token-set"}


def test_a_parameter_that_adds_a_need_shows_in_the_instances_tags_not_the_classes():
    aware = [n for n in _builtins("attack")
             if "defense_aware" in inspect.signature(registry.plugin_info("attack", n).obj.__init__).parameters]  # fmt: skip
    assert len(aware) >= 4
    for name in aware:
        cls_tags, inst_tags = get_tags(registry.plugin_info("attack", name).obj), get_tags(_instance("attack", name, defense_aware=True))
        assert "knows_defense" not in cls_tags.needs and "knows_defense" in inst_tags.needs, name


@pytest.mark.parametrize("protocol", ["fedsgd", "secure-aggregation", "cgd"])
def test_the_gate_grants_what_the_tags_declare(protocol):
    """gleak.mechanics.gate.grant reads the same declaration: under no named threat model an applicable attack runs
    under its tags' threat model; through a sum no attack whose tags need labels runs; an active attack, or one
    sending per-client models, is refused exactly where the protocol's tags deny it."""
    from gleak.contracts.threat_model import of_attack, of_tags
    from gleak.mechanics.gate import grant

    from gleak.contracts.plugin import Attack

    class Peek(Attack):  # what no built-in needs at its defaults: the victim's labels
        needs = frozenset({"architecture", "parameters", "labels"})

    proto = _instance("protocol", protocol)
    server = get_tags(proto)
    for name in [*_builtins("attack"), "peek"]:
        attack = Peek() if name == "peek" else _instance("attack", name)
        tags = get_tags(attack)
        refused = (("labels" in tags.needs and server.observes_sum)
                   or ("per_client_models" in tags.needs and not server.per_client_models)
                   or (tags.active and not server.shared_model))  # fmt: skip
        try:
            got = grant(attack, proto, name, protocol, None)
        except UnsupportedCase:
            assert refused, (name, protocol)
            continue
        assert not refused, (name, protocol)
        assert got == of_tags(tags), name
        if name != "peek":
            assert of_attack(name, None) == of_tags(get_tags(registry.create("attack", name))), name


def test_gleak_show_prints_the_tags():
    from gleak.plugin_commands import show_text

    for name in ("fishing", "tag", "closed-form"):
        tags = get_tags(_instance("attack", name))
        text = show_text("attack", name)
        assert f"active: {'yes' if tags.active else 'no'}" in text
    assert "stateful: yes" in show_text("defense", "dgp") and "stateful: no" in show_text("defense", "noise")
