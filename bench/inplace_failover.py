"""One unexpected worker failure on a single node: torchrun checkpoint-restart vs tmrun in-place replacement.

Three measurements, one invocation (the baseline runs interleaved with tmrun):

1. 2 CPU workers, 6 x Linear(2048) (~25M parameters), batch 32, SIGKILL of rank 1 at the start of
   step S (0-based; S steps completed).
   * torchrun: ``python -m torch.distributed.run --standalone`` (c10d rendezvous) with
     ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torchrun's reliable setting) and ``--max-restarts 3``,
     running examples/train_checkpoint.py (DDP + Adam, checkpoint every 10 steps, the script kills
     its own rank 1 at step S); the worker group restarts and reloads the checkpoint.
   * tmrun: ``tmrun --standalone --standby 1 --inject-failure rank=1,step=S`` running
     examples/train_inplace.py (DDP + AdamW over the tmrun worker API); the warm standby takes
     rank 1 in place.
   * tmrun, cold joiner: the same with ``--shadow-steps 0`` (the standby never ran a step).
2. tmrun downtime against world size (2, 4, 8 workers), a tiny model paced by --step-time.
3. Warm vs cold joiner (from the runs of 1): the promoted standby's first step against a steady step.

Per run, from the step logs (one line per completed step, with unix time):
* steady step: median interval between consecutive completed steps of rank 0 over the last (up to 8)
  steps before the failure;
* downtime: the largest gap between two consecutive step lines of the survivor (rank 0) minus one
  steady step (the definition of the brief and of bench/failover.py);
* time lost: the same on the committed timeline (only the last completion of each step counts),
  so the work redone after the failure is included;
* steps recomputed: step numbers that rank 0 logged more than once;
* joiner (tmrun): its first step is timed from its own "recovered into generation" line (agent
  log); warm-up = the joiner's steps before the first step from which the median of 3 steps is
  within 1.2 x steady, and the seconds from its recovery until that step started.

Every process is started with a tag in its environment; on exit the bench SIGKILLs, by PID,
every process carrying its tag that is still alive (workers run in sessions of their own).

    python bench/inplace_failover.py              # default: --runs 3, about 10 minutes on 2 cores
    python bench/inplace_failover.py --quick      # smoke run, 1-2 minutes
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT_SCRIPT = ROOT / "examples" / "train_checkpoint.py"
INPLACE_SCRIPT = ROOT / "examples" / "train_inplace.py"
TAG_VAR = "TMRUN_BENCH_TAG"
WARM_FACTOR = 1.2
WARM_RUN = 3  # warm from the first step where the median of this many steps is within WARM_FACTOR x steady
STEADY_WINDOW = 8


# -- processes ------------------------------------------------------------------------------


def tagged_pids(tag: str) -> list[int]:
    pids = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(TAG_VAR) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return pids


class Job:
    """One launcher command and everything it starts (found through the tag, killed by PID)."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str]) -> None:
        self.tag = uuid.uuid4().hex
        full = dict(os.environ)
        full.update(env)
        full[TAG_VAR] = self.tag
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full,
                                     stdin=subprocess.DEVNULL)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def cleanup(self) -> list[int]:
        """Stop the launcher if it still runs (SIGTERM, 10 s to stop its workers), then SIGKILL
        whatever of this job is still alive; returns PIDs that would not go."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        left: list[int] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = tagged_pids(self.tag)
            if not left and self.proc.poll() is not None:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        self._log.close()
        return tagged_pids(self.tag)


LIVE_JOBS: list[Job] = []


@dataclass
class JobEnd:
    code: int | None  # None: stopped by the bench (timeout, or ``stop_on`` matched)
    log: str
    left: list[int]  # PIDs that would not die
    stopped: str = ""  # why the bench stopped it
    others: float = float("nan")  # CPU cores busy with processes other than this bench's, on average


def busy_cpu() -> tuple[float, float]:
    """(CPU seconds the whole machine was busy, CPU seconds of this process and its reaped children)."""
    total = psutil.cpu_times()
    busy = sum(total) - total.idle - getattr(total, "iowait", 0.0)
    mine = os.times()
    return busy, mine.user + mine.system + mine.children_user + mine.children_system


def run_job(cmd: list[str], work: Path, env: dict[str, str], timeout: float, stop_on: str = "") -> JobEnd:
    """Run to completion, at most ``timeout`` seconds; stop early (2 s later) when a launcher
    log line matches the regex ``stop_on``."""
    log_path = work / "launcher.log"
    busy0, mine0 = busy_cpu()
    wall0 = time.monotonic()
    job = Job(cmd, log_path, env)
    LIVE_JOBS.append(job)
    stopped = ""
    try:
        deadline = time.monotonic() + timeout
        code = None
        while time.monotonic() < deadline:
            code = job.wait(0.25)
            if code is not None:
                break
            if stop_on:
                found = re.search(f"^.*(?:{stop_on}).*$", log_path.read_text(errors="replace"), re.M)
                if found:
                    time.sleep(2.0)
                    stopped = f"stopped by the bench after: {found.group(0).strip()}"
                    break
        if code is None and not stopped:
            stopped = f"no finish within {timeout:.0f}s (hung)"
        time.sleep(0.2)  # let a clean launcher's children finish exiting before the check
    finally:
        left = job.cleanup()
        LIVE_JOBS.remove(job)
    busy1, mine1 = busy_cpu()
    others = max(0.0, (busy1 - busy0) - (mine1 - mine0)) / max(1e-9, time.monotonic() - wall0)
    return JobEnd(code if not stopped else None, log_path.read_text(errors="replace"), left, stopped, others)


def cleanup_all(*_: object) -> None:
    for job in list(LIVE_JOBS):
        job.cleanup()


# -- logs -------------------------------------------------------------------------------------


def read_steps(path: Path) -> list[tuple[int, float, str]]:
    """(step, unix time, third column) per line; a torn last line is skipped."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3:
                try:
                    rows.append((int(parts[0]), float(parts[1]), parts[2]))
                except ValueError:
                    continue
    return rows


