import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The tests never reach the network: `gleak run` would otherwise try to fetch LPIPS's AlexNet weights in every test
# that runs a suite (subprocesses inherit this). The fetch itself is tested against a local file URL.
os.environ.setdefault("GLEAK_LPIPS_NO_DOWNLOAD", "1")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per usable core, at most 4. Many tests start `gleak run` with two
    worker processes of their own, so more pytest workers than cores only makes them wait; past 4 the start-up of
    each worker (torch's import) and the longest test file, not the cores, bound the wall time."""
    from gleak.orchestration.workers import usable_cores  # what `gleak run --workers auto` counts (no torch import)

    return max(1, min(4, usable_cores()))


def pytest_collection_modifyitems(config, items):
    """The test files longest first (tests/file_costs.json, measured: tests/_file_costs.py), each file's tests in
    their own order: pytest-xdist hands files to workers in this order (pyproject's --no-loadscope-reorder; its
    default order, by number of tests, started the few long science files last while the other worker idled)."""
    import json

    table = ROOT / "tests" / "file_costs.json"
    costs = json.loads(table.read_text()) if table.is_file() else {}
    items.sort(key=lambda item: -costs.get(item.nodeid.split("::")[0], 0.0))  # stable: a file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def _torch_one_thread():
    """Every test runs torch on one thread: the models are tiny, so one thread is faster than two and far faster
    when other processes load the cores, and a result does not depend on the machine's core count (torch's
    reductions split their work by thread count). Inter-op threads too, where torch still allows it (only before
    its first inter-op work). Trials in worker processes pin themselves (`gleak run --threads`, default 1)."""
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # inter-op work has started already: torch refuses a change
        pass
    yield


@pytest.fixture(autouse=True)
def _torch_stays_on_one_thread():
    """A test that changes torch's thread count (an API call with threads=N) hands the next test one thread again."""
    yield
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture
def gleak_cmd():
    """The CLI as a subprocess command (so exit codes and stderr are the user's)."""
    return [sys.executable, "-m", "gleak"]


def _env() -> dict[str, str]:
    """The environment of a CLI subprocess: this checkout's gleak first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def run_env():
    return _env()


@pytest.fixture
def gleak_cli(capsys):
    """The CLI in this process: gleak_cli(args) -> (exit status, stderr), what the user's command would give (for
    what a subprocess is not needed for: no os._exit, no signal, no second interpreter)."""
    from gleak import cli

    def call(args: list[str]) -> tuple[int, str]:
        capsys.readouterr()
        code = cli.main(args)
        return code, capsys.readouterr().err

    return call


# A small suite with a [utility] table (skimage at 16x16, a 32-unit MLP): shared by the utility and report tests.
UTILITY_SUITE = """
[suite]
name = "rep"
seeds = [0]
[case]
dataset = "skimage"
model = "mlp"
model_params = { hidden = [32] }
resolution = 16
batch_size = 2
[[attack]]
name = "closed-form"
[[attack]]
name = "idlg"
[[defense]]
name = "none"
[[defense]]
name = "noise"
sigma = [0.001, 0.1]
[[defense]]
name = "topk"
ratio = [0.5, 0.99]
[[defense]]
name = "noise"
mode = "dp"
noise_multiplier = 1.0
[utility]
dataset = "skimage"
model = "mlp"
model_params = { hidden = [32] }
resolution = 16
clients = 2
rounds = 4
batch_size = 8
"""


@pytest.fixture(scope="session")
def utility_suite():
    return UTILITY_SUITE


@pytest.fixture(scope="session")
def utility_run(tmp_path_factory):
    """UTILITY_SUITE run once by the CLI: (suite file, output folder, the run's stderr, env). Tests that change the
    folder work on a copy. Run once for all pytest-xdist workers (the first to get here runs it under a lock, in the
    folder their temporary folders share; each worker's session gets its own copy of the result)."""
    import json
    import shutil
    import subprocess

    from filelock import FileLock

    env = _env()
    base = tmp_path_factory.getbasetemp()  # under xdist, gw0's and gw1's folders sit in this session's folder
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "utility_run"
    with FileLock(f"{shared}.lock"):
        if not (shared / "stderr.json").is_file():
            shutil.rmtree(shared, ignore_errors=True)
            shared.mkdir()
            (shared / "rep.toml").write_text(UTILITY_SUITE)
            r = subprocess.run([sys.executable, "-m", "gleak", "run", str(shared / "rep.toml"), "--out", str(shared / "out"),
                                "--no-progress"], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
            assert r.returncode == 0, r.stderr
            (shared / "stderr.json").write_text(json.dumps(r.stderr))
    d = tmp_path_factory.mktemp("utility_run")
    shutil.copy(shared / "rep.toml", d / "rep.toml")
    shutil.copytree(shared / "out", d / "out")
    (d / "out" / ".lock").unlink(missing_ok=True)
    return d / "rep.toml", d / "out", json.loads((shared / "stderr.json").read_text()), env


@pytest.fixture
def published(monkeypatch):
    """`published(path)`: take this file as the published AlexNet weights (its digest as the published one), for
    tests that load a backbone built here (random weights: they exercise the loading path, never a score)."""
    from gleak.mechanics import perceptual

    def accept(path):
        monkeypatch.setattr(perceptual, "ALEXNET_SHA256_PREFIX", perceptual.sha256_of(path)[:8])
        return path

    return accept
