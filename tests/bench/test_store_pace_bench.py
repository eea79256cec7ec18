"""bench/store_pace.py: the job's store requests per second by wait and job size, tmrun's pace
against the same waits unbounded, counted in one run."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT, load_script

BENCH = ROOT / "bench" / "store_pace.py"


def test_a_small_job_is_unchanged_and_a_large_one_stays_under_the_budget() -> None:
    bench = load_script(BENCH, "store_pace")
    rows = bench.measure([8, 1000])
    budget = bench.store_pace.STORE_BUDGET
    assert {row["wait"] for row in rows} == {"joiner's address", "plan (generation file)", "plan (store only)",
                                            "lost vote's records"}
    for row in rows:
        if row["world"] == 8:
            assert row["tmrun"] == row["unbounded"], row
        else:
            assert row["tmrun"] <= budget * 1.0001 < row["unbounded"], row
    assert bench.store_pace.STORE_BUDGET == budget  # put back after each unbounded count


def test_bad_worlds_are_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--worlds", "0,x"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "--worlds: positive integers" in done.stderr and "Traceback" not in done.stderr, done.stderr
