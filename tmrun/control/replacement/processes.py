"""Policy for one node: a member is a worker process, a standby is a warm standby process.

The agent's controller watches the worker processes, learns of failures from process exits
and from workers' reports, promotes a warm standby process to the failed rank and publishes the
plan (a new generation). With no standby ready within ``standby_wait`` seconds it abandons
in-place replacement for this worker group (the workers are told to stop) and the agent falls
back to torchrun's restart. It also moves ranks for planned migrations.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from collections.abc import Collection
from typing import Protocol

from torch.distributed import Store

from tmrun.console import say
from tmrun.control.detection import Detection
from tmrun.control.events import record_event
from tmrun.control.replacement import core
from tmrun.protocol import messages as proto


class StandbyProcess(Protocol):
    index: int
    process: subprocess.Popen[bytes]
    local_rank: int  # its device: a promoted standby runs its rank there


class StandbyProcesses(Protocol):
    """The agent's pool of warm standby processes, as the policy uses it."""

    @property
    def members(self) -> list[StandbyProcess]: ...

    @property
    def failing(self) -> str: ...  # non-empty when standbys keep dying on their own

    def fill(self) -> None: ...

    def take(self, member: StandbyProcess) -> None: ...


@dataclass
class Outcome:
    """What the agent does next: keep going, finished, or fall back (``failed`` ranks)."""

    finished: bool = False
    failed: dict[int, int] = field(default_factory=dict)  # rank -> exit code
    reason: str = ""
    final: bool = False  # do not restart the group: the training is over (restarting would redo it)


