"""Planned migration: downtime of moving rank 1 to a warm standby at a step boundary.

    python bench/migration.py --runs 3                      # rank 1 asks (tm.migrate), same-host reads
    python bench/migration.py --runs 3 --handover socket    # the state over the loopback socket
    python bench/migration.py --runs 3 --via ctl            # an operator asks (tmrun-ctl migrate 1)

2 CPU workers, examples/train_inplace.py (6 x Linear(2048), about 25M parameters, AdamW). After
step --at, rank 1 asks for its own migration (``--migrate-at``), or the bench runs ``tmrun-ctl
migrate 1`` (an operator's tool; on these 2 cores its torch import and exit compete with the
workers, which --via ctl shows). Per run, from rank 0's step log:
* steady step: median interval of the 8 steps before the request;
* downtime: the largest interval after the request, up to the start of the standby that refills
  the pool, minus one steady step (the brief's definition, on the migration's steps);
* later, while the refilled standby warms up: the same over the steps until it is warm (its
  import and shadow steps compete for the 2 cores; on a GPU host they run on spare cores);
* steps recomputed: step numbers logged twice;
and from the workers' log lines where the handover's time goes (the joiner has the model, the
optimizer state is complete, the leaver is done) and which path the state took (memory: read out
of the leaver's memory; socket). The baseline of a planned move under torchrun is a
checkpoint-restart; bench/inplace_failover.py measures that cost for an unexpected failure,
which a planned restart cannot beat.
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
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # for inplace_failover's log arithmetic
SCRIPT = ROOT / "examples" / "train_inplace.py"


def one_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from inplace_failover import log_time, read_steps  # log and step-log reading

    env = {**os.environ, "TMRUN_STATE_DIR": str(work / "state")}
    log0 = work / "steps-0.log"
    cmd = [sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", "2", "--standby", "1",
           "--handover", args.handover, str(SCRIPT), "--steps", str(args.steps), "--width", str(args.width), "--depth", str(args.depth),
           "--step-log", str(work / "steps-{rank}.log")]
    if args.via == "api":
        cmd += ["--migrate-at", str(args.at)]  # rank 1 calls tm.migrate() after step --at
    with open(work / "agent.log", "wb") as out:
        job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    requested_at = 0.0
    try:
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline and job.poll() is None:
            if (args.via == "ctl" and not requested_at and len(read_steps(log0)) >= args.at
                    and "standby 0 warm" in (work / "agent.log").read_text(errors="replace")):
                requested_at = time.time()
                subprocess.run([sys.executable, "-m", "tmrun.cli.ctl", "migrate", "1", "--reason", "bench"],
                               env=env, capture_output=True, timeout=60, check=True)
            time.sleep(0.02)
        if job.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
            raise SystemExit(f"the job failed; see {work / 'agent.log'}")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    rows = [(step, at) for step, at, _ in read_steps(log0)]
    text = (work / "agent.log").read_text(errors="replace")
    if args.via == "api" and len(rows) > args.at:
        requested_at = rows[args.at][1]  # rank 1 asked right after this step; rank 0 finished it about then
    if not requested_at or "planned migration" not in text:
        raise SystemExit(f"no migration happened (the standby was not warm in time?); see {work / 'agent.log'}")
    gaps = [(b, b - a) for a, b in pairwise(t for _, t in rows)]  # (step completed at, interval)
    steady = statistics.median([gap for end, gap in gaps if end <= requested_at][-8:])
    refill_from = log_time(text, r"^standby worker 1 started", requested_at) or float("inf")
    refill_to = (log_time(text, r"^standby 1 warm", requested_at) or float("inf")) + 2 * steady
    switch = [gap for end, gap in gaps if requested_at < end <= refill_from]
    refill = [gap for end, gap in gaps if refill_from < end <= refill_to]
    steps = [s for s, _ in rows]

    def seconds(pattern: str) -> float:
        found = re.search(pattern, text)
        return float(found.group(1)) if found else float("nan")

    path = re.search(r"received the model \(\d+ bytes\) in [\d.]+s \((\w+)\)", text)
    return {"steady": steady, "downtime": max(0.0, max(switch) - steady),
            "refill": max(0.0, max(refill) - steady) if refill else float("nan"),
            "recomputed": float(len(steps) - len(set(steps))),
            "path": path.group(1) if path else "?",
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
    parser.add_argument("--handover", choices=("auto", "socket"), default="auto",
                        help="tmrun --handover: auto reads the leaver's memory (same host), socket sends it")
    parser.add_argument("--keep", default="", help="keep each run's logs in this folder")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="tmrun-migrate-") as tmp:
        for index in range(args.runs):
            work = Path(args.keep or tmp) / f"run{index}"
            work.mkdir(parents=True)
            results.append(one_run(args, work))
    via = "tm.migrate() in rank 1" if args.via == "api" else "tmrun-ctl migrate 1"
    print(f"planned migration of rank 1 (2 workers, {args.depth}x{args.width} MLP, AdamW), {args.runs} runs, "
          f"asked by {via}, --handover {args.handover} (path taken: {', '.join(sorted({r['path'] for r in results}))})")
    print("| steady step (ms) | downtime (s) min / median / max | steps recomputed | "
          "later, while the refilled standby warms up (s) |")
    print("|---|---|---|---|")
    downs = [r["downtime"] for r in results]
    refills = [r["refill"] for r in results]
    print(f"| {statistics.median(r['steady'] for r in results) * 1e3:.0f} | "
          f"{min(downs):.3f} / {statistics.median(downs):.3f} / {max(downs):.3f} | "
          f"{', '.join(str(int(r['recomputed'])) for r in results)} | "
          f"{' / '.join(f'{x:.3f}' for x in sorted(refills))} |")
    print()
    print("handover, per run (s): joiner has the model / joiner has the optimizer state / leaver done")
    for index, r in enumerate(results):
        print(f"  run {index}: {r['model']:.3f} / {r['complete']:.3f} / {r['leaver']:.3f}")


if __name__ == "__main__":
    main()
