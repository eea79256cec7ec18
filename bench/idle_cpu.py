"""The CPU a job's processes use while it trains at a slow pace: tmrun (its agent, workers and a
warm standby) against torchrun (its agent and workers) with gloo, the same script, interleaved.

    python bench/idle_cpu.py --runs 3

The script is examples/train_inplace.py with ``--step-time`` (a sleep per step) so that the
training itself costs little: what remains is each launcher's own overhead (its agent's loop and
store, the worker API's per-step work, a standby waiting warm). Every process of the launcher's
tree is sampled (``psutil``, user + system time) over ``--window`` seconds once rank 0 logged
``--warm-steps`` steps (after a standby's shadow steps); each is counted under its role.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers of the other benches
from steady_step import interleaved, launch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_inplace.py"
ROLES = ("launcher", "worker", "standby")


def role_of(cmdline: Sequence[str]) -> str:
    """The role of a process of a launcher's tree, from its command line."""
    text = " ".join(cmdline)
    if "tmrun.worker.standby_process" in text:
        return "standby"
    if str(SCRIPT.name) in text and ("torch.distributed.run" not in text and "tmrun.cli.main" not in text):
        return "worker"
    return "launcher"


def cpu_seconds(processes: Iterable[psutil.Process]) -> dict[int, tuple[str, float]]:
    """pid -> (role, user + system seconds so far) of the processes still alive."""
    seen: dict[int, tuple[str, float]] = {}
    for process in processes:
        try:
            times = process.cpu_times()
            seen[process.pid] = (role_of(process.cmdline()), times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return seen


def shares(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
           seconds: float) -> dict[str, float]:
    """Per role, the cores used over ``seconds`` (1.0: one core busy) by the processes sampled
    at both ends (a process that started or ended in between is left out)."""
    used = dict.fromkeys(ROLES, 0.0)
    for pid, (role, end) in after.items():
        if pid in before:
            used[role] += max(end - before[pid][1], 0.0) / seconds
    return used


def steps_logged(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def run(kind: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    log = work / "steps-{rank}.log"
    script = [str(SCRIPT), "--steps", str(args.steps), "--width", "48", "--batch", "16",
              "--step-time", str(args.step_time), "--step-log", str(log)]
    cmd, env = launch(kind, args.nproc, script)
    env["TMRUN_STATE_DIR"] = str(work / "state")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rank0 = Path(str(log).replace("{rank}", "0"))
    try:
        deadline = time.monotonic() + args.timeout
        while steps_logged(rank0) < args.warm_steps:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{kind} run ended or stalled before step {args.warm_steps}")
            time.sleep(0.1)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        before, start = cpu_seconds(tree), time.monotonic()
        time.sleep(args.window)
        after = cpu_seconds(tree)
        used = shares(before, after, time.monotonic() - start)
        if proc.poll() is not None:
            raise SystemExit(f"{kind} run ended during the window: raise --steps")
        return used
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--step-time", type=float, default=0.2)
    parser.add_argument("--warm-steps", type=int, default=60, help="rank 0's steps before the window")
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    results = interleaved(run, args, "tmrun-idle-")
    print(f"{args.nproc} workers, examples/train_inplace.py --step-time {args.step_time} (a sleep per step), "
          f"{args.window:g} s window after step {args.warm_steps}, {args.runs} runs each; cores used "
          "(1.0 = one core busy), median of the runs")
    print("| launcher | agent | workers (all) | standby | total |")
    print("|---|---|---|---|---|")
    for kind, runs in results.items():
        median = {role: statistics.median(r[role] for r in runs) for role in ROLES}
        total = statistics.median(sum(r.values()) for r in runs)
        standby = f"{median['standby']:.3f}" if kind == "tmrun" else "-"
        print(f"| {kind} | {median['launcher']:.3f} | {median['worker']:.3f} | {standby} | {total:.3f} |")


if __name__ == "__main__":
    main()
