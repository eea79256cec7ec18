"""Recovery from the loss of a node: torchrun (a replacement agent joins) vs tmrun (a standby node).

All runs: 2 nodes x 1 CPU worker on loopback, 6 x Linear(2048) = 25M parameters. When the
survivor completes step --kill-step, the harness SIGKILLs node 1 (its agent and its worker).

* torchrun: the checkpointing DDP job of examples/train_checkpoint.py (Adam, checkpoint every 10
  steps); a replacement agent is started at once (its best case).
* tmrun: the same job; a third agent was started as a standby node (group restart from the
  checkpoint, on the standby node).
* tmrun-inplace: examples/train_inplace.py (the worker API, AdamW) with the same standby node; the
  harness waits until the standby node's worker is warm before it kills node 1 (in a real job the
  standby is warm long before a failure); the standby node's worker takes rank 1 in place.

Reported per run: seconds from the kill to the survivor's first completed step after it, the
downtime (largest gap between completed steps on the survivor, among the gaps that end after the
kill, minus one steady step), and the steps recomputed. torchrun runs with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, its reliable setting (see shared research notes); the same
number of runs of each, interleaved, in one invocation.

    python bench/failover.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_checkpoint.py"
INPLACE_SCRIPT = ROOT / "examples" / "train_inplace.py"
TOOLS = ("torchrun", "tmrun", "tmrun-inplace")


@dataclass
class Outcome:
    tool: str
    ok: bool
    kill_to_step: float = float("nan")
    downtime: float = float("nan")
    recomputed: int = -1
    note: str = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def steps(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            rows.append((int(parts[0]), float(parts[1])))
    return rows


def kill_node(agent: subprocess.Popen[bytes]) -> None:
    """SIGKILL an agent and every worker it started (workers live in sessions of their own)."""
    try:
        victims = [agent.pid] + [c.pid for c in psutil.Process(agent.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        victims = [agent.pid]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            kill_node(proc)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def launcher(tool: str, port: int, run_id: str, job_args: list[str], standby: bool) -> list[str]:
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
    if tool == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--max-restarts", "3", *common, *job_args]
    extra = ["--standby", "1"] if standby else []
    return [sys.executable, "-m", "tmrun.cli.main", *extra, "--max-restarts", "3", *common, *job_args]


def one_run(tool: str, args: argparse.Namespace, index: int) -> Outcome:
    work = Path(tempfile.mkdtemp(prefix=f"tmrun-bench-{tool}-"))
    port = free_port()
    if tool == "tmrun-inplace":
        job = [
            str(INPLACE_SCRIPT), "--steps", str(args.steps), "--width", str(args.width), "--depth", str(args.layers),
            "--step-log", str(work / "steps-{rank}-%s.log"),
        ]  # fmt: skip
    else:
        job = [
            str(SCRIPT), "--ckpt-dir", str(work), "--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every),
            "--width", str(args.width), "--layers", str(args.layers), "--step-log", str(work / "steps-{rank}-%s.log"),
        ]  # fmt: skip
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(name: str) -> subprocess.Popen[bytes]:
        cmd = launcher(tool, port, f"bench{index}", [a.replace("%s", name) for a in job], standby=True)
        proc = subprocess.Popen(cmd, stdout=open(work / f"{name}.log", "wb"), stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        return proc

    try:
        nodes = [spawn("node0")]
        time.sleep(1.0)  # node 0 hosts the store
        nodes.append(spawn("node1"))
        if tool != "torchrun":
            time.sleep(1.0)
            spawn("standby")
        survivor_log = work / "steps-0-node0.log"
        deadline = time.monotonic() + args.timeout

        def ready() -> bool:
            if tool == "tmrun-inplace" and "warm after" not in (work / "standby.log").read_text():
                return False
            return any(s >= args.kill_step for s, _ in steps(survivor_log))

        while not ready():
            if time.monotonic() > deadline:
                return Outcome(tool, False, note="never reached the kill step")
            time.sleep(0.01)
        kill_time = time.time()
        kill_node(nodes[1])
        if tool == "torchrun":
            spawn("replacement")
        while procs[0].poll() is None:
            if time.monotonic() > deadline:
                return Outcome(tool, False, note=f"no finish within {args.timeout} s (hung)")
            time.sleep(0.1)
        if procs[0].returncode != 0:
            return Outcome(tool, False, note=f"node 0 exited {procs[0].returncode}")
        rows = steps(survivor_log)
        after = [t for s, t in rows if t > kill_time]
        times = [t for _, t in rows]
        steady = statistics.median(b - a for a, b in zip(times, times[1:]))
        # the failure's gaps only: a standby warming up beside the job (2 cores here) slows steps
        # before the kill, which is not the failure's cost
        gaps = sorted(b - a for a, b in zip(times, times[1:]) if b > kill_time)
        recomputed = len(rows) - len({s for s, _ in rows})
        return Outcome(tool, True, after[0] - kill_time, gaps[-1] - steady, recomputed)
    finally:
        reap(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=15)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    outcomes: list[Outcome] = []
    for index in range(args.runs):
        for tool in TOOLS:
            outcome = one_run(tool, args, index)
            outcomes.append(outcome)
            print(f"run {index} {tool}: {outcome}", flush=True)
    print()
    print(f"Command: python bench/failover.py --runs {args.runs} --steps {args.steps} --kill-step {args.kill_step} "
          f"--width {args.width} --layers {args.layers}")
    print()
    print("| launcher | recovered | kill -> next step, s (min / median / max) | downtime, s (min / median / max) | steps recomputed |")
    print("|---|---|---|---|---|")
    for tool in TOOLS:
        done = [o for o in outcomes if o.tool == tool and o.ok]
        total = len([o for o in outcomes if o.tool == tool])
        if not done:
            print(f"| {tool} | 0 of {total} | - | - | - |")
            continue

        def spread(values: list[float]) -> str:
            return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"

        recomputed = sorted({o.recomputed for o in done})
        print(f"| {tool} | {len(done)} of {total} | {spread([o.kill_to_step for o in done])} | "
              f"{spread([o.downtime for o in done])} | {', '.join(map(str, recomputed))} |")


if __name__ == "__main__":
    main()
