"""In-place replacement across nodes, end to end on loopback: three real tmrun agents with
``--nnodes 2 --standby 1 --nproc-per-node 2`` (node 0 hosts the store, nodes 0 and 1 are active,
node 2 stands by with one warm standby worker per local rank).

A whole node (agent and workers) killed, or a node whose worker raises, is replaced in place by
the standby node: survivors keep their processes, at most the step in flight is redone, and the
final parameters and optimizer state are bitwise equal to a run with no failure. With no standby
node, tmrun falls back to restarting the group (logged) and the job still finishes.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from functools import partial
from pathlib import Path
from typing import Callable

import psutil
import pytest

from tests.helpers import EXAMPLES, drain_when_warm, run_agents, tmrun_cmd, wait_until

STEPS = 14
NPROC = 2
WORLD = 2 * NPROC
JOB_TIMEOUT = 240
SCRIPT_ARGS = ["--steps", str(STEPS), "--width", "48", "--batch", "16", "--step-time", "0.05"]


def _steps(work: Path) -> dict[int, list[tuple[int, int]]]:
    """rank -> [(step, pid)] from the example's step logs."""
    out: dict[int, list[tuple[int, int]]] = {}
    for rank in range(WORLD):
        path = work / f"steps-{rank}.log"
        rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
        out[rank] = [(int(r[0]), int(r[2])) for r in rows]
    return out


def _run_nodes(work: Path, agents: int, *tmrun_args: str, script_args: list[str] | None = None,
               during: Callable[[list[subprocess.Popen[bytes]]], None] | None = None,
               env: dict[str, str] | None = None) -> tuple[list[int], list[str], str]:
    """Start ``agents`` agents in order (the first hosts the store); returns their exit codes,
    their logs and the final digest. ``during(agents)``: run in a thread once every agent started."""
    work.mkdir()
    codes, logs = run_agents(work, agents, lambda port: tmrun_cmd(
        "--nnodes", "2", "--standby", "1", "--nproc-per-node", str(NPROC),
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nodes", "--rdzv-conf", "heartbeat_interval=0.5",
        *tmrun_args, str(EXAMPLES / "train_inplace.py"), *SCRIPT_ARGS, *(script_args or []),
        "--step-log", str(work / "steps-{rank}.log"), "--final", str(work / "final"),
    ), {"TMRUN_STATE_DIR": str(work / "state"), **(env or {})}, JOB_TIMEOUT, during)  # fmt: skip
    final = (work / "final").read_text().strip() if (work / "final").exists() else ""
    return codes, logs, final


@pytest.fixture(scope="module")
def reference(nodes_reference: str) -> str:
    return nodes_reference  # the same job with no failure (tests/e2e/conftest.py), once per session


def _check_in_place(work: Path, logs: list[str], final: str, reference: str) -> None:
    everything = "\n".join(logs)
    assert final == reference, "final state differs from the failure-free run\n" + everything
    assert re.search(r"replace: generation 1: node 2 replaces node 1 at group rank 1 in place "
                     r"\(ranks 2->standby 2000, 3->standby 2001\)", logs[0]), everything
    assert "recovered: generation 1: all 4 ranks back in" in logs[0], everything
    assert "this standby node now runs ranks [2, 3] in place" in logs[2], everything
    steps = _steps(work)
    for rank in (0, 1):  # survivors: the same process throughout, at most the step in flight redone
        done = [s for s, _ in steps[rank]]
        assert sorted(set(done)) == list(range(STEPS)), (rank, done)
        assert len(done) - len(set(done)) <= 1, (rank, done)
        assert len({pid for _, pid in steps[rank]}) == 1, f"rank {rank} changed process\n{everything}"
    for rank in (2, 3):  # the failed node's ranks, continued by the standby node's workers
        assert len({pid for _, pid in steps[rank]}) == 2, (rank, steps[rank])
        assert steps[rank][-1][0] == STEPS - 1
    assert "epoch 2" not in logs[0], "the group restarted instead of an in-place replacement\n" + everything


