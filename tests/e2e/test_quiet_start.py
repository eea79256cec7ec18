"""No noise in the quick start (issue 31): torch's "Failed to initialize NumPy" warning, printed at
import by every process where numpy is not installed (the quick start installs none), is not
printed by the launcher, the workers or the standbys tmrun starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import EXAMPLES, run, tmrun_cmd

WARNING = "Failed to initialize NumPy"


def _without_numpy(tmp_path: Path) -> dict[str, str]:
    """An environment in which ``import numpy`` fails, as in a venv without it, and with no warning
    filter inherited (a test that ran tmrun's main() in this process set tmrun's own filter here)."""
    stub = tmp_path / "no_numpy" / "numpy"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    return {"PYTHONPATH": str(stub.parent), "PYTHONWARNINGS": ""}


def test_the_environment_without_numpy_makes_torch_warn(tmp_path: Path) -> None:
    """The control: without tmrun's filter torch does print it here (so the test below can fail)."""
    env = _without_numpy(tmp_path)
    result = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, **env})
    assert WARNING in result.stderr, result.stderr


def test_the_quick_start_prints_no_numpy_warning(tmp_path: Path) -> None:
    env = _without_numpy(tmp_path)
    result = run(tmrun_cmd("--standalone", "--nproc-per-node", "2", "--standby", "1", "--console", "plain",
                           "--inject-failure", "rank=1,step=8", str(EXAMPLES / "train_inplace.py"),
                           "--steps", "12", "--step-time", "0.2", "--width", "32"),
                 timeout=180, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "in-place replacement" in result.stdout, result.stdout[-4000:]  # launcher, workers, standby and its refill all ran
    assert WARNING not in result.stdout, result.stdout
