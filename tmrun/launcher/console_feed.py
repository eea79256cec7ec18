"""What the live console shows, assembled from what the control plane already publishes.

The leading agent's :class:`~tmrun.console.live.LiveConsole` calls a :class:`ConsoleFeed` at a
bounded rate. It reads the job's status from the store on a connection of its own (the
membership, every node's processes, the events: :func:`tmrun.control.status.read_status`),
adds CPU and memory of the processes on this host (psutil), and turns it into a
:class:`~tmrun.console.live.ConsoleView`. Nothing here writes to the store or talks to a worker.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict
from typing import TYPE_CHECKING

import psutil
from torch.distributed import PrefixStore

from tmrun.console.live import ConsoleView, EventRow, MemberRow
from tmrun.control import metrics
from tmrun.control.events import read_new_events
from tmrun.control.status import JobStatus, read_status
from tmrun.protocol import keys
from tmrun.protocol.messages import ClosedNotice, Event, NodeProgress, ProtocolMessageError, RankProgress

if TYPE_CHECKING:
    from tmrun.rendezvous.handler import TmrunRendezvousHandler

class ConsoleFeed:
    def __init__(self, handler: TmrunRendezvousHandler) -> None:
        self._handler = handler
        self._store = PrefixStore(keys.job_prefix(handler.get_run_id()), handler.raw_store.clone())
        self._started = time.time()
        self._processes: dict[int, psutil.Process] = {}
        self._last_seen: tuple[int, float] | None = None  # rank 0's (step, completion time) at the last look
        self._intervals: deque[float] = deque(maxlen=64)  # seconds per step of rank 0, one per look
        self._events: list[Event] = []  # every event so far, read once each
        self._next_event = 0

    def _progress(self, status: JobStatus) -> dict[int, RankProgress]:
        """rank -> its last published progress (agents publish it about once a second)."""
        found: dict[int, RankProgress] = {}
        for group_rank in range(len(status.membership.active)):
            key = keys.node_progress(group_rank)
            try:
                if self._store.check([key]):
                    found.update((r.rank, r) for r in NodeProgress.decode(key, self._store.get(key)).ranks)
            except ProtocolMessageError:
                continue  # a damaged record: show the rest
        return found

    def _record_history(self, progress: dict[int, RankProgress]) -> None:
        """One interval per look at which rank 0 advanced: (time between its last completed
        steps) / (steps between them); a recovery makes one long interval."""
        first = progress.get(0)
        if first is None or first.step < 0:
            return
        if self._last_seen is not None and first.step > self._last_seen[0]:
            step, when = self._last_seen
            self._intervals.append(max(first.time - when, 0.0) / (first.step - step))
        if self._last_seen is None or first.step != self._last_seen[0]:
            self._last_seen = (first.step, first.time)

    def _usage(self, pid: int | None) -> tuple[float | None, float | None]:
        """(cpu %, resident MiB) of a process on this host, or Nones."""
        if pid is None:
            return None, None
        try:
            process = self._processes.get(pid)
            if process is None:
                process = self._processes[pid] = psutil.Process(pid)
                process.cpu_percent(None)  # the first reading only starts the interval
            with process.oneshot():
                return process.cpu_percent(None), process.memory_info().rss / (1 << 20)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            self._processes.pop(pid, None)
            return None, None

    def _members(self, status: JobStatus, progress: dict[int, RankProgress], now: float) -> list[MemberRow]:
        rows = []
        for node in status.nodes:
            for worker in node.workers:
                pid = worker.get("pid")
                cpu, rss = self._usage(pid if isinstance(pid, int) else None)
                rank = worker.get("rank")
                seen = progress.get(rank) if isinstance(rank, int) else None
                rows.append(MemberRow(node=node.node_id, rank=rank if isinstance(rank, int) else None,
                                      role=(seen.role if seen is not None and seen.role else "active"),
                                      pid=pid if isinstance(pid, int) else None, host=node.host,
                                      step=seen.step if seen is not None and seen.step >= 0 else None,
                                      step_seconds=seen.step_seconds if seen is not None and seen.step >= 0 else None,
                                      heartbeat_age=max(now - seen.time, 0.0) if seen is not None and seen.time else None,
                                      cpu_percent=cpu, rss_mib=rss))
            for standby in node.standby_workers:
                pid = standby.get("pid")
                cpu, rss = self._usage(pid if isinstance(pid, int) else None)
                state = str(standby.get("state", ""))
                rows.append(MemberRow(node=node.node_id, rank=None, role="exited" if state == "exited" else "standby",
                                      pid=pid if isinstance(pid, int) else None, host=node.host,
                                      cpu_percent=cpu, rss_mib=rss))
        return sorted(rows, key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.node))

    def __call__(self) -> ConsoleView:
        status = read_status(self._store, self._handler.get_run_id(), str(self._handler.endpoint), with_events=False)
        new, self._next_event = read_new_events(self._store, self._next_event)
        self._events.extend(new)
        now = time.time()
        progress = self._progress(status)
        self._record_history(progress)
        # ETTR as tmrun-ctl status and the end-of-job totals give it (docs/events.md)
        ettr = metrics.totals([asdict(e) for e in self._events], now)["ettr"] if self._events else None
        phase = status.membership.phase.value
        if self._store.check([keys.CLOSED]):  # the leader may not have published the closed membership yet
            phase = ClosedNotice.decode(keys.CLOSED, self._store.get(keys.CLOSED)).phase
        standby_states = [str(s.get("state", "?")) for n in status.nodes for s in n.standby_workers]
        summary = ", ".join(f"{standby_states.count(s)} {s}" for s in sorted(set(standby_states)))
        return ConsoleView(
            run_id=status.run_id, phase=phase, epoch=status.membership.epoch,
            members=self._members(status, progress, now), step_history=list(self._intervals),
            events=[EventRow(e.time, e.kind, e.detail) for e in self._events[-8:]],
            ettr=ettr, elapsed=now - self._started, standby_summary=summary,
        )
