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
    """Bad flags: one line on stderr (no usage block), exit status 2 (``prog``: the bench's file name)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="hsdp_failover.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
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


class Watch:
    """One launcher run until the kill and to its end (this bench's and bench/torchtitan_failover.py's):
    bounded waits that check, every half second, that the launcher lives and (tmrun) that
    in-place recovery did not break."""

    def __init__(self, job: Job, log: Path, tmrun: bool, deadline: float) -> None:
        self.job, self.log, self.tmrun, self.deadline = job, log, tmrun, deadline

    def check_alive(self) -> None:
        if self.job.proc.poll() is not None:
            raise Abort(f"the launcher exited (code {self.job.proc.returncode}) before the kill")
        if self.tmrun:
            found = re.search(f"^.*(?:{INPLACE_BROKEN}).*$", self.log.read_text(errors="replace"), re.MULTILINE)
            if found:
                raise Abort(f"in-place recovery broke: {found.group(0).strip()}")

    def wait_for(self, what: str, ready, poll: float = POLL) -> None:  # type: ignore[no-untyped-def]
        checked = 0.0
        while not ready():
            now = time.monotonic()
            if now > self.deadline:
                raise Abort(f"waited too long for {what}")
            if now - checked > 0.5:
                self.check_alive()
                checked = now
            time.sleep(poll)

    def standby_warm(self) -> None:
        """tmrun: until its standby is warm (a kill before that waits for it, which is not the
        recovery this bench measures)."""
        if self.tmrun:
            self.wait_for("the standby to be warm", lambda: "] standby 0 warm" in self.log.read_text(errors="replace"))

    def finish(self, timeout: float) -> int:
        """The launcher's exit code, once it ends (Abort when it does not, within the deadline)."""
        while time.monotonic() < self.deadline:
            code = self.job.wait(0.25)
            if code is not None:
                return code
            if self.tmrun:
                try:
                    self.check_alive()
                except Abort:
                    if self.job.proc.poll() is not None:  # it ended just now (not "before the kill")
                        return self.job.proc.returncode
                    raise
        raise Abort(f"no finish within {timeout:.0f}s (hung)")


def step_done(path: Path, step: int) -> bool:
    """Whether a rank's step log (``step time pid`` lines) has reached ``step``."""
    line = last_line(path)
    return len(line) >= 3 and int(line[0]) >= step


def kill_logged_rank(job: Job, line: list[str], at: float = 0.0) -> float:
    """SIGKILL the process of a step log's ``line``, once it is checked to be this job's, at the
    wall-clock time ``at`` (0: at once); the kill's time."""
    pid = int(line[2])
    try:
        import psutil

        if psutil.Process(pid).environ().get(TAG_VAR) != job.tag:
            raise Abort(f"pid {pid} of rank {KILL_RANK}'s step log is not this job's")
    except psutil.Error as exc:
        raise Abort(f"rank {KILL_RANK}'s pid {pid} is gone before the kill: {exc!r}") from exc
    time.sleep(max(0.0, at - time.time()))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError as exc:
        raise Abort(f"rank {KILL_RANK} (pid {pid}) was gone at the kill") from exc
    return time.time()


def wind_up(job: Job, run: Run, started: tuple[float, float, float]) -> None:
    """The job's processes gone (any left is a note), and the run's wall time and the CPU others
    used meanwhile (``started``: monotonic time, busy and own CPU seconds at the start)."""
    left = job.cleanup()
    LIVE_JOBS.remove(job)
    if left:
        run.notes.append(f"{len(left)} processes would not die: {left}")
    wall0, busy0, mine0 = started
    busy1, mine1 = busy_cpu()
    run.seconds = time.monotonic() - wall0
    run.others = max(0.0, (busy1 - busy0) - (mine1 - mine0)) / max(1e-9, run.seconds)


def judge(run, code: int | None, rows: list, t_kill: float, text: str, last_step: int) -> list[str]:  # type: ignore[no-untyped-def]
    """What went wrong in a run, from its exit code, rank 0's step log and (tmrun) the agent's
    log; sets the run's metrics, recovery and phases. The torchrun side's resume check is the caller's."""
    tmrun = run.launcher == "tmrun"
    problems: list[str] = []
    if code is None:
        problems.append("did not finish")
    elif code != 0:
        problems.append(f"exit code {code}")
    if not rows or rows[-1][0] != last_step:
        problems.append(f"rank 0's last step {rows[-1][0] if rows else None}, not {last_step}")
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
    return problems


