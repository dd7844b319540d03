import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gleak_cmd():
    """The CLI as a subprocess command (so exit codes and stderr are the user's)."""
    return [sys.executable, "-m", "gleak"]


@pytest.fixture
def run_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
