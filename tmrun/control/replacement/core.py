"""The replacement core: what both topologies do the same way.

Everything here works on one in-place prefix of the store (``keys.group_prefix`` on one node,
``keys.node_prefix`` per epoch across nodes) and knows nothing of who decides:

* :class:`Generations` publishes a generation (assignments first, then the plan, then the
  generation number, then the node's generation file) and abandons in-place recovery;
* :class:`Recoveries` tracks published generations until every rank reports itself recovered
  (or a later generation or an abandonment supersedes them);
* :class:`MigrationInbox` hands out operators' migration requests, one change at a time;
* :class:`ReportInbox` reads workers' reports about peers they lost;
* :class:`Slots` holds the processes that play this node's ranks: exits, fencing, stopping;
* :class:`Accusations` holds survivors' reports against ranks whose process still runs until
  each is due (the rank is then fenced);
* :func:`standbys_ready`, :func:`api_ready` and :func:`others_done` are the questions both
  policies ask the store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.distributed import Store

from tmrun.console import say
from tmrun.control import phases as recovery_phases
from tmrun.protocol import keys
from tmrun.protocol import messages as proto


def write_gen_file(path: str, gen: int) -> None:
    """Workers on this node read the generation here at every step boundary (a file read instead
    of a store round trip). Written after the plan is in the store, replaced atomically."""
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as flag:
        flag.write(str(gen))
    os.replace(partial, path)


def terminate(processes: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """SIGTERM every process still running, then SIGKILL what is left after ``timeout``; reaps all."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def how_it_ended(code: int) -> str:
    """"signal SIGKILL" or "exit code 3"."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


# ---- questions to the store ----------------------------------------------------------------------


def api_ready(store: Store, world_size: int) -> bool:
    """True once every one of ``world_size`` ranks runs the tmrun worker API."""
    return store.check([keys.API]) and store.add(keys.MEMBERS, 0) >= world_size


class ApiGate:
    """Latched :func:`api_ready`: once every rank ran the worker API, in-place replacement is on
    for this prefix (call it: ``gate()``)."""

    def __init__(self, store: Store, world_size: int) -> None:
        self._store = store
        self._world_size = world_size
        self._open = False

    def __call__(self) -> bool:
        self._open = self._open or api_ready(self._store, self._world_size)
        return self._open


def standbys_ready(store: Store, standby_ids: Iterable[int]) -> bool:
    """True when every standby in ``standby_ids`` finished its shadow steps and waits."""
    wanted = [keys.standby_ready(i) for i in standby_ids]
    return bool(wanted) and store.check(wanted)


def others_done(store: Store, ranks: Iterable[int]) -> bool:
    """True when every rank in ``ranks`` finished its steps (a failure then cannot be healed:
    nobody is left to heal a joiner from, and a restart would redo the whole training)."""
    wanted = [keys.done(r) for r in ranks]
    return bool(wanted) and store.check(wanted)


def has_subgroups(store: Store) -> bool:
    """The job's ranks made subgroups (a device mesh, ``new_group``): its standbys wait in
    ``tmrun.init()`` (docs/mesh.md); a planned migration of a whole node of such a job is refused."""
    return store.check([keys.SUBGROUPS]) and store.get(keys.SUBGROUPS) == b"1"


def unhealable(store: Store) -> str:
    """Why the members of the change under way found it cannot heal in place ('' when they did
    not): a shard whose every replica was lost (docs/mesh.md, section 4)."""
    if not store.check([keys.UNHEALABLE]):
        return ""
    raw = store.get(keys.UNHEALABLE)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def diverged(store: Store) -> str:
    """Why the members of a change stopped the job: replicas that disagree once healed ('' when
    they agree). The job ends failed: a restart would train on from a checkpoint as if the
    cause were gone, and it needs a person (docs/events.md, ``diverged``)."""
    if not store.check([keys.DIVERGED]):
        return ""
    raw = store.get(keys.DIVERGED)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def any_done(store: Store, ranks: Iterable[int]) -> bool:
    """True when a rank in ``ranks`` already finished its steps (a planned switch can no longer
    happen: that rank will never reach the switch step)."""
    return any(store.check([keys.done(r)]) for r in ranks)


# ---- generations --------------------------------------------------------------------------------------


class Generations:
    """The only writer of generations and plans of one in-place prefix."""

    def __init__(self, store: Store, gen_file: str = "") -> None:
        self._store = store
        self._gen_file = gen_file
        if gen_file:
            write_gen_file(gen_file, self.current())

    def current(self) -> int:
        return proto.read_gen(self._store)

    def publish(self, world_size: int, replaced: dict[int, int], reason: str, planned: bool,
                returned: tuple[int, ...] = ()) -> int:
        """Generation current+1, in which each rank of ``replaced`` is played by the standby it
        maps to. The assignments go first (the joiners connect while the survivors read the
        plan), the generation file last (a worker that sees it finds the plan)."""
        gen = self.current() + 1
        plan = proto.ReplacementPlan(gen, world_size, dict(replaced), reason=reason, planned=planned,
                                     created=time.time(), returned=tuple(returned))
        for rank, standby_id in replaced.items():
            self._store.set(keys.standby_assign(standby_id), proto.Assignment(rank, gen, planned=planned).encode())
        self._store.set(keys.plan(gen), plan.encode())
        self._store.set(keys.GEN, str(gen))
        if self._gen_file:
            write_gen_file(self._gen_file, gen)
        return gen

    def abandon(self, why: str) -> None:
        """In-place recovery is over for this prefix: every waiting worker gives up (the group
        restarts, as torchrun)."""
        self._store.set(keys.ABORT, proto.AbortNotice(why, self.current()).encode())

    def abandoned(self) -> bool:
        return self._store.check([keys.ABORT])


FIRST_STEP_WAIT = 60.0  # seconds a recovery's event waits for every rank's first step after it


@dataclass
class _Recovery:
    store: Store
    gen: int
    world_size: int
    started: float  # monotonic: the failure seen (or the migration request taken)
    seen: float  # the same instant in Unix time
    published: float  # Unix time: the plan was in the store
    asked: float | None  # Unix time of a migration's request
    evidence: float | None = None  # Unix time: the earliest evidence of the failure known to the controller
    seconds: float | None = None  # once every rank recovered: started -> then
    recovered_at: float = 0.0  # Unix time, idem
    recovered_mono: float = 0.0


@dataclass(frozen=True)
class Recovered:
    gen: int
    world_size: int
    seconds: float  # from the failure (or the migration request) to the last rank's recovery
    phases: dict[str, Any] = field(default_factory=dict)  # control.phases: seconds per phase
    marks: dict[str, float | None] = field(default_factory=dict)  # control.phases: the instants
    # 1 where a survivor redoes the step it was in, 0 where every survivor's step had committed
    # (a rank lost in or after its optimizer step), None where no survivor said
    steps_recomputed: int | None = None

    def describe(self) -> str:
        return f"generation {self.gen}: all {self.world_size} ranks back in {self.seconds:.3f}s"

    def fields(self) -> dict[str, Any]:
        """The ``recovered`` event's structured fields (docs/events.md)."""
        fields = {"gen": self.gen, "seconds": round(self.seconds, 6), "phases": self.phases, "marks": self.marks}
        if self.steps_recomputed is not None:
            fields["steps_recomputed"] = self.steps_recomputed
        return fields


