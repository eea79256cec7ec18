"""HSDP downtime after one worker SIGKILL: tmrun in-place replacement vs torchrun's checkpoint restart.

The job: examples/train_hsdp.py, a small GPT-style transformer sharded with FSDP2 on a 2 x 2
("replicate", "shard") device mesh (HSDP), AdamW, a warm-up + cosine LR schedule and a stateful
data loader; 4 CPU workers on one node (``OMP_NUM_THREADS=1``). The same script under both
launchers, interleaved run by run in one invocation:

* torchrun: ``python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 3``
  with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torchrun's reliable setting), the script with
  ``--checkpoint-dir DIR --checkpoint-every C`` (torch.distributed.checkpoint of the sharded model
  and optimizer, plus scheduler and loader): the worker group restarts after the kill and
  resumes from the last checkpoint;
* tmrun: ``tmrun --standalone --nproc-per-node 4 --standby 1``, the script without a checkpoint:
  the standby, waiting warm in ``tmrun.init()``, takes the lost rank in place (docs/mesh.md).

The kill, the same for both: once rank 1 logged the completion of step S - 1 (0-based: at the
start of step S, S steps done) and, under tmrun, the standby said it is warm, the bench SIGKILLs
rank 1's process from outside, by the PID its step log names (checked to be this job's);
t_kill = ``time.time()`` right after it.

From rank 0's step log (one line per completed step: step, unix time, pid), with the arithmetic
of bench/random_kill.py (``kill_metrics``, imported):

* steady: the median interval of the (up to) 8 steps before the kill;
* downtime = (t_next - t_last) - steady: the largest gap between completed steps around the
  kill (t_last: the last completion before the kill) minus one steady step;
* kill -> next step = (t_next - t_kill) - steady;
* committed time lost: when rank 0 completes the step in flight again, minus (t_last + steady):
  torchrun's includes the steps recomputed since its checkpoint;
* steps recomputed: steps completed before the kill that rank 0 completed again.

A run counts as recovered when the launcher exits 0 after every step, the kill's figures could
be computed and (tmrun) the agent logged an in-place replacement with rank 0 in the same process,
(torchrun) the job resumed from a checkpoint. Every run writes each rank's final digest (local
shards, optimizer state, LR schedule, loader: ``--final``); the bench checks that every run of
both launchers ends with the same bits (a resume that was not exact would differ).

Processes are tagged and cleaned up as in bench/inplace_failover.py (whose helpers this bench
imports), also on Ctrl-C; every wait is bounded (``--timeout`` per run).

    python bench/hsdp_failover.py                         # --runs 3, 3.2M parameters: about 6 minutes on 2 cores
    python bench/hsdp_failover.py --runs 1 --dim 128      # smoke run
    python bench/hsdp_failover.py --dim 512 --layers 6    # a larger model (19M parameters)
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers of the other benches
from inplace_failover import (  # noqa: E402
    INPLACE_BROKEN,
    LIVE_JOBS,
    TAG_VAR,
    Job,
    base_env,
    busy_cpu,
    cleanup_all,
    machine,
    print_notes,
    read_steps,
)
from random_kill import PHASES, KillMetrics, kill_metrics, last_line, log_size, read_events, recovered_phases  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HSDP_SCRIPT = ROOT / "examples" / "train_hsdp.py"
NPROC = 4  # the 2 x 2 mesh
LAUNCHERS = ("torchrun", "tmrun")
NAN = float("nan")
POLL = 0.05
FAST_POLL = 0.005  # while waiting for rank 1's step S - 1 (the kill's moment)
KILL_RANK = 1
STEADY_MIN = 3  # steps before the kill: the steady step needs a few intervals


# -- flags and pure arithmetic (unit tested: tests/bench/test_hsdp_bench.py) ----------------------


class OneLineParser(argparse.ArgumentParser):
    """Bad flags: one line on stderr (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"hsdp_failover.py: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs per launcher, interleaved (default 3)")
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256: 3.2M parameters with 4 layers)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--kill-step", type=int, default=15,
                        help="rank 1 is SIGKILLed at the start of this step, 0-based (default 15)")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="torchrun's checkpoint interval (default 10)")
    parser.add_argument("--launchers", default="torchrun,tmrun", help="which launchers (default both)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds one run may take (default 240)")
    parser.add_argument("--keep", action="store_true", help="keep the logs (printed folder)")
    args = parser.parse_args(argv)
    args.launchers = [s.strip() for s in args.launchers.split(",") if s.strip()]
    problems = [
        (args.runs < 1, "--runs must be at least 1"),
        (args.layers < 1, "--layers must be at least 1"),
        (args.dim < 2 or args.dim % 2, "--dim must be even and at least 2 (2 attention heads)"),
        (args.kill_step < STEADY_MIN, f"--kill-step must be at least {STEADY_MIN} (a steady step before the kill)"),
        (args.steps < args.kill_step + 3, "--steps must be at least --kill-step + 3 (steps after the recovery)"),
        (args.checkpoint_every < 1, "--checkpoint-every must be at least 1"),
        (args.checkpoint_every > args.kill_step,
         "--checkpoint-every must be at most --kill-step (torchrun needs a checkpoint before the kill)"),
        (not args.launchers, "--launchers names none"),
        (args.timeout <= 0, "--timeout must be positive"),
    ]
    for launcher in args.launchers:
        problems.append((launcher not in LAUNCHERS, f"unknown launcher {launcher!r} (torchrun, tmrun)"))
    for bad, message in problems:
        if bad:
            parser.error(message)
    return args


