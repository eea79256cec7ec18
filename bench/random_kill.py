"""Worker kills at random moments of a step: tmrun in-place replacement vs torchrun checkpoint restart.

Per setting (model size x launcher) one job absorbs ``--kills`` SIGKILLs of rank 1, sent from
outside. 2 CPU workers, batch 32, 6 x Linear(W) (25M: W=2048, 100M: W=4096).

* torchrun: ``python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts N+2``
  with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its reliable setting), examples/train_checkpoint.py
  (DDP + Adam, checkpoint every ``--ckpt-every`` steps); each kill restarts the worker group
  from the last checkpoint.
* tmrun: ``tmrun --standalone --nproc-per-node 2 --standby 1 --max-restarts N+2`` running examples/train_inplace.py
  (DDP + AdamW over the worker API); each kill is absorbed in place by the warm standby.

The kill: once the job is ready (tmrun: the previous recovery's ``recovered`` event is in the
job's events file and the replacement standby said it is warm; torchrun: rank 1 logged a step
from a new process) and rank 0 then completed ``--settle`` more steps, the bench waits for rank 1's
next completed step, sleeps U(0, steady step) (``random.Random(--seed)``, the same draws for
both launchers), and SIGKILLs rank 1's process, by the PID its step log names. t_kill =
``time.time()`` right after the kill.

Per kill, from rank 0's step log (one line per completed step, unix time; under torchrun rank 0
restarts too and its new process's lines count; under tmrun a step that the failure aborted
is logged by the survivor and logged again when redone: the aborted line is not a completion):

* steady: median interval of the 8 steps before the kill;
* t_last / t_next: the completions around the stall: the largest gap between consecutive
  completions that starts at the last completion before the kill or within one steady step
  after it (a step whose work was done before the kill can be logged just after it);
* (a) downtime = (t_next - t_last) - steady (the issue's definition);
* (b) kill -> next step = (t_next - t_kill) - steady: the stall caused by the kill;
* (c) work lost in flight = t_kill - t_last (a = b + c; negative when rank 0's last step
  before the stall completed just after the kill);
* (e) recovery stall = (t_next - max(t_kill, t_last)) - steady: (b) without the work of the
  last step that completed after the kill (it was not lost), (a) without the work lost in
  flight: the time the job stood still beyond one ordinary step, what the recovery itself
  cost; (e) = min(a, b);
* (d) committed time lost = (when rank 0 again completes the step that was in flight) -
  (t_last + steady): with torchrun this includes the steps recomputed since the checkpoint;
* steps recomputed: steps completed before the kill (up to t_last) that rank 0 completed again
  (the step in flight is not counted: it is (c));
* (f) the next 2 steps = (the second completion after t_next - t_next) - 2 steady: what the
  recovery still costs after its first step (e.g. DDP rebuilding its buckets after a reset of
  its reducers, in the second step); not part of (a)-(e).

tmrun's recovery phases (detect, plan, connect, transfer, first_step, recover, total) come from
the ``recovered`` events of the job's events file (docs/events.md). Every figure is reported
as min / median / p90 / max (p90: linear interpolation between closest ranks).

Processes are tagged and cleaned up as in bench/inplace_failover.py (whose helpers this bench
imports), also on Ctrl-C; every wait is bounded (``--kill-timeout`` per kill).

    python bench/random_kill.py                      # 10 kills per setting, 25M and 100M
    python bench/random_kill.py --sizes 25M --kills 3
    python bench/random_kill.py --quick              # smoke run: 6.3M parameters, 3 kills
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers of bench/inplace_failover.py
from inplace_failover import (
    CHECKPOINT_SCRIPT,
    INPLACE_BROKEN,
    INPLACE_SCRIPT,
    LIVE_JOBS,
    STEADY_WINDOW,
    TAG_VAR,
    Job,
    base_env,
    busy_cpu,
    cleanup_all,
    machine,
    print_notes,
    read_steps,
    steady_step,
)

SIZES = {"6M": (1024, 6), "25M": (2048, 6), "100M": (4096, 6)}  # name: (width, depth)
PHASES = ("kill_to_seen", "detect", "plan", "connect", "transfer", "first_step", "recover", "total")
NAN = float("nan")
POLL = 0.05  # seconds between checks while waiting for a state
FAST_POLL = 0.002  # while waiting for rank 1's next step (the kill's reference point)


# -- pure arithmetic (unit tested) ------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of the finite values, linear interpolation between closest
    ranks (numpy's default); NaN when there are none."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return NAN
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(values: list[float]) -> tuple[float, float, float, float]:
    """(min, median, p90, max) of the finite values."""
    return percentile(values, 0), percentile(values, 50), percentile(values, 90), percentile(values, 100)


def completions(rows: list[tuple[int, float, str]], redone_aborted: bool) -> list[tuple[int, float]]:
    """(step, time) of rank 0's completed steps, in time order. With ``redone_aborted`` (tmrun's
    example: the third column is the process id) a line is dropped when the same process logs
    the same step again later: the first was a step the failure aborted, redone."""
    if redone_aborted:
        seen: set[tuple[int, str]] = set()
        kept = []
        for step, t, who in reversed(rows):
            if (step, who) not in seen:
                seen.add((step, who))
                kept.append((step, t))
        out = kept[::-1]
    else:
        out = [(step, t) for step, t, _ in rows]
    return sorted(out, key=lambda row: row[1])


@dataclass
class KillMetrics:
    steady: float
    downtime: float  # (a) (t_next - t_last) - steady
    stall: float  # (b) (t_next - t_kill) - steady
    lost_work: float  # (c) t_kill - t_last
    committed: float  # (d) in-flight step completed again - (t_last + steady); NaN: not seen
    recomputed: int  # completed steps (up to t_last) completed again; -1: not known
    in_flight: int  # the step number that was in flight
    t_last: float
    t_next: float
    after: float = NAN  # (f) the 2 completions after t_next: their time beyond 2 steady steps; NaN: not seen


def kill_metrics(rows: list[tuple[int, float, str]], t_kill: float, t_end: float = math.inf,
                 redone_aborted: bool = False) -> KillMetrics | None:
    """What one kill at ``t_kill`` cost, from rank 0's step log ``rows`` (read_steps); lines
    after ``t_end`` (the next kill) are not looked at. None: too few steps around the kill."""
    comps = completions(rows, redone_aborted)
    times = [t for _, t in comps]
    last = bisect.bisect_right(times, t_kill) - 1
    if last < 1:
        return None
    steady = steady_step(times[: last + 1])
    best: tuple[float, int] | None = None
    for j in range(last, len(comps) - 1):
        if times[j] > t_kill + steady or times[j + 1] > t_end:
            break
        gap = times[j + 1] - times[j]
        if best is None or gap > best[0]:
            best = (gap, j)
    if best is None:
        return None
    j = best[1]
    t_last, t_next, last_step = times[j], times[j + 1], comps[j][0]
    in_flight = last_step + 1
    again = next((t for step, t in comps[j + 1:] if step == in_flight and t <= t_end), None)
    committed, recomputed = NAN, -1
    if again is not None:
        committed = again - t_last - steady
        recomputed = len({step for step, t in comps[j + 1:] if step <= last_step and t <= again})
    after = times[j + 3] - t_next - 2 * steady if j + 3 < len(times) and times[j + 3] <= t_end else NAN
    return KillMetrics(steady, t_next - t_last - steady, t_next - t_kill - steady, t_kill - t_last, committed,
                       recomputed, in_flight, t_last, t_next, after)


def recovered_phases(events: list[dict[str, object]], gens: int,
                     kill_times: list[float] | None = None) -> list[dict[str, float]]:
    """The phases of the ``recovered`` events of generations 1..gens (one per in-place
    recovery), NaN where not measured; ``kill_to_seen``: from the kill of generation g's
    (``kill_times[g - 1]``) to the controller seeing the failure (``marks.seen``): the hop the
    events cannot see (the process's death, its pidfd, the agent waking)."""
    out = []
    for event in events:
        if event.get("kind") != "recovered" or not isinstance(event.get("gen"), int):
            continue
        if not 1 <= int(event["gen"]) <= gens:  # type: ignore[call-overload]
            continue
        phases = dict(event.get("phases") or {})  # type: ignore[call-overload]
        marks = event.get("marks") or {}
        seen = marks.get("seen") if isinstance(marks, dict) else None
        gen = int(event["gen"])  # type: ignore[call-overload]
        if kill_times is not None and gen <= len(kill_times) and isinstance(seen, (int, float)):
            phases["kill_to_seen"] = float(seen) - kill_times[gen - 1]
        out.append({p: float(phases[p]) if isinstance(phases.get(p), (int, float)) else NAN for p in PHASES})
    return out


# -- the jobs ---------------------------------------------------------------------------------


def read_events(path: Path | None) -> list[dict[str, object]]:
    events = []
    if path is not None and path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a torn last line
    return events


def last_line(path: Path) -> list[str]:
    """The last complete line of a step log, split (empty: none yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return []
    lines = tail.split("\n")[:-1]  # what follows the last newline is still being written
    return lines[-1].split() if lines else []


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class Abort(Exception):
    """The setting cannot go on (the job died, a wait ran out, in-place recovery broke)."""


@dataclass
class Kill:
    t_kill: float
    pid: int
    point: float  # where in rank 1's step it came: (t_kill - rank 1's last completion) / steady
    metrics: KillMetrics | None = None


@dataclass
class Setting:
    launcher: str
    size: str
    params: int
    kills: list[Kill] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    others: float = NAN  # CPU cores other processes kept busy meanwhile
    seconds: float = NAN


class Driver:
    """One job and its kills."""

    def __init__(self, args: argparse.Namespace, work: Path, launcher: str, size: str, started: float) -> None:
        self.args = args
        self.work = work
        self.launcher = launcher
        self.size = size
        self.width, self.depth = SIZES[size]
        self.tmrun = launcher == "tmrun"
        self.log = work / "launcher.log"
        self.rank0 = work / "steps-0.log"
        self.rank1 = work / "steps-1.log"
        self.pid_column = 2 if self.tmrun else 3  # train_inplace: step time pid; train_checkpoint: step time loss pid
        self.started = started
        self.job: Job | None = None
        self.events_path: Path | None = None
        self.rng = random.Random(args.seed)  # the same draws for both launchers

    def command(self) -> tuple[list[str], dict[str, str]]:
        a = self.args
        steps = "1000000"  # the bench stops the job
        if self.tmrun:
            cmd = [
                sys.executable, "-m", "tmrun.cli.main", "--standalone", "--nproc-per-node", "2", "--standby", "1",
                "--max-restarts", str(a.kills + 2),  # each in-place replacement counts
                str(INPLACE_SCRIPT), "--width", str(self.width), "--depth", str(self.depth), "--batch", str(a.batch),
                "--steps", steps, "--step-log", str(self.work / "steps-{rank}.log"),
            ]  # fmt: skip
            return cmd, dict(base_env(), TMRUN_STATE_DIR=str(self.work / "state"))
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(a.kills + 2), str(CHECKPOINT_SCRIPT), "--ckpt-dir", str(self.work),
            "--steps", steps, "--ckpt-every", str(a.ckpt_every), "--width", str(self.width),
            "--layers", str(self.depth), "--batch", str(a.batch), "--step-log", str(self.work / "steps-{rank}.log"),
        ]  # fmt: skip
        return cmd, dict(base_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    def say(self, text: str) -> None:
        print(f"  [{time.monotonic() - self.started:5.0f}s] {self.launcher} {self.size}: {text}", flush=True)

    # -- waits ------------------------------------------------------------------------------

    def check_alive(self) -> None:
        assert self.job is not None
        code = self.job.proc.poll()
        if code is not None:
            raise Abort(f"the launcher exited (code {code})")
        if self.tmrun:
            found = re.search(f"^.*(?:{INPLACE_BROKEN}).*$", self.log.read_text(errors="replace"), re.MULTILINE)
            if found:
                raise Abort(f"in-place recovery broke: {found.group(0).strip()}")

    def wait_for(self, what: str, ready: Callable[[], bool], deadline: float, poll: float = POLL) -> None:
        checked = 0.0
        while not ready():
            now = time.monotonic()
            if now > deadline:
                raise Abort(f"waited too long for {what}")
            if now - checked > 0.5:
                self.check_alive()
                checked = now
            time.sleep(poll)

    def events(self) -> list[dict[str, object]]:
        if self.events_path is None:
            found = re.search(r"the job's events go to (\S+)", self.log.read_text(errors="replace"))
            if found:
                self.events_path = Path(found.group(1))
        return read_events(self.events_path)

    def recovered(self, gen: int) -> bool:
        return any(e.get("kind") == "recovered" and e.get("gen") == gen for e in self.events())

    def standby_warm(self, index: int) -> bool:
        return re.search(rf"\] standby {index} warm after", self.log.read_text(errors="replace")) is not None

    def rank0_steps_after(self, since: float) -> int:
        return sum(1 for _, t in completions(read_steps(self.rank0), self.tmrun) if t > since)

    def previous_kill_done(self, kills: list[Kill]) -> bool:
        if not kills:
            return True
        m = kill_metrics(read_steps(self.rank0), kills[-1].t_kill, redone_aborted=self.tmrun)
        return m is not None and not math.isnan(m.committed)

    def ready(self, kills: list[Kill]) -> bool:
        """The job may take its next kill once settled: the previous recovery is complete and
        (tmrun) the pool's standby is warm again; (torchrun) rank 1 runs in a new process."""
        n = len(kills)
        if self.tmrun:
            if n and not self.recovered(n):
                return False
            if not self.standby_warm(n):  # standby 0 at the start, then one refill per recovery
                return False
        else:
            line = last_line(self.rank1)
            if len(line) <= self.pid_column or (kills and int(line[self.pid_column]) == kills[-1].pid):
                return False
        return self.previous_kill_done(kills)

    # -- the run ----------------------------------------------------------------------------

    def kill_once(self, kills: list[Kill]) -> Kill:
        assert self.job is not None
        deadline = time.monotonic() + self.args.kill_timeout
        self.wait_for("the job to be ready (recovered, standby warm)", lambda: self.ready(kills), deadline)
        ready_at = time.time()
        self.wait_for(f"{self.args.settle} steps of rank 0",
                      lambda: self.rank0_steps_after(ready_at) >= self.args.settle, deadline)
        size = log_size(self.rank1)
        self.wait_for("rank 1's next step", lambda: log_size(self.rank1) != size, deadline, poll=FAST_POLL)
        line = last_line(self.rank1)
        if len(line) <= self.pid_column:
            raise Abort(f"rank 1's step log has no pid: {line}")
        pid = int(line[self.pid_column])
        rank1 = [t for _, t, _ in read_steps(self.rank1)][-(STEADY_WINDOW + 1):]
        steady = steady_step(rank1)
        try:
            if psutil.Process(pid).environ().get(TAG_VAR) != self.job.tag:
                raise Abort(f"pid {pid} of rank 1's step log is not this job's")
        except psutil.Error as exc:
            raise Abort(f"rank 1's pid {pid} is gone before the kill: {exc!r}") from exc
        time.sleep(self.rng.uniform(0.0, steady))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError as exc:
            raise Abort(f"rank 1 (pid {pid}) was gone at the kill") from exc
        t_kill = time.time()
        kill = Kill(t_kill, pid, (t_kill - float(line[1])) / steady)
        self.say(f"kill {len(kills) + 1}: rank 1 (pid {pid}) SIGKILLed {kill.point:.2f} steady steps after its "
                 f"last completed step (steady {steady:.3f}s)")
        return kill

    def run(self) -> Setting:
        args = self.args
        width, depth = self.width, self.depth
        params = depth * (width * width + width) + (width + 1 if self.tmrun else 0)
        result = Setting(self.launcher, self.size, params)
        cmd, env = self.command()
        busy0, mine0 = busy_cpu()
        wall0 = time.monotonic()
        self.job = Job(cmd, self.log, env)
        LIVE_JOBS.append(self.job)
        kills: list[Kill] = []
        try:
            try:
                while len(kills) < args.kills:
                    kills.append(self.kill_once(kills))
                # the last recovery: complete, and a few steps after it
                deadline = time.monotonic() + args.kill_timeout
                if self.tmrun:
                    self.wait_for("the last recovery's event", lambda: self.recovered(len(kills)), deadline)
                self.wait_for("the step in flight at the last kill", lambda: self.previous_kill_done(kills), deadline)
                done_at = time.time()
                self.wait_for("3 steps after the last recovery", lambda: self.rank0_steps_after(done_at) >= 3, deadline)
            except Abort as exc:
                result.notes.append(f"stopped after {len(kills)} kills: {exc}")
                self.say(f"STOPPED: {exc}")
        finally:
            left = self.job.cleanup()
            LIVE_JOBS.remove(self.job)
            if left:
                result.notes.append(f"{len(left)} processes would not die: {left}")
        busy1, mine1 = busy_cpu()
        result.seconds = time.monotonic() - wall0
        result.others = max(0.0, (busy1 - busy0) - (mine1 - mine0)) / max(1e-9, result.seconds)
        rows = read_steps(self.rank0)
        for index, kill in enumerate(kills):
            t_end = kills[index + 1].t_kill if index + 1 < len(kills) else math.inf
            kill.metrics = kill_metrics(rows, kill.t_kill, t_end, redone_aborted=self.tmrun)
            if kill.metrics is None:
                result.notes.append(f"kill {index + 1}: too few steps of rank 0 around it")
        result.kills = kills
        if self.tmrun:
            result.phases = recovered_phases(self.events(), len(kills), [kill.t_kill for kill in kills])
            if len(result.phases) != len(kills):
                result.notes.append(f"{len(result.phases)} recovered events for {len(kills)} kills")
            if len({who for _, _, who in rows}) > 1:
                result.notes.append("rank 0 changed process")
            if re.search(r"rank \d+ failed; waiting up to", self.log.read_text(errors="replace")):
                result.notes.append("a failure waited for a standby")
        elif kills and "resumed from step" not in self.log.read_text(errors="replace"):
            result.notes.append("no restart from a checkpoint seen")
        for index, kill in enumerate(kills):
            m = kill.metrics
            if m is not None:
                self.say(f"kill {index + 1}: downtime {m.downtime:.3f}s, kill -> next {m.stall:.3f}s, "
                         f"in flight {m.lost_work:.3f}s, committed {m.committed:.3f}s, recomputed {m.recomputed}")
        return result


# -- report -----------------------------------------------------------------------------------


def cells(values: list[float], fmt: str = "{:.3f}") -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "0 | - | - | - | -"
    return f"{len(finite)} | " + " | ".join(fmt.format(v) for v in summary(finite))


def recovery_stall(m: KillMetrics) -> float:
    """(e): the stall after the kill, counting neither the work lost in flight nor the work of a
    step that completed after the kill."""
    return min(m.downtime, m.stall)


METRICS: list[tuple[str, Callable[[KillMetrics], float], str]] = [
    ("steady step, s", lambda m: m.steady, "{:.3f}"),
    ("(a) downtime: (t_next - t_last) - steady, s", lambda m: m.downtime, "{:.3f}"),
    ("(b) kill -> next step: (t_next - t_kill) - steady, s", lambda m: m.stall, "{:.3f}"),
    ("(c) work lost in flight: t_kill - t_last, s", lambda m: m.lost_work, "{:.3f}"),
    ("(e) recovery stall: (t_next - max(t_kill, t_last)) - steady, s", lambda m: recovery_stall(m), "{:.3f}"),
    ("(d) committed time lost (incl. recomputed steps), s", lambda m: m.committed, "{:.3f}"),
    ("steps recomputed", lambda m: float(m.recomputed) if m.recomputed >= 0 else NAN, "{:.1f}"),
    ("(f) the next 2 steps beyond 2 steady ones, s", lambda m: m.after, "{:.3f}"),
]


def report(args: argparse.Namespace, settings: list[Setting], total: float) -> None:
    print()
    print("Command: " + " ".join(["python", "bench/random_kill.py", *sys.argv[1:]]))
    print(f"Machine: {machine()}; total {total:.0f} s")
    print()
    print("2 CPU workers (`OMP_NUM_THREADS=1`), batch 32; rank 1 SIGKILLed from outside "
          f"U(0, steady) after one of its completed steps (seed {args.seed}), once the job settled "
          f"({args.settle} steps of rank 0 after the previous recovery and, for tmrun, the replacement "
          "standby warm). torchrun: `python -m torch.distributed.run --standalone --nproc-per-node 2 "
          f"--max-restarts {args.kills + 2}`, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, "
          f"examples/train_checkpoint.py (Adam, checkpoint every {args.ckpt_every} steps). tmrun: "
          f"`--standalone --nproc-per-node 2 --standby 1 --max-restarts {args.kills + 2}`, examples/train_inplace.py (AdamW). "
          "Seconds; n = kills measured; p90 interpolated.")
    for size in dict.fromkeys(s.size for s in settings):
        here = [s for s in settings if s.size == size]
        width, depth = SIZES[size]
        print()
        print(f"### {size}: {depth} x Linear({width}), "
              + ", ".join(f"{s.launcher} {s.params / 1e6:.1f}M parameters" for s in here))
        print()
        for s in here:
            print(f"* {s.launcher}: {len(s.kills)} of {args.kills} kills, {s.seconds:.0f} s; other processes kept "
                  f"{s.others:.2f} CPU cores busy; kill points (steady steps after rank 1's completed step): "
                  f"{cells([k.point for k in s.kills], '{:.2f}').split(' | ', 1)[-1].replace(' | ', ' / ')} "
                  "(min / median / p90 / max)")
        print()
        print("| launcher | metric | n | min | median | p90 | max |")
        print("|---|---|---|---|---|---|---|")
        for s in here:
            measured = [k.metrics for k in s.kills if k.metrics is not None]
            for label, get, fmt in METRICS:
                print(f"| {s.launcher} | {label} | {cells([get(m) for m in measured], fmt)} |")
        tm = next((s for s in here if s.launcher == "tmrun"), None)
        tr = next((s for s in here if s.launcher == "torchrun"), None)
        if tm is not None and tr is not None:
            print()
            for label, get in (("(a) downtime", lambda m: m.downtime), ("(b) kill -> next step", lambda m: m.stall),
                               ("(e) recovery stall", recovery_stall)):
                tm_p90 = percentile([get(k.metrics) for k in tm.kills if k.metrics], 90)
                tr_median = percentile([get(k.metrics) for k in tr.kills if k.metrics], 50)
                ratio = f"{tr_median / tm_p90:.1f}" if tm_p90 > 0 and not math.isnan(tr_median) else "-"
                print(f"* {label}: torchrun median {tr_median:.3f} s / tmrun p90 {tm_p90:.3f} s = **{ratio}**")
        if tm is not None:
            print()
            print(f"tmrun recovery phases ({size}; the `recovered` events, docs/events.md), seconds:")
            print()
            print("| phase | n | min | median | p90 | max |")
            print("|---|---|---|---|---|---|")
            for phase in PHASES:
                print(f"| {phase} | {cells([p[phase] for p in tm.phases])} |")
    print_notes([f"{s.launcher} {s.size}: {note}" for s in settings for note in s.notes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10, help="kills per setting and launcher (default 10)")
    parser.add_argument("--sizes", default="25M,100M", help=f"model sizes, of {', '.join(SIZES)} (default 25M,100M)")
    parser.add_argument("--launchers", default="torchrun,tmrun", help="which launchers (default both)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 6M parameters, 3 kills")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ckpt-every", type=int, default=10, help="torchrun script's checkpoint interval")
    parser.add_argument("--settle", type=int, default=STEADY_WINDOW + 1,
                        help="steps rank 0 completes after the job is ready before the next kill (default 9)")
    parser.add_argument("--kill-timeout", type=float, default=600,
                        help="seconds one kill may take, from the previous one's end to the job ready again")
    parser.add_argument("--keep", action="store_true", help="keep the logs (printed folder)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.kills = "6M", 3
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    launchers = [s.strip() for s in args.launchers.split(",") if s.strip()]
    for size in sizes:
        if size not in SIZES:
            parser.error(f"unknown size {size!r}: one of {', '.join(SIZES)}")
    for launcher in launchers:
        if launcher not in ("torchrun", "tmrun"):
            parser.error(f"unknown launcher {launcher!r}")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix="tmrun-random-kill-"))
    started = time.monotonic()
    print(f"machine: {machine()}", flush=True)
    print(f"logs: {root}" + ("" if args.keep else " (removed at the end; --keep keeps them)"), flush=True)
    settings: list[Setting] = []
    try:
        for size in sizes:
            for launcher in launchers:
                work = root / f"{launcher}-{size}"
                work.mkdir()
                settings.append(Driver(args, work, launcher, size, started).run())
    finally:
        cleanup_all()
    report(args, settings, time.monotonic() - started)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