class Recoveries:
    """Published generations whose ranks are still recovering, then (the event's phases) whose
    ranks have not all completed their first step after it."""

    def __init__(self, first_step_wait: float = FIRST_STEP_WAIT) -> None:
        self._awaiting: list[_Recovery] = []
        self._finishing: list[_Recovery] = []
        self._first_step_wait = first_step_wait

    def begin(self, store: Store, gen: int, world_size: int, started: float, asked: float | None = None,
              evidence: float | None = None) -> None:
        """Generation ``gen`` was just published; ``started`` (monotonic) is when the failure was
        seen or the migration request taken, ``asked`` (Unix time) when a migration was asked,
        ``evidence`` (Unix time) the earliest evidence of the failure the reports carry (a worker's
        exit as its agent saw it, a lost node's last heartbeat)."""
        now = time.time()
        seen = now - max(0.0, time.monotonic() - started)
        self._awaiting.append(_Recovery(store, gen, world_size, started, seen, now, asked or None, evidence or None))

    def __bool__(self) -> bool:
        """True while a published generation's ranks are still recovering."""
        return bool(self._awaiting)

    def poll(self) -> list[Recovered]:
        """Generations whose every rank recovered since the last call (their phases follow from
        :meth:`completed`); drops those superseded by a later generation or abandoned."""
        finished = []
        for recovery in list(self._awaiting):
            store = recovery.store
            if store.add(keys.recovered(recovery.gen), 0) >= recovery.world_size:
                self._awaiting.remove(recovery)
                polled_mono, polled_at = time.monotonic(), time.time()
                # every rank recovered when the last one healed, not when this loop looked (up
                # to one poll later): its published instant, within [the start, now] (another
                # host's clock may run ahead or behind)
                healed = [timing.healed for timing in _timings(recovery, quiet=True)]
                lag = 0.0
                if len(healed) >= recovery.world_size:
                    lag = min(max(0.0, polled_at - max(healed)), polled_mono - recovery.started)
                recovery.recovered_mono = polled_mono - lag
                recovery.recovered_at = polled_at - lag
                recovery.seconds = recovery.recovered_mono - recovery.started
                self._finishing.append(recovery)
                finished.append(Recovered(recovery.gen, recovery.world_size, recovery.seconds))
            elif proto.read_gen(store) > recovery.gen or store.check([keys.ABORT]):
                self._awaiting.remove(recovery)
        return finished

    def completed(self, final: bool = False) -> list[Recovered]:
        """Recovered generations with their phases, once every rank completed its first step
        after the recovery, a later generation or an abandonment came first, the wait ran out, or
        ``final`` (the job is ending: nobody steps any more)."""
        done = []
        for recovery in list(self._finishing):
            store = recovery.store
            if not (final or store.add(keys.first_steps(recovery.gen), 0) >= recovery.world_size
                    or time.monotonic() - recovery.recovered_mono > self._first_step_wait
                    or proto.read_gen(store) > recovery.gen or store.check([keys.ABORT])):
                continue
            self._finishing.remove(recovery)
            done.append(self._with_phases(recovery))
        return done

    @staticmethod
    def _with_phases(recovery: _Recovery) -> Recovered:
        timings = _timings(recovery)
        at = recovery_phases.marks(timings, recovery.world_size, recovery.seen, recovery.published, recovery.asked,
                                   evidence=recovery.evidence)
        seconds = recovery_phases.downtime(at, recovery.recovered_at, recovery.seconds or 0.0,
                                           planned=recovery.asked is not None)
        said = [timing.redone for timing in timings if timing.redone is not None]  # the survivors'
        return Recovered(recovery.gen, recovery.world_size, seconds,
                         recovery_phases.phases(at, recovery.recovered_at, seconds), at,
                         steps_recomputed=int(any(said)) if said else None)


