"""An active node of an in-place job over several nodes, seen from its agent (real store, real
child processes killed by PID): it fences every worker of the node when one is lost or fails,
reports the node failed once, and copies the generation into the node's file."""

from __future__ import annotations

import pytest

import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from tmrun.protocol import keys, messages as proto
from tmrun.control.replacement.nodes import NodeWatch

SLEEP = "import time; time.sleep(60)"


def _member(tmp_path: Path) -> tuple[dist.Store, NodeWatch, list[tuple[bool, str]]]:
    store = dist.HashStore()
    reports: list[tuple[bool, str]] = []
    member = NodeWatch(store, 4, str(tmp_path / "gen"), lambda by_signal, detail: reports.append((by_signal, detail)))
    return store, member, reports


def _start(procs: list[subprocess.Popen[bytes]], code: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", code])
    procs.append(process)
    return process


def test_a_worker_that_fails_takes_its_node_down_and_is_reported_once(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    store, member, reports = _member(tmp_path)
    mate, failing = _start(procs, SLEEP), _start(procs, "raise SystemExit(3)")
    member.adopt({2: mate, 3: failing}, promoted=False)
    failing.wait(timeout=30)
    assert member.step().failed
    assert mate.wait(timeout=10) == -9  # its node-mate is stopped too: a member is a node
    assert reports == [(False, "rank 3 exit code 3")]
    assert member.step().failed and len(reports) == 1  # reported once


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
def test_a_survivors_report_fences_the_node(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    store, member, reports = _member(tmp_path)
    hung, mate = _start(procs, SLEEP), _start(procs, SLEEP)
    member.adopt({2: hung, 3: mate}, promoted=False)
    for report in (proto.WorkerReport(reporter=0, lost=-1, gen=0),  # nobody named: nobody fenced
                   proto.WorkerReport(reporter=0, lost=2, gen=5)):  # another generation: stale
        store.set(keys.report(store.add(keys.REPORT_SEQ, 1) - 1), report.encode())
    assert not member.step().failed and hung.poll() is None
    store.set(keys.report(store.add(keys.REPORT_SEQ, 1) - 1), proto.WorkerReport(reporter=0, lost=2, gen=0).encode())
    assert not member.step().failed and not reports  # the settle window: its own exit may explain it
    deadline = time.monotonic() + 10
    while not member.step().failed:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert (hung.wait(timeout=10), mate.wait(timeout=10)) == (-9, -9)
    assert len(reports) == 1 and "rank 2" in reports[0][1] and "lost by rank 0" in reports[0][1]


def test_a_local_exit_within_the_settle_window_wins_the_blame_over_a_report(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """Issue 16: rank 2 reports rank 3 lost before rank 3's process (which raised) finished
    exiting. The exit with an error is the root cause: the node is reported for "exit code 1",
    not for the survivor's report."""
    store, member, reports = _member(tmp_path)
    mate, exiting = _start(procs, SLEEP), _start(procs, "import time, sys; time.sleep(0.05); sys.exit(1)")
    member.adopt({2: mate, 3: exiting}, promoted=False)
    store.set(keys.report(store.add(keys.REPORT_SEQ, 1) - 1), proto.WorkerReport(reporter=2, lost=3, gen=0).encode())
    deadline = time.monotonic() + 10
    while not member.step().failed:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert reports == [(False, "rank 3 exit code 1")], reports


def test_a_report_superseded_by_a_newer_generation_stops_nothing(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    """A survivor reports rank 2 lost while its process runs (it read a link that rank 2 closed on
    seeing a rank of another node die); within the settle window the leader publishes generation
    1 for that death: the report is stale, this node is neither stopped nor reported."""
    store = dist.HashStore()
    reports: list[tuple[bool, str]] = []
    member = NodeWatch(store, 4, str(tmp_path / "gen"), lambda by_signal, detail: reports.append((by_signal, detail)),
                       settle=0.3)
    alive, mate = _start(procs, SLEEP), _start(procs, SLEEP)
    member.adopt({2: alive, 3: mate}, promoted=False)
    store.set(keys.report(store.add(keys.REPORT_SEQ, 1) - 1), proto.WorkerReport(reporter=0, lost=2, gen=0).encode())
    assert not member.step().failed
    store.set(keys.GEN, "1")
    assert not member.step().failed
    time.sleep(0.4)
    assert not member.step().failed and not member.step().failed
    assert not reports and alive.poll() is None and mate.poll() is None


def test_generation_file_and_finish(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    store, member, _ = _member(tmp_path)
    assert (tmp_path / "gen").read_text() == "0"
    a, b = _start(procs, "pass"), _start(procs, "pass")
    member.adopt({0: a, 1: b}, promoted=False)
    store.set(keys.GEN, "3")
    a.wait(timeout=30)
    b.wait(timeout=30)
    assert member.step().finished
    assert (tmp_path / "gen").read_text() == "3"
    assert not member.enabled()
    store.set(keys.API, "1")
    store.add(keys.MEMBERS, 4)
    assert member.enabled()


def _watched(tmp_path: Path, **settings: object) -> tuple[dist.Store, dist.Store, NodeWatch, list, dict]:
    from tmrun.control.detection import Detection, DetectionSettings
    from tmrun.protocol import progress

    store, job = dist.HashStore(), dist.HashStore()
    (tmp_path / "progress").mkdir()
    detection = Detection(DetectionSettings(progress_dir=str(tmp_path / "progress"), read_interval=0.0,
                                            gpu_health=False, **settings), job, 1, {2: 0, 3: 1})  # type: ignore[arg-type]
    reports: list[tuple[bool, str]] = []
    watch = NodeWatch(store, 4, str(tmp_path / "gen"), lambda by_signal, detail: reports.append((by_signal, detail)),
                      detection, job)
    store.set(keys.API, "1")
    store.add(keys.MEMBERS, 4)
    files = {r: progress.ProgressFile(progress.path_for(str(tmp_path / "progress"), r)) for r in (2, 3)}
    return store, job, watch, reports, files


def test_a_stopped_worker_fails_its_node_after_the_hang_timeout(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    import os
    import signal
    import time

    from tmrun.protocol.progress import ProgressRecord

    store, job, watch, reports, files = _watched(tmp_path, hang_timeout=0.5)
    stuck, mate = _start(procs, SLEEP), _start(procs, SLEEP)
    watch.adopt({2: mate, 3: stuck}, promoted=False)
    files[2].write(ProgressRecord(step=4, pid=mate.pid, comm_since=time.time()))
    files[3].write(ProgressRecord(step=4, pid=stuck.pid))
    assert not watch.step().failed
    os.kill(stuck.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 20
    while not watch.step().failed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (stuck.wait(timeout=10), mate.wait(timeout=10)) == (-9, -9)  # the whole node is fenced
    assert len(reports) == 1 and "rank 3" in reports[0][1] and "hangs (process stopped" in reports[0][1]


def test_a_straggler_asks_the_leader_to_migrate_its_node(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    from tmrun.protocol.progress import ProgressRecord

    store, job, watch, reports, files = _watched(tmp_path, straggler_factor=2.0, straggler_steps=2)
    a, b = _start(procs, SLEEP), _start(procs, SLEEP)
    watch.adopt({2: a, 3: b}, promoted=False)
    from tmrun.protocol.membership import Membership

    def slow_steps(steps: range) -> None:
        for step in steps:
            files[2].write(ProgressRecord(step=step, busy_seconds=0.1, pid=a.pid, role="active"))
            files[3].write(ProgressRecord(step=step, busy_seconds=0.6, pid=b.pid, role="active"))
            assert not watch.step().failed

    # no standby node warm yet: the leader would refuse, so the node waits (and asks later)
    job.set(keys.STATE, Membership(epoch=1, active=[0, 1], standby=[2]).to_json())
    store.set(keys.standby_node(2), proto.StandbyNode([2000, 2001]).encode())
    store.set(keys.standby_ready(2000), "{}")
    slow_steps(range(4))
    assert job.add(keys.MIGRATE_SEQ, 0) == 0
    store.set(keys.standby_ready(2001), "{}")  # the standby node is warm: asked after K more slow steps
    slow_steps(range(4, 8))
    assert job.add(keys.MIGRATE_SEQ, 0) == 1  # once
    request = proto.MigrateRequest.decode("m", job.get(keys.migrate_request(0)))
    assert request.rank == 3 and request.reason.startswith("straggler") and reports == []
