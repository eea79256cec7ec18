"""``close()`` right after a communicator is made (its worker thread not yet waiting for work)
returns: the worker is woken whatever the interleaving. Before the fix the stop flag was set
outside the queue's mutex, so the notify could fall between the worker's check of its predicate
and its wait; that worker slept for good and ``close()`` joined it for ever (CI hung once at a
worker's exit, in ``close_groups_at_exit``; this loop hung within 100-200 cycles)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("tmrun_native")

CYCLES = 3000
LOOP = f"""
import tmrun_native as tn
for _ in range({CYCLES}):
    tn.Communicator(0, 2, "close-race", 0, tn.Options()).close()
print("closed", {CYCLES})
"""


def test_a_communicator_closed_as_soon_as_it_is_made_never_hangs() -> None:
    # a subprocess: a hang must fail this test, not the suite
    try:
        done = subprocess.run([sys.executable, "-c", LOOP], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"close() hung within {CYCLES} create/close cycles")
    assert done.returncode == 0 and f"closed {CYCLES}" in done.stdout, done.stderr
