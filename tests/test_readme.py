"""The README is a front door: short, the quick start first, its plugin examples pass check-plugin as written, and no
internal history (issue numbers, "seed 00N", commit hashes) in what a user reads."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def plugin_blocks() -> dict[str, str]:
    """file name -> code of every ```python block of the README that starts with '# my_NAME.py'."""
    out = {}
    for block in re.findall(r"```python\n(.*?)```", README, flags=re.S):
        first = block.splitlines()[0]
        m = re.fullmatch(r"# (my_\w+\.py)", first.strip())
        if m:
            out[m.group(1)] = block
    return out


@pytest.fixture(scope="module")
def plugin_files(tmp_path_factory) -> dict[str, tuple[Path, list]]:
    """The README's plugin blocks as files, each loaded once: name -> (path, the (kind, name) pairs it registered)."""
    from gleak.contracts.registry import load_plugin_file

    folder = tmp_path_factory.mktemp("readme-plugins")
    out = {}
    for name, code in plugin_blocks().items():
        (folder / name).write_text(code)
        out[name] = (folder / name, [p for p in load_plugin_file(folder / name) if p[0] in ("attack", "defense", "protocol")])
    return out


def test_readme_is_short_and_starts_with_the_quick_start():
    lines = README.splitlines()
    assert len(lines) <= 250, len(lines)
    head = "\n".join(lines[:30])
    for needed in ("pip install", "gleak run", "leaderboard.md", "figures/", "python -m pytest -q"):
        assert needed in head, needed
    for doc in re.findall(r"\]\(((?:docs|results|examples)/[^)#]+)\)", README):  # every link resolves
        assert (ROOT / doc).exists() or doc == "docs/architecture.md", doc


def test_no_internal_history_where_users_read():
    pattern = re.compile(r"seed 00[0-9]|\bissue [0-9]+|\bstop [0-9]+|\bcommit [0-9a-f]{7,}", re.IGNORECASE)
    files = [ROOT / "README.md", ROOT / "results" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "results").glob("*/leaderboard.md")),  # the suites' descriptions are quoted there
             *sorted((ROOT / "suites").glob("*.toml"))]
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files
            for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]  # fmt: skip
    assert not hits, hits


def test_the_readme_plugin_examples_pass_the_conformance_checks_in_a_users_own_pytest(tmp_path):
    """An attack, a defense and a protocol, each as written in the README, beside a user's own test file that puts
    gleak's checks in its pytest with gleak.testing.parametrize_with_checks: every check of every example is one
    test and passes. A defense that mutates its input, in the same file, fails exactly its two checks."""
    from gleak.orchestration.conformance import CHECK_NAMES

    blocks = plugin_blocks()
    assert sorted(blocks) == ["my_attack.py", "my_defense.py", "my_protocol.py"]
    for name, code in blocks.items():
        (tmp_path / name).write_text(code)
    (tmp_path / "test_mine.py").write_text(textwrap.dedent('''
        import torch
        from gleak import Defense, register_defense
        from gleak.testing import parametrize_with_checks
        from my_attack import MeanImage
        from my_defense import ClipNorm
        from my_protocol import MeanOnly

        @register_defense("user-bad")
        class Bad(Defense):
            """Adds noise in place, from the global generator."""
            def transform(self, update, rng):
                for t in update:
                    t.add_(torch.randn(t.shape, dtype=t.dtype))
                return update

        @parametrize_with_checks([MeanImage, ClipNorm, MeanOnly, ("defense", "user-bad")])
        def test_gleak_conformance(plugin, check):
            check(plugin)
    '''))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "test_mine.py"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    out = done.stdout + done.stderr
    expected = sum(len(CHECK_NAMES[k]) for k in ("attack", "defense", "protocol", "defense"))
    failed = sorted(re.findall(r"FAILED test_mine.py::test_gleak_conformance\[(.*?)\]", out))
    assert failed == ["defense:user-bad:deterministic-under-a-seed", "defense:user-bad:does-not-mutate-its-input"], out
    assert re.search(rf"\b2 failed, {expected - 2} passed\b", out), out


def test_the_readme_defense_passes_gleak_check_plugin(tmp_path):
    """The command as the README gives it: `gleak check-plugin my_defense.py` prints 'all checks passed', exit 0."""
    path = tmp_path / "my_defense.py"
    path.write_text(plugin_blocks()["my_defense.py"])
    done = subprocess.run([sys.executable, "-m", "gleak", "check-plugin", str(path)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all checks passed" in done.stdout and "defense clip-norm" in done.stdout


@pytest.mark.parametrize("name", ["my_attack.py", "my_defense.py"])
def test_the_readme_plugins_reconstruct_and_defend_what_they_say(plugin_files, name):
    """Not only conformant: the mean-image attack returns one guess per sample, the mean of the public images in
    normalised space; clip-norm leaves an update of norm at most max_norm."""
    import torch

    from gleak import create
    from gleak.contracts.wire import Knowledge, Observation, Update

    g = torch.Generator().manual_seed(0)
    if name == "my_attack.py":
        public = torch.randn(10, 3, 8, 8, generator=g)
        k = Knowledge(input_shape=(3, 8, 8), num_classes=10, batch_size=3, public_x=public)
        rec = create("attack", "mean-image", samples=4).reconstruct(Observation(update=Update({}), knowledge=k), g)
        assert rec.x.shape == (3, 3, 8, 8)
        assert torch.allclose(rec.x, public[:4].mean(0).expand(3, -1, -1, -1))
    else:
        u = Update({"w": torch.full((4,), 3.0), "b": torch.full((2,), 4.0)})
        out = create("defense", "clip-norm", max_norm=2.0).transform(u, g)
        assert abs(float(out.flat().norm()) - 2.0) < 1e-6 and float(u.flat().norm()) > 2.0
