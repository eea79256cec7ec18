"""Survivors' reports against ranks whose process still runs (control/replacement/core.py:
Accusations), the one hold both topologies use: each report waits its settle time, a rank that
reports a loss itself waits longer, a rank that said goodbye waits for its own exit, and a report
whose rank exited, was replaced or whose generation passed is dropped (real child processes,
killed by PID)."""

from __future__ import annotations

import subprocess
import sys
import time

from tmrun.control.replacement.core import LEFT_MARK, Accusations, Slots
from tmrun.protocol.messages import WorkerReport

SLEEP = "import time; time.sleep(60)"


def _slots(procs: list[subprocess.Popen[bytes]], ranks: list[int]) -> Slots:
    started = {rank: subprocess.Popen([sys.executable, "-c", SLEEP]) for rank in ranks}
    procs.extend(started.values())
    slots = Slots()
    slots.adopt(started)
    return slots


def _due_ranks(accusations: Accusations, slots: Slots, gen: int) -> list[int]:
    return [slot.rank for slot, _ in accusations.due(slots, gen)]


def test_each_kind_of_report_waits_its_own_time(procs) -> None:  # type: ignore[no-untyped-def]
    """Rank 1: a plain report (settle); rank 2: reports a loss itself too (cascade settle); rank 3:
    said goodbye (goodbye grace). Each is due after its own wait, once."""
    slots = _slots(procs, [1, 2, 3])
    accusations = Accusations(settle=0.1, cascade_settle=0.4, goodbye_grace=0.8)
    start = time.monotonic()  # before the reports: each wait counts from its report
    assert accusations.note(WorkerReport(reporter=0, lost=1, gen=2), slots, 2) is not None
    assert accusations.note(WorkerReport(reporter=0, lost=2, gen=2), slots, 2) is not None
    assert accusations.note(WorkerReport(reporter=2, lost=0, gen=2), slots, 2) is None  # rank 0 is not ours
    goodbye = accusations.note(WorkerReport(reporter=0, lost=3, gen=2, detail=f"rank 3 lost: {LEFT_MARK}"), slots, 2)
    assert goodbye is not None and goodbye.goodbye
    assert accusations.note(WorkerReport(reporter=0, lost=1, gen=2), slots, 2) is None  # held already
    assert len(accusations) == 3 and _due_ranks(accusations, slots, 2) == []
    due: dict[int, float] = {}
    while len(due) < 3:
        assert time.monotonic() - start < 10
        for rank in _due_ranks(accusations, slots, 2):
            assert rank not in due  # each once
            due[rank] = time.monotonic() - start
        time.sleep(0.01)
    assert sorted(due, key=due.__getitem__) == [1, 2, 3], due
    assert due[1] >= 0.1 and due[2] >= 0.4 and due[3] >= 0.8, due
    assert len(accusations) == 0


def test_a_goodbye_heard_later_gives_a_held_rank_its_grace(procs) -> None:  # type: ignore[no-untyped-def]
    """One peer saw rank 1's link reset, another its goodbye: it is leaving, and its own exit
    code (not our SIGKILL) must say why. Nothing is due within the grace; its exit drops it."""
    slots = _slots(procs, [1])
    accusations = Accusations(settle=0.0, cascade_settle=0.0, goodbye_grace=30.0)
    accusations.note(WorkerReport(reporter=0, lost=1, gen=1, detail="Connection reset by peer"), slots, 1)
    accusations.note(WorkerReport(reporter=2, lost=1, gen=1, detail=f"rank 1 lost: {LEFT_MARK}"), slots, 1)
    time.sleep(0.05)
    assert _due_ranks(accusations, slots, 1) == []
    procs[-1].kill()
    procs[-1].wait(timeout=10)
    assert _due_ranks(accusations, slots, 1) == [] and len(accusations) == 0  # its exit explains it


def test_stale_dead_and_replaced_ranks_are_dropped(procs) -> None:  # type: ignore[no-untyped-def]
    slots = _slots(procs, [1, 2])
    accusations = Accusations(settle=0.0, cascade_settle=0.0, goodbye_grace=0.0)
    assert accusations.note(WorkerReport(reporter=0, lost=1, gen=1), slots, 2) is None  # an older generation
    assert accusations.note(WorkerReport(reporter=1, lost=1, gen=2), slots, 2) is None  # its own leave
    held = accusations.note(WorkerReport(reporter=0, lost=1, gen=2), slots, 2)
    assert held is not None and held.pid == slots[1].pid
    # the leader publishes generation 3 (the loss was elsewhere): the report is superseded
    assert [a.report.lost for a in accusations.superseded(3)] == [1] and len(accusations) == 0
    assert _due_ranks(accusations, slots, 3) == []
    # rank 2 replaced by a new process after the report: the new process is not blamed
    accusations.note(WorkerReport(reporter=0, lost=2, gen=3), slots, 3)
    replacement = subprocess.Popen([sys.executable, "-c", SLEEP])
    procs.append(replacement)
    slots.replace(2, replacement, leaving=False)
    assert _due_ranks(accusations, slots, 3) == [] and len(accusations) == 0
    # a report against the new process is held and due
    accusations.note(WorkerReport(reporter=0, lost=2, gen=3), slots, 3)
    assert _due_ranks(accusations, slots, 3) == [2]