def conclude(run, problems: list[str], finals: list[Path]) -> None:  # type: ignore[no-untyped-def]
    """Every rank's final digest read; the run is ok when nothing went wrong."""
    run.finals = [read_final(path) for path in finals]
    if not all(run.finals):
        problems.append("not every rank wrote its final digest")
    run.ok = not problems and not run.notes and run.metrics is not None
    run.notes = problems + run.notes


def start_watched(cmd: list[str], log: Path, env: dict[str, str], tmrun: bool,
                  timeout: float) -> tuple[Job, Watch, tuple[float, float, float]]:
    """The launcher started (its output to ``log``) under watch for ``timeout`` s, and what
    :func:`wind_up` needs of the start."""
    started = (time.monotonic(), *busy_cpu())
    job = Job(cmd, log, env)
    LIVE_JOBS.append(job)
    return job, Watch(job, log, tmrun, started[0] + timeout), started


def one_run(args: argparse.Namespace, launcher: str, index: int, work: Path) -> Run:
    run = Run(launcher, index)
    log = work / "launcher.log"
    rank0, rank1 = work / "steps-0.log", work / f"steps-{KILL_RANK}.log"
    cmd, env = command(args, launcher, work)
    job, watch, started = start_watched(cmd, log, env, launcher == "tmrun", args.timeout)
    t_kill = NAN
    code: int | None = None
    try:
        try:
            watch.standby_warm()
            watch.wait_for(f"rank {KILL_RANK}'s step {args.kill_step - 2}", lambda: step_done(rank1, args.kill_step - 2))
            size = log_size(rank1)  # the next line is step S - 1: kill right after it
            watch.wait_for(f"rank {KILL_RANK}'s step {args.kill_step - 1}", lambda: log_size(rank1) != size
                           and step_done(rank1, args.kill_step - 1), poll=FAST_POLL)
            line = last_line(rank1)
            t_kill = kill_logged_rank(job, line)
            if int(line[0]) != args.kill_step - 1:
                run.notes.append(f"killed after rank {KILL_RANK}'s step {line[0]}, not {args.kill_step - 1}")
            code = watch.finish(args.timeout)
        except Abort as exc:
            run.notes.append(str(exc))
    finally:
        wind_up(job, run, started)
    text = log.read_text(errors="replace")
    problems = judge(run, code, read_steps(rank0), t_kill, text, args.steps - 1)
    if launcher != "tmrun" and "resumed from the checkpoint of step" not in text:
        problems.append("no resume from a checkpoint seen")
    conclude(run, problems, [work / f"final-{rank}" for rank in range(NPROC)])
    return run


def run_all(args: argparse.Namespace, root: Path, one, report) -> None:  # type: ignore[no-untyped-def]
    """Every run (``one(launcher, index, work)``, launchers alternating), its line as it ends;
    then ``report(args, runs, seconds)``; exit status 1 when no run recovered."""
    started = time.monotonic()
    print(f"machine: {machine()}", flush=True)
    print(f"logs: {root}" + ("" if args.keep else " (removed at the end; --keep keeps them)"), flush=True)
    runs: list = []
    try:
        for index in range(args.runs):
            for launcher in args.launchers:
                work = root / f"{launcher}-{index}"
                work.mkdir()
                run = one(launcher, index, work)
                runs.append(run)
                print(f"  [{time.monotonic() - started:4.0f}s] {run.line()}", flush=True)
    finally:
        cleanup_all()
    report(args, runs, time.monotonic() - started)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    if not any(r.ok for r in runs):
        sys.exit(1)


def print_tables(launchers: list[str], runs: list) -> None:
    """The report's tables: each launcher's recovery (min / median / max over its recovered runs),
    then tmrun's recovery hop by hop."""
    print()
    print("| launcher | recovered | steady step s | kill -> next step s | downtime s | committed time lost s "
          "| steps recomputed | tmrun recovery s |")
    print("|---|---|---|---|---|---|---|---|")
    for launcher in launchers:
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
    print_tables(args.launchers, runs)
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
    run_all(args, root, lambda launcher, index, work: one_run(args, launcher, index, work), report)


if __name__ == "__main__":
    main()
