"""Steady-state step time: tmrun (worker API, "tmrun" backend, a warm standby) against torchrun
with gloo, the same script, model and data, interleaved in one run.

    python bench/steady_step.py --runs 3

The script is examples/train_inplace.py; under torchrun it initialises gloo
(``TMRUN_BACKEND=gloo``: the worker API then only wraps DDP), under tmrun it gets the full
in-place machinery (generation checks, RNG records, a standby in its sandbox beside it). A step's
time is the median interval between completed steps on rank 0, after the first five steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_inplace.py"


def step_time(log: Path) -> float:
    times = [float(line.split()[1]) for line in log.read_text().splitlines()]
    gaps = [b - a for a, b in zip(times[5:], times[6:])]
    return statistics.median(gaps)


def launch(kind: str, nproc: int, script: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run ``script`` under ``kind``: "torchrun+gloo" (the worker
    API then only wraps DDP over gloo) or "tmrun" (a warm standby beside the workers)."""
    env = dict(os.environ)
    if kind == "torchrun+gloo":
        env["TMRUN_BACKEND"] = "gloo"
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                *script], env
    return [sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", str(nproc), "--standby", "1",
            *script], env


def interleaved(run_one: Callable[[str, argparse.Namespace, Path], T], args: argparse.Namespace,
                prefix: str) -> dict[str, list[T]]:
    """``args.runs`` runs of each launcher, alternating (drifts of the machine hit both), each in
    a fresh folder: launcher -> the results of ``run_one(kind, args, folder)``."""
    results: dict[str, list[T]] = {"torchrun+gloo": [], "tmrun": []}
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for index in range(args.runs):
            for kind in results:
                work = Path(tmp) / f"{kind}-{index}"
                work.mkdir()
                results[kind].append(run_one(kind, args, work))
    return results


def run(kind: str, args: argparse.Namespace, work: Path) -> float:
    log = work / f"{kind}-{{rank}}.log"
    script = [str(SCRIPT), "--steps", str(args.steps), "--width", str(args.width), "--depth", str(args.depth),
              "--batch", str(args.batch), "--step-log", str(log)]
    cmd, env = launch(kind, args.nproc, script)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if proc.wait(timeout=args.timeout) != 0:
            raise SystemExit(f"{kind} run failed (exit code {proc.returncode})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return step_time(Path(str(log).replace("{rank}", "0")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    results = interleaved(run, args, "tmrun-steady-")
    params = args.depth * (args.width * args.width + args.width) + args.width + 1
    print(f"{args.nproc} workers, MLP {args.depth}x{args.width} ({params / 1e6:.1f}M parameters), AdamW, "
          f"batch {args.batch}, {args.steps} steps, {args.runs} runs each")
    print("| launcher | step time min / median / max (ms) |")
    print("|---|---|")
    for kind, values in results.items():
        low, mid, high = min(values), statistics.median(values), max(values)
        print(f"| {kind} | {low * 1e3:.1f} / {mid * 1e3:.1f} / {high * 1e3:.1f} |")
    ratio = statistics.median(results["tmrun"]) / statistics.median(results["torchrun+gloo"])
    print(f"tmrun / torchrun+gloo (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
