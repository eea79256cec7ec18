"""tmrun.protocol.orphan_guard: a process whose agent (its parent) died is ended after the grace,
also when its main thread never comes back (stalled); it says why, once; a live agent keeps it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tmrun.protocol import orphan_guard
from tests.helpers import wait_until

# the "agent": starts the "worker" (a stalled main thread under the guard), prints its pid, waits
AGENT = textwrap.dedent("""
    import os, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
    print(worker.pid, flush=True)
    time.sleep(float(sys.argv[2]))
""")
WORKER = textwrap.dedent("""
    import sys, time
    from tmrun.protocol import orphan_guard
    orphan_guard.start(int(sys.argv[1]), lambda m: print("guard:", m, flush=True), grace=GRACE)
    orphan_guard.start(int(sys.argv[1]), lambda m: print("second guard:", m, flush=True), grace=GRACE)
    while True:
        time.sleep(3600)  # stalled for good: never a step boundary
""")


def _run_agent(tmp_path: Path, grace: float, agent_lives: float) -> tuple[subprocess.Popen[bytes], int, Path]:
    out = tmp_path / "out.txt"
    with open(out, "wb") as sink:
        agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER.replace("GRACE", repr(grace)), str(agent_lives)],
                                 stdout=subprocess.PIPE, stderr=sink, cwd=str(Path(__file__).resolve().parents[2]))
    assert agent.stdout is not None
    worker = int(agent.stdout.readline())
    return agent, worker, out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_stalled_orphan_is_ended_after_the_grace(tmp_path: Path) -> None:
    agent, worker, _ = _run_agent(tmp_path, grace=0.3, agent_lives=60)
    try:
        assert agent.stdout is not None
        _kill(agent.pid)
        agent.wait(timeout=10)
        assert wait_until(lambda: not _alive(worker), 10), "the orphan outlived its agent"
        said = agent.stdout.read().decode()
        assert said.count("guard: the tmrun agent (pid") == 1 and "second guard" not in said, said
        assert f"(pid {agent.pid}) is gone and it did not leave within 0.3s" in said, said
    finally:
        _kill(worker)
        _kill(agent.pid)
        agent.wait(timeout=10)


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
def test_a_live_agent_keeps_its_worker(tmp_path: Path) -> None:
    agent, worker, _ = _run_agent(tmp_path, grace=0.0, agent_lives=60)
    try:
        assert not wait_until(lambda: not _alive(worker), 1.5), "the guard ended a worker whose agent lives"
    finally:
        _kill(worker)
        _kill(agent.pid)
        agent.wait(timeout=10)


def test_no_agent_no_guard() -> None:
    assert orphan_guard.start(0, print) is None
    assert not orphan_guard.orphaned(0)  # a process started without an agent is never an orphan
    assert not orphan_guard.orphaned(os.getppid()) and orphan_guard.orphaned(os.getpid())


@pytest.mark.parametrize(("value", "grace"), [("", 5.0), ("2.5", 2.5), (" 0 ", 0.0)])
def test_grace_from_environ(value: str, grace: float) -> None:
    assert orphan_guard.grace_from_environ({orphan_guard.GRACE_ENV: value}) == grace
    assert orphan_guard.grace_from_environ({}) == orphan_guard.DEFAULT_GRACE


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_a_bad_grace_is_one_line(value: str) -> None:
    with pytest.raises(ValueError, match=r"TMRUN_ORPHAN_GRACE=.* is not a number of seconds >= 0"):
        orphan_guard.grace_from_environ({orphan_guard.GRACE_ENV: value})