def test_whole_node_killed_is_replaced_in_place(tmp_path: Path, reference: str) -> None:
    """SIGKILL of node 1's agent and both its workers at the start of step 4."""
    codes, logs, final = _run_nodes(tmp_path / "kill", 3, "--inject-failure", "node=1,step=4")
    assert codes[0] == 0 and codes[2] == 0, "\n".join(logs)
    assert codes[1] == -9  # the killed agent
    assert "lost: node 1 (active): agent process exited" in logs[0]
    _check_in_place(tmp_path / "kill", logs, final, reference)


def test_node_whose_worker_raises_is_fenced_and_replaced(tmp_path: Path, reference: str) -> None:
    """Rank 3 (node 1) raises: node 1's agent stops its other worker, reports the node failed,
    and leaves cleanly once the standby node took its ranks; the job goes on without it."""
    codes, logs, final = _run_nodes(tmp_path / "raise", 3, "--inject-failure", "rank=3,step=4,signal=RAISE")
    assert codes == [0, 0, 0], "\n".join(logs)
    # its own exit code, or, where its exit took longer than the agent's 3 s wait for it (a loaded
    # 2-core machine: two standbys in their shadow steps), its peer's report of the loss
    assert re.search(r"this node failed \(rank 3 (exit code 1|\(pid \d+\) lost by rank \d, its process still running)\)",
                     logs[1]), logs[1]
    assert "ranks were taken over in place" in logs[1] and "this node leaves, the job goes on" in logs[1]
    _check_in_place(tmp_path / "raise", logs, final, reference)


def test_no_standby_node_falls_back_to_a_group_restart(tmp_path: Path, reference: str) -> None:
    """No third agent: the failure waits --standby-wait for a standby node, then the workers are
    told to give up in-place recovery and the group restarts (as torchrun) in a new epoch."""
    codes, logs, final = _run_nodes(tmp_path / "none", 2, "--standby-wait", "2",
                                    "--inject-failure", "rank=3,step=4,signal=RAISE")
    assert codes == [0, 0], "\n".join(logs)
    assert "fallback: no warm standby node within 2s: the group restarts (as torchrun)" in logs[0], logs[0]
    assert "node 0 runs group rank 0 of 2 in epoch 2" in logs[0]
    assert final == reference  # the example keeps no checkpoint: the restarted group trains from step 0
    # what the restart cost, from both nodes' progress: steps 0..3 done again, and the time
    # until step 4 completed (it printed '0 steps recomputed' and left the restart out)
    assert re.search(r"restarted: epoch 2: the group restart cost [\d.]+s \(failure to back at step 4\), resumed at "
                     r"step 0 after step 3 had completed: 4 steps recomputed", logs[0]), logs[0]
    assert "4 steps recomputed, 1 group restart (counted above)" in logs[0], logs[0]


