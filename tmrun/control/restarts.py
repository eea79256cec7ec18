"""What a group restart cost, measured from the workers' progress (the leader's ``restarted`` event).

A group restart (torchrun's path: every worker of the job starts again in a new epoch) loses the
time until the restarted group is back where it was, and recomputes every step it had completed
since the checkpoint the script resumed from. Both are measured here, from the progress records
the node agents publish (:class:`~tmrun.protocol.messages.NodeProgress`):

* ``high_water``: the last step completed before the failure, the largest ``step`` of the old
  epoch's final records (``keys.final_progress``: each agent writes its ranks' last records once
  the old epoch's workers stopped, before it starts the new epoch's);
* ``resumed``: the step the new epoch's loop started at (``tm.steps(total, start)``: the script's
  checkpoint step + 1; 0 for a script that keeps no checkpoint), the smallest over its ranks;
* ``steps_recomputed`` = ``high_water - resumed + 1`` (never below 0);
* ``seconds``: from the earliest evidence of the failure (``failed``: the failed worker's exit as its
  agent saw it, or the lost node's last heartbeat) until every rank of the new epoch completed
  step ``high_water + 1`` (``back``: the first step that makes new progress). The instant a rank
  completed that step is its record's ``time`` less one ``step_seconds`` per later step (the
  records are published about once a second).

A restart whose workers write no progress (a script that does not use the worker API) cannot be
measured: it stays open and is reported, at the job's end, with ``seconds`` None (the totals
then flag it as not included). A restart whose group never got back (the job ended first, or a
later restart came) is counted until that end, with ``back`` None.

Pure over the store's keys: the leader calls :meth:`RestartAccounts.poll` from its loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tmrun.protocol import keys
from tmrun.protocol.messages import NodeProgress, ProtocolMessageError, RankProgress

POLL_INTERVAL = 0.5  # seconds between looks at the progress keys while a restart is open


@dataclass
class Restarted:
    """One group restart's cost (see the module's doc)."""

    old_epoch: int
    new_epoch: int
    failed: float
    back: float | None  # None: the group did not get back (the job ended, or another restart came)
    seconds: float | None  # None: not measured (no progress records)
    high_water: int | None
    resumed: int | None
    steps_recomputed: int | None

    def describe(self) -> str:
        if self.seconds is None:
            return (f"epoch {self.new_epoch}: the group restart was not measured (no progress records: no rank "
                    "ran a step of the worker API after it)")
        if self.back is None:
            line = (f"epoch {self.new_epoch}: the group restart cost {self.seconds:.3f}s "
                    "(until the end: the group did not get back)")
        elif self.high_water is None:
            line = f"epoch {self.new_epoch}: the group restart cost {self.seconds:.3f}s (failure to its first step)"
        else:
            line = (f"epoch {self.new_epoch}: the group restart cost {self.seconds:.3f}s "
                    f"(failure to back at step {self.high_water + 1})")
        if self.steps_recomputed is not None:
            before = ("with no step completed before" if self.high_water is None
                      else f"after step {self.high_water} had completed")
            line += f", resumed at step {self.resumed} {before}: {self.steps_recomputed} steps recomputed"
        return line

    def fields(self) -> dict[str, Any]:
        return {"seconds": None if self.seconds is None else round(self.seconds, 6),
                "steps_recomputed": self.steps_recomputed, "resumed": self.resumed, "high_water": self.high_water,
                "marks": {"failed": self.failed, "back": self.back}}


@dataclass
class _Open:
    old_epoch: int
    new_epoch: int
    old_nodes: int
    new_nodes: int
    failed: float
    high_water: int | None = None
    resumed: int | None = None
    furthest: int | None = None  # the new epoch's least advanced rank's step, last seen
    finals_read: set[int] = field(default_factory=set)  # old group ranks whose last records were read (once)


class RestartAccounts:
    """The open group restarts of a job, closed as the restarted group gets back."""

    def __init__(self, store: Any) -> None:
        self._store = store  # the job's prefixed store
        self._open: list[_Open] = []
        self._next_poll = 0.0

    def begin(self, old_epoch: int, new_epoch: int, old_nodes: int, new_nodes: int, failed: float) -> list[Restarted]:
        """A restart into ``new_epoch`` was published. A restart still open ends here (its group
        did not get back before this one's failure); returns it."""
        ended = [self._close(o, failed, back=None) for o in self._open]
        self._open = [_Open(old_epoch, new_epoch, old_nodes, new_nodes, failed)]
        self._next_poll = 0.0
        return ended

    def poll(self, now: float | None = None) -> list[Restarted]:
        """The restarts whose group got back since the last call (at most every POLL_INTERVAL)."""
        now = time.monotonic() if now is None else now
        if not self._open or now < self._next_poll:
            return []
        self._next_poll = now + POLL_INTERVAL
        done = []
        for account in list(self._open):
            back = self._look(account)
            if back is not None:
                self._open.remove(account)
                done.append(self._close(account, back, back=back))
        return done

    def finish(self, end: float) -> list[Restarted]:
        """The job ends at ``end`` (Unix time): the restarts still open, each closed at the instant
        its group got back if the records read now show it did (the job can end between two
        polls), else counted until ``end``."""
        ended = []
        for account in self._open:
            back = self._look(account)
            ended.append(self._close(account, end if back is None else back, back=back))
        self._open = []
        return ended

    def _look(self, account: _Open) -> float | None:
        """Read what is known of ``account`` now; the instant its group got back, if it did."""
        unread = [g for g in range(account.old_nodes) if g not in account.finals_read]
        for final in self._read([keys.final_progress(account.old_epoch, g) for g in unread]):
            account.finals_read.add(final.node)  # written once: not read again
            steps = [r.step for r in final.ranks if r.step >= 0]
            if steps:
                account.high_water = max(steps + ([account.high_water] if account.high_water is not None else []))
        names = [keys.node_progress(g) for g in range(account.new_nodes)]
        if not self._store.check(names):
            return None  # a node has no record at all yet: one round trip, not one per node
        current = [p for p in self._read(names, checked=True) if p.epoch == account.new_epoch and p.ranks]
        if len(current) < account.new_nodes:
            return None  # a node of the new epoch has no record yet
        ranks = [r for p in current for r in p.ranks]
        starts = [r.resumed for r in ranks if r.resumed >= 0]
        if starts:
            account.resumed = min(starts)
        account.furthest = min(r.step for r in ranks)
        if account.resumed is None:
            return None
        target = account.resumed if account.high_water is None else max(account.high_water + 1, account.resumed)
        if account.furthest < target:
            return None
        return max(max(_completed_at(r, target) for r in ranks), account.failed)

    def _read(self, names: list[str], checked: bool = False) -> list[NodeProgress]:
        """The records of ``names`` that exist (``checked``: all do, no check per key)."""
        found = []
        for name in names:
            try:
                if checked or self._store.check([name]):
                    found.append(NodeProgress.decode(name, self._store.get(name)))
            except ProtocolMessageError:
                continue  # a malformed record counts as none
        return found

    @staticmethod
    def _close(account: _Open, end: float, back: float | None) -> Restarted:
        measured = account.resumed is not None
        recomputed = None
        if measured and account.high_water is not None:
            # a group that never got back redid only the steps it reached again
            reached = account.furthest if account.furthest is not None else -1
            redone_to = account.high_water if back is not None else min(account.high_water, reached)
            recomputed = max(0, redone_to - account.resumed + 1)
        elif measured:
            recomputed = 0  # nothing had completed before the failure
        return Restarted(account.old_epoch, account.new_epoch, account.failed, back,
                         max(0.0, end - account.failed) if measured else None, account.high_water,
                         account.resumed, recomputed)


def _completed_at(rank: RankProgress, step: int) -> float:
    """When ``rank`` completed ``step`` (no later than its record's step): its record's time less
    one step's wall time per step completed since."""
    return rank.time - max(0, rank.step - step) * rank.step_seconds