def gpt_parameters(dim: int, layers: int, vocab: int = 64, seq: int = 16) -> int:
    """Parameters of examples/tiny_gpt.py's GPT: embeddings, per block two LayerNorms, q/k/v/o
    without bias and a 4x MLP with bias; the final LayerNorm and the head (no bias)."""
    block = 2 * (2 * dim) + 4 * dim * dim + (dim * 4 * dim + 4 * dim) + (4 * dim * dim + dim)
    return vocab * dim + seq * dim + layers * block + 2 * dim + dim * vocab


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """min / median / max of the finite values; "-" when there are none."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "-"
    return " / ".join(fmt.format(v) for v in (min(finite), statistics.median(finite), max(finite)))


def distinct(values: list[int]) -> str:
    """The distinct non-negative values, sorted ("-" when none): steps recomputed per run."""
    seen = sorted({v for v in values if v >= 0})
    return ", ".join(str(v) for v in seen) if seen else "-"


def digests_agree(finals: list[list[str]]) -> bool | None:
    """Every run's per-rank final digests equal (None: fewer than 2 complete runs to compare)."""
    complete = [f for f in finals if f and all(f)]
    if len(complete) < 2:
        return None
    return all(f == complete[0] for f in complete[1:])


# -- one run --------------------------------------------------------------------------------------


@dataclass
class Run:
    launcher: str
    index: int
    ok: bool = False
    metrics: KillMetrics | None = None
    recovery: float = NAN  # tmrun: the controller's "all ranks recovered, X s after"
    phases: dict[str, float] = field(default_factory=dict)  # tmrun: the recovered event's (docs/events.md)
    finals: list[str] = field(default_factory=list)
    others: float = NAN  # CPU cores other processes kept busy meanwhile
    seconds: float = NAN
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        text = f"{self.launcher} run {self.index}: {'recovered' if self.ok else 'FAILED'}"
        m = self.metrics
        if m is not None:
            text += (f", steady {m.steady:.3f}s, downtime {m.downtime:.3f}s, kill -> next step {m.stall:.3f}s, "
                     f"committed lost {m.committed:.3f}s, recomputed {m.recomputed}")
        if not math.isnan(self.recovery):
            text += f", tmrun recovery {self.recovery:.3f}s"
        text += f" ({self.seconds:.0f}s, others {self.others:.2f} cores)"
        return text + (f" [{'; '.join(self.notes)}]" if self.notes else "")


class Abort(Exception):
    """The run cannot go on (the job died, a wait ran out, in-place recovery broke)."""


