"""A migration's leaver ends through tmrun.worker.leave: exit handlers run, output is flushed,
the script's ``finally`` blocks run, the status is 0 (1 if the script fails while unwinding)."""

from __future__ import annotations

import pytest

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    from tmrun.worker.leave import leave

    sys.stdout.write("buffered, no newline")  # must be flushed
    atexit.register(lambda: print("handler registered before the leave", flush=True))
    try:
        leave()
    finally:
        print("finally ran")
        if sys.argv[1] == "fail":
            raise RuntimeError("failed while unwinding")
    print("never here")
    """
)


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "leaver.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60)


@pytest.mark.e2e  # starts processes that import torch: not in the unit subset
def test_leave_runs_handlers_and_exits_zero(tmp_path: Path) -> None:
    result = _run(tmp_path, "ok")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("buffered, no newline")
    assert "finally ran" in result.stdout and "handler registered before the leave" in result.stdout
    assert "never here" not in result.stdout


@pytest.mark.e2e  # starts processes that import torch: not in the unit subset
def test_leave_reports_a_failure_while_unwinding(tmp_path: Path) -> None:
    result = _run(tmp_path, "fail")
    assert result.returncode == 1
    assert "failed while unwinding" in result.stderr
    assert "handler registered before the leave" in result.stdout