def _timings(recovery: _Recovery, quiet: bool = False) -> list[proto.RecoveryTiming]:
    """The recovery timings its ranks published (each rank writes its own before it counts
    itself recovered); a malformed one is left out (and said, unless ``quiet``: the event's
    phases read them again)."""
    timings = []
    for rank in range(recovery.world_size):
        key = keys.timing(recovery.gen, rank)
        try:
            if recovery.store.check([key]):
                timings.append(proto.RecoveryTiming.decode(key, recovery.store.get(key)))
        except proto.ProtocolMessageError as exc:
            if not quiet:
                say(f"ignored a malformed recovery timing: {exc}")
    return timings


# ---- inboxes --------------------------------------------------------------------------------------------


class MigrationsWaiting:
    """Ranks that detection wants moved while no warm standby can take them (or a recovery is
    under way): each is said once, and detection asks again later."""

    def __init__(self, moves: str) -> None:
        self._moves = moves  # what the line says happens: "it moves", "this node moves"
        self._ranks: set[int] = set()

    def wait(self, detection: Any, rank: int, kind: str, why: str, standby: str) -> None:
        if rank not in self._ranks:
            self._ranks.add(rank)
            say(f"rank {rank}: {why}; {self._moves} once a {standby} is warm")
        ask_again(detection, rank, kind, why)

    def done(self, rank: int) -> None:
        self._ranks.discard(rank)