def test_planned_migration_of_a_node_recomputes_nothing(tmp_path: Path, reference: str) -> None:
    """tmrun-ctl drain 1 (a migration of the node at group rank 1) once the standby node is warm:
    node 1's workers hand their state to the standby node's workers at a step boundary and exit
    0, node 1's agent leaves (and tmrun-ctl says so), no step is redone, and the result equals a
    run without migration."""
    work = tmp_path / "migrate"
    requested: list[str] = []
    shown: list[str] = []
    request = partial(drain_when_warm, work, requested, shown)
    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    codes, logs, final = _run_nodes(work, 3, script_args=["--step-time", "1.0"])  # room for the request under load
    thread.join(timeout=150)
    everything = "\n".join(logs)
    # tmrun-ctl status lists the warm standby node's standby workers (it listed none)
    standby_node = [n for n in json.loads(shown[0])["nodes"] if n["role"] == "standby"]
    assert len(standby_node) == 1 and len(standby_node[0]["standby_workers"]) == 2, shown
    assert {w["local_rank"] for w in standby_node[0]["standby_workers"]} == {0, 1}, shown
    assert requested and "draining node 1 (group rank 1)" in requested[0], requested
    # its agent left (or, when the training ended first, it leaves with the job)
    assert re.search(r"node 1 drained: (its agent left|the job ended)", requested[0]), requested
    assert codes == [0, 0, 0], everything
    assert re.search(r"migrate: generation 1: node 2 replaces node 1 at group rank 1 in place "
                     r"\(ranks 2->standby 2000, 3->standby 2001\): drain", logs[0]), everything
    assert "this node leaves, the job goes on" in logs[1], logs[1]
    # both ranks' joiners read their leaver's memory (the three agents share this host)
    assert len(re.findall(r"received the model \(\d+ bytes\) in [\d.]+s \(memory\)", everything)) == 2, everything
    assert final == reference, everything
    steps = _steps(work)
    for rank in range(WORLD):
        assert [s for s, _ in steps[rank]] == list(range(STEPS)), (rank, steps[rank])  # nothing recomputed
    for rank in (0, 1):
        assert len({pid for _, pid in steps[rank]}) == 1
    for rank in (2, 3):
        assert len({pid for _, pid in steps[rank]}) == 2


def test_node_whose_rank_hangs_is_fenced_and_replaced(tmp_path: Path, reference: str) -> None:
    """Rank 3 (node 1) stalls in its forward for good, its process and communicator alive: node
    1's agent sees no step for --hang-timeout with rank 3 outside the collective rank 2 waits in,
    fences its node and reports it; the standby node takes ranks 2 and 3 in place."""
    codes, logs, final = _run_nodes(tmp_path / "hang", 3, "--hang-timeout", "5",
                                    "--inject-failure", "rank=3,step=4,at=forward,signal=STALL")
    assert codes == [0, 0, 0], "\n".join(logs)
    assert re.search(r"this node failed \(rank 3 \(pid \d+\) hangs \(no step completed for [\d.]+s, outside any "
                     r"collective while rank\(s\) 2 wait in one\)\)", logs[1]), logs[1]
    _check_in_place(tmp_path / "hang", logs, final, reference)


@pytest.mark.variant  # by default: a straggler rank migrated on one node (test_detection_one_node)
def test_straggler_node_is_migrated_while_training_goes_on(tmp_path: Path, reference: str) -> None:
    """rank=3,slow=3x: rank 3 (node 1) does three times its peers' own work per step. Node 1's
    agent sees it over 2x the others' median for 3 steps and asks for a migration; the leader
    moves node 1 to the standby node at a step boundary while training goes on. No step is lost
    or redone, and the result equals a run without the straggler. The recovered event carries
    every phase, across the agents' processes, in order."""
    work = tmp_path / "straggler"
    codes, logs, final = _run_nodes(work, 3, "--straggler-factor", "2", "--straggler-steps", "3",
                                    "--inject-failure", "rank=3,slow=3x", script_args=["--step-time", "0.5"])
    everything = "\n".join(logs)
    assert codes == [0, 0, 0], everything
    found = re.search(r"rank 3: straggler: its own work took ([\d.]+)s per step, over 2x the others' median "
                      r"([\d.]+)s for 3 consecutive steps \(up to step (\d+)\); asking for a migration of this node",
                      logs[1])
    assert found, logs[1]
    assert re.search(r"migrate: generation 1: node 2 replaces node 1 at group rank 1 in place "
                     r"\(ranks 2->standby 2000, 3->standby 2001\): straggler", logs[0]), everything
    assert "this node leaves, the job goes on" in logs[1], logs[1]
    assert final == reference, "final state differs from the run without a straggler\n" + everything
    steps = _steps(work)
    for rank in range(WORLD):
        assert [s for s, _ in steps[rank]] == list(range(STEPS)), (rank, steps[rank])  # none lost or redone
    for rank in (0, 1):
        assert len({pid for _, pid in steps[rank]}) == 1
    detected = int(found.group(3))
    for rank in (2, 3):
        old_pid = steps[rank][0][1]
        switched = next(step for step, pid in steps[rank] if pid != old_pid)  # the joiner's first step
        # training went on: the group completed steps after the detection before the switch
        assert switched >= detected + 2, (rank, detected, switched)
    # the event log: the migration's recovered event with every phase, from the request on
    (events,) = (work / "state" / "runs").glob("*.events.jsonl")
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    (recovered,) = [r for r in rows if r["kind"] == "recovered"]
    names = ["detect", "plan", "connect", "transfer", "first_step"]
    assert all(isinstance(recovered["phases"][n], float) and recovered["phases"][n] >= 0 for n in names), recovered
    marks = [recovered["marks"][n]
             for n in ["failed", "seen", "published", "switch", "connected", "healed", "first_step"]]
    assert marks == sorted(marks), recovered
    # the survivors trained on until the switch step (at least a step of 0.5 s: the overlap), and
    # the downtime counts from the switch only
    assert recovered["phases"]["overlap"] >= 0.5, recovered
    assert recovered["seconds"] < recovered["phases"]["overlap"], recovered


