"""Planned migration: downtime of moving rank 1 to a warm standby with ``tmrun-ctl migrate``.

    python bench/migration.py --runs 3

2 CPU workers, examples/train_inplace.py (6 x Linear(2048), about 25M parameters, AdamW). When
rank 0 has completed --at steps, the bench runs ``tmrun-ctl migrate 1``. Per run, from rank 0's
step log: steady step (median interval before the request), downtime (largest interval after the
request minus one steady step) and steps recomputed (step numbers logged twice); from the workers'
log lines, where the handover's time goes (the model received by the joiner, the optimizer state
complete, the leaver done). The baseline of a
planned move under torchrun is a checkpoint-restart; bench/inplace_failover.py measures that
cost for an unexpected failure, which a planned restart cannot beat.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_inplace.py"


def _rows(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    return [(int(f[0]), float(f[1])) for f in (line.split() for line in path.read_text().splitlines()) if len(f) >= 2]


def _ctl_prefix(args: argparse.Namespace) -> list[str]:
    """tmrun-ctl is an operator's tool, not part of the job: on a GPU host it runs beside many
    idle cores (or on a login node). Here it would take one of the two cores the workers use
    for its 1.3 s torch import, so by default it runs at the lowest priority."""
    return [] if args.ctl_same_priority else ["nice", "-n", "19"]


def one_run(args: argparse.Namespace, work: Path) -> dict[str, float]:
    env = {**os.environ, "TMRUN_STATE_DIR": str(work / "state")}
    log0 = work / "steps-0.log"
    cmd = [sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", "2", "--standby", "1",
           str(SCRIPT), "--steps", str(args.steps), "--width", str(args.width), "--depth", str(args.depth),
           "--step-log", str(work / "steps-{rank}.log")]
    if args.via == "api":
        cmd += ["--migrate-at", str(args.at)]  # rank 1 calls tm.migrate() after step --at
    with open(work / "agent.log", "wb") as out:
        job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    requested_at = 0.0
    try:
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline and job.poll() is None:
            ready = "standby 0 warm" in (work / "agent.log").read_text(errors="replace")
            if args.via == "ctl" and ready and len(_rows(log0)) >= args.at and not requested_at:
                requested_at = time.time()
                subprocess.run([*_ctl_prefix(args), sys.executable, "-m", "tmrun.cli.ctl", "migrate", "1",
                                "--reason", "bench"],
                               env=env, capture_output=True, timeout=60, check=True)
            time.sleep(0.02)
        if job.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
            raise SystemExit(f"the job failed; see {work / 'agent.log'}")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    rows = _rows(log0)
    text = (work / "agent.log").read_text(errors="replace")
    if args.via == "api" and len(rows) > args.at:
        requested_at = rows[args.at][1]  # rank 1 asked right after this step; rank 0 finished it about then
    if not requested_at or "planned migration" not in text:
        raise SystemExit(f"no migration happened (the standby was not warm in time?); see {work / 'agent.log'}")
    times = [t for _, t in rows]
    before = [b - a for a, b in zip(times, times[1:]) if b <= requested_at][-8:]
    steady = statistics.median(before)
    after = [b - a for a, b in zip(times, times[1:]) if b > requested_at]
    steps = [s for s, _ in rows]

    def seconds(pattern: str) -> float:
        found = re.search(pattern, text)
        return float(found.group(1)) if found else float("nan")

    return {"steady": steady, "downtime": max(0.0, max(after) - steady),
            "recomputed": float(len(steps) - len(set(steps))),
            "model": seconds(r"received the model \(\d+ bytes\) in ([\d.]+)s"),
            "complete": seconds(r"optimizer state complete \(\d+ bytes\), ([\d.]+)s after"),
            "leaver": seconds(r"handed \d+ bytes to the joiner in ([\d.]+)s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--at", type=int, default=15, help="request the migration after this many steps")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--via", choices=("api", "ctl"), default="api",
                        help="who asks: rank 1 itself (tm.migrate) or an operator (tmrun-ctl migrate 1)")
    parser.add_argument("--ctl-same-priority", action="store_true",
                        help="run tmrun-ctl at the workers' priority (it competes with them for the CPUs)")
    parser.add_argument("--keep", default="", help="keep each run's logs in this folder")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="tmrun-migrate-") as tmp:
        for index in range(args.runs):
            work = Path(args.keep or tmp) / f"run{index}"
            work.mkdir(parents=True)
            results.append(one_run(args, work))
    print(f"planned migration of rank 1 (2 workers, {args.depth}x{args.width} MLP, AdamW), {args.runs} runs")
    print("| steady step (ms) | downtime (s) min / median / max | steps recomputed |")
    print("|---|---|---|")
    downs = [r["downtime"] for r in results]
    print(f"| {statistics.median(r['steady'] for r in results) * 1e3:.0f} | "
          f"{min(downs):.3f} / {statistics.median(downs):.3f} / {max(downs):.3f} | "
          f"{', '.join(str(int(r['recomputed'])) for r in results)} |")
    print()
    print("handover, per run (s): joiner has the model / joiner has the optimizer state / leaver done")
    for index, r in enumerate(results):
        print(f"  run {index}: {r['model']:.3f} / {r['complete']:.3f} / {r['leaver']:.3f}")


if __name__ == "__main__":
    main()
