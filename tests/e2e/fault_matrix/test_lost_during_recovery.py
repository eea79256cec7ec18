"""A rank lost after a generation is published, while that generation recovers (docs/reliability.md,
"joiner waits for a dead rank's address"). Three workers, ``--standby 2``: rank 1 is SIGKILLed at
step 4 (generation 1: its joiner connects); rank 2 dies as soon as it read generation 1's plan,
before it published its address for it. Generation 1's joiner gives up waiting for that address
at once (generation 2 superseded it: before, it waited 60 s and the job fell back to a group
restart); the controller gives it rank 1 again in generation 2, with rank 2's standby, and every
member replaces those links. The job finishes in place, bitwise equal.

From step 2 until every rank recovered, two busy-loop hogs saturate the machine's cores (CPU
starvation end to end, docs/reliability.md): started and killed here, by PID."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.e2e.test_inplace_one_node import _check, _run
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e


def test_a_rank_lost_while_a_generation_recovers_gets_one_more_generation(tmp_path: Path, reference3: str) -> None:
    work = tmp_path / "during"
    hogs: list[subprocess.Popen[bytes]] = []

    def starve() -> None:
        """From step 2 until every rank recovered: two busy loops saturate both cores (the
        start-up, which only costs time here, runs without them)."""
        steps0 = work / "steps-0.log"
        if wait_until(lambda: steps0.exists() and len(steps0.read_text().splitlines()) >= 2, 120):
            hogs.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2))
            wait_until(lambda: "all 3 ranks recovered" in (work / "agent.log").read_text(), 120)
        for hog in hogs:
            hog.kill()

    thread = threading.Thread(target=starve, daemon=True)
    thread.start()
    try:
        code, log, final, steps = _run(
            tmp_path, "during", "--inject-failure", "rank=1,step=4", "--inject-failure", "rank=2,at=recovery",
            nproc=3, standby=2, step_time=0.1,
        )
    finally:
        thread.join(timeout=10)
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert len(hogs) == 2, "the hogs never ran"
    _check(code, log, final, steps, reference3, survivors=[0])
    assert "falling back" not in log and "fallback" not in log, log
    assert re.search(r"generation 2: rank 1's joiner \(standby \d+, pid \d+\) had not recovered into generation 1: "
                     r"it reconnects for generation 2", log), log
    assert "joining generation 2" in log, log
    recovered = re.search(r"generation 2: all 3 ranks recovered, ([\d.]+)s after the change began", log)
    assert recovered, log
    # a stale wait would run into a 60 s timeout inside the recovery (the job's wall time also
    # counts its start-up and steps under the hogs: not a measure of the recovery)
    assert float(recovered.group(1)) < 30, f"{recovered.group(0)}: a stale wait ran into a timeout\n{log}"
