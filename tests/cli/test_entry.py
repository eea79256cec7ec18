"""The ``tmrun`` command leaves without the interpreter's teardown, but after its exit handlers
and with its streams flushed, with :func:`tmrun.cli.main.main`'s exit code."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, sys
import tmrun.cli.main as cli
atexit.register(lambda: print("exit handler ran", flush=True))
sys.stdout.write("buffered, not flushed")
sys.argv = ["tmrun", *sys.argv[1:]]
cli.entry()
"""


def _entry(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=60)


def test_a_usage_error_leaves_with_code_2_after_the_exit_handlers() -> None:
    done = _entry("--nproc-per-node", "0", "train.py")
    assert done.returncode == 2, done
    assert "exit handler ran" in done.stdout and "buffered, not flushed" in done.stdout, done
    assert done.stderr.startswith("tmrun: error:") and "Traceback" not in done.stderr, done


def test_help_leaves_with_code_0() -> None:
    done = _entry("--help")
    assert done.returncode == 0 and "usage:" in done.stdout and "exit handler ran" in done.stdout, done
