"""A rank that stays is lost while a planned migration is under way (before its switch step).

Three workers, ``--standby 2``; once both standbys are warm, ``tmrun-ctl migrate 1`` (the first
standby is promoted for the planned generation 1) and rank 2 is SIGKILLed once it prepared its
links to that joiner (the ``switch`` drill). The controller replaces rank 2 with the second
standby in the unplanned generation 2, and gives rank 1 to the migration's joiner again there;
no rank commits toward generation 1 (its joiner no longer connects for it); the leaver, whose
handover the newer generation superseded, leaves; rank 0 heals both joiners.

Before the fix the migration's joiner was not carried into generation 2: it waited 5 s for an
assignment and left, its exit cost a third generation, and rank 0 waited out two 30 s connect
timeouts committing toward joiners that had moved on (55 s of downtime; the same case on an HSDP
mesh hung: ``tests/e2e/test_mesh.py::test_hsdp_survivor_killed_at_the_switch``)."""

from __future__ import annotations

import re
import threading
from functools import partial
from pathlib import Path

import pytest

from tests.e2e.fault_matrix.conftest import STEPS
from tests.helpers import EXAMPLES, ctl_when_logged, run_job, tmrun_cmd

pytestmark = pytest.mark.e2e

JOB_TIMEOUT = 240


def test_a_rank_lost_before_a_migrations_switch_gets_one_generation_with_the_joiner(tmp_path: Path,
                                                                                    reference3: str) -> None:
    work = tmp_path / "migration"
    work.mkdir()
    requested: list[str] = []
    request = partial(ctl_when_logged, work / "agent.log", ["standby 0 warm", "standby 1 warm"],
                      ["migrate", "1", "--reason", "drill"], work / "state", requested)
    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    cmd = tmrun_cmd(
        "--standalone", "--nproc-per-node", "3", "--standby", "2", "--console", "plain",
        "--inject-failure", "rank=2,at=switch",
        str(EXAMPLES / "train_inplace.py"), "--steps", str(STEPS), "--width", "48", "--batch", "16",
        "--step-time", "1.0",  # paced: the request lands well before the last step (same bits)
        "--step-log", str(work / "steps-{rank}.log"), "--final", str(work / "final"),
    )  # fmt: skip
    code, log = run_job(cmd, work / "agent.log", {"TMRUN_STATE_DIR": str(work / "state")}, JOB_TIMEOUT)
    thread.join(timeout=5)
    assert requested and "migration of rank 1 requested" in requested[0], (requested, log)
    assert code == 0, log
    assert (work / "final").read_text().strip() == reference3, log
    assert re.search(r"planned migration, generation 1: rank 1 \(pid \d+\) -> standby 0", log), log
    assert re.search(r"generation 2: rank 1's joiner \(standby 0, pid \d+\) had not recovered into generation 1: "
                     r"it reconnects for generation 2", log), log
    assert re.search(r"in-place replacement, generation 2: rank 2 \(pid \d+, signal SIGKILL\) -> standby 1", log), log
    assert "generation 3" not in log and "falling back" not in log and "Traceback" not in log, log
    assert "lost a member again during recovery" not in log, log  # nobody waited on a joiner that moved on
    assert "generation 2: all 3 ranks recovered" in log, log
    rows = [line.split() for line in (work / "steps-0.log").read_text().splitlines()]
    assert len({row[2] for row in rows}) == 1, "rank 0 changed process"
    done = [int(row[0]) for row in rows]
    assert sorted(set(done)) == list(range(STEPS)) and len(done) - len(set(done)) <= 1, done
