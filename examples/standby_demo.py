"""Demo: a 2-node job (three agents on this machine: two active nodes and a standby node) loses
a worker to SIGKILL; the standby node takes its group rank and the job finishes every step.

    python examples/standby_demo.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS, KILL_STEP = 30, 15


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="tmrun-demo-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    job = [
        str(HERE / "train_checkpoint.py"), "--ckpt-dir", str(work), "--steps", str(STEPS), "--ckpt-every", "10",
        "--width", "512", "--layers", "4", "--kill-rank", "1", "--kill-step", str(KILL_STEP),
    ]  # fmt: skip
    agents = []
    for node in range(3):
        cmd = [
            sys.executable, "-m", "tmrun.cli.main", "--nnodes", "2", "--standby", "1", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "demo",
            *job, "--step-log", str(work / f"steps-node{node}-rank{{rank}}.log"),
        ]  # fmt: skip
        log = open(work / f"agent{node}.log", "wb")
        agents.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        print(f"started agent {node} (pid {agents[-1].pid}){' as the standby node' if node == 2 else ''}", flush=True)
        time.sleep(1.5)
    try:
        codes = [agent.wait(timeout=600) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    print("\n--- tmrun events (agent 0, which hosts the rendezvous) ---")
    for line in (work / "agent0.log").read_text().splitlines():
        if line.startswith("[tmrun"):
            print(line)
    rows = [line.split() for line in (work / "steps-node0-rank0.log").read_text().splitlines()]
    times = [float(r[1]) for r in rows]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    steady = gaps[len(gaps) // 2]
    killed_at = float((work / "killed.marker").read_text() or 0)
    after = [t for t in times if t > killed_at]
    print("\n--- recovery cost, seen from the survivor (group rank 0) ---")
    print(f"exit codes of the three agents: {codes}")
    print(f"steps completed: {rows[-1][0]} of {STEPS}; steps recomputed: {len(rows) - len({r[0] for r in rows})}")
    if killed_at and after:
        print(f"kill -> next completed step: {after[0] - killed_at:.2f} s; steady step: {steady:.3f} s")
    print(f"downtime (largest gap minus a steady step): {gaps[-1] - steady:.2f} s")
    print(f"logs: {work}")
    return 0 if codes == [0, 0, 0] and int(rows[-1][0]) == STEPS else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
