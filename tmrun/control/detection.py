"""Detection beyond process exit, in the agent: hung ranks, stragglers, unhealthy GPUs.

Inputs are cheap: every worker keeps a progress record in a file on the node
(:mod:`tmrun.protocol.progress`: its last completed step, that step's wall time and its own work
outside collectives, whether a collective is outstanding and since when); the agent reads them
at most every ``read_interval`` seconds and publishes them per node in the store
(:class:`~tmrun.protocol.messages.NodeProgress`, at most every ``publish_interval`` seconds).

* **Hang** (``hang_timeout`` > 0): no rank completed a step for ``hang_timeout`` seconds
  (measured by the agent, from the last step it saw completed by the current processes; the clock
  starts once every rank completed a step, and restarts after every change). Data parallel ranks
  wait for each other, so every rank stalls together; the one to blame is a stopped process
  (``/proc`` state T), else the ranks *not* inside a collective, and outside any for
  ``hang_timeout``, while others have waited inside one as long (stuck in their own compute; one
  that just left a collective noticed a lost peer elsewhere: no verdict yet), else the ranks
  behind the others' step.
  A rank stalled while others complete later steps hangs; one stalled at the step the others were
  only seen completing later waits for the group's view. It is fenced (SIGKILL) and replaced like
  a failed rank. When every rank waits inside a collective at the same step, nothing tells which
  one hangs: that is logged once per stall and left to the communicator's timeout.
* **Straggler** (``straggler_factor`` > 1): a rank whose own work per step (``busy_seconds``)
  exceeds ``straggler_factor`` x the median of the other ranks' (and that median by at least
  ``straggler_min_seconds``) for ``straggler_steps`` consecutive steps is migrated to a standby
  (a planned migration: no step lost), once per process.
* **GPU health** (:mod:`tmrun.control.gpu_health`): a rank whose GPU turns unhealthy is migrated.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from tmrun.control.gpu_health import GpuHealth, load_nvml
from tmrun.protocol import keys, progress
from tmrun.protocol import messages as proto


@dataclass(frozen=True)
class DetectionSettings:
    progress_dir: str = ""  # "" : no progress records, no detection
    hang_timeout: float = 0.0  # 0: off
    straggler_factor: float = 0.0  # 0: off
    straggler_steps: int = 5
    straggler_min_seconds: float = 0.05
    gpu_health: bool = True  # when NVML starts (or TMRUN_FAKE_NVML)
    read_interval: float = 0.2
    publish_interval: float = 1.0


@dataclass
class Findings:
    hung: list[tuple[int, str]] = field(default_factory=list)  # rank, why: fence and replace
    migrate: list[tuple[int, str, str]] = field(default_factory=list)  # rank, event kind, why: migrate
    notes: list[str] = field(default_factory=list)  # log lines


def process_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, a debugger): state T or t in /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


@dataclass
class _Seen:
    pid: int
    step: int
    changed: float  # monotonic time the agent saw the step change (or first saw this process)
    slow: int = 0  # consecutive straggling steps
    flagged: bool = False  # a straggler migration was asked for this process


class HangDetector:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._noted_at = -1.0

    def check(self, now: float, seen: dict[int, _Seen], records: dict[int, progress.ProgressRecord],
              stopped: dict[int, bool], wall_now: float) -> tuple[list[tuple[int, str]], list[str]]:
        if self.timeout <= 0 or not seen or any(s.step < 0 for s in seen.values()):
            return [], []  # the clock starts once every rank completed a step (start-up may be long)
        stalled = {r: now - s.changed for r, s in seen.items() if now - s.changed > self.timeout}
        if not stalled:
            self._noted_at = -1.0
            return [], []
        if len(stalled) < len(seen):
            # Others progress past a stalled rank's step: that one hangs. Others merely seen later at
            # the same step (the agent reads every read_interval, a loaded machine skews them) are
            # not progress: they stall too within that skew, and the whole group's view decides.
            ahead = max(s.step for r, s in seen.items() if r not in stalled)
            return [(r, f"no step completed for {t:.1f}s while the other ranks progress")
                    for r, t in sorted(stalled.items()) if seen[r].step < ahead], []
        quiet = min(stalled.values())
        blamed = [(r, f"process stopped, no step completed for {quiet:.1f}s") for r in sorted(seen) if stopped.get(r)]
        if blamed:
            return blamed, []
        waiting = {r: wall_now - rec.comm_since for r, rec in records.items() if rec.comm_since > 0}
        outside = [r for r in sorted(seen) if r not in waiting]
        if outside and any(t > self.timeout for t in waiting.values()):
            # Only a rank outside collectives for hang_timeout is stuck in its own compute. One
            # that left a collective within it (its record changed since) was in one with the
            # others: a peer elsewhere was lost and this rank noticed first, so a change is
            # starting (CI: a node's hung rank fenced, a survivor on this node then blamed too).
            stuck = [r for r in outside if r not in records or wall_now - records[r].updated > self.timeout]
            return [(r, f"no step completed for {quiet:.1f}s, outside any collective while rank(s) "
                        f"{', '.join(map(str, sorted(waiting)))} wait in one") for r in stuck], []
        steps = {r: s.step for r, s in seen.items()}
        behind = [r for r in sorted(steps) if steps[r] < max(steps.values())]
        if behind:
            return [(r, f"no step completed for {quiet:.1f}s, behind the others (step {steps[r]})") for r in behind], []
        if outside and waiting:
            return [], []  # the ranks inside a collective have not waited hang_timeout yet: a verdict soon
        if self._noted_at < 0:
            self._noted_at = now
            where = ("every rank inside a collective" if not outside
                     else "no rank inside a collective (a long computation?)")
            return [], [f"no step completed for {quiet:.1f}s on any rank, {where}: cannot tell which rank "
                        "hangs" + (" (the communicator's timeout decides)" if not outside else "")]
        return [], []


class StragglerDetector:
    def __init__(self, factor: float, steps: int, min_seconds: float) -> None:
        self.factor = factor
        self.steps = max(1, steps)
        self.min_seconds = min_seconds

    def on_step(self, rank: int, seen: dict[int, _Seen], records: dict[int, progress.ProgressRecord]) -> str:
        """Rank ``rank`` completed a step: the reason to migrate it, or ''."""
        if self.factor <= 1:
            return ""
        me = seen[rank]
        others = [rec.busy_seconds for r, rec in records.items() if r != rank and rec.step >= 0]
        record = records[rank]
        if me.flagged or not others or record.role not in ("active", ""):
            return ""
        median = statistics.median(others)
        if record.busy_seconds > self.factor * median and record.busy_seconds - median >= self.min_seconds:
            me.slow += 1
        else:
            me.slow = 0
        if me.slow < self.steps:
            return ""
        me.flagged = True
        return (f"straggler: its own work took {record.busy_seconds:.3f}s per step, over {self.factor:g}x the "
                f"others' median {median:.3f}s for {me.slow} consecutive steps (up to step {record.step})")

    def retry_later(self, seen: _Seen) -> None:
        seen.flagged = False
        seen.slow = 0


class Detection:
    """One node's detection (see the module's doc); the controller calls :meth:`poll`."""

    def __init__(self, settings: DetectionSettings, job_store: Any, node: int, local_ranks: dict[int, int],
                 nvml: Any = "auto", epoch: int = -1) -> None:
        self.settings = settings
        self._epoch = epoch
        self._job = job_store
        self._node = node
        self._local = dict(local_ranks)  # rank -> local rank (its GPU: local rank % GPUs)
        self._seen: dict[int, _Seen] = {}
        self._records: dict[int, progress.ProgressRecord] = {}
        self._next_read = 0.0
        self._next_publish = 0.0
        self.hang = HangDetector(settings.hang_timeout)
        self.straggler = StragglerDetector(settings.straggler_factor, settings.straggler_steps,
                                           settings.straggler_min_seconds)
        self.gpus: GpuHealth | None = None
        if settings.gpu_health:
            self.gpus = GpuHealth(load_nvml() if nvml == "auto" else nvml)
        self._bad_gpus: dict[int, str] = {}

    def moved(self, rank: int, local_rank: int) -> None:
        """``rank`` runs on local rank ``local_rank``'s device from now on (a promoted standby
        keeps its own GPU): a fault on that GPU concerns the rank, one on its old GPU no longer."""
        self._local[rank] = local_rank
        self._bad_gpus.pop(rank, None)

    def local_rank(self, rank: int) -> int | None:
        """The local rank (device) ``rank`` runs on, as far as this detection knows."""
        return self._local.get(rank)

    def poll(self, pids: dict[int, int], busy: bool, now: float | None = None) -> Findings:
        """``pids``: rank -> pid of its current process (running ones); ``busy``: a change is under
        way (no hang or straggler verdict then: everyone waits for it)."""
        now = time.monotonic() if now is None else now
        findings = Findings()
        if not self.settings.progress_dir or now < self._next_read:
            return findings
        self._next_read = now + self.settings.read_interval
        stepped = self._read(pids, now)
        if busy:
            for seen in self._seen.values():
                seen.changed = now  # the change restarts every clock
        else:
            for rank in stepped:
                why = self.straggler.on_step(rank, self._seen, self._records)
                if why:
                    findings.migrate.append((rank, "straggler", why))
            stopped = {r: process_stopped(pid) for r, pid in pids.items() if r in self._seen}
            findings.hung, findings.notes = self.hang.check(now, self._seen, self._records, stopped, time.time())
        if self.gpus is not None and self.gpus.enabled:
            for problem in self.gpus.poll(now):
                ranks = [r for r, local in sorted(self._local.items()) if local % self.gpus.count == problem.index]
                for rank in ranks:
                    self._bad_gpus[rank] = f"GPU {problem.index} unhealthy: {problem.what}"
        for rank, why in list(self._bad_gpus.items()):
            if not busy and rank in pids:
                findings.migrate.append((rank, "gpu-unhealthy", why))
                del self._bad_gpus[rank]
        if now >= self._next_publish:
            self._next_publish = now + self.settings.publish_interval
            self._publish(pids)
        return findings

    def publish_progress(self, pids: dict[int, int], now: float | None = None) -> None:
        """Only read and publish the records (at most every ``publish_interval``), judging
        nothing: a job without standbys, whose restarts the leader measures from them."""
        now = time.monotonic() if now is None else now
        if not self.settings.progress_dir or now < self._next_publish:
            return
        self._next_publish = now + self.settings.publish_interval
        self._read(pids, now)
        self._publish(pids)

    def publish_last(self, pids: dict[int, int]) -> None:
        """The workers finished: read and publish their records once more, whatever the interval
        (the leader's count of a group restart reads them as the job closes: a record a second
        old may predate the step at which the group got back)."""
        if not self.settings.progress_dir:
            return
        self._read(pids, time.monotonic())
        self._publish(pids)

    def retry(self, rank: int) -> None:
        """A migration asked for ``rank`` was refused (no warm standby yet): ask again later."""
        seen = self._seen.get(rank)
        if seen is not None:
            self.straggler.retry_later(seen)

    def gpu_retry(self, rank: int, why: str) -> None:
        self._bad_gpus[rank] = why

    def _read(self, pids: dict[int, int], now: float) -> list[int]:
        stepped = []
        for rank, pid in pids.items():
            record = progress.read(progress.path_for(self.settings.progress_dir, rank))
            seen = self._seen.get(rank)
            if seen is None or seen.pid != pid:
                seen = self._seen[rank] = _Seen(pid, -1, now)
                self._records.pop(rank, None)
            if record is None or record.pid != pid:
                continue
            self._records[rank] = record
            if record.step != seen.step:
                seen.step, seen.changed = record.step, now
                if record.step >= 0:
                    stepped.append(rank)
        for rank in set(self._seen) - set(pids):
            del self._seen[rank]
            self._records.pop(rank, None)
        return stepped

    def _publish(self, pids: dict[int, int]) -> None:
        self._set(keys.node_progress(self._node), self._node_progress(self._records, set(pids)))

    def _node_progress(self, records: dict[int, progress.ProgressRecord], ranks: set[int]) -> proto.NodeProgress:
        return proto.NodeProgress(self._node, time.time(), tuple(
            proto.RankProgress(rank=r, step=rec.step, step_seconds=rec.step_seconds, busy_seconds=rec.busy_seconds,
                               time=rec.step_end, pid=rec.pid, role=rec.role, resumed=rec.resumed)
            for r, rec in sorted(records.items()) if r in ranks), epoch=self._epoch)

    def _set(self, key: str, value: proto.NodeProgress) -> None:
        try:
            self._job.set(key, value.encode())
        except Exception:  # noqa: BLE001 - the store is going away with the job
            pass

    def publish_final(self) -> None:
        """This epoch's workers stopped: their last records (each rank's last process that wrote
        one), once, for the leader's count of a group restart (keys.final_progress)."""
        if not self.settings.progress_dir or self._epoch < 0:
            return
        records = {}
        for rank in self._local:
            record = progress.read(progress.path_for(self.settings.progress_dir, rank))
            if record is not None and record.pid:
                records[rank] = record
        self._set(keys.final_progress(self._epoch, self._node), self._node_progress(records, set(records)))

    def close(self) -> None:
        if self.gpus is not None:
            self.gpus.close()