def ask_again(detection: Any, rank: int, kind: str, why: str) -> None:
    """Detection reports ``rank`` again later (a straggler, or a GPU found unhealthy)."""
    if kind == "straggler":
        detection.retry(rank)
    else:
        detection.gpu_retry(rank, why)


class MigrationInbox:
    """Operators' migration requests (job level: ``tmrun-ctl migrate``, ``tm.migrate()``)."""

    def __init__(self, job_store: Store, skip_older: bool = False) -> None:
        self._job = job_store
        # skip_older: requests written before this inbox existed were for an earlier worker group
        self._seen = job_store.add(keys.MIGRATE_SEQ, 0) if skip_older else 0

    def requests(self, busy: Callable[[], bool]) -> Iterator[proto.MigrateRequest | proto.ProtocolMessageError]:
        """The requests in order; a malformed one is yielded as its error. Stops (leaving the
        rest for later) while ``busy()``: one change at a time."""
        for number, key in proto.numbered(self._job, keys.MIGRATE_SEQ, keys.migrate_request, self._seen):
            if busy():
                return
            self._seen = number + 1
            try:
                yield proto.MigrateRequest.decode(key, self._job.get(key))
            except proto.ProtocolMessageError as exc:
                yield exc


class ReportInbox:
    """Workers' reports, in order (a malformed one is logged and skipped)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._seen = 0

    def restart(self) -> None:
        self._seen = 0

    def __iter__(self) -> Iterator[proto.WorkerReport]:
        for number, key in proto.numbered(self._store, keys.REPORT_SEQ, keys.report, self._seen):
            self._seen = number + 1
            try:
                yield proto.WorkerReport.decode(key, self._store.get(key))
            except proto.ProtocolMessageError as exc:
                say(f"ignored a malformed worker report: {exc}")


# ---- this node's processes -----------------------------------------------------------------------


@dataclass
class Slot:
    """One rank of this node and the process that currently plays it (a child of the agent:
    the worker torch started, or a promoted standby)."""

    rank: int
    process: subprocess.Popen[bytes]
    promoted: bool = False
    fenced: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def fence(self) -> None:
        """SIGKILL the process: nothing it does later can reach the new generation."""
        self.fenced = True
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


LEFT_MARK = "it closed its communicator"  # a lost peer's goodbye (tmrun_native: a clean leave)
LEAVING_GRACE = 3.0  # s: a rank that said goodbye has this long to exit by itself before it is fenced


class Slots:
    """The ranks this node plays and the processes that play them."""

    def __init__(self) -> None:
        self.by_rank: dict[int, Slot] = {}
        self.leavers: list[Slot] = []  # migrated ranks' old processes, leaving on their own

    def adopt(self, processes: dict[int, subprocess.Popen[bytes]], promoted: bool = False) -> None:
        self.by_rank = {rank: Slot(rank, process, promoted=promoted) for rank, process in processes.items()}

    def __getitem__(self, rank: int) -> Slot:
        return self.by_rank[rank]

    def get(self, rank: int) -> Slot | None:
        return self.by_rank.get(rank)

    def ranks(self) -> list[int]:
        return list(self.by_rank)

    def pids(self) -> list[int]:
        return [s.pid for s in self.by_rank.values() if s.poll() is None]

    def rank_pids(self) -> dict[int, int]:
        """Every rank's current process id, running or exited."""
        return {s.rank: s.pid for s in self.by_rank.values()}

    def codes(self) -> dict[int, int | None]:
        return {s.rank: s.poll() for s in self.by_rank.values()}

    def failed(self) -> dict[int, int]:
        """rank -> exit code of every rank whose process failed."""
        return {rank: int(code) for rank, code in sorted(self.codes().items()) if code not in (None, 0)}

    def all_succeeded(self) -> bool:
        return all(code == 0 for code in self.codes().values())

    def replace(self, rank: int, process: subprocess.Popen[bytes], leaving: bool) -> Slot:
        """A promoted standby plays ``rank`` now; the old process leaves on its own (``leaving``,
        a migration) or is already gone. Returns the old slot."""
        old = self.by_rank[rank]
        self.by_rank[rank] = Slot(rank, process, promoted=True)
        if leaving:
            self.leavers.append(old)
        return old

    def give_back(self, rank: int, leaver: Slot) -> None:
        """A migration cancelled before its switch: ``leaver`` (still running) plays ``rank``
        again; the joiner's slot is dropped (the caller stops its process)."""
        if leaver in self.leavers:
            self.leavers.remove(leaver)
        self.by_rank[rank] = leaver

    def reap_leavers(self) -> None:
        for slot in list(self.leavers):
            code = slot.poll()
            if code is None:
                continue
            self.leavers.remove(slot)
            if code == 0:
                # the process's own line says whether it handed over (a migration whose joiner
                # was lost before it connected leaves with nothing to hand over, also exit 0)
                say(f"rank {slot.rank}'s previous process (pid {slot.pid}) left cleanly (exit code 0)")
            else:
                say(f"rank {slot.rank}'s previous process (pid {slot.pid}) left with exit code {code}")

    def fence_all(self, wait: float = 10.0) -> None:
        """SIGKILL every process of the node and wait for each (bounded)."""
        for slot in self.by_rank.values():
            slot.fence()
        for slot in self.by_rank.values():
            try:
                slot.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:  # stuck in the kernel: it cannot compute either
                say(f"rank {slot.rank} (pid {slot.pid}) did not exit {wait:g} s after SIGKILL")

    def stop_promoted(self, timeout: float = 5.0) -> None:
        """Stop every promoted standby still running (the group is being stopped)."""
        terminate([s.process for s in [*self.by_rank.values(), *self.leavers] if s.promoted], timeout)