def wall_time(stamp: str, near: float) -> float:
    """A log stamp HH:MM:SS.mmm (local time) as unix time: the candidate date closest to ``near``."""
    clock = dt.datetime.strptime(stamp, "%H:%M:%S.%f").time()
    day = dt.datetime.fromtimestamp(near).date()
    candidates = [dt.datetime.combine(day + dt.timedelta(days=d), clock).timestamp() for d in (-1, 0, 1)]
    return min(candidates, key=lambda t: abs(t - near))


ENTRY = re.compile(r"\[tmrun(?:@\S+)? (?:worker (\d+) )?(\d\d:\d\d:\d\d\.\d{3})\] ((?:(?!\[tmrun[ @])[^\n])*)")


def log_entries(log: str) -> list[tuple[str, str, str]]:
    """(worker pid or "", stamp, message) of every tmrun line; lines that several processes
    wrote at the same instant can be glued together in the file, so entries are found anywhere."""
    return [(m.group(1) or "", m.group(2), m.group(3).strip()) for m in ENTRY.finditer(log)]


def log_time(log: str, pattern: str, near: float, pid: str = "") -> float | None:
    """Unix time of the first tmrun log entry whose message matches ``pattern`` (of worker ``pid``)."""
    for who, stamp, message in log_entries(log):
        if (not pid or who == pid) and re.search(pattern, message):
            return wall_time(stamp, near)
    return None


def median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def steady_step(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return median_or_nan(gaps[-STEADY_WINDOW:])


def largest_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:])), default=float("nan"))


def committed_times(rows: list[tuple[int, float, str]]) -> list[float]:
    last: dict[int, float] = {}
    for step, t, _ in rows:
        last[step] = t
    return [last[s] for s in sorted(last)]


# -- runs -------------------------------------------------------------------------------------


@dataclass
class Result:
    case: str
    ok: bool
    note: str = ""
    steady: float = float("nan")
    downtime: float = float("nan")
    lost: float = float("nan")
    recomputed: int = -1
    recovery: float = float("nan")  # tmrun: the controller's "all ranks recovered, X s after"
    first_ratio: float = float("nan")  # joiner's first step / steady
    warm_steps: int = -1
    warm_seconds: float = float("nan")
    extra: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        text = f"{self.case}: {'ok' if self.ok else 'FAILED'}"
        if self.steady == self.steady:
            text += (f", steady {self.steady:.3f}s downtime {self.downtime:.3f}s lost {self.lost:.3f}s "
                     f"recomputed {self.recomputed}")
        if self.recovery == self.recovery:
            text += f", recovery {self.recovery:.3f}s"
        if self.first_ratio == self.first_ratio:
            text += (f", joiner first step {self.first_ratio:.2f}x steady, warm-up {self.warm_steps} steps / "
                     f"{self.warm_seconds:.2f}s")
        return text + (f" [{self.note}]" if self.note else "")