def command(args: argparse.Namespace, launcher: str, work: Path) -> tuple[list[str], dict[str, str]]:
    script = [
        str(HSDP_SCRIPT), "--steps", str(args.steps), "--dim", str(args.dim), "--layers", str(args.layers),
        "--step-log", str(work / "steps-{rank}.log"), "--final", str(work / "final-{rank}"),
    ]  # fmt: skip
    if launcher == "tmrun":
        cmd = [sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", str(NPROC),
               "--standby", "1", *script]
        return cmd, dict(base_env(), TMRUN_STATE_DIR=str(work / "state"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
           "--max-restarts", "3", *script, "--checkpoint-dir", str(work / "checkpoints"),
           "--checkpoint-every", str(args.checkpoint_every)]
    return cmd, dict(base_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def one_run(args: argparse.Namespace, launcher: str, index: int, work: Path) -> Run:
    run = Run(launcher, index)
    tmrun = launcher == "tmrun"
    log = work / "launcher.log"
    rank0, rank1 = work / "steps-0.log", work / f"steps-{KILL_RANK}.log"
    cmd, env = command(args, launcher, work)
    busy0, mine0 = busy_cpu()
    wall0 = time.monotonic()
    deadline = wall0 + args.timeout
    job = Job(cmd, log, env)
    LIVE_JOBS.append(job)
    t_kill = NAN
    code: int | None = None

    def check_alive() -> None:
        if job.proc.poll() is not None:
            raise Abort(f"the launcher exited (code {job.proc.returncode}) before the kill")
        if tmrun:
            found = re.search(f"^.*(?:{INPLACE_BROKEN}).*$", log.read_text(errors="replace"), re.MULTILINE)
            if found:
                raise Abort(f"in-place recovery broke: {found.group(0).strip()}")

    def wait_for(what: str, ready, poll: float = POLL) -> None:  # type: ignore[no-untyped-def]
        checked = 0.0
        while not ready():
            now = time.monotonic()
            if now > deadline:
                raise Abort(f"waited too long for {what}")
            if now - checked > 0.5:
                check_alive()
                checked = now
            time.sleep(poll)

    def rank1_done(step: int) -> bool:
        line = last_line(rank1)
        return len(line) >= 3 and int(line[0]) >= step

    try:
        try:
            if tmrun:
                wait_for("the standby to be warm", lambda: "] standby 0 warm" in log.read_text(errors="replace"))
            wait_for(f"rank {KILL_RANK}'s step {args.kill_step - 2}", lambda: rank1_done(args.kill_step - 2))
            size = log_size(rank1)  # the next line is step S - 1: kill right after it
            wait_for(f"rank {KILL_RANK}'s step {args.kill_step - 1}", lambda: log_size(rank1) != size
                     and rank1_done(args.kill_step - 1), poll=FAST_POLL)
            line = last_line(rank1)
            pid = int(line[2])
            try:
                import psutil

                if psutil.Process(pid).environ().get(TAG_VAR) != job.tag:
                    raise Abort(f"pid {pid} of rank {KILL_RANK}'s step log is not this job's")
            except psutil.Error as exc:
                raise Abort(f"rank {KILL_RANK}'s pid {pid} is gone before the kill: {exc!r}") from exc
            os.kill(pid, signal.SIGKILL)
            t_kill = time.time()
            if int(line[0]) != args.kill_step - 1:
                run.notes.append(f"killed after rank {KILL_RANK}'s step {line[0]}, not {args.kill_step - 1}")
            while code is None and time.monotonic() < deadline:
                code = job.wait(0.25)
                if tmrun and code is None:
                    check_alive()
            if code is None:
                raise Abort(f"no finish within {args.timeout:.0f}s (hung)")
        except Abort as exc:
            run.notes.append(str(exc))
    finally:
        left = job.cleanup()
        LIVE_JOBS.remove(job)
        if left:
            run.notes.append(f"{len(left)} processes would not die: {left}")
    busy1, mine1 = busy_cpu()
    run.seconds = time.monotonic() - wall0
    run.others = max(0.0, (busy1 - busy0) - (mine1 - mine0)) / max(1e-9, run.seconds)
    text = log.read_text(errors="replace")
    rows = read_steps(rank0)
    problems: list[str] = []
    if code is None:
        problems.append("did not finish")
    elif code != 0:
        problems.append(f"exit code {code}")
    if not rows or rows[-1][0] != args.steps - 1:
        problems.append(f"rank 0's last step {rows[-1][0] if rows else None}, not {args.steps - 1}")
    if not math.isnan(t_kill):
        run.metrics = kill_metrics(rows, t_kill, redone_aborted=tmrun)
        if run.metrics is None:
            problems.append("too few steps of rank 0 around the kill")
    if tmrun:
        if "in-place replacement" not in text:
            problems.append("no in-place replacement in the agent log")
        if len({who for _, _, who in rows}) > 1:
            problems.append("rank 0 changed process")
        recovered = re.search(r"generation 1: all \d+ ranks recovered, ([\d.]+)s after", text)
        if recovered:
            run.recovery = float(recovered.group(1))
        events = re.search(r"the job's events go to (\S+)", text)
        if events and not math.isnan(t_kill):
            phases = recovered_phases(read_events(Path(events.group(1))), 1, [t_kill])
            if phases:
                run.phases = phases[0]
    elif "resumed from the checkpoint of step" not in text:
        problems.append("no resume from a checkpoint seen")
    run.finals = [read_final(work / f"final-{rank}") for rank in range(NPROC)]
    if not all(run.finals):
        problems.append("not every rank wrote its final digest")
    run.ok = not problems and not run.notes and run.metrics is not None
    run.notes = problems + run.notes
    return run


def read_final(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# -- report ---------------------------------------------------------------------------------------


def report(args: argparse.Namespace, runs: list[Run], total: float) -> None:
    params = gpt_parameters(args.dim, args.layers)
    print()
    print("Command: " + " ".join(["python", "bench/hsdp_failover.py", *sys.argv[1:]]))
    print(f"Machine: {machine()}; total {total:.0f} s")
    print(f"Other processes on the machine (not this bench's) kept {spread([r.others for r in runs])} CPU cores "
          "busy during a run (min / median / max).")
    print()
    print(f"examples/train_hsdp.py, HSDP on a 2 x 2 mesh, 4 CPU workers, GPT {args.layers} x {args.dim} "
          f"({params / 1e6:.1f}M parameters), AdamW, {args.steps} steps; rank {KILL_RANK} SIGKILLed from outside "
          f"at the start of step {args.kill_step} (0-based). torchrun: `--max-restarts 3`, "
          f"`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, DCP checkpoint every {args.checkpoint_every} steps; "
          "tmrun: `--standby 1` (warm at the kill), no checkpoint. Seconds, min / median / max over the "
          "recovered runs.")
    print()
    print("| launcher | recovered | steady step s | kill -> next step s | downtime s | committed time lost s "
          "| steps recomputed | tmrun recovery s |")
    print("|---|---|---|---|---|---|---|---|")
    for launcher in args.launchers:
        mine = [r for r in runs if r.launcher == launcher]
        done = [r for r in mine if r.ok and r.metrics is not None]
        ms = [r.metrics for r in done if r.metrics is not None]
        print(f"| {launcher} | {len(done)} of {len(mine)} | {spread([m.steady for m in ms], '{:.3f}')} | "
              f"{spread([m.stall for m in ms])} | {spread([m.downtime for m in ms])} | "
              f"{spread([m.committed for m in ms])} | {distinct([m.recomputed for m in ms])} | "
              f"{spread([r.recovery for r in done], '{:.3f}')} |")
    phased = [r.phases for r in runs if r.ok and r.phases]
    if phased:
        print()
        print("tmrun's recovery, hop by hop (the `recovered` event's phases, docs/events.md; kill_to_seen: the "
              "bench's kill to the controller seeing it), seconds, min / median / max:")
        print()
        print("| " + " | ".join(PHASES) + " |")
        print("|" + "---|" * len(PHASES))
        print("| " + " | ".join(spread([p.get(name, NAN) for p in phased], "{:.3f}") for name in PHASES) + " |")
    agree = digests_agree([r.finals for r in runs if r.ok])
    print()
    if agree is None:
        print("Final state: fewer than 2 recovered runs, nothing to compare.")
    elif agree:
        print("Final state: every recovered run of both launchers ended with the same per-rank digests "
              "(local shards, optimizer state, LR schedule, loader).")
    else:
        print("Final state: the recovered runs' per-rank digests DIFFER (a resume was not exact).")
    print_notes([f"{r.launcher} run {r.index}: {'; '.join(r.notes)}" for r in runs if r.notes])


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix="tmrun-hsdp-bench-"))
    started = time.monotonic()
    print(f"machine: {machine()}", flush=True)
    print(f"logs: {root}" + ("" if args.keep else " (removed at the end; --keep keeps them)"), flush=True)
    runs: list[Run] = []
    try:
        for index in range(args.runs):
            for launcher in args.launchers:
                work = root / f"{launcher}-{index}"
                work.mkdir()
                run = one_run(args, launcher, index, work)
                runs.append(run)
                print(f"  [{time.monotonic() - started:4.0f}s] {run.line()}", flush=True)
    finally:
        cleanup_all()
    report(args, runs, time.monotonic() - started)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    if not any(r.ok for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
