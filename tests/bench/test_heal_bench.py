"""bench/heal_transfer.py at a tiny size: healing between two real processes on this host, once
read out of the donor's memory (process_vm_readv across processes) and once over the socket,
each bitwise equal (the bench exits non-zero otherwise)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT, run

BENCH = ROOT / "bench" / "heal_transfer.py"


@pytest.mark.e2e  # starts processes that import torch: not in the unit subset
def test_heal_between_two_processes_by_either_path() -> None:
    out = run([sys.executable, str(BENCH), "--runs", "1", "--sizes", "64x2", "--timeout", "120"], timeout=180)
    assert out.returncode == 0, out.stdout
    assert "every run bitwise equal" in out.stdout, out.stdout
    assert "| memory | 1 |" in out.stdout and "| socket | 1 |" in out.stdout, out.stdout