def base_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun_run(args: argparse.Namespace, work: Path) -> Result:
    case = "torchrun"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
        str(CHECKPOINT_SCRIPT), "--ckpt-dir", str(work), "--steps", str(args.steps),
        "--ckpt-every", str(args.ckpt_every), "--width", str(args.width), "--layers", str(args.depth),
        "--batch", str(args.batch), "--kill-rank", "1", "--kill-step", str(args.fail_step),
        "--step-log", str(work / "steps-{rank}.log"),
    ]  # fmt: skip
    env = dict(base_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    end = run_job(cmd, work, env, args.timeout)
    rows = read_steps(work / "steps-0.log")
    if end.code is None:
        return Result(case, False, f"{end.stopped}; {len(rows)} step lines", extra={"others": end.others})
    if end.code != 0 or not rows or rows[-1][0] != args.steps:
        return Result(case, False, f"exit code {end.code}, last step {rows[-1][0] if rows else None}",
                      extra={"others": end.others})
    # train_checkpoint logs steps completed (1-based): the kill comes before step index S, so
    # steps 1..S are the ones before the failure.
    before = [t for s, t, _ in rows[: args.fail_step] if s <= args.fail_step]
    steady = steady_step(before)
    times = [t for _, t, _ in rows]
    recomputed = len(rows) - len({s for s, _, _ in rows})
    note = "" if "resumed from step" in end.log else "no restart from a checkpoint seen"
    if end.left:
        note += f"; {len(end.left)} processes would not die"
    return Result(case, True, note, steady, largest_gap(times) - steady,
                  largest_gap(committed_times(rows)) - steady, recomputed, extra={"others": end.others})


# Signs that in-place replacement is over for this run: the controller fences a live survivor,
# or gives up and restarts the worker group. The bench stops the run 2 s later.
INPLACE_BROKEN = r"lost by rank \d+; stopping it|falling back to restarting"


def tmrun_run(args: argparse.Namespace, work: Path, case: str, nproc: int, model: list[str], fail_step: int,
              steps: int, shadow_steps: int | None = None) -> Result:
    extra = ["--shadow-steps", str(shadow_steps)] if shadow_steps is not None else []
    cmd = [
        sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", str(nproc), "--standby", "1",
        *extra, "--inject-failure", f"rank=1,step={fail_step}",
        str(INPLACE_SCRIPT), *model, "--steps", str(steps), "--step-log", str(work / "steps-{rank}.log"),
    ]  # fmt: skip
    env = dict(base_env(), TMRUN_STATE_DIR=str(work / "state"))
    end = run_job(cmd, work, env, args.timeout, stop_on=INPLACE_BROKEN)
    log = end.log
    rows = read_steps(work / "steps-0.log")
    problems: list[str] = []  # the run does not count as an in-place recovery
    notes: list[str] = []
    if end.code is None:
        problems.append(end.stopped)
    elif end.code != 0 or not rows or rows[-1][0] != steps - 1:
        problems.append(f"exit code {end.code}, last step {rows[-1][0] if rows else None}")
    if "in-place replacement" not in log:
        problems.append("no in-place replacement in the agent log")
    if len({pid for _, _, pid in rows}) > 1:
        problems.append("rank 0 changed process")
    if not rows:
        return Result(case, False, "; ".join(problems) or "no step lines", extra={"others": end.others})
    near = rows[-1][1]
    replaced_at = log_time(log, r"^in-place replacement, generation 1", near)
    warm_at = log_time(log, r"^standby 0 warm", near)
    if warm_at is None or replaced_at is None or warm_at > replaced_at:
        notes.append("standby 0 was not warm at the failure")
    if re.search(r"rank \d+ failed; waiting up to", log.split("generation 1: all")[0]):
        notes.append("the failure waited for a standby")
    recovered = re.search(r"generation 1: all \d+ ranks recovered, ([\d.]+)s after", log)
    before = [t for s, t, _ in rows if s < fail_step]
    steady = steady_step(before)
    times = [t for _, t, _ in rows]
    recomputed = len(rows) - len({s for s, _, _ in rows})
    result = Result(case, not problems, "", steady, largest_gap(times) - steady,
                    largest_gap(committed_times(rows)) - steady, recomputed,
                    float(recovered.group(1)) if recovered else float("nan"), extra={"others": end.others})
    # the joiner: rank 1's lines written by a process other than the original rank 1; its first
    # step is timed from its own "recovered into generation" line
    rank1 = read_steps(work / "steps-1.log")
    joiner = next((pid for _, _, pid in rank1 if pid != rank1[0][2]), "") if rank1 else ""
    joined = [t for _, t, pid in rank1 if pid == joiner] if joiner else []
    start = log_time(log, r"^rank \d+: recovered into generation", near, pid=joiner) if joiner else None
    if joined and start is not None:
        marks = [start] + joined
        intervals = [b - a for a, b in zip(marks, marks[1:])]
        result.first_ratio = intervals[0] / steady
        settled = next((i for i in range(len(intervals) - WARM_RUN + 1)
                        if statistics.median(intervals[i:i + WARM_RUN]) <= WARM_FACTOR * steady), -1)
        if settled >= 0:
            result.warm_steps = settled
            result.warm_seconds = marks[settled] - start
        elif not problems:
            notes.append(f"the joiner's steps never got within {WARM_FACTOR} x steady (median of {WARM_RUN})")
    else:
        notes.append("no completed step of the joiner found")
    refill = log_time(log, r"^standby 1 warm", near)
    if refill is not None and replaced_at is not None:
        result.extra["refill_warm"] = refill - replaced_at
    if end.left:
        notes.append(f"{len(end.left)} processes would not die")
    result.note = "; ".join(problems + notes)
    return result


# -- report -----------------------------------------------------------------------------------


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def int_spread(values: list[int]) -> str:
    values = [v for v in values if v >= 0]
    if not values:
        return "-"
    return " / ".join(str(v) for v in (min(values), int(statistics.median(values)), max(values)))


def print_notes(notes: list[str]) -> None:
    """The report's closing "Notes:" list (nothing when there are none)."""
    if notes:
        print()
        print("Notes:")
        for note in notes:
            print(f"* {note}")


def machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    import torch

    mem = psutil.virtual_memory().total / 2**30
    return (f"{os.cpu_count()} CPU cores ({model}), {mem:.0f} GiB, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs per case (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 run each, a smaller model, 2 and 4 workers")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=35)
    parser.add_argument("--fail-step", type=int, default=15, help="rank 1 dies at the start of this step (0-based)")
    parser.add_argument("--ckpt-every", type=int, default=10, help="torchrun script's checkpoint interval")
    parser.add_argument("--scale", default="2,4,8", help="world sizes for the scaling runs")
    parser.add_argument("--scale-steps", type=int, default=50)
    parser.add_argument("--scale-fail-step", type=int, default=40)
    parser.add_argument("--scale-step-time", type=float, default=0.1, help="pacing of the tiny model's steps")
    parser.add_argument("--timeout", type=float, default=180, help="seconds one launcher may run")
    parser.add_argument("--parts", default="failover,scale",
                        help="what to run: failover (measurements 1 and 3), scale (measurement 2)")
    parser.add_argument("--keep", action="store_true", help="keep the logs (printed folder)")
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
        args.width = 1024
        args.scale = "2,4"
        args.timeout = min(args.timeout, 120)
    sizes = [int(s) for s in args.scale.split(",") if s.strip()]

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix="tmrun-inplace-bench-"))
    started = time.monotonic()
    results: list[Result] = []
    model = ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    tiny = ["--width", "64", "--depth", "2", "--batch", "16", "--step-time", str(args.scale_step_time)]
    params = args.depth * (args.width * args.width + args.width) + args.width + 1
    print(f"machine: {machine()}", flush=True)
    print(f"logs: {root}" + ("" if args.keep else " (removed at the end; --keep keeps them)"), flush=True)

    def record(result: Result) -> None:
        results.append(result)
        others = result.extra.get("others", float("nan"))
        print(f"  [{time.monotonic() - started:4.0f}s, others {others:.2f} cores] {result.line()}", flush=True)

    try:
        for index in range(args.runs if "failover" in args.parts else 0):
            work = root / f"torchrun-{index}"
            work.mkdir()
            record(torchrun_run(args, work))
            for case, shadow in (("tmrun", None), ("tmrun cold", 0)):
                work = root / f"{case.replace(' ', '-')}-{index}"
                work.mkdir()
                record(tmrun_run(args, work, case, 2, model, args.fail_step, args.steps, shadow))
        for index in range(args.runs if "scale" in args.parts else 0):
            for nproc in sizes:
                work = root / f"scale{nproc}-{index}"
                work.mkdir()
                record(tmrun_run(args, work, f"scale {nproc}", nproc, tiny, args.scale_fail_step, args.scale_steps))
    finally:
        cleanup_all()

    def of(case: str) -> list[Result]:
        return [r for r in results if r.case == case]

    print()
    print("Command: " + " ".join(["python", "bench/inplace_failover.py", *sys.argv[1:]]))
    print(f"Machine: {machine()}; total {time.monotonic() - started:.0f} s")
    others = [r.extra.get("others", float("nan")) for r in results]
    print(f"Other processes on the machine (not this bench's) kept {spread(others)} CPU cores busy during a run "
          "(min / median / max over the runs).")
    if "failover" in args.parts:
        report_failover(args, of, params)
    if "scale" in args.parts:
        report_scale(args, of, sizes)
    print_notes([f"{r.case}: {r.note}" for r in results if r.note])
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def report_failover(args: argparse.Namespace, of: Callable[[str], list[Result]], params: int) -> None:
    print()
    print(f"### 1. One worker SIGKILLed: 2 CPU workers, {params / 1e6:.1f}M parameters, batch {args.batch}, "
          f"rank 1 killed at the start of step {args.fail_step} of {args.steps}")
    print()
    print("torchrun: `python -m torch.distributed.run --standalone` (c10d rendezvous), "
          "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (its reliable setting), `--max-restarts 3`, "
          f"examples/train_checkpoint.py (Adam, checkpoint every {args.ckpt_every} steps). "
          "tmrun: `--standby 1 --inject-failure rank=1,step=S`, examples/train_inplace.py (AdamW); "
          "cold: the same with `--shadow-steps 0`. Seconds, min / median / max.")
    print()
    print("| launcher | recovered | steady step s | downtime s | time lost incl. redone steps s | steps recomputed "
          "| tmrun recovery s |")
    print("|---|---|---|---|---|---|---|")
    for case in ("torchrun", "tmrun", "tmrun cold"):
        runs = of(case)
        done = [r for r in runs if r.ok]
        print(f"| {case} | {len(done)} of {len(runs)} | {spread([r.steady for r in done])} | "
              f"{spread([r.downtime for r in done])} | {spread([r.lost for r in done])} | "
              f"{int_spread([r.recomputed for r in done])} | {spread([r.recovery for r in done])} |")
    print()
    print("### 3. The joiner (rank 1's new process) after the same failure: warm standby vs cold joiner")
    print()
    print(f"First step: from the joiner's \"recovered\" line to its first completed step, in steady steps. "
          f"Warm-up: the joiner's steps before the first step from which the median of {WARM_RUN} steps is within "
          f"{WARM_FACTOR} x steady, and seconds from its recovery to the start of that step. New standby warm: "
          "when the standby that the pool starts at the promotion reported warm.")
    print()
    print("| joiner | runs in place | first step / steady | warm-up steps | warm-up s "
          "| new standby warm, s after the failure |")
    print("|---|---|---|---|---|---|")
    for case, label in (("tmrun", "warm (2 shadow steps, default)"), ("tmrun cold", "cold (`--shadow-steps 0`)")):
        runs = of(case)
        seen = [r for r in runs if r.first_ratio == r.first_ratio]  # a failed run may still have a first step
        ok = len([r for r in runs if r.ok])
        print(f"| {label} | {ok} of {len(runs)} | {spread([r.first_ratio for r in seen])} | "
              f"{int_spread([r.warm_steps for r in seen])} | {spread([r.warm_seconds for r in seen])} | "
              f"{spread([r.extra.get('refill_warm', float('nan')) for r in seen], '{:.1f}')} |")
    print()


def report_scale(args: argparse.Namespace, of: Callable[[str], list[Result]], sizes: list[int]) -> None:
    print()
    print(f"### 2. tmrun downtime against world size: tiny model (2 x Linear(64)), step paced by "
          f"--step-time {args.scale_step_time}, rank 1 killed at step {args.scale_fail_step} of {args.scale_steps}")
    print()
    print("| workers | recovered | steady step s | downtime s | time lost s | steps recomputed | tmrun recovery s |")
    print("|---|---|---|---|---|---|---|")
    for nproc in sizes:
        runs = of(f"scale {nproc}")
        done = [r for r in runs if r.ok]
        print(f"| {nproc} | {len(done)} of {len(runs)} | {spread([r.steady for r in done], '{:.3f}')} | "
              f"{spread([r.downtime for r in done])} | {spread([r.lost for r in done])} | "
              f"{int_spread([r.recomputed for r in done])} | {spread([r.recovery for r in done])} |")


if __name__ == "__main__":
    main()
