"""The house: gleak's modules import each other one way, bottom-up through the layers below, and never in a circle.

The imports are read from the source (ast), not by importing: every `import` and `from ... import` anywhere in a
module counts, at the top or inside a function (a deferred import is still a dependency), except under
`if TYPE_CHECKING:` (names for annotations only). attacks/, defenses/ and protocols/ are installed as gleak.attacks,
gleak.defenses and gleak.protocols and are walked with gleak/.

A module may import modules of its own layer (no circle) and of the layers below it, never one above. A new module
must be placed in a layer here: the test names it until it is. docs/architecture.md explains the layers.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"gleak": "gleak", "attacks": "gleak.attacks", "defenses": "gleak.defenses", "protocols": "gleak.protocols"}

# Bottom-up, as folders: a module's layer is the subpackage of gleak it sits in (gleak/contracts/..., the built-in
# plugin folders at the checkout's top), and gleak's own top-level modules are the faces. A new subpackage of gleak
# must be placed here: the test names it until it is.
LAYERS = [
    # pure data types, errors, the plugin registry and the plugin kinds' base classes: what everything else speaks
    ("contracts", {"contracts"}),
    # the computations: metrics, the round (protocol), the observation gate, models, data, and their small helpers
    ("mechanics", {"mechanics"}),
    # the built-in plugins: they build on the contracts and the mechanics only (the registry finds them by name)
    ("plugins", {"attacks", "defenses", "protocols"}),
    # running trials and keeping their results: one trial, the runner and its workers, the store, the folder
    ("orchestration", {"orchestration"}),
    # what is written from the stored results: aggregation, claims, documents, figures, the report of a folder
    ("reporting", {"reporting"}),
]
FACES = ("faces", set())  # gleak/*.py: the command line, the Python API, the package itself
MOST_TOP_LEVEL_MODULES = 15
MOST_LINES = 600


_SUBPACKAGES = {p.name for p in (ROOT / "gleak").iterdir() if (p / "__init__.py").exists()}


def modules(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages' folders."""
    out = {}
    for folder, pkg in packages.items():
        for f in sorted((root / folder).rglob("*.py")):
            parts = list(f.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = f
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules (of `mods`) it imports."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                # `from gleak.mechanics import device` imports the module gleak.mechanics.device; `from gleak.x import f` the module gleak.x
                targets |= {resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else resolve(base) for a in node.names}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str, layers: list = LAYERS) -> int | None:
    """The index of the module's layer: its folder's, or the faces (one past the last) for gleak's own top-level
    modules; None for a subpackage no layer names."""
    parts = module.split(".")
    if len(parts) == 1 or (parts[0] == "gleak" and len(parts) == 2 and parts[1] not in _SUBPACKAGES):
        return len(layers)  # the package itself (gleak/__init__.py) or a module directly in gleak/
    return next((i for i, (_, names) in enumerate(layers) if parts[1] in names), None)


def _layer_name(index: int, layers: list) -> str:
    return layers[index][0] if index < len(layers) else FACES[0]


def upward(graph: dict[str, set[str]], layers: list = LAYERS) -> list[str]:
    out = []
    for m, targets in sorted(graph.items()):
        lm = layer_of(m, layers)
        for t in sorted(targets):
            lt = layer_of(t, layers)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{m} ({_layer_name(lm, layers)}) imports {t} ({_layer_name(lt, layers)})")
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph(modules())


def test_every_module_has_a_layer(graph):
    missing = [m for m in graph if layer_of(m) is None]
    assert not missing, f"place these modules' subpackages in a layer of LAYERS: {missing}"


def test_gleak_holds_few_modules_directly_and_none_is_long():
    """The layers are visible as folders: gleak/ itself holds only the faces (and few of them), and no module of
    the framework or the built-in plugins is over MOST_LINES lines."""
    top = sorted(p.name for p in (ROOT / "gleak").glob("*.py"))
    assert len(top) <= MOST_TOP_LEVEL_MODULES, f"gleak/ holds {len(top)} modules directly: {top}"
    long = {str(f.relative_to(ROOT)): n for f in modules().values() if (n := len(f.read_text().splitlines())) > MOST_LINES}
    assert not long, f"modules over {MOST_LINES} lines: {long}"


