"""In-place recovery by layout: DDP, HSDP, TP, PP and 3-D jobs of about the same size, one run.

Every layout trains under ``tmrun --standalone --standby 1`` with torch's own APIs (the
examples), on 4 ranks (3-D: 8, the smallest (2, 2, 2) mesh), ``OMP_NUM_THREADS=1``:

* ``ddp``: examples/train_inplace.py, an MLP under DistributedDataParallel (the baseline: its
  standby runs the script in its sandbox, warm);
* ``ddp_sub``: the same with ``--subgroup`` (a ``dist.new_group`` of every rank beside the DDP
  model): a job with subgroups, whose standby rehearses and builds its DDP model once promoted,
  then takes a survivor's gradient buckets (tmrun.worker.ddp_buckets); not in the default set;
* ``hsdp``: examples/train_hsdp.py, a GPT under FSDP2 on a 2 x 2 ("replicate", "shard") mesh;
* ``tp``: examples/train_dp_tp.py, a GPT whose MLPs are split over "tp" (2 x 2 "dp", "tp");
* ``pp``: examples/train_pp.py, an MLP stack in 2 stages x 2 replicas (1F1B);
* ``3d``: examples/train_3d.py, MLP blocks on a (2, 2, 2) ("dp", "pp", "tp") mesh;
* ``pp_hsdp``: the same blocks, ``--inner fsdp``: torchtitan's PP x HSDP shape on a (2, 2, 2)
  ("pp", "dp", "shard") mesh, each stage ``fully_shard``-ed on ("dp", "shard").

The sizes (``--params``, default 1.6M) are matched by the width of each model
(:func:`layouts`: the parameter counts are printed). The standby of a job with subgroups rehearses
the script in its sandbox as rank 0, then runs it again as the rank it is given (docs/mesh.md,
section 1b); the bench waits until the standby is warm (its shadow steps done), then SIGKILLs
rank 1 right after it logged step S - 1 (the start of step S, ``--kill-step``), by the PID its
step log names (checked to be this job's). ``TMRUN_REHEARSAL=0`` gives those layouts the cold
standby instead (it waits in ``tmrun.init()``, imports ahead what rank 0 imported, and builds
once it has a rank), for comparison.

Per run, from rank 0's step log with bench/random_kill.py's arithmetic: *downtime* = the largest
gap between completed steps around the kill minus one steady step (the median of those before);
and the controller's *tmrun recovery* ("all ranks recovered, X s after the change began"), hop by
hop from the ``recovered`` event. The report gives min / median / max per layout and each
layout's median downtime and median tmrun recovery over DDP's (the issue's target: the recovery of HSDP,
TP and PP within 1.5x DDP's).

    python bench/layout_recovery.py                      # --runs 2: about 6 minutes on 2 cores
    python bench/layout_recovery.py --runs 1 --layouts ddp,pp
    TMRUN_REHEARSAL=0 python bench/layout_recovery.py --runs 1    # cold standbys for the subgroup layouts
    TMRUN_REHEARSAL=0 TMRUN_WARM_IMPORTS=0 python bench/layout_recovery.py --runs 1   # ... importing nothing ahead
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers of the other benches
from hsdp_failover import (  # noqa: E402
    Abort,
    OneLineParser,
    Run,
    Watch,
    conclude,
    gpt_parameters,
    judge,
    kill_logged_rank,
    run_all,
    spread,
    step_done,
    wind_up,
)
from inplace_failover import LIVE_JOBS, Job, base_env, busy_cpu, read_steps  # noqa: E402
from random_kill import PHASES, last_line, log_size  # noqa: E402

BROKEN = "falling back to restarting"  # the group restart: in-place recovery broke
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
KILL_RANK = 1
OFF = ("0", "off", "false", "no")  # TMRUN_WARM_IMPORTS values that turn importing ahead off
NAN = float("nan")
POLL, FAST_POLL = 0.05, 0.005


@dataclass(frozen=True)
class Layout:
    name: str
    script: str
    ranks: int
    size_args: tuple[str, ...]
    parameters: int
    subgroups: bool  # the standby rehearses, then runs the script again (cold: waits in tmrun.init())


def mlp_parameters(width: int, depth: int) -> int:
    """examples/train_inplace.py's MLP (depth x Linear(width, width), a Linear(width, 1) head) and
    examples/train_pp.py's stack (the same without the head)."""
    return depth * (width * width + width)


def block_parameters(width: int, depth: int) -> int:
    """examples/train_3d.py's blocks: Linear(width, 4 width) and Linear(4 width, width) each."""
    return depth * (2 * 4 * width * width + 4 * width + width)