class ProcessReplacement:
    def __init__(self, store: Store, pool: StandbyProcesses, world_size: int, standby_wait: float,
                 max_replacements: int, events_store: Store, gen_file: str, refill_delay: float = 0.0,
                 detection: Detection | None = None,
                 report_settle: tuple[float, float] = (core.REPORT_SETTLE, core.CASCADE_SETTLE)) -> None:
        self._store = store
        self._pool = pool
        self._world_size = world_size
        self._standby_wait = standby_wait
        self._replacements_left = max_replacements
        self._events = events_store
        self._refill_delay = refill_delay
        self._refill_at = 0.0  # monotonic time before which the pool is not refilled (after a recovery)
        self.enabled = core.ApiGate(store, world_size)  # enabled(): every rank runs the worker API
        self._generations = core.Generations(store, gen_file)
        self._recoveries = core.Recoveries()
        self._reports = core.ReportInbox(store)
        self._accusations = core.Accusations(*report_settle)  # reports against live ranks, until due
        self._migrations = core.MigrationInbox(events_store, skip_older=True)
        self.slots = core.Slots()
        self.gen = 0
        self.replacements = 0
        self.detection = detection  # hangs, stragglers, unhealthy GPUs (control.detection)
        self._waiting_for_standby = core.MigrationsWaiting("it moves")  # ranks to move once a standby is warm
        # rank -> its joiner in the last generation, while that generation recovers: a
        # generation published meanwhile (a rank lost during the recovery) gives each live one
        # its rank again, so that every member replaces its links the same way (the joiner
        # reconnects for the new generation instead of waiting for a dead rank's address)
        self._joining: dict[int, StandbyProcess] = {}
        # rank -> (its joiner, its leaver's slot) of the last planned generation, while it
        # recovers: a member lost before the migration switched cancels it (the leaver, the
        # holder of the rank's state, keeps the rank; the joiner is stopped)
        self._migrating: dict[int, tuple[StandbyProcess, core.Slot, int | None]] = {}  # + the leaver's local rank
        self._cancelled: list[StandbyProcess] = []  # stopped joiners of cancelled migrations, not reaped yet

    def adopt(self, processes: dict[int, subprocess.Popen[bytes]]) -> None:
        """The worker group just started: ``processes`` rank -> its process."""
        self.slots.adopt(processes)

    def step(self) -> Outcome:
        """One look at the workers and the reports; replaces what failed."""
        if not self._recoveries and time.monotonic() >= self._refill_at:
            # A standby that died while waiting is replaced before it is needed; after a
            # promotion the new one starts only once the job recovered, plus the refill delay
            # (its warm-up competes for the node's CPUs with the recovery and the joiner's first
            # steps). A failure that finds no standby starts one at once (_replace).
            self._pool.fill()
        self._fence_reported()
        self._detect()
        self._recovered(final=False)
        self.slots.reap_leavers()
        self._cancelled = [member for member in self._cancelled if member.process.poll() is None]
        for request in self._migrations.requests(lambda: bool(self._recoveries) or not self.enabled()):
            if isinstance(request, proto.ProtocolMessageError):
                say(f"ignored a malformed migration request: {request}")
            else:
                self._migrate(request)
        failed = self.slots.failed()
        if failed:
            # every rank found failed is replaced in one generation (failures seen together, or
            # while waiting for standbys, are folded into one plan: two generations published
            # one after the other would leave the first one's joiner waiting for a dead rank)
            outcome = self._replace(failed)
            if outcome is not None:
                self._recovered(final=True)
                return outcome
        finished = self.slots.all_succeeded()
        if finished:
            self._recovered(final=True)  # every rank is done: no first step is coming
        return Outcome(finished=finished)

    def _recovered(self, final: bool) -> None:
        """Say when every rank recovered; record the ``recovered`` event, with its phases, once
        every rank completed its first step after it (core.Recoveries.completed)."""
        for recovered in self._recoveries.poll():
            self._refill_at = time.monotonic() + self._refill_delay
            say(f"generation {recovered.gen}: all {recovered.world_size} ranks recovered, "
                f"{recovered.seconds:.3f}s after the change began")
        for recovered in self._recoveries.completed(final=final):
            record_event(self._events, "recovered", recovered.gen,
                         f"{recovered.world_size} ranks back in {recovered.seconds:.3f}s", **recovered.fields())

    def publish_last_progress(self) -> None:
        """Every rank finished: the progress records published once more (each rank's last
        process, exited now), for the leader's count of a group restart as the job closes."""
        if self.detection is not None:
            self.detection.publish_last(self.slots.rank_pids())

    def _detect(self) -> None:
        """Hung ranks are fenced (and replaced below, as failed ranks); stragglers and ranks on an
        unhealthy GPU are migrated (planned: no step lost)."""
        detection = self.detection
        if detection is None or not self.enabled():
            return
        pids = {slot.rank: slot.pid for slot in self.slots.by_rank.values() if slot.poll() is None and not slot.fenced}
        findings = detection.poll(pids, busy=bool(self._recoveries))
        if (findings.hung or findings.notes) and core.any_done(self._store, self.slots.ranks()):
            findings.hung, findings.notes = [], []  # the training is finishing: nobody steps any more
        for note in findings.notes:
            say(note)
        for rank, why in findings.hung:
            slot = self.slots[rank]
            say(f"rank {rank} (pid {slot.pid}) hangs ({why}); stopping it")
            record_event(self._events, "hang", self.gen, f"rank {rank} (pid {slot.pid}): {why}")
            slot.fence()
        for rank, kind, why in findings.migrate:
            if self._recoveries or self._ready_standby() is None:  # ask again once a standby is warm
                self._waiting_for_standby.wait(detection, rank, kind, why, "standby")
                continue
            self._waiting_for_standby.done(rank)
            say(f"rank {rank}: {why}; migrating it to a standby")
            record_event(self._events, kind, self.gen, f"rank {rank}: {why}")
            if not self._migrate(proto.MigrateRequest(rank=rank, reason=why)):
                core.ask_again(detection, rank, kind, why)

    def _refuse(self, what: str, why: str) -> bool:
        say(f"migration of {what} refused: {why}")
        record_event(self._events, "migrate-refused", self.gen, f"{what}: {why}")
        return False

    def _migrate(self, request: proto.MigrateRequest) -> bool:
        if request.node >= 0:
            return self._refuse(f"the {request.describe()}", "this job runs on one node (migrate a rank)")
        slot = self.slots.get(request.rank)
        if slot is None or slot.poll() is not None:
            return self._refuse(f"rank {request.rank}", "no such running rank on this node")
        if core.any_done(self._store, self.slots.ranks()):
            return self._refuse(f"rank {request.rank}", "the training is finishing (a rank finished its steps)")
        unhealable = core.unhealable(self._store)  # (a gloo group: no joiner can enter it)
        if unhealable:
            return self._refuse(f"rank {request.rank}", unhealable)
        member = self._ready_standby()
        if member is None:
            return self._refuse(f"rank {request.rank}", "no warm standby")
        detail = f"rank {request.rank} (pid {slot.pid}) -> standby {member.index} (pid {member.process.pid}): {request.reason}"
        self._promote(request.rank, member, time.monotonic(), request.reason, planned=True, asked=request.time)
        say(f"planned migration, generation {self.gen}: {detail}")
        record_event(self._events, "migrate", self.gen, detail)
        return True

    def _fence_reported(self) -> None:
        for report in self._reports:
            if report.gen != self.gen:
                record_event(self._events, "stale", self.gen, f"report about generation {report.gen}")
                continue
            self._accusations.note(report, self.slots, self.gen)
        for slot, report in self._accusations.due(self.slots, self.gen):
            self._fence(slot, report)

    def _fence(self, slot: core.Slot, report: proto.WorkerReport) -> None:
        # A survivor lost this rank but its process lives on (hung, or cut off): fence it so that
        # nothing it does later can reach the new generation.
        say(f"rank {report.lost} (pid {slot.pid}) lost by rank {report.reporter}; stopping it")
        slot.fence()

    def standby_warm(self, standby_id: int) -> bool:
        """True once standby ``standby_id`` finished its shadow steps and waits for an assignment."""
        return core.standbys_ready(self._store, [standby_id])

    def _ready_standby(self, skip: Collection[StandbyProcess] = ()) -> StandbyProcess | None:
        for member in self._pool.members:
            if member in skip:
                continue
            if member.process.poll() is None and core.standbys_ready(self._store, [member.index]):
                return member
        return None

    def _replace(self, failed: dict[int, int]) -> Outcome | None:
        """Replace every rank of ``failed`` (rank -> exit code) in ONE generation: wait (up to
        ``standby_wait``) until a warm standby is reserved for each, folding in the ranks that
        fail meanwhile, then publish a single plan. All or nothing: no partial plan is ever
        published while another rank of the same failure is still waiting for its standby."""
        failed = dict(failed)
        first = min(failed)
        why = core.diverged(self._store)
        if why:
            say(f"{why}; the job ends failed without a restart")
            record_event(self._events, "diverged", self.gen, why)
            return Outcome(failed=failed, reason=why, final=True)
        if core.others_done(self._store, [r for r in self.slots.ranks() if r not in failed]):
            say(f"{_ranks(failed)} failed with {_codes(failed)} after every other rank finished its steps; "
                "the job ends failed (a restart would redo the whole training)")
            return Outcome(failed=failed, reason=f"rank {first} failed after every other rank finished",
                           final=True)
        if core.unhealable(self._store):  # the members found the state cannot be healed: no use waiting
            return self._abandon(failed, core.unhealable(self._store))
        if self._replacements_left < len(failed):
            return self._abandon(failed, "no in-place replacements left (--max-restarts)")
        if not self._holder_left(failed):
            return self._abandon(failed, NO_HOLDER)
        started = time.monotonic()
        reserved: dict[int, StandbyProcess] = {}  # rank -> warm standby, published together below

        def reserve() -> None:
            for rank in sorted(failed):
                if rank in reserved:
                    continue
                member = self._ready_standby(skip=list(reserved.values()))
                if member is None:
                    return
                reserved[rank] = member

        reserve()
        if len(reserved) < len(failed):
            say(f"{_ranks(failed)} failed; waiting up to {self._standby_wait:.0f}s for "
                f"{len(failed) - len(reserved)} more warm standby(s)")
            self._pool.fill()
        while len(reserved) < len(failed) and time.monotonic() - started < self._standby_wait:
            if self._pool.failing:
                return self._abandon(failed, self._pool.failing)
            if core.unhealable(self._store):
                return self._abandon(failed, core.unhealable(self._store))
            time.sleep(0.05)
            self._pool.fill()
            for rank, code in self.slots.failed().items():  # fold failures seen while waiting
                if rank not in failed:
                    say(f"rank {rank} failed too ({core.how_it_ended(code)}); it joins the same plan")
                    failed[rank] = code
            if not self._holder_left(failed):  # no use waiting for standbys
                return self._abandon(failed, NO_HOLDER)
            reserve()
        if self._replacements_left < len(failed):
            return self._abandon(failed, "no in-place replacements left (--max-restarts)")
        if len(reserved) < len(failed):
            return self._abandon(failed, f"no standby ready within {self._standby_wait:.0f}s")
        self._replacements_left -= len(failed)
        self.replacements += len(failed)
        details = "; ".join(
            f"rank {rank} (pid {self.slots[rank].pid}, {core.how_it_ended(failed[rank])}) -> standby "
            f"{reserved[rank].index} (pid {reserved[rank].process.pid})" for rank in sorted(failed))
        self._promote_all(reserved, started, "; ".join(f"rank {r}: {_code(c)}" for r, c in sorted(failed.items()))
                          if len(failed) > 1 else _code(failed[first]), planned=False)
        say(f"in-place replacement, generation {self.gen}: {details}")
        record_event(self._events, "replace", self.gen, details)
        return None

    def _holder_left(self, failed: Collection[int]) -> bool:
        """Whether a rank outside ``failed`` still holds the training state: not a joiner that
        had not recovered yet (it holds nothing until it is healed) unless it is a migration's
        whose leaver still runs (the leaver keeps the rank and its state). With none, a plan
        would have every member new: its healing fails on every one of them ("no member holds
        the training state"), after the wait for standbys."""
        new: set[int] = set()
        if self._recoveries:
            for rank, member in self._joining.items():
                migration = self._migrating.get(rank)
                leaver_runs = migration is not None and migration[1].poll() is None
                if member.process.poll() is None and self._plays(rank, member) and not leaver_runs:
                    new.add(rank)
        return any(rank not in failed and rank not in new for rank in range(self._world_size))

    def _promote(self, rank: int, member: StandbyProcess, started: float, reason: str, planned: bool,
                 asked: float = 0.0) -> None:
        """Publish a generation in which ``member`` plays ``rank``, and take it from the pool."""
        self._promote_all({rank: member}, started, reason, planned, asked)

    def _promote_all(self, moves: dict[int, StandbyProcess], started: float, reason: str, planned: bool,
                     asked: float = 0.0) -> None:
        """Publish ONE generation in which each standby of ``moves`` plays its rank."""
        carried: dict[int, StandbyProcess] = {}
        returned: dict[int, tuple[StandbyProcess, core.Slot, int | None]] = {}
        if self._recoveries and not planned:
            for rank, (joiner, leaver, local) in self._migrating.items():
                if rank not in moves and leaver.poll() is None and self._plays(rank, joiner):
                    returned[rank] = (joiner, leaver, local)
            for rank, member in self._joining.items():
                if rank not in moves and rank not in returned and member.process.poll() is None \
                        and self._plays(rank, member):
                    carried[rank] = member
        assigned = {r: m.index for r, m in {**moves, **carried}.items()}
        previous = self.gen
        self.gen = self._generations.publish(self._world_size, assigned, reason, planned, returned=tuple(returned))
        self._recoveries.begin(self._store, self.gen, self._world_size, started, asked=asked)
        migrating: dict[int, tuple[StandbyProcess, core.Slot, int | None]] = {}
        for rank, member in moves.items():
            self._pool.take(member)
            old = self.slots.replace(rank, member.process, leaving=planned)
            if planned:
                migrating[rank] = (member, old, self.detection.local_rank(rank) if self.detection is not None else None)
            if self.detection is not None:
                self.detection.moved(rank, member.local_rank)  # its GPU's health is the rank's now
        for rank, member in carried.items():
            say(f"generation {self.gen}: rank {rank}'s joiner (standby {member.index}, pid {member.process.pid}) "
                f"had not recovered into generation {self.gen - 1}: it reconnects for generation {self.gen}")
        for rank, (joiner, leaver, local) in returned.items():
            self.slots.give_back(rank, leaver)
            if self.detection is not None and local is not None:
                self.detection.moved(rank, local)
            joiner.process.terminate()  # it waits for links of the cancelled generation: it stops (SIGTERM)
            self._cancelled.append(joiner)
            say(f"generation {self.gen}: the migration of rank {rank} (generation {previous}) had not switched: "
                f"cancelled; its process (pid {leaver.pid}) keeps the rank, the joiner (standby {joiner.index}, "
                f"pid {joiner.process.pid}) is stopped")
            record_event(self._events, "migrate-cancelled", self.gen,
                         f"rank {rank}: a member was lost before the switch of generation {previous}")
        self._migrating = migrating
        # a generation's joiners, planned ones included: a failure before they all recovered gives
        # them their rank again in the unplanned generation that follows (a migration's joiner
        # too: its leaver, superseded, leaves without handing over and the joiner is healed)
        self._joining = {**moves, **carried}

    def _plays(self, rank: int, member: StandbyProcess) -> bool:
        """``member``'s process is the one that plays ``rank`` now."""
        slot = self.slots.get(rank)
        return slot is not None and slot.process is member.process

    def _abandon(self, failed: dict[int, int], why: str) -> Outcome:
        say(f"{_ranks(failed)} failed and {why}: falling back to restarting the worker group (as torchrun)")
        self._generations.abandon(why)
        record_event(self._events, "fallback", self.gen, f"{_ranks(failed)}: {why}")
        return Outcome(failed=dict(failed), reason=why)

    def stop_promoted(self, timeout: float = 5.0) -> None:
        """Stop every promoted standby still running (the group is being stopped)."""
        self.slots.stop_promoted(timeout)


NO_HOLDER = "no rank holds the training state any more (every rank failed, or joined and was not healed yet)"


def _code(code: int) -> str:
    return f"exit code {code}"


def _ranks(failed: dict[int, int]) -> str:
    ranks = sorted(failed)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _codes(failed: dict[int, int]) -> str:
    return ", ".join(core.how_it_ended(failed[r]) for r in sorted(failed))