def test_no_import_circle(graph):
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_runs_up_the_layers(graph):
    found = upward(graph)
    assert not found, "imports up the layers:\n" + "\n".join(found)


def test_the_walk_sees_deferred_imports_skips_type_checking_and_finds_a_circle(tmp_path):
    """The checks can fail: a package whose modules import each other in a function (a circle) and whose annotation
    import sits under TYPE_CHECKING (not an edge), with one import up the layers."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from p.mid import g\n    return g\n")
    (pkg / "mid.py").write_text("from p import low\n\ndef g():\n    return low\n")
    (pkg / "top.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.low import f\nimport p.mid\n")
    g = import_graph(modules(tmp_path, {"p": "p"}))
    assert g["p.low"] == {"p.mid"} and g["p.mid"] == {"p.low"} and g["p.top"] == {"p.mid"}
    assert circles(g) == [["p.low", "p.mid"]]
    layers = [("bottom", {"low"}), ("top", {"mid", "top"})]
    assert upward(g, layers) == ["p.low (bottom) imports p.mid (top)"]


def test_the_cgd_engine_keeps_its_old_path_for_one_release():
    """CGD's engine moved from defenses/ to protocols/ (beside its protocol): each old name still imports, warns
    (DeprecationWarning) and is the moved object itself; importing the old module alone (plugin discovery) is silent."""
    import importlib
    import warnings

    from gleak.protocols import cgd_reference, cgd_training, cgd_vertical

    old = importlib.import_module("gleak.defenses.cgd_training")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(old)
    homes = {"reference_train": cgd_reference, "invert_preactivation_wire": cgd_vertical}
    for name in old.__all__:
        home = homes.get(name, cgd_training)
        with pytest.warns(DeprecationWarning, match=f"import {name} from {home.__name__}"):
            assert getattr(old, name) is getattr(home, name)
    with pytest.warns(DeprecationWarning):
        exec("from gleak.defenses.cgd_training import ConfinedMLP, Partition", {})
    with pytest.raises(AttributeError):
        old.torch  # noqa: B018 - only the engine's names are forwarded


def test_each_plugin_file_is_one_module_however_it_is_imported():
    """From the checkout root the built-in plugin folders are importable as top-level packages too: `attacks.dlg`
    and `gleak.attacks.dlg` are one module, whichever comes first, and the plugin registers once. A moved module's
    flat path (`gleak.metrics`) is the moved module itself and says where it went."""
    import subprocess
    import sys

    code = ("import {first}, {second}, sys, warnings\n"
            "assert sys.modules['attacks.dlg'] is sys.modules['gleak.attacks.dlg']\n"
            "assert sys.modules['attacks'] is sys.modules['gleak.attacks']\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import gleak.metrics, gleak.mechanics.metrics\n"
            "assert gleak.metrics is gleak.mechanics.metrics and gleak.metrics.__spec__.name == 'gleak.mechanics.metrics'\n"
            "assert any('import gleak.mechanics.metrics' in str(x.message) for x in w), [str(x.message) for x in w]\n"
            "import gleak\n"
            "assert gleak.list_plugins('attack', 'dlg') == ['dlg']\n")  # fmt: skip
    for first, second in (("gleak.attacks.dlg", "attacks.dlg"), ("attacks.dlg", "gleak.attacks.dlg")):
        done = subprocess.run([sys.executable, "-c", code.format(first=first, second=second)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, (first, second, done.stderr[-2000:])


def test_the_install_names_every_subpackage_of_the_tree():
    """`pip install .` installs the packages pyproject.toml lists, not the tree: a subpackage left out of the list
    works in an editable checkout and is missing from every wheel (import gleak then fails)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "gleak").rglob("__init__.py")}
    assert tree <= listed, sorted(tree - listed)
    folders = {"gleak.attacks": "attacks", "gleak.defenses": "defenses", "gleak.protocols": "protocols"}
    assert set(folders) <= listed and all((ROOT / f / "__init__.py").is_file() for f in folders.values())
