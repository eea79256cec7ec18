"""The agent of a one-node ``--standby 1`` job SIGKILLed mid-training (docs/reliability.md,
"agent kill, one node"). The agent is the job's supervisor, store and controller: the job ends.
Decided: no worker or standby is left behind; each notices on its own that its parent changed
(a worker at its next step boundary, a standby in its wait) and exits within a few seconds,
before writing any result. The test kills only the agent and asserts before its own cleanup.
A worker that never reaches a step boundary (stalled for good: a wedged kernel, a deadlock) is
ended by its orphan guard (tmrun.protocol.orphan_guard) once its grace ran out."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, kill_tree, start, tagged_pids, tmrun_cmd, wait_until

pytestmark = pytest.mark.e2e

BOUND = 10.0  # seconds for every orphan to exit by itself (a step is 0.2 s; a loaded CI machine)


def test_killed_agent_leaves_no_worker_or_standby_behind(tmp_path: Path) -> None:
    work = tmp_path / "agentkill"
    work.mkdir()
    cmd = tmrun_cmd(
        "--standalone", "--nproc-per-node", "2", "--standby", "1",
        str(EXAMPLES / "train_inplace.py"), "--steps", "200", "--width", "48", "--batch", "16",
        "--step-time", "0.2", "--step-log", str(work / "steps-{rank}.log"), "--final", str(work / "final"),
    )  # fmt: skip
    log = work / "agent.log"
    job = start(cmd, log=log, env={"TMRUN_STATE_DIR": str(work / "state")})
    try:
        steps0 = work / "steps-0.log"
        # mid-training (the standby may be warm or still in its shadow steps: both must go)
        assert wait_until(lambda: "standby worker 0 started" in log.read_text()
                          and steps0.exists() and len(steps0.read_text().splitlines()) >= 2, 120), log.read_text()
        others = [pid for pid in tagged_pids(job.tag) if pid != job.pid]  # type: ignore[attr-defined]
        assert len(others) >= 3, others  # two workers and the standby (at least)
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=10)
        killed = time.monotonic()
        gone = wait_until(lambda: not tagged_pids(job.tag), BOUND)  # type: ignore[attr-defined]
        elapsed = time.monotonic() - killed
        left = tagged_pids(job.tag)  # type: ignore[attr-defined]
        text = log.read_text()
        assert gone and left == [], f"left behind {BOUND}s after the agent's SIGKILL: {left}\n{text}"
        # every process left on its own (nothing was killed but the agent): a worker at its step
        # boundary says so; one that was inside its step when the other left loses its peer
        # first and leaves through its recovery (the store is gone), in other words
        assert text.count("is gone; this worker exits (the job ends)") >= 1, text
        assert not (work / "final").exists(), "a result was written after the agent died"
        print(f"every process gone {elapsed:.2f}s after the agent's SIGKILL")
    finally:
        kill_tree(job)


def test_killed_agent_ends_a_worker_that_never_reaches_a_step_boundary(tmp_path: Path) -> None:
    work = tmp_path / "stalled"
    work.mkdir()
    cmd = tmrun_cmd(
        "--standalone", "--nproc-per-node", "2", "--standby", "1", "--inject-failure", "rank=0,step=2,signal=STALL",
        str(EXAMPLES / "train_inplace.py"), "--steps", "200", "--width", "48", "--batch", "16",
        "--step-time", "0.2", "--final", str(work / "final"),
    )  # fmt: skip
    log = work / "agent.log"
    job = start(cmd, log=log, env={"TMRUN_STATE_DIR": str(work / "state"), "TMRUN_ORPHAN_GRACE": "1"})
    try:
        assert wait_until(lambda: "rank 0 stalls at step of step 2" in log.read_text(), 120), log.read_text()
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=10)
        gone = wait_until(lambda: not tagged_pids(job.tag), BOUND)  # type: ignore[attr-defined]
        left = tagged_pids(job.tag)  # type: ignore[attr-defined]
        text = log.read_text()
        assert gone and left == [], f"left behind {BOUND}s after the agent's SIGKILL: {left}\n{text}"
        # rank 0 stalled for good: its guard ended it; rank 1 waits in the stalled collective
        assert re.search(r"worker \d+ [\d:.]+\] ending this process: its agent \(pid \d+\) is gone and it did "
                         r"not leave within 1s", text), text
        assert not (work / "final").exists(), "a result was written after the agent died"
    finally:
        kill_tree(job)
