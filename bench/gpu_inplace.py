"""GPU check of in-place replacement and planned migration with CUDA tensors (GPU only).

    python bench/gpu_inplace.py [--steps 30] [--width 2048] [--depth 6] [--json PATH]

Runs examples/train_inplace.py with ``--device cuda`` under tmrun (2 workers and a standby on
the first GPU, the "tmrun" backend with ``TMRUN_DEVICE_PLANE=staging``: TCP over loopback, CUDA
tensors staged through host memory; bench/gpu_nccl.py checks the NCCL device plane):

1. reference: no failure;
2. failure: rank 1 SIGKILLed during backward at step --kill-step (``--inject-failure``);
3. migration: rank 1 asks for its own migration after step --kill-step (``tm.migrate``), with the
   joiner reading the leaver's host copies (same host);
4. migration with ``--handover socket``.

Each run must exit 0 with final parameters and optimizer state bitwise equal to the reference
run's, on both ranks (a joiner that received wrong state would also stay apart from the
survivor: DDP only averages gradients). The example's own report (downtime, steps recomputed)
and the handover's log lines are shown.
Exit status: 0 passed, 1 failed, 77 skipped (no CUDA device).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_inplace.py"
SKIP = 77


def run_job(work: Path, name: str, args: argparse.Namespace, tmrun_args: list[str], script_args: list[str]) -> dict:
    out = work / name
    out.mkdir()
    cmd = [sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", "2", "--standby", "1",
           *tmrun_args, str(SCRIPT), "--device", "cuda", "--steps", str(args.steps), "--width", str(args.width),
           "--depth", str(args.depth), "--final", str(out / "final-{rank}"), "--step-log", str(out / "steps-{rank}.log"),
           *script_args]
    started = time.monotonic()
    env = {**os.environ, "TMRUN_STATE_DIR": str(out / "state")}
    with open(out / "agent.log", "wb") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout,
                              start_new_session=True, check=False).returncode
    text = (out / "agent.log").read_text(errors="replace")
    finals = [(out / f"final-{r}").read_text().strip() if (out / f"final-{r}").exists() else "" for r in (0, 1)]
    report = re.search(r"\[rank 0\].*", text)
    lines = [m.group(0) for m in re.finditer(
        r"[^\n]*(?:replacement, generation|planned migration|recovered into|received the model|handed \d+|"
        r"optimizer state complete|healing from|Traceback|Error)[^\n]*", text)]
    return {"name": name, "exit": code, "final": finals[0], "replicas_equal": bool(finals[0]) and finals[0] == finals[1], "seconds": round(time.monotonic() - started, 1),
            "report": report.group(0) if report else "", "log": lines[-14:], "log_path": str(out / "agent.log")}


def replaced_in_place(run: dict, log: str) -> bool:
    """The failure run's rank was replaced in place (its report counts a recovery), not by a
    group restart (which ends bitwise equal too: it trains from step 0)."""
    return bool(re.search(r"recoveries: [1-9]", run["report"])) and "group restart" not in log


def migrated(log: str) -> bool:
    """A migration run's leaver handed its state over (a refused migration changes nothing)."""
    return bool(re.search(r"handed \d+ bytes to the joiner", log))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill-step", type=int, default=14)
    parser.add_argument("--step-time", type=float, default=1.0,
                        help="extra seconds a step: the failure and the migration land after the standby is warm "
                             "(some 15 s after the start on a GPU)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", default="")
    parser.add_argument("--keep", default="", help="keep the runs' logs in this folder")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return SKIP
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    os.environ["TMRUN_DEVICE_PLANE"] = "staging"  # this check's path; the NCCL plane's is bench/gpu_nccl.py
    if torch.cuda.device_count() < 3:  # 2 workers and a standby: the standby shares a GPU
        os.environ["TMRUN_STANDBY_SHARE_GPU"] = "1"
    kill = str(args.kill_step)
    with tempfile.TemporaryDirectory(prefix="tmrun-gpu-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        slow = ["--step-time", str(args.step_time)]
        runs = [run_job(work, "reference", args, [], slow)]
        runs.append(run_job(work, "failure", args, ["--inject-failure", f"rank=1,step={kill},at=backward"], slow))
        runs.append(run_job(work, "migration", args, [], [*slow, "--migrate-at", kill]))
        runs.append(run_job(work, "migration-socket", args, ["--handover", "socket"], [*slow, "--migrate-at", kill]))
        logs = {r["name"]: Path(r["log_path"]).read_text(errors="replace") for r in runs}
    reference = runs[0]["final"]
    ok = bool(reference) and all(r["exit"] == 0 and r["replicas_equal"] and r["final"] == reference for r in runs)
    # the event took place: replaced in place (not a group restart), migrated (not refused)
    runs[1]["in_place"] = replaced_in_place(runs[1], logs["failure"])
    for r in runs[2:]:
        r["migrated"] = migrated(logs[r["name"]])
    ok &= runs[1]["in_place"] and all(r["migrated"] for r in runs[2:])
    for r in runs:
        same = ("missing" if not r["final"] else
                "bitwise equal to the reference" if r["final"] == reference else "DIFFERS from the reference")
        replicas = "ranks 0 and 1 hold the same bits" if r["replicas_equal"] else "RANKS 0 AND 1 DIFFER"
        event = ("" if r["name"] == "reference" else "; replaced in place" if r.get("in_place") else
                 "; migrated" if r.get("migrated") else "; THE EVENT DID NOT HAPPEN AS ASKED (restart or refused)")
        print(f"\n== {r['name']}: exit {r['exit']} in {r['seconds']} s; {replicas}; final state {same}{event}\n"
              f"   {r['report']}")
        for line in r["log"]:
            print(f"   {line[:220]}")
    print("\nPASS" if ok else "\nFAIL")
    if args.json:
        Path(args.json).write_text(json.dumps({"ok": ok, "runs": runs}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
