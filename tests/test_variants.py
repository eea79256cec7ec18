"""The default run deselects the tests marked ``variant``; ``--variants``, ``-m variant`` and a
variant's own node id run them (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.e2e  # starts pytest processes that import torch: not in the unit subset

MODULE = "tests/e2e/test_real_code.py"
SEEDED = "test_a_rank_killed_at_a_random_moment_is_replaced_in_place"


def _collected(*args: str) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [line.split("::", 1)[1] for line in result.stdout.splitlines() if "::" in line]


def test_the_default_run_keeps_one_case_and_the_flag_runs_them_all() -> None:
    default = _collected(MODULE)
    assert f"{SEEDED}[1]" in default and f"{SEEDED}[2]" not in default and f"{SEEDED}[3]" not in default, default
    everything = _collected(MODULE, "--variants")
    assert {f"{SEEDED}[{seed}]" for seed in (1, 2, 3)} <= set(everything) and len(everything) == len(default) + 2
    assert sorted(_collected(MODULE, "-m", "variant")) == sorted([f"{SEEDED}[2]", f"{SEEDED}[3]"])


def test_a_variant_named_on_the_command_line_runs() -> None:
    assert _collected(f"{MODULE}::{SEEDED}[3]") == [f"{SEEDED}[3]"]
    assert sorted(_collected(f"{MODULE}::{SEEDED}")) == [f"{SEEDED}[{seed}]" for seed in (1, 2, 3)]
    assert _collected(f"{ROOT / MODULE}::{SEEDED}[2]") == [f"{SEEDED}[2]"]  # an absolute path