def layouts(params: int) -> dict[str, Layout]:
    """Each layout at about ``params`` parameters: the width that comes nearest at a fixed depth."""
    mlp_depth, gpt_layers, block_depth = 24, 8, 12

    def nearest(count, depth: int, step: int = 2) -> int:  # type: ignore[no-untyped-def]
        return min(range(step, 4097, step), key=lambda w: abs(count(w, depth) - params))

    mlp = nearest(mlp_parameters, mlp_depth, 8)
    gpt = nearest(gpt_parameters, gpt_layers, 2)
    block = nearest(block_parameters, block_depth, 8)
    return {
        "ddp": Layout("ddp", "train_inplace.py", 4, ("--width", str(mlp), "--depth", str(mlp_depth)),
                      mlp_parameters(mlp, mlp_depth) + mlp + 1, False),
        "ddp_sub": Layout("ddp_sub", "train_inplace.py", 4, ("--width", str(mlp), "--depth", str(mlp_depth),
                                                             "--subgroup"), mlp_parameters(mlp, mlp_depth) + mlp + 1,
                          True),
        "hsdp": Layout("hsdp", "train_hsdp.py", 4, ("--dim", str(gpt), "--layers", str(gpt_layers)),
                       gpt_parameters(gpt, gpt_layers), True),
        "tp": Layout("tp", "train_dp_tp.py", 4, ("--dim", str(gpt), "--layers", str(gpt_layers)),
                     gpt_parameters(gpt, gpt_layers), True),
        "pp": Layout("pp", "train_pp.py", 4, ("--width", str(mlp), "--depth", str(mlp_depth)),
                     mlp_parameters(mlp, mlp_depth), True),
        "3d": Layout("3d", "train_3d.py", 8, ("--width", str(block), "--depth", str(block_depth)),
                     block_parameters(block, block_depth), True),
        "pp_hsdp": Layout("pp_hsdp", "train_3d.py", 8,
                          ("--inner", "fsdp", "--width", str(block), "--depth", str(block_depth)),
                          block_parameters(block, block_depth), True),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="layout_recovery.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="runs per layout, interleaved (default 2)")
    parser.add_argument("--params", type=float, default=1.6e6, help="parameters per model (default 1.6e6)")
    parser.add_argument("--layouts", default="ddp,hsdp,tp,pp,3d,pp_hsdp", help="which layouts (default all six)")
    parser.add_argument("--steps", type=int, default=120, help="steps per run (default 120)")
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="extra seconds per step, a sleep (default 0: survivors sleeping through a loss delay its recovery)")
    parser.add_argument("--kill-step", type=int, default=8,
                        help="rank 1 is killed at this step's start, or at the third after its standby is warm (default 8)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds one run may take (default 240)")
    parser.add_argument("--keep", action="store_true", help="keep the logs (printed folder)")
    args = parser.parse_args(argv)
    args.layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    known = layouts(int(args.params)) if args.params >= 1e4 else {}
    problems = [
        (args.runs < 1, "--runs must be at least 1"),
        (not 1e4 <= args.params <= 1e8, "--params must be between 1e4 and 1e8"),
        (args.kill_step < 3, "--kill-step must be at least 3 (a steady step before the kill)"),
        (args.steps < args.kill_step + 3, "--steps must be at least --kill-step + 3 (steps after the recovery)"),
        (args.step_time < 0, "--step-time must not be negative"),
        (not args.layouts, "--layouts names none"),
        (args.timeout <= 0, "--timeout must be positive"),
    ]
    problems += [(name not in known, f"unknown layout {name!r} ({', '.join(known)})") for name in args.layouts]
    for bad, message in problems:
        if bad:
            parser.error(message)
    args.specs = [known[name] for name in args.layouts]
    return args


class LayoutWatch(Watch):
    """A survivor may report the killed rank before the agent reaps it ("lost by rank N; stopping
    it": the agent fences a process that is dying anyway), which the other benches' watch takes
    for a broken recovery: here only a fallback to the group restart is."""

    def check_alive(self) -> None:
        if self.job.proc.poll() is not None:
            raise Abort(f"the launcher exited (code {self.job.proc.returncode}) before the kill")
        if BROKEN in self.log.read_text(errors="replace"):
            raise Abort("in-place recovery broke: the job fell back to restarting the worker group")


def warm_marker(layout: Layout, warm_imports: bool = True, rehearsal: bool = True) -> str:
    """The agent log's line that says this layout's standby is warm for the kill: its sandbox's
    shadow steps done (a subgroup layout's: its rehearsal, tmrun/worker/rehearsal.py). For
    comparison, with ``TMRUN_REHEARSAL=0`` a subgroup layout's standby waits in init() cold:
    warm once it imported ahead what rank 0 imported (``TMRUN_WARM_IMPORTS=0``: at once)."""
    if not layout.subgroups or rehearsal:
        return "] standby 0 warm after"
    return "in its first steps" if warm_imports else "] standby 0 warm in tmrun.init()"


