"""A rank that stays is lost while a planned migration is under way (before its switch step).

Once both standbys are warm, ``tmrun-ctl migrate 1`` (the first standby is promoted for the
planned generation 1) and a rank that stays is SIGKILLed once it prepared its links to that
joiner (the ``switch`` drill). The migration had not switched: the controller cancels it in the
unplanned generation 2, which replaces the dead rank with the second standby and gives rank 1
back to its own process (the holder of its state; the migration's joiner is stopped). No rank
commits toward generation 1; rank 1's process stays, and with it the state:

* three workers, rank 2 killed: rank 2's joiner heals from ranks 0 and 1;
* two workers, rank 0 killed: rank 1's process is the only holder of the state, and rank 0's
  joiner heals from it.

Before (2026-11-25): the migration's joiner was not carried into generation 2: it waited 5 s for
an assignment and left, its exit cost a third generation, and rank 0 waited out two 30 s connect
timeouts committing toward joiners that had moved on (55 s of downtime; on an HSDP mesh the job
hung: ``tests/e2e/test_mesh.py::test_hsdp_survivor_killed_at_the_switch``); with two workers the
leaver left without handing over, nobody held the state and the job fell back to a group
restart (the training from its start)."""

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


def _migrate_while_one_dies(work: Path, nproc: int, killed: int) -> tuple[str, dict[int, list[list[str]]]]:
    """The job (``nproc`` workers, --standby 2, paced steps) with ``tmrun-ctl migrate 1`` once both
    standbys are warm and rank ``killed`` SIGKILLed at the switch drill. Returns the log and
    every rank's step-log rows."""
    work.mkdir()
    requested: list[str] = []
    request = partial(ctl_when_logged, work / "agent.log", ["standby 0 warm", "standby 1 warm"],
                      ["migrate", "1", "--reason", "drill"], work / "state", requested)
    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    cmd = tmrun_cmd(
        "--standalone", "--nproc-per-node", str(nproc), "--standby", "2", "--console", "plain",
        "--inject-failure", f"rank={killed},at=switch",
        str(EXAMPLES / "train_inplace.py"), "--steps", str(STEPS), "--width", "48", "--batch", "16",
        "--step-time", "1.0",  # paced: the request lands well before the last step (same bits)
        "--step-log", str(work / "steps-{rank}.log"), "--final", str(work / "final"),
    )  # fmt: skip
    code, log = run_job(cmd, work / "agent.log", {"TMRUN_STATE_DIR": str(work / "state")}, JOB_TIMEOUT)
    thread.join(timeout=5)
    assert requested and "migration of rank 1 requested" in requested[0], (requested, log)
    assert code == 0, log
    assert re.search(r"planned migration, generation 1: rank 1 \(pid \d+\) -> standby 0", log), log
    assert re.search(rf"in-place replacement, generation 2: rank {killed} \(pid \d+, signal SIGKILL\) -> standby 1", log), log
    assert re.search(r"generation 2: the migration of rank 1 \(generation 1\) had not switched: cancelled; "
                     r"its process \(pid \d+\) keeps the rank", log), log
    assert "generation 3" not in log and "falling back" not in log and "Traceback" not in log, log
    assert "lost a member again during recovery" not in log, log  # nobody waited on a joiner that moved on
    assert f"generation 2: all {nproc} ranks recovered" in log, log
    rows = {rank: [line.split() for line in (work / f"steps-{rank}.log").read_text().splitlines()]
            for rank in range(nproc)}
    for rank in range(nproc):
        done = [int(row[0]) for row in rows[rank]]
        assert sorted(set(done)) == list(range(STEPS)) and len(done) - len(set(done)) <= 1, (rank, done)
    for rank in range(nproc):
        if rank != killed:  # rank 1's process included: the cancelled migration's leaver stays
            assert len({row[2] for row in rows[rank]}) == 1, (rank, "changed process")
    return log, rows


def test_a_rank_lost_before_a_migrations_switch_cancels_it(tmp_path: Path, reference3: str) -> None:
    _migrate_while_one_dies(tmp_path / "three", 3, killed=2)
    assert (tmp_path / "three" / "final").read_text().strip() == reference3


def test_the_only_other_holder_lost_before_the_switch_keeps_the_state(tmp_path: Path, one_node_reference: str) -> None:
    """Two workers: rank 0 dies while rank 1 migrates; rank 1's process is the only holder of
    the state and keeps it (before: the job restarted from scratch)."""
    log, _ = _migrate_while_one_dies(tmp_path / "two", 2, killed=0)
    assert (tmp_path / "two" / "final").read_text().strip() == one_node_reference, log
    assert re.search(r"rank 0: recovered into generation 2 .*from 1 donor", log), log
