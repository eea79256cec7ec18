"""The job token in a whole job (one node, a failure replaced in place): workers get it through
their environment, never argv; it is in no log line, event or status; every listener of the job
that tmrun owns challenges a stray client; the job completes."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import psutil

from tests.helpers import EXAMPLES, TAG_VAR, kill_tree, leftovers, start, tmrun_cmd

TOKEN = "e2e-job-token-" + "5a" * 16


def _probe(proc: psutil.Process) -> dict[int, bytes]:
    """What each TCP listener of ``proc`` says first to a client that says nothing (0.5 s)."""
    out: dict[int, bytes] = {}
    for conn in proc.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN:
            continue
        port = conn.laddr.port
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.settimeout(0.5)
                try:
                    out[port] = sock.recv(64)
                except (TimeoutError, OSError):
                    out[port] = b""
        except OSError:
            continue
    return out


def _watch(agent, log: Path, seen: dict) -> None:  # type: ignore[no-untyped-def]
    """Every process of the job is looked at once (argv, environment) as it appears; once the
    standby is warm (every listener open), each live one's listeners are probed too."""
    looked: set[int] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        _look(agent, seen, looked, probe=False)
        if "standby 0 warm" in (log.read_text() if log.exists() else ""):
            break
        time.sleep(0.2)
    time.sleep(0.5)
    _look(agent, seen, looked, probe=True)


def _look(agent, seen: dict, looked: set[int], probe: bool) -> None:  # type: ignore[no-untyped-def]
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
            if env.get(TAG_VAR) != agent.tag:
                continue
            role = "agent" if proc.pid == agent.pid else ("worker" if "RANK" in env or "TMRUN_ROLE" in env else "other")
            if proc.pid not in looked:
                looked.add(proc.pid)
                seen.setdefault("argv", []).append(" ".join(proc.cmdline()))
                seen.setdefault("env", []).append((role, env.get("TMRUN_JOB_TOKEN"), env.get("TMRUN_JOB_TOKEN_FILE")))
            if probe:
                seen.setdefault("listeners", []).append((role, proc.pid, _probe(proc)))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


def test_token_reaches_workers_by_environment_only(tmp_path: Path) -> None:
    state, logs = tmp_path / "state", tmp_path / "logs"
    token_file = tmp_path / "job.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    cmd = tmrun_cmd(
        "--standalone", "--nproc-per-node", "2", "--standby", "1", "--log-dir", str(logs),
        # the failure well after the standby is warm (the listeners are probed then, every process
        # alive): at step 10 of 0.15 s it came first under load, and the probe found workers closing
        "--inject-failure", "rank=1,step=20",
        str(EXAMPLES / "train_inplace.py"), "--steps", "24", "--width", "48", "--batch", "16", "--step-time", "0.3",
    )  # fmt: skip
    log = tmp_path / "agent.log"
    agent = start(cmd, log=log, env={"TMRUN_STATE_DIR": str(state), "TMRUN_JOB_TOKEN_FILE": str(token_file)})
    seen: dict = {}
    watcher = threading.Thread(target=_watch, args=(agent, log, seen), daemon=True)
    watcher.start()
    try:
        code = agent.wait(timeout=240)
    finally:
        kill_tree(agent)
        assert leftovers(agent) == []
    watcher.join(timeout=10)
    text = log.read_text()
    assert code == 0, text
    assert TOKEN not in text
    events = list(logs.glob("*.events.jsonl"))
    assert len(events) == 1 and TOKEN not in events[0].read_text()
    kinds = [json.loads(line)["kind"] for line in events[0].read_text().splitlines()]
    assert "replace" in kinds and "recovered" in kinds, kinds
    for path in logs.rglob("*"):
        if path.is_file():
            assert TOKEN not in path.read_text(errors="replace"), path
    # workers: token in the environment (the variable, not the file), never in argv
    assert seen.get("argv"), "the job's processes were not seen"
    assert all(TOKEN not in argv for argv in seen["argv"])
    workers = [e for e in seen["env"] if e[0] == "worker"]
    assert len(workers) >= 3, seen["env"]  # 2 ranks + 1 standby
    assert all(token == TOKEN and token_file_var is None for _, token, token_file_var in workers), seen["env"]
    # every listener of the workers and the agent: the native communicators and tmrun's own
    # endpoints challenge first (TCPStore listeners are torch's and say nothing)
    challenged = [(role, port) for role, _, probes in seen["listeners"] for port, first in probes.items()
                  if first.startswith(b"TMRAUTH1") or first.startswith(b"TMRUN-AUTH1 ")]
    print("listeners:", [(role, pid, {p: f[:12] for p, f in probes.items()}) for role, pid, probes in seen["listeners"]])
    assert any(role == "worker" for role, _ in challenged), seen["listeners"]
    assert sum(1 for role, _ in challenged if role == "agent") >= 2, seen["listeners"]  # ops + liveness
    assert not os.path.exists(state / "runs")  or not list((state / "runs").glob("*.token"))  # removed at the end
