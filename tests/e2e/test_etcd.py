"""The control plane on etcd, end to end on loopback: a real etcd (Debian's etcd-server) and
three tmrun agents with ``--rdzv-backend tmrun-etcd --nnodes 2 --standby 1 --nproc-per-node 2``.

* The leading agent's node (agent and both workers) SIGKILLed: another agent's lease wins the
  lead, goes on from the store, finds node 0 lost (its lease expired) and the standby node takes
  its ranks in place; survivors keep their processes, at most the step in flight is redone, and
  the final state is bitwise equal to a run with no failure.
* etcd itself lost: every agent ends with one line naming etcd, never a hang, nothing left.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.etcd.server import start_etcd, why_no_etcd
from tests.e2e.test_inplace_nodes import JOB_TIMEOUT, NPROC, SCRIPT_ARGS, STEPS, _steps
from tests.helpers import EXAMPLES, kill_tree, leftovers, start, tmrun_cmd, wait_until

LEASE = "lease_ttl=2,heartbeat_interval=0.5,connect_timeout=5"


def _agent_cmd(work: Path, endpoint: str, run_id: str, *extra: str) -> list[str]:
    return tmrun_cmd(
        "--nnodes", "2", "--standby", "1", "--nproc-per-node", str(NPROC), "--rdzv-backend", "tmrun-etcd",
        "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", LEASE, *extra,
        str(EXAMPLES / "train_inplace.py"), *SCRIPT_ARGS,
        "--step-log", str(work / "steps-{rank}.log"), "--final", str(work / "final"),
    )  # fmt: skip


def _start_agents(work: Path, endpoint: str, *extra: str, agents: int = 3) -> list[subprocess.Popen[bytes]]:
    """``agents`` agents (three: two active nodes and a standby node), one after another (node
    ids follow their order)."""
    work.mkdir(parents=True, exist_ok=True)
    run_id = f"etcd-{uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen[bytes]] = []
    for node in range(agents):
        procs.append(start(_agent_cmd(work, endpoint, run_id, *extra), log=work / f"agent{node}.log",
                           env={"TMRUN_STATE_DIR": str(work / "state")}))
        assert wait_until(lambda n=node: f"node {n} " in (work / f"agent{n}.log").read_text(), 60), (
            (work / f"agent{node}.log").read_text())
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        kill_tree(proc)
    for proc in procs:
        assert leftovers(proc) == []


@pytest.fixture(scope="module")
def reference(nodes_reference: str) -> str:
    return nodes_reference  # test_inplace_nodes' job with no failure (tests/e2e/conftest.py)


def test_leading_node_killed_job_goes_on_in_place(tmp_path: Path, etcd_server, reference: str) -> None:  # type: ignore[no-untyped-def]
    work = tmp_path / "lead"
    procs = _start_agents(work, etcd_server.endpoint, "--inject-failure", "node=0,step=4")
    try:
        codes = [proc.wait(timeout=JOB_TIMEOUT) for proc in procs]
    finally:
        _stop(procs)
    logs = [(work / f"agent{n}.log").read_text() for n in range(3)]
    everything = "\n".join(f"--- agent {n}\n{log}" for n, log in enumerate(logs))
    assert "this agent leads the job" in logs[0] and "took over" not in logs[0], everything
    assert codes[0] == -9 and codes[1] == 0 and codes[2] == 0, everything
    taker = next(n for n in (1, 2) if "took over: the previous leader's lease expired" in logs[n])
    assert "lost: node 0 (active): its agent's etcd lease expired" in logs[taker], everything
    assert re.search(r"replace: generation 1: node 2 replaces node 0 at group rank 0 in place "
                     r"\(ranks 0->standby 2000, 1->standby 2001\)", logs[taker]), everything
    assert "recovered: generation 1: all 4 ranks back in" in logs[taker], everything
    assert "formed" not in logs[taker].split("took over")[1], "the new leader formed the group again\n" + everything
    assert "epoch 2" not in everything, "the group restarted instead of an in-place replacement\n" + everything
    assert (work / "final").read_text().strip() == reference, "final state differs\n" + everything
    steps = _steps(work)
    for rank in (2, 3):  # survivors (node 1): one process, at most the step in flight redone
        done = [s for s, _ in steps[rank]]
        assert sorted(set(done)) == list(range(STEPS)), (rank, done)
        assert len(done) - len(set(done)) <= 1, (rank, done)
        assert len({pid for _, pid in steps[rank]}) == 1, f"rank {rank} changed process\n{everything}"
    for rank in (0, 1):  # the leader's node's ranks, continued by the standby node's workers
        assert len({pid for _, pid in steps[rank]}) == 2, (rank, steps[rank])
        assert steps[rank][-1][0] == STEPS - 1


def test_etcd_lost_every_agent_ends_in_one_line(tmp_path: Path) -> None:
    reason = why_no_etcd()
    if reason:
        pytest.skip(f"no etcd here: {reason}")
    server = start_etcd(tmp_path)
    work = tmp_path / "gone"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs = _start_agents(work, server.endpoint, agents=2)  # the two active nodes
        assert wait_until(lambda: (work / "steps-0.log").exists() and
                          len((work / "steps-0.log").read_text().splitlines()) >= 2, 90)
        server.stop()
        started = time.monotonic()
        codes = [proc.wait(timeout=60) for proc in procs]
        assert time.monotonic() - started < 45
    finally:
        server.stop()
        _stop(procs)
    for n in range(2):
        log = (work / f"agent{n}.log").read_text()
        assert codes[n] != 0, log
        assert "Traceback" not in log, log
        errors = [line for line in log.splitlines() if line.startswith("tmrun: error:")]
        assert len(errors) == 1 and "etcd" in errors[0], log
