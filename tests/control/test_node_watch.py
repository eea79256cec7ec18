"""An active node of an in-place job over several nodes, seen from its agent (real store, real
child processes killed by PID): it fences every worker of the node when one is lost or fails,
reports the node failed once, and copies the generation into the node's file."""

from __future__ import annotations

import subprocess
import sys
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


def test_a_survivors_report_fences_the_node(tmp_path: Path, procs) -> None:  # type: ignore[no-untyped-def]
    store, member, reports = _member(tmp_path)
    hung, mate = _start(procs, SLEEP), _start(procs, SLEEP)
    member.adopt({2: hung, 3: mate}, promoted=False)
    for report in (proto.WorkerReport(reporter=0, lost=-1, gen=0),  # nobody named: nobody fenced
                   proto.WorkerReport(reporter=0, lost=2, gen=5)):  # another generation: stale
        store.set(keys.report(store.add(keys.REPORT_SEQ, 1) - 1), report.encode())
    assert not member.step().failed and hung.poll() is None
    store.set(keys.report(store.add(keys.REPORT_SEQ, 1) - 1), proto.WorkerReport(reporter=0, lost=2, gen=0).encode())
    assert member.step().failed
    assert (hung.wait(timeout=10), mate.wait(timeout=10)) == (-9, -9)
    assert reports and "rank 2" in reports[0][1] and "lost by rank 0" in reports[0][1]


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