REPORT_SETTLE = 0.5  # s: a report against a live rank waits this long for the loss's real cause to surface
CASCADE_SETTLE = LEAVING_GRACE  # s: the same, when the accused rank itself reported a loss in that generation


@dataclass
class _Accusation:
    since: float  # monotonic time of the first report
    pid: int  # the process it blamed (a replaced rank's newer process is not blamed)
    report: proto.WorkerReport
    goodbye: bool  # a report said the rank closed its communicator: it is on its way out
    announced: bool = False  # the longer wait of a rank that reports a loss itself was said


class Accusations:
    """Survivors' reports that they lost a rank whose process still runs, each held until it is
    due: the rank is then fenced (hung, or cut off). Both topologies hold reports here: the
    one-node controller fences the rank, a node's agent fails its node.

    A report is not proof. When one rank dies, the ranks that see it first abort the epoch and
    close their links; a peer reading such a closed link blames the live rank that closed it
    (a reset connection looks the same whoever died). Fencing on the first report would then
    kill a healthy rank, and with it maybe the last live replica of a shard (the group restart).
    So a report waits ``settle`` for the real loss to show as a process exit (the generation it
    starts makes the report stale), and ``cascade_settle`` when the accused rank itself reported
    a loss in the same generation: it is alive and answering, not hung. A rank that said goodbye
    (it closed its communicator: :data:`LEFT_MARK`) is on its way out, and its own exit says why
    (a worker that raised: exit code 1, not our SIGKILL): it has ``goodbye_grace``. A rank that
    really hangs says nothing and is fenced after the short wait."""

    def __init__(self, settle: float = REPORT_SETTLE, cascade_settle: float = CASCADE_SETTLE,
                 goodbye_grace: float = LEAVING_GRACE) -> None:
        self._settle = settle
        self._cascade_settle = cascade_settle
        self._goodbye_grace = goodbye_grace
        self._pending: dict[int, _Accusation] = {}  # accused rank -> its first report
        self._reporters: dict[int, set[int]] = {}  # generation -> ranks that reported a peer lost in it

    def __len__(self) -> int:
        return len(self._pending)

    def note(self, report: proto.WorkerReport, slots: Slots, gen: int) -> _Accusation | None:
        """A survivor's report; returns the accusation it starts against a live rank of ``slots``
        (None: a report of another generation, about a rank that exited, is not ours or is
        already accused, or about the reporter itself)."""
        if report.gen != gen:
            return None
        if report.lost >= 0 and report.lost != report.reporter:
            self._reporters.setdefault(gen, set()).add(report.reporter)
        slot = slots.get(report.lost)
        if slot is None or slot.poll() is not None or slot.fenced or report.lost == report.reporter:
            return None
        goodbye = LEFT_MARK in report.detail
        held = self._pending.get(report.lost)
        if held is not None and held.pid == slot.pid:
            held.goodbye = held.goodbye or goodbye  # any report of its goodbye: it is leaving
            return None
        self._pending[report.lost] = accusation = _Accusation(time.monotonic(), slot.pid, report, goodbye)
        return accusation

    def wait(self, accusation: _Accusation) -> float:
        """How long ``accusation`` is held (from its first report), as things stand now."""
        if accusation.goodbye:
            return self._goodbye_grace
        return self._cascade_settle if self._cascade(accusation) else self._settle

    def _cascade(self, accusation: _Accusation) -> bool:
        """The accused rank itself reported a peer lost in the accusation's generation."""
        return accusation.report.lost in self._reporters.get(accusation.report.gen, set())

    def superseded(self, gen: int) -> list[_Accusation]:
        """Drop (and return) the accusations of a generation older than ``gen``: the loss their
        report saw was replaced meanwhile."""
        for old in [g for g in self._reporters if g < gen]:
            del self._reporters[old]
        stale = [rank for rank, accusation in self._pending.items() if accusation.report.gen != gen]
        return [self._pending.pop(rank) for rank in stale]

    def due(self, slots: Slots, gen: int) -> list[tuple[Slot, proto.WorkerReport]]:
        """The accused slots to fence now (each once); reports of an older generation, and ranks
        that exited or were replaced meanwhile, are dropped."""
        self.superseded(gen)
        now, due = time.monotonic(), []
        for rank, accusation in list(self._pending.items()):
            slot, report = slots.get(rank), accusation.report
            if slot is None or slot.pid != accusation.pid or slot.poll() is not None or slot.fenced:
                del self._pending[rank]
                continue
            wait = self.wait(accusation)
            if self._cascade(accusation) and not accusation.goodbye and not accusation.announced:
                accusation.announced = True
                say(f"rank {rank} (pid {accusation.pid}) lost by rank {report.reporter}, but it reports a lost "
                    f"peer itself: waiting up to {wait:g}s for the loss's cause before stopping it")
            if now - accusation.since >= wait:
                del self._pending[rank]
                due.append((slot, report))
        return due