def test_node_cut_off_is_replaced_and_leaves_when_it_comes_back(tmp_path: Path, reference: str) -> None:
    """Node 1's agent and both its workers SIGSTOPped mid-training (a node cut off: nothing it
    holds closes). Survivors lose ranks 2 and 3 after the comm timeout; the leader declares node 1
    lost after heartbeat_timeout (3 s here) and the standby node takes its ranks in place. Then
    node 1 is SIGCONTed: its agent finds it was replaced and leaves in one line; its workers do
    not rejoin (the result is still bitwise equal), and nothing of it is left."""
    work = tmp_path / "cutoff"
    events: list[str] = []

    def cut_off(procs: list[subprocess.Popen[bytes]]) -> None:
        steps2 = work / "steps-2.log"
        # at step 2 (the standby node may still warm up: the leader waits for it, --standby-wait)
        if not wait_until(lambda: steps2.exists() and len(steps2.read_text().splitlines()) >= 2, 120):
            events.append("never ready")
            return
        agent = psutil.Process(procs[1].pid)
        stopped = [agent, *agent.children(recursive=True)]
        for proc in stopped:  # the agent first, so that it cannot react
            proc.send_signal(signal.SIGSTOP)
        events.append(f"stopped {[p.pid for p in stopped]}")
        replaced = wait_until(lambda: "replace: generation 1" in (work / "agent0.log").read_text(), 90)
        events.append(f"replaced: {replaced}")
        time.sleep(1.0)  # the new generation trains on a little before node 1 comes back
        for proc in stopped:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        continued = time.monotonic()
        # on their own (the test's cleanup comes later): node 1's agent and workers leave
        gone = wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in stopped), 15)
        events.append(f"gone after {time.monotonic() - continued:.1f}s: {gone}")
        events.append("continued")

    codes, logs, final = _run_nodes(work, 3, "--rdzv-conf", "heartbeat_interval=0.5,heartbeat_timeout=3",
                                    script_args=["--step-time", "0.3"], during=cut_off,
                                    env={"TMRUN_COMM_TIMEOUT": "2"})  # survivors lose ranks 2 and 3 sooner
    everything = "\n".join(logs)
    assert events[-1:] == ["continued"], (events, everything)
    assert codes == [0, 0, 0], everything
    assert "gone after" in events[-2] and events[-2].endswith("True"), (events, everything)
    assert re.search(r"lost: node 1 \(active\): no heartbeat for 3 s", logs[0]), everything
    # node 1's agent, back, finds it was replaced and leaves in one line; nothing reported anew
    assert "node 1 was declared lost and its ranks were taken over in place" in logs[1], logs[1]
    assert "this node leaves, the job goes on" in logs[1] and "this node failed" not in logs[1], logs[1]
    assert "failure: node 1" in logs[0] and logs[0].count("failure: node") == 1, logs[0]
    _check_in_place(work, logs, final, reference)
