"""End to end on loopback: standby nodes and standby worker processes, with real agents."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.helpers import EXAMPLES, SCRIPTS, free_port, kill_tree, leftovers, start, tmrun_cmd, wait_until

STEPS = 20


def _read_steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [int(line.split()[0]) for line in path.read_text().splitlines() if line.strip()]


def test_standby_node_takes_the_failed_group_rank(tmp_path: Path) -> None:
    port = free_port()
    script_args = [
        str(EXAMPLES / "train_checkpoint.py"), "--ckpt-dir", str(tmp_path), "--steps", str(STEPS),
        "--ckpt-every", "5", "--width", "64", "--step-sleep", "0.05", "--kill-rank", "1", "--kill-step", "8",
    ]  # fmt: skip
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for node in range(3):
            cmd = tmrun_cmd(
                "--nnodes", "2", "--standby", "1", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "e2e", "--rdzv-conf", "heartbeat_interval=0.5",
                *script_args, "--step-log", str(tmp_path / f"steps-node{node}-rank{{rank}}.log"),
            )  # fmt: skip
            agents.append(start(cmd, log=tmp_path / f"agent{node}.log"))
            # Join in order: agent 0 hosts the store, agents 0 and 1 are active, agent 2 stands by.
            assert wait_until(lambda n=node: f"node {n}" in (tmp_path / "agent0.log").read_text(), 60)
        codes = [agent.wait(timeout=180) for agent in agents]
        logs = [(tmp_path / f"agent{n}.log").read_text() for n in range(3)]
        assert codes == [0, 0, 0], "\n\n".join(logs)
        # Node 1's worker was SIGKILLed at step 8; node 2 (the standby) took group rank 1.
        assert "node 2 replaces node 1 at group rank 1" in logs[0]
        assert "signal SIGKILL" in logs[1]
        standby_steps = _read_steps(tmp_path / "steps-node2-rank1.log")
        assert standby_steps and standby_steps[-1] == STEPS and standby_steps[0] > 5
        assert max(_read_steps(tmp_path / "steps-node1-rank1.log")) < STEPS  # the failed node stopped
        survivor = _read_steps(tmp_path / "steps-node0-rank0.log")
        assert survivor[-1] == STEPS and set(range(1, STEPS + 1)) <= set(survivor)
        # Exactly one restart: the steps since the last checkpoint (5) were redone once.
        assert len(survivor) - len(set(survivor)) == 8 - 5
    finally:
        for agent in agents:
            kill_tree(agent)
        for agent in agents:
            assert leftovers(agent) == []


def test_single_node_standby_worker_is_visible_and_stopped(tmp_path: Path) -> None:
    env = {"TMRUN_STATE_DIR": str(tmp_path / "state")}
    agent = start(tmrun_cmd("--standalone", "--standby", "1", "--nproc-per-node", "2", str(SCRIPTS / "sleeper.py"), "8"), env=env)
    try:

        def status() -> dict[str, object] | None:
            result = subprocess.run(
                [*tmrun_cmd()[:2], "tmrun.cli.ctl", "status", "--json"],
                capture_output=True, text=True, timeout=60, env={**os.environ, **env},
            )  # fmt: skip
            return json.loads(result.stdout) if result.returncode == 0 else None

        seen: dict[str, object] = {}

        def standby_ready() -> bool:
            data = status()
            if not data:
                return False
            node = data["nodes"][0]  # type: ignore[index]
            seen.update(node)
            return bool(node["standby_workers"]) and node["standby_workers"][0]["state"] == "ready"

        assert wait_until(standby_ready, 60, interval=0.5), seen
        assert len(seen["workers"]) == 2  # type: ignore[arg-type]
        standby_pid = int(seen["standby_workers"][0]["pid"])  # type: ignore[index]
        assert agent.wait(timeout=120) == 0
        assert not Path(f"/proc/{standby_pid}").exists() or "zombie" in Path(f"/proc/{standby_pid}/status").read_text().lower()
    finally:
        kill_tree(agent)
        assert leftovers(agent) == []
