import textwrap
from importlib import metadata

import pytest

import gleak
from gleak.contracts import registry
from gleak.contracts.errors import InputError, UnknownPluginError
from gleak.contracts.plugin import Attack


def test_builtins_listed_with_wildcards():
    assert {"closed-form", "idlg"} <= set(gleak.list_plugins("attack"))
    assert {"none", "quantization", "noise", "topk"} <= set(gleak.list_plugins("defense"))
    assert gleak.list_plugins("defense", "top*") == ["topk"]
    assert gleak.list_plugins("attacks", "*form*") == ["closed-form"]


def test_unknown_name_lists_close_matches():
    with pytest.raises(UnknownPluginError) as e:
        gleak.create("attack", "closed-from")
    assert "did you mean 'closed-form'" in str(e.value)
    assert "\n" not in str(e.value)


def test_params_validated_by_type_and_name():
    with pytest.raises(registry.ParamError) as e:
        gleak.create("defense", "topk", ratoi=0.5)
    assert e.value.key == "ratoi" and "did you mean 'ratio'" in str(e.value)
    with pytest.raises(registry.ParamError) as e:
        gleak.create("defense", "topk", ratio="high")
    assert e.value.key == "ratio" and "must be float" in str(e.value)
    with pytest.raises(registry.ParamError):
        gleak.create("defense", "topk", ratio=1.5)  # the plugin's own range check
    d = gleak.create("defense", "topk", ratio=0.5)
    assert d.get_params() == {"ratio": 0.5, "scope": "global", "error_feedback": False}


def test_a_stored_form_that_does_not_rebuild_its_configuration_is_refused():
    """identity_params may leave a parameter out of stored configs (and ids) only where the defaults restore it: the
    cgd protocol once dropped vertical = "literal", and every such stored trial rebuilt as the vfl default."""
    from gleak.contracts.plugin import Defense

    class Lossy(Defense):
        """Test defense whose stored form drops a non-default reading."""

        def __init__(self, reading: str = "new"):
            self.reading = reading

        @classmethod
        def identity_params(cls, params):
            return {k: v for k, v in params.items() if not (k == "reading" and v == "old")}

        def transform(self, update, rng):
            return update

    own = registry.Registry("defense")  # a registry of its own: the session's plugin lists never see it
    own.register("lossy")(Lossy)
    assert own.check_params("lossy", {"reading": "new"}) == {"reading": "new"}
    with pytest.raises(RuntimeError, match="lossy.*reading"):
        own.check_params("lossy", {"reading": "old"})
    for name in gleak.list_plugins("defense"):  # every built-in stored form rebuilds itself at its defaults
        registry.check_params("defense", name, dict(getattr(registry.plugin_info("defense", name).obj, "conformance_params", {})))


def test_check_value_typing_subset():
    from typing import Literal, Optional

    assert registry.check_value(float, 1) and not registry.check_value(float, True)
    assert registry.check_value(Literal["a", "b"], "a") and not registry.check_value(Literal["a"], "c")
    assert registry.check_value(Optional[int], None) and not registry.check_value(Optional[int], 1.5)
    assert registry.check_value(list[int], [1, 2]) and not registry.check_value(list[int], [1, "x"])


def test_plugin_file_registers_and_broken_file_is_one_line(tmp_path):
    good = tmp_path / "myplug.py"
    good.write_text(textwrap.dedent('''
        from gleak import register_attack
        from gleak.contracts.plugin import Attack
        from gleak.contracts.wire import Reconstruction

        @register_attack("test-zero-attack")
        class Zero(Attack):
            """Returns the mean image."""
            needs = frozenset({"architecture"})
            def __init__(self, scale: float = 0.0):
                self.scale = scale
            def reconstruct(self, observation, rng):
                import torch
                return Reconstruction(x=torch.zeros((1, *observation.knowledge.input_shape)))
    '''))
    added = registry.load_plugin_file(good)
    assert ("attack", "test-zero-attack") in added
    assert "test-zero-attack" in gleak.list_plugins("attack")

    bad = tmp_path / "broken.py"
    bad.write_text("import this_module_does_not_exist_anywhere\n")
    with pytest.raises(InputError) as e:
        registry.load_plugin_file(bad)
    assert str(bad) in str(e.value) and "ModuleNotFoundError" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InputError):
        registry.load_plugin_file(tmp_path / "missing.py")


def test_entry_points_are_discovered(monkeypatch):
    class EPAttack(Attack):
        """From an entry point."""

    class FakeEP:
        name, value = "ep-attack", "somepkg:EPAttack"

        def load(self):
            return EPAttack

    real = metadata.entry_points

    def fake(group=None, **kw):
        return [FakeEP()] if group == "gleak.attacks" else real(group=group, **kw)

    reg = registry.Registry("attack")
    monkeypatch.setattr(registry.metadata, "entry_points", fake)
    assert "ep-attack" in reg.names()
    assert reg.info("ep-attack").source.startswith("entry point")
