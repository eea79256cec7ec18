"""The worker's side of progress (worker/progress.py, the backend's CommClock) and the slow
drill (worker/drills.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tmrun.comm.backend import CommClock
from tmrun.protocol import progress
from tmrun.protocol.drills import Drill
from tmrun.worker import progress as worker_progress
from tmrun.worker.drills import DrillRunner
from tmrun.worker.progress import ProgressWriter


def test_comm_clock_counts_time_with_a_collective_outstanding() -> None:
    clock = CommClock()
    changes: list[float] = []
    clock.listener = changes.append
    clock.begin()
    clock.begin()  # overlapping operations count once
    time.sleep(0.05)
    clock.end()
    assert clock.since() > 0
    clock.end()
    clock.end()  # unbalanced: ignored
    assert 0.04 < clock.seconds() < 1.0 and clock.since() == 0.0
    assert len(changes) == 2 and changes[0] > 0 and changes[1] == 0.0


def test_writer_records_steps_and_work_outside_collectives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = CommClock()
    monkeypatch.setattr(worker_progress, "COMM_CLOCK", clock)
    writer = ProgressWriter(str(tmp_path))
    writer.bind(1, gen=0, role="active")
    writer.begin_step()
    time.sleep(0.05)  # own work
    clock.begin()
    path = progress.path_for(str(tmp_path), 1)
    assert progress.read(path).comm_since > 0  # type: ignore[union-attr]
    time.sleep(0.1)  # waiting for peers
    clock.end()
    busy = writer.end_step(4, gen=0, role="active")
    record = progress.read(path)
    assert record is not None and record.step == 4 and record.comm_since == 0.0 and record.role == "active"
    assert 0.04 < busy < 0.1 and record.step_seconds >= 0.15 and record.busy_seconds == busy


def test_writer_without_a_directory_writes_nothing(tmp_path: Path) -> None:
    writer = ProgressWriter("")
    writer.bind(0, 0, "active")
    writer.begin_step()
    assert writer.end_step(0, 0, "active") >= 0 and not writer.enabled


def test_slow_drill_sleeps_in_proportion_to_the_ranks_own_work(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("tmrun.worker.drills.time.sleep", slept.append)
    runner = DrillRunner([Drill.parse("rank=1,slow=3x,step=2")], rank=1, promoted=False)
    for step in range(5):
        runner.fire("step", step)
        runner.observe(0.1 + (slept[-1] if step >= 2 and slept else 0.0))
    assert slept == pytest.approx([0.2, 0.2, 0.2])  # from step 2 on, (3 - 1) x its own 0.1 s
    other = DrillRunner([Drill.parse("rank=1,slow=3x")], rank=0, promoted=False)
    other.observe(0.1)
    other.fire("step", 1)
    joiner = DrillRunner([Drill.parse("rank=1,slow=3x")], rank=1, promoted=True)
    joiner.observe(0.1)
    joiner.fire("step", 1)
    assert len(slept) == 3  # neither another rank nor a joiner is slowed


def test_a_delay_drill_sleeps_once_at_its_point_and_the_rank_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("tmrun.worker.drills.time.sleep", slept.append)
    runner = DrillRunner([Drill.parse("rank=2,step=1,at=forward,delay=3")], rank=2, promoted=False)
    runner.fire("step", 1)
    runner.fire("forward", 0)
    assert slept == []
    runner.fire("forward", 1)  # returns: no signal, no exception
    runner.fire("forward", 1)
    assert slept == [3.0]  # once


def test_a_timed_drill_that_has_not_fired_when_the_steps_end_says_so(capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``time=`` drill later than the rank's steps fired only if the process lived that long;
    one that did not left the test without its failure, silently (found in a campaign of kills
    in a job's first second)."""
    started: list[float] = []

    class _Timer:  # no real timer: it would SIGKILL this test process when it fires
        def __init__(self, seconds: float, *args: object, **kwargs: object) -> None:
            started.append(seconds)
            self.daemon = True

        def start(self) -> None:
            pass

    monkeypatch.setattr("tmrun.worker.drills.threading.Timer", _Timer)
    runner = DrillRunner([Drill.parse("rank=2,time=300"), Drill.parse("rank=1,time=300"),
                          Drill.parse("rank=2,step=3")], rank=2, promoted=False)
    runner.steps_ended()
    err = capsys.readouterr().err
    assert "rank 2: --inject-failure rank=2,at=step,signal=KILL,who=original,time=300.0 has not fired" in err, err
    assert err.count("has not fired") == 1, err  # not another rank's, nor a step drill
    assert started == [300.0, 300.0]
