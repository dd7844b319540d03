import textwrap


import gleak
from gleak.orchestration.conformance import CHECK_NAMES, check_plugin
from gleak.testing import parametrize_with_checks


def _builtins():
    # Protocols named as defenses (cgd) are checked as protocols, once.
    for kind in ("attack", "defense", "protocol"):
        for name in gleak.list_plugins(kind):
            if not (kind == "defense" and gleak.contracts.registry.plugin_info(kind, name).protocol):
                yield kind, name


@parametrize_with_checks(list(_builtins()))
def test_builtin_passes(plugin, check):
    """Every built-in passes every check of its kind, one pytest id per (plugin, check) through the same
    gleak.testing.parametrize_with_checks a plugin author uses."""
    check(plugin)


def test_a_bad_defense_fails_the_check(tmp_path):
    from gleak.contracts.registry import load_plugin_file

    f = tmp_path / "bad_defense.py"
    f.write_text(textwrap.dedent('''
        import torch
        from gleak import register_defense
        from gleak.contracts.plugin import Defense

        @register_defense("test-bad-defense")
        class Bad(Defense):
            """Mutates its input and ignores the generator."""
            def transform(self, update, rng):
                for t in update:
                    t.add_(torch.randn(t.shape, dtype=t.dtype))
                return update
    '''))
    load_plugin_file(f)
    failed = {c.name for c in check_plugin("defense", "test-bad-defense") if not c.passed}
    assert {"deterministic under a seed", "does not mutate its input"} <= failed


def test_a_parameter_named_like_a_method_of_its_base_fails_the_check(tmp_path):
    """A defense whose parameter is called `epsilon` stores a number where the trial calls Defense.epsilon(): the
    utility run then fails with "'float' object is not callable". The check names the parameter and the method."""
    from gleak.contracts.registry import load_plugin_file

    f = tmp_path / "shadow_defense.py"
    f.write_text(textwrap.dedent('''
        from gleak import register_defense
        from gleak.contracts.plugin import Defense

        @register_defense("test-shadow-defense")
        class Shadow(Defense):
            """Keeps a privacy budget under the name of the method that reports one."""
            def __init__(self, epsilon: float = 0.1, sigma: float = 1.0):
                self.epsilon, self.sigma = epsilon, sigma
    '''))
    load_plugin_file(f)
    checks = {c.name: c for c in check_plugin("defense", "test-shadow-defense")}
    shadow = checks["parameters shadow no method"]
    assert not shadow.passed and "epsilon" in shadow.detail and "Defense" in shadow.detail and "sigma" not in shadow.detail
    assert checks["parameters are typed"].passed


def test_an_attack_that_crashes_on_other_cases_fails(tmp_path):
    from gleak.contracts.registry import load_plugin_file

    f = tmp_path / "bad_attack.py"
    f.write_text(textwrap.dedent('''
        import torch
        from gleak import register_attack
        from gleak.contracts.plugin import Attack
        from gleak.contracts.wire import Reconstruction

        @register_attack("test-bad-attack")
        class Bad(Attack):
            """Crashes with a KeyError on conv models."""
            def reconstruct(self, observation, rng):
                observation.update["1.weight"]
                return Reconstruction(x=torch.rand((1, *observation.knowledge.input_shape)))
    '''))
    load_plugin_file(f)
    failed = {c.name for c in check_plugin("attack", "test-bad-attack") if not c.passed}
    assert "unsupported cases raise UnsupportedCase only" in failed
    assert "deterministic under a seed" in failed  # torch.rand ignores the generator


def test_the_example_model_plugin_passes_gleak_check_plugin_and_docs_show_it():
    """`gleak check-plugin examples/my_model.py` as docs/models.md gives it: every model check passes, exit 0; the
    page shows the file as it is."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    path = root / "examples" / "my_model.py"
    assert path.read_text().strip() in (root / "docs" / "models.md").read_text()
    done = subprocess.run([sys.executable, "-m", "gleak", "check-plugin", str(path)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "model tiny-cnn:" and done.stdout.rstrip().endswith("all checks passed")
    assert all(f"  PASS  {name}" in done.stdout for name in CHECK_NAMES["model"]), done.stdout
    assert done.stderr == "", done.stderr


def test_a_model_with_wrong_logits_and_unseeded_weights_fails_those_checks(tmp_path):
    from gleak.contracts.registry import load_plugin_file

    f = tmp_path / "bad_model.py"
    f.write_text(textwrap.dedent('''
        import os
        import torch
        from torch import nn
        from gleak import register_model

        @register_model("test-bad-model")
        def bad(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
            """One class too many, and weights from a generator gleak does not seed."""
            m = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes + 1))
            g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
            with torch.no_grad():
                m[1].weight.copy_(torch.randn(m[1].weight.shape, generator=g))
            return m
    '''))
    load_plugin_file(f)
    results = {c.name: c for c in check_plugin("model", "test-bad-model")}
    assert set(results) == set(CHECK_NAMES["model"])
    failed = {n for n, c in results.items() if not c.passed}
    assert {"forward shape", "deterministic under a seed"} <= failed, results
    assert "expected (2, 10) logits" in results["forward shape"].detail
    assert results["builds for a case"].passed and results["parameter names"].passed
