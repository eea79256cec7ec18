"""The in-place controller of a single-node job: it watches the worker processes, learns of
failures from process exits and from workers' reports, promotes a warm standby to the failed
rank and publishes the plan (a new generation) through the store.

It is the only writer of generations and plans (see tmrun/control/inplace_protocol.py). With
no standby ready within ``standby_wait`` seconds it abandons in-place replacement for this
worker group (the workers are told to stop) and the agent falls back to torchrun's restart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from torch.distributed import Store

from tmrun.console import say
from tmrun.protocol import keys, messages as proto
from tmrun.control.events import record_event
from tmrun.launcher.standby_pool import StandbyMember, StandbyPool, terminate
from tmrun.launcher.worker_slots import Slot, WorkerSlots, write_gen_file


@dataclass
class Outcome:
    """What the agent does next: keep going, finished, or fall back (``failed`` ranks)."""

    finished: bool = False
    failed: dict[int, int] = field(default_factory=dict)  # rank -> exit code
    reason: str = ""
    final: bool = False  # do not restart the group: the training is over (restarting would redo it)


class InplaceController(WorkerSlots):
    def __init__(self, store: Store, pool: StandbyPool, world_size: int, standby_wait: float,
                 max_replacements: int, events_store: Store, gen_file: str, refill_delay: float = 0.0) -> None:
        super().__init__(store, world_size)
        self._pool = pool
        self._standby_wait = standby_wait
        self._replacements_left = max_replacements
        self._events = events_store
        self._gen_file = gen_file
        self._refill_delay = refill_delay
        self._refill_at = 0.0  # monotonic time before which the pool is not refilled (after a recovery)
        self.gen = 0
        self.replacements = 0
        self._awaiting: dict[int, float] = {}  # generation -> when its failure was seen
        self._leavers: list[Slot] = []  # migrated ranks' old processes, leaving on their own
        self._migrations_seen = events_store.add(keys.MIGRATE_SEQ, 0)  # older requests were for older groups
        self._write_gen_file()

    def adopt(self, processes: dict[int, subprocess.Popen[bytes]]) -> None:
        """The worker group just started: ``processes`` rank -> its process."""
        self.slots = {rank: Slot(rank, process) for rank, process in processes.items()}
        self.gen = 0
        self._write_gen_file()
        self._enabled = False
        self._reports_seen = 0

    def step(self) -> Outcome:
        """One look at the workers and the reports; replaces what failed."""
        if not self._awaiting and time.monotonic() >= self._refill_at:
            # A standby that died while waiting is replaced before it is needed; after a
            # promotion the new one starts only once the job recovered, plus the refill delay
            # (its warm-up competes for the node's CPUs with the recovery and the joiner's first
            # steps). A failure that finds no standby starts one at once (_replace).
            self._pool.fill()
        self._read_reports()
        self._check_recovered()
        self._check_leavers()
        self._read_migrations()
        codes = {s.rank: s.poll() for s in self.slots.values()}
        for rank, code in sorted(codes.items()):
            if code not in (None, 0):
                outcome = self._replace(rank, int(code))
                if outcome is not None:
                    return outcome
        if all(s.poll() == 0 for s in self.slots.values()):
            return Outcome(finished=True)
        return Outcome()

    def _check_recovered(self) -> None:
        for gen, seen in list(self._awaiting.items()):
            if self._store.add(keys.recovered(gen), 0) >= self._world_size:
                del self._awaiting[gen]
                self._refill_at = time.monotonic() + self._refill_delay
                elapsed = time.monotonic() - seen
                say(f"generation {gen}: all {self._world_size} ranks recovered, {elapsed:.3f}s after the change began")
                record_event(self._events, "recovered", gen, f"{self._world_size} ranks back in {elapsed:.3f}s")
            elif gen < self.gen:
                del self._awaiting[gen]  # superseded by a later failure

    def _check_leavers(self) -> None:
        for slot in list(self._leavers):
            code = slot.poll()
            if code is None:
                continue
            self._leavers.remove(slot)
            if code == 0:
                say(f"rank {slot.rank}'s previous process (pid {slot.pid}) handed over and left cleanly")
            else:
                say(f"rank {slot.rank}'s previous process (pid {slot.pid}) left with exit code {code}")

    def _read_migrations(self) -> None:
        for number, key in proto.numbered(self._events, keys.MIGRATE_SEQ, keys.migrate_request, self._migrations_seen):
            if self._awaiting or not self.enabled():
                return  # one change at a time: retry once the current one is over
            self._migrations_seen = number + 1
            try:
                request = proto.MigrateRequest.decode(key, self._events.get(key))
            except proto.ProtocolMessageError as exc:
                say(f"ignored a malformed migration request: {exc}")
                continue
            self._migrate(request)

    def _migrate(self, request: proto.MigrateRequest) -> None:
        if request.node >= 0:
            say(f"migration of the {request.describe()} refused: this job runs on one node (migrate a rank)")
            record_event(self._events, "migrate-refused", self.gen, f"{request.describe()}: single-node job")
            return
        slot = self.slots.get(request.rank)
        if slot is None or slot.poll() is not None:
            say(f"migration of rank {request.rank} refused: no such running rank on this node")
            record_event(self._events, "migrate-refused", self.gen, f"rank {request.rank}: not running here")
            return
        member = self._ready_standby()
        if member is None:
            say(f"migration of rank {request.rank} refused: no warm standby")
            record_event(self._events, "migrate-refused", self.gen, f"rank {request.rank}: no warm standby")
            return
        detail = f"rank {request.rank} (pid {slot.pid}) -> standby {member.index} (pid {member.process.pid}): {request.reason}"
        self._promote(request.rank, member, time.monotonic(), request.reason, planned=True)
        say(f"planned migration, generation {self.gen}: {detail}")
        record_event(self._events, "migrate", self.gen, detail)
        self._leavers.append(slot)

    def _read_reports(self) -> None:
        for report in self._new_reports():
            if report.gen != self.gen:
                record_event(self._events, "stale", self.gen, f"report about generation {report.gen}")
                continue
            slot = self.slots.get(report.lost)
            if slot is not None and slot.poll() is None and not slot.fenced and report.lost != report.reporter:
                # A survivor lost this rank but its process lives on (hung, or cut off): fence it
                # so that nothing it does later can reach the new generation.
                say(f"rank {report.lost} (pid {slot.pid}) lost by rank {report.reporter}; stopping it")
                slot.fenced = True
                try:
                    os.kill(slot.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _ready_standby(self) -> StandbyMember | None:
        for member in self._pool.members:
            if member.process.poll() is None and self._store.check([keys.standby_ready(member.index)]):
                return member
        return None

    def _replace(self, rank: int, exitcode: int) -> Outcome | None:
        slot = self.slots[rank]
        others_done = all(self._store.check([keys.done(r)]) for r in self.slots if r != rank)
        if others_done:
            say(f"rank {rank} failed with exit code {exitcode} after every other rank finished its steps; "
                "the job ends failed (a restart would redo the whole training)")
            return Outcome(failed={rank: exitcode}, reason=f"rank {rank} failed after every other rank finished",
                           final=True)
        if self._replacements_left <= 0:
            return self._abandon(rank, exitcode, "no in-place replacements left (--max-restarts)")
        started = time.monotonic()
        member = self._ready_standby()
        if member is None:
            say(f"rank {rank} failed; waiting up to {self._standby_wait:.0f}s for a warm standby")
            self._pool.fill()
        while member is None and time.monotonic() - started < self._standby_wait:
            if self._pool.failing:
                return self._abandon(rank, exitcode, self._pool.failing)
            time.sleep(0.05)
            self._pool.fill()
            member = self._ready_standby()
        if member is None:
            return self._abandon(rank, exitcode, f"no standby ready within {self._standby_wait:.0f}s")
        self._replacements_left -= 1
        self.replacements += 1
        how = f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"
        detail = f"rank {rank} (pid {slot.pid}, {how}) -> standby {member.index} (pid {member.process.pid})"
        self._promote(rank, member, started, f"exit code {exitcode}", planned=False)
        say(f"in-place replacement, generation {self.gen}: {detail}")
        record_event(self._events, "replace", self.gen, detail)
        return None

    def _promote(self, rank: int, member: StandbyMember, started: float, reason: str, planned: bool) -> None:
        """Publish generation gen+1 in which ``member`` plays ``rank`` (assignment first, so the
        standby can connect while survivors read the plan), and refill the pool."""
        self.gen += 1
        self._awaiting[self.gen] = started
        plan = proto.ReplacementPlan(self.gen, self._world_size, {rank: member.index}, reason=reason,
                                     planned=planned, created=time.time())
        self._store.set(keys.standby_assign(member.index), proto.Assignment(rank, self.gen, planned=planned).encode())
        self._store.set(keys.plan(self.gen), plan.encode())
        self._store.set(keys.GEN, str(self.gen))
        self._write_gen_file()  # after the plan is in the store: a reader that sees it finds the plan
        self._pool.take(member)
        self.slots[rank] = Slot(rank, member.process, promoted=True)

    def _write_gen_file(self) -> None:
        write_gen_file(self._gen_file, self.gen)

    def _abandon(self, rank: int, exitcode: int, why: str) -> Outcome:
        say(f"rank {rank} failed and {why}: falling back to restarting the worker group (as torchrun)")
        self._store.set(keys.ABORT, proto.AbortNotice(why, self.gen).encode())
        record_event(self._events, "fallback", self.gen, f"rank {rank}: {why}")
        return Outcome(failed={rank: exitcode}, reason=why)

    def stop_promoted(self, timeout: float = 5.0) -> None:
        """Stop every promoted standby still running (the group is being stopped)."""
        terminate([s.process for s in [*self.slots.values(), *self._leavers] if s.promoted], timeout)
