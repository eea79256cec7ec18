"""Demo: a 2-node job (three agents on this machine: two active nodes and a standby node).

    python examples/standby_demo.py            # a plain torchrun script with checkpoints: a worker
                                               # is SIGKILLed, the standby node takes its group rank,
                                               # the group restarts from the checkpoint
    python examples/standby_demo.py --inplace  # the worker API (2 workers a node): node 1, agent and
                                               # workers, is SIGKILLed; the standby node's warm
                                               # workers take its ranks in place, nobody restarts
"""

from __future__ import annotations

import argparse
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inplace", action="store_true", help="the worker API script, a whole node killed")
    inplace = parser.parse_args().inplace
    work = Path(tempfile.mkdtemp(prefix="tmrun-demo-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if inplace:
        nproc, drill = "2", ["--inject-failure", f"node=1,step={KILL_STEP}"]
        job = [str(HERE / "train_inplace.py"), "--steps", str(STEPS), "--width", "512", "--step-time", "0.1"]
    else:
        nproc, drill = "1", []
        job = [
            str(HERE / "train_checkpoint.py"), "--ckpt-dir", str(work), "--steps", str(STEPS), "--ckpt-every", "10",
            "--width", "512", "--layers", "4", "--kill-rank", "1", "--kill-step", str(KILL_STEP),
        ]  # fmt: skip
    agents = []
    for node in range(3):
        step_log = work / ("steps-rank{rank}.log" if inplace else f"steps-node{node}-rank{{rank}}.log")
        cmd = [
            sys.executable, "-m", "tmrun.cli.main", "--nnodes", "2", "--standby", "1", "--nproc-per-node", nproc,
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "demo", *drill,
            *job, "--step-log", str(step_log),
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
    survivor_log = work / ("steps-rank0.log" if inplace else "steps-node0-rank0.log")
    rows = [line.split() for line in survivor_log.read_text().splitlines()]
    times = [float(r[1]) for r in rows]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    steady = gaps[len(gaps) // 2]
    marker = work / "killed.marker"
    killed_at = float(marker.read_text() or 0) if marker.exists() else 0.0
    after = [t for t in times if t > killed_at]
    print("\n--- recovery cost, seen from the survivor (group rank 0) ---")
    print(f"exit codes of the three agents: {codes}")
    last = int(rows[-1][0]) + (1 if inplace else 0)  # train_inplace.py counts steps from 0
    print(f"steps completed: {last} of {STEPS}; steps recomputed: {len(rows) - len({r[0] for r in rows})}")
    if inplace:
        print(f"survivor rank 0 kept its process: {len({r[2] for r in rows}) == 1}")
    if killed_at and after:
        print(f"kill -> next completed step: {after[0] - killed_at:.2f} s; steady step: {steady:.3f} s")
    print(f"downtime (largest gap minus a steady step): {gaps[-1] - steady:.2f} s")
    print(f"logs: {work}")
    expected = [0, -9, 0] if inplace else [0, 0, 0]  # in place: node 1's agent was SIGKILLed by the drill
    return 0 if codes == expected and last == STEPS else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
