"""Regenerate examples/walkthrough.ipynb from examples/walkthrough.py, executed, with its outputs stored, so that a
reader sees the printed results and the figures before running anything:

    python examples/execute_walkthrough.py

It runs the cells in a kernel (nbclient) in a scratch folder, as tests/test_examples.py does, and writes the
notebook with each cell's outputs (execution timestamps dropped, so that the file changes only when an output
does). Needs jupytext, nbclient and ipykernel (gleak[dev])."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    import jupytext
    import nbclient
    import nbformat

    nb = jupytext.read(HERE / "walkthrough.py")
    with tempfile.TemporaryDirectory() as scratch:
        # relative output paths in the printed results, as a reader's own run shows them
        os.environ["GLEAK_EXAMPLE_OUT"] = "walkthrough-out"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": scratch}}).execute()
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, HERE / "walkthrough.ipynb")
    print(f"wrote {HERE / 'walkthrough.ipynb'}: {sum(c.cell_type == 'code' for c in nb.cells)} code cells with their outputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
