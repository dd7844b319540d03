"""The examples run end to end, so that they cannot rot: examples/walkthrough.py and README's Python section."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_readme_python_section_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Python\n") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "gleak.run_trial" in code and "gleak.results" in code and "gleak.run(" in code
    code = code.replace("/tmp/gleak-quick", str(tmp_path / "quick")).replace("/tmp/gleak-trial.png", str(tmp_path / "t.png"))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "t.png").is_file() and (tmp_path / "quick" / "leaderboard.md").is_file()
    assert "20 0" in r.stdout  # the quick suite at one seed and batch size 1: 20 trials run, none failed


NOTEBOOK = ROOT / "examples" / "walkthrough.ipynb"


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def test_the_notebook_holds_the_percent_script_s_cells():
    """examples/walkthrough.ipynb is generated from examples/walkthrough.py (jupytext): the same cells, in order, so
    an edit to one without regenerating the other fails here."""
    jupytext = pytest.importorskip("jupytext")
    import nbformat

    assert _cells(nbformat.read(NOTEBOOK, as_version=4)) == _cells(jupytext.read(ROOT / "examples" / "walkthrough.py"))


def test_the_notebook_runs_end_to_end(tmp_path, monkeypatch):
    """Executed cell by cell in a kernel (nbclient), as a reader runs it, within a minute on the tiny defaults."""
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    import nbformat

    monkeypatch.setenv("GLEAK_EXAMPLE_OUT", "walkthrough-out")  # relative to the kernel's folder, tmp_path
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's own (inline): figures show as images
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "RunResult(" in outputs and "ran=20, failed=0" in outputs
    # The script runs these very cells (test_the_notebook_holds_the_percent_script_s_cells), so one run covers both.
    assert (tmp_path / "walkthrough-out" / "suite" / "figures" / "frontier.png").is_file()
    assert (tmp_path / "walkthrough-out" / "closed_form_vs_topk.png").stat().st_size > 1000
    assert "recovered" in outputs  # the undefended closed form at batch size 1 is exact
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))  # the figures show
    # The committed notebook carries its outputs (examples/execute_walkthrough.py), those of these very cells: each
    # code cell shows the same kinds of output as it does when run again, and its printed lines start alike.
    stored = nbformat.read(NOTEBOOK, as_version=4)
    assert _output_kinds(stored) == _output_kinds(nb) and all(kinds for kinds in _output_kinds(stored))
    assert _first_words(stored) == _first_words(nb)


def _output_kinds(nb) -> list[list[str]]:
    return [sorted({o.output_type + ":" + ",".join(sorted(o.get("data", {}))) for o in c.get("outputs", [])})
            for c in nb.cells if c.cell_type == "code"]  # fmt: skip


def _first_words(nb) -> list[list[str]]:
    """The first word of each printed line (no numbers, which move with the machine's round-off)."""
    return [[line.split(" ")[0] for o in c.get("outputs", []) for line in o.get("text", "").splitlines()[:3]]
            for c in nb.cells if c.cell_type == "code"]  # fmt: skip