def one_run(args: argparse.Namespace, layout: Layout, index: int, work: Path) -> Run:
    run = Run("tmrun", index)  # judge() checks what a tmrun run must show
    log = work / "launcher.log"
    rank0, rank1 = work / "steps-0.log", work / f"steps-{KILL_RANK}.log"
    script = [str(EXAMPLES / layout.script), "--steps", str(args.steps), "--step-time", str(args.step_time),
              *layout.size_args,
              "--step-log", str(work / "steps-{rank}.log"), "--final", str(work / "final-{rank}")]
    cmd = [sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", str(layout.ranks),
           "--standby", "1", "--console", "plain", *script]
    started = (time.monotonic(), *busy_cpu())
    job = Job(cmd, log, dict(base_env(), TMRUN_STATE_DIR=str(work / "state")))
    LIVE_JOBS.append(job)
    watch = LayoutWatch(job, log, True, started[0] + args.timeout)
    t_kill, code = NAN, None
    try:
        try:
            marker = warm_marker(layout, os.environ.get("TMRUN_WARM_IMPORTS", "1").strip().lower() not in OFF,
                                 os.environ.get("TMRUN_REHEARSAL", "1").strip().lower() not in OFF)
            watch.wait_for("the standby to be warm", lambda: marker in log.read_text(errors="replace"))
            now = last_line(rank1)
            kill_step = max(args.kill_step, (int(now[0]) if len(now) >= 3 else 0) + 3)
            if kill_step > args.steps - 3:
                raise Abort(f"the standby was warm only at rank {KILL_RANK}'s step {now[0]}: too late (more --steps)")
            watch.wait_for(f"rank {KILL_RANK}'s step {kill_step - 2}", lambda: step_done(rank1, kill_step - 2))
            size = log_size(rank1)
            watch.wait_for(f"rank {KILL_RANK}'s step {kill_step - 1}",
                           lambda: log_size(rank1) != size and step_done(rank1, kill_step - 1), poll=FAST_POLL)
            line = last_line(rank1)
            t_kill = kill_logged_rank(job, line)
            if int(line[0]) != kill_step - 1:
                run.notes.append(f"killed after rank {KILL_RANK}'s step {line[0]}, not {kill_step - 1}")
            code = watch.finish(args.timeout)
        except Abort as exc:
            run.notes.append(str(exc))
    finally:
        wind_up(job, run, started)
    problems = judge(run, code, read_steps(rank0), t_kill, log.read_text(errors="replace"), args.steps - 1)
    conclude(run, problems, [work / f"final-{rank}" for rank in range(layout.ranks)])
    run.launcher = layout.name  # judged as a tmrun run; reported by layout
    return run


def median_of(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else NAN


def report(args: argparse.Namespace, runs: list[Run], seconds: float) -> None:
    results = [(run.launcher, run) for run in runs]
    print()
    print("| layout | ranks | parameters | recovered | steady step s | downtime s | downtime x DDP (median) "
          "| tmrun recovery s | recovery x DDP (median) | steps recomputed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    by_name = {spec.name: [r for name, r in results if name == spec.name and r.ok and r.metrics] for spec in args.specs}
    ddp = median_of([r.metrics.downtime for r in by_name.get("ddp", []) if r.metrics])
    ddp_recovery = median_of([r.recovery for r in by_name.get("ddp", [])])
    for spec in args.specs:
        mine = [r for name, r in results if name == spec.name]
        done = by_name[spec.name]
        metrics = [r.metrics for r in done if r.metrics is not None]
        down = median_of([m.downtime for m in metrics])
        ratio = f"{down / ddp:.2f}" if ddp > 0 and not math.isnan(down) else "-"
        recovery = median_of([r.recovery for r in done])
        recovery_ratio = (f"{recovery / ddp_recovery:.2f}" if ddp_recovery > 0 and not math.isnan(recovery)
                          else "-")
        recomputed = sorted({m.recomputed for m in metrics if m.recomputed >= 0})
        print(f"| {spec.name} | {spec.ranks} | {spec.parameters / 1e6:.2f}M | {len(done)} of {len(mine)} | "
              f"{spread([m.steady for m in metrics], '{:.3f}')} | {spread([m.downtime for m in metrics], '{:.3f}')} | "
              f"{ratio} | {spread([r.recovery for r in done], '{:.3f}')} | {recovery_ratio} | "
              f"{', '.join(map(str, recomputed)) or '-'} |")
    phased = [(name, r.phases) for name, r in results if r.ok and r.phases]
    if phased:
        print()
        print("tmrun's recovery hop by hop (the `recovered` event, docs/events.md), seconds, median per layout:")
        print()
        print("| layout | " + " | ".join(PHASES) + " |")
        print("|---|" + "---|" * len(PHASES))
        for spec in args.specs:
            mine = [p for name, p in phased if name == spec.name]
            if mine:
                print(f"| {spec.name} | " + " | ".join(f"{median_of([p.get(n, NAN) for p in mine]):.3f}"
                                                      for n in PHASES) + " |")
    print(f"\n{len(results)} runs in {seconds:.0f}s")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    specs = {spec.name: spec for spec in args.specs}
    args.launchers = list(specs)  # run_all's rotation: one run of each layout in turn
    print("layouts: " + ", ".join(f"{s.name} {s.parameters / 1e6:.2f}M ({s.script} {' '.join(s.size_args)})"
                                  for s in args.specs), flush=True)
    run_all(args, Path(tempfile.mkdtemp(prefix="tmrun-layouts-")),
            lambda name, index, work: one_run(args, specs[name], index, work), report)


if __name__ == "__main__":
    main()
