"""What every part of the worker runtime shares, one per process: :class:`Context`.

The parts (:mod:`~tmrun.worker.loop`, :mod:`~tmrun.worker.recovery`,
:mod:`~tmrun.worker.migration`, :mod:`~tmrun.worker.standby`) each keep their own state and
read or change only this: the launch environment, the role, rank and world size, the
generation, the step bookkeeping, the tracked objects, the stores and the failure drills.

Names of what is counted (see :mod:`tmrun.protocol.keys`): *generation* (``gen``) is an in-place
change of the worker group (a rank replaced or migrated; 0 for the group as started); the
rendezvous *epoch* (the whole group restarted) is the agent's business and never seen here.
The native communicator calls its generation ``epoch``: wherever the runtime hands it one, it
is a generation.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from typing import Any, Callable, NoReturn

import torch.distributed as dist

from tmrun.console import say
from tmrun.protocol import keys, messages as proto, orphan_guard
from tmrun.protocol.environment import LaunchEnv, Mode
from tmrun.protocol.stores import open_job_store
from tmrun.worker import (ddp_buckets, gloo_groups, group, pipeline_startup, rehearsal, startup_replay, store_pace,
                          warm_imports)
from tmrun.worker.drills import DrillRunner
from tmrun.worker.interrupt import StepInterrupter
from tmrun.worker.leave import exit_now
from tmrun.worker.progress import ProgressWriter
from tmrun.worker.roles import Lifecycle, Role
from tmrun.worker.tracked import TrackedState

POLL = 0.02  # a standby waiting to be needed
FAST_POLL = 0.002  # a survivor waiting for the plan (downtime)


class RecoveryError(RuntimeError):
    """In-place recovery could not complete (the job falls back to the agent's restart)."""


class Abandoned(RecoveryError):
    """The controller gave in-place recovery up while this process waited (no warm standby in
    time, a shard without a replica...): the group restarts, as torchrun's would. An expected
    end: a rank in recovery leaves with one line (:meth:`Context.leave_for_restart`)."""


class Rejoin(Exception):
    """The controller gave this joiner its rank again in a newer generation (the one it was
    joining was superseded before it recovered): join again with ``assignment``."""

    def __init__(self, assignment: proto.Assignment) -> None:
        super().__init__(f"rejoin as rank {assignment.rank} in generation {assignment.gen}")
        self.assignment = assignment


class Superseded(RecoveryError):
    """A newer generation was published while this process waited inside the change to
    ``gen`` (a rank lost while that generation recovered): the wait is over at once."""

    def __init__(self, gen: int, newest: int, what: str) -> None:
        super().__init__(f"generation {newest} superseded generation {gen} while waiting for {what}")
        self.gen, self.newest = gen, newest


def log(message: str) -> None:
    """One line of the worker: ``[tmrun worker PID HH:MM:SS.mmm] message`` on stderr."""
    say(message, worker=True)


# why a job that trains a DDP model and made subgroups is not replaced in place where its model
# cannot take the survivors' gradient buckets (refuse_in_place; tmrun.worker.ddp_buckets)
DDP_WITH_SUBGROUPS = ("the script trains a DistributedDataParallel model in a job with subgroups (a device mesh, "
                      "dist.new_group): its standby builds after its promotion and must then take the survivors' "
                      "gradient buckets, which it cannot: {why}")


class Context:
    def __init__(self, env: LaunchEnv) -> None:
        standby = env.mode is Mode.STANDBY
        self.env = env
        self.life = Lifecycle(Role.STANDBY if standby else Role.ACTIVE)
        self.rank = 0 if standby else env.rank
        self.world_size = env.world_size
        self.tracked = TrackedState()
        # the start-ups of tracked pipeline schedules: recorded, or a joiner's served from a recording
        self.pipeline_startups = pipeline_startup.Startups(self._startup_peer, log, self.tracked.shard_key)
        self.tracked.on_pipeline = self.pipeline_startups.wrap
        self.store: dist.Store | None = None  # the in-place protocol's prefix of the agent's store
        self.job_store: dist.Store | None = None
        self.gen = 0  # this process's generation of the worker group
        self.current_step = -1
        self.committed_step = -1  # the last step whose update this rank applied
        self.aborted_by: int | None = None  # rank whose loss aborted the current step (-1: unknown)
        # the committed step whose tail (what the script did after its update: an evaluation, a
        # checkpoint) was void, on this rank or, once a change agreed on it, on any: the script
        # redoes it in the next step (tm.voided_step); kept until a later step commits
        self.void_tail: int | None = None
        self.step_rng: dict[str, Any] | None = None  # random state at the start of the current step
        self.rng_inherited: Any = None  # a joiner: its rank's random-state record (step_records.Record), once
        self.per_rank_inherited: Any = None  # a joiner: its rank's per-rank record (step_records.Record), once
        self.fresh = False  # a joiner that has not received the state yet
        self.stop_requested = False  # SIGTERM to a standby
        self.loop_finished = False  # steps() ran its last step (a peer's exit is no loss then)
        self.interrupter = StepInterrupter(doomed=lambda: self.aborted_by is not None,
                                           optimized=self.tracked.optimized_ids)
        self.heal_read: Any = None  # transfer.DeferredRead: the optimizer state still arriving here
        self.handover_arriving = False  # a migration's joiner: the leaver's optimizer state still arriving
        self.heal_served: tuple[int, list[int]] | None = None  # (generation, members still reading this one)
        self.ddp_used = False
        # a standby of a job with subgroups waits in tmrun.init() and builds its model as its rank
        # (docs/mesh.md, section 1): these say it will, and that its healing is still due
        self.join_at_init = False
        self.built_as_rank = False
        self.pending_join: tuple[float, float] | None = None  # (started monotonic, connected Unix time)
        # the assignment a rehearsal was given (tmrun.worker.rehearsal) and when it was read (monotonic)
        self.carried_assignment: tuple[proto.Assignment, float] | None = None
        self.startup_replayer: startup_replay.Replayer | None = None  # a rehearsal's receives (a pipeline's start-up)
        self.subgroups_published = False
        self.recoveries: list[dict[str, float | int]] = []
        self.loss_noticed: float | None = None  # Unix time a collective lost a peer (the change under way)
        self.first_step_due: proto.RecoveryTiming | None = None  # published when healed; first_step follows
        self.drills = DrillRunner.from_environ(-1 if standby else self.rank, promoted=False)
        # (a plain worker too where its agent asked: a job without standbys, whose group restarts
        # the leader measures from these records; under torchrun there is no directory)
        self.progress = ProgressWriter(env.progress_dir)

    def _startup_peer(self) -> tuple[dist.Store, int] | None:
        if self.store is None or self.life.is_(Role.STANDBY):
            return None
        return self.store, self.rank

    @property
    def role(self) -> Role:
        return self.life.role

    @property
    def in_place(self) -> bool:
        return self.env.mode is not Mode.PLAIN

    def fire(self, point: str, step: int | None = None) -> None:
        """Failure drills of ``point`` in ``step`` (default: the current step; never in a
        standby's sandbox)."""
        if not self.life.is_(Role.STANDBY):
            self.drills.fire(point, self.current_step if step is None else step)

    def require_store(self) -> dist.Store:
        assert self.store is not None, "the in-place store (an in-place job only)"
        return self.store

    def comm_store(self) -> dist.Store:
        """Where the runtime's native communicators publish their addresses."""
        return dist.PrefixStore(keys.COMM_PREFIX, self.require_store())

    # -- setup ------------------------------------------------------------------------------

    def connect(self, on_comm_failure: Callable[[BaseException], bool],
                on_term: Callable[[int, object], None]) -> None:
        """Join the process group for this process's mode: torchrun's (plain), the sandbox (a
        standby) or the in-place group through the agent's store (an active rank)."""
        env = self.env
        if env.mode is Mode.PLAIN:
            group.init_plain()
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            # a drill fires once per job: in the first start of the group (no store to claim it in)
            self.drills.claim = lambda index: os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            return
        # a gloo group the script makes is a tmrun background group; another backend's cannot
        # follow a replacement
        gloo_groups.watch(lambda asked: self.refuse_in_place(gloo_groups.why(asked)), group.BACKEND,
                          on_gloo=self._say_gloo_replaced)
        tcp = open_job_store(env, timeout=60)
        store = self.store = dist.PrefixStore(env.store_prefix, tcp)
        job_store = self.job_store = dist.PrefixStore(keys.job_prefix(env.run_id), tcp)
        self.drills.claim = lambda index: job_store.add(keys.drill(index), 1) == 1
        group.set_plane_store(dist.PrefixStore(keys.PLANE_PREFIX, store))
        if env.mode is Mode.STANDBY:
            signal.signal(signal.SIGTERM, on_term)
            assignment, assigned_at, second_run = rehearsal.carried()
            if second_run:  # after a rehearsal: assigned in it (or a cold standby, it failed)
                self.join_at_init = True
                self.carried_assignment = None if assignment is None else (assignment, assigned_at)
                return
            if self._job_has_subgroups():
                if rehearsal.enabled(env.shadow_steps):  # the sandbox as rank 0, run again once assigned
                    self.startup_replayer = startup_replay.replay(self._startup_recording)
                    # what rank 0's set-up imported, before the rehearsal freezes what the process
                    # holds (tmrun.worker.rehearsal.begin): the collection between the two runs,
                    # on the recovery's path, then sees only what the rehearsal made
                    warm_imports.Importer(self.require_store(), log, quiet_if_none=True).poll()
                    rehearsal.begin()
                    group.init_local(env.world_size)
                    return
                self.join_at_init = True  # no sandbox: the runtime waits for the assignment in init()
                return
            group.init_local(env.world_size, dist.PrefixStore(keys.PG_PREFIX, store))
            return
        self.gen = proto.read_gen(store)
        group.init_active(dist.PrefixStore(keys.PG_PREFIX, store), env.rank, env.world_size, env.comm_timeout)
        group.set_failure_handler(on_comm_failure)
        if env.rank == 0:
            store.set(keys.JOB_ID, group.comm().job_id)
        store.set(keys.API, "1")
        store.add(keys.MEMBERS, 1)

    def refuse_in_place(self, why: str) -> None:
        """This job's failures take the group restart (``why``: what makes an in-place replacement
        impossible or unverified): rank 0 says so in one line, every rank records it for the
        controller (which falls back at once, and refuses planned migrations). Not in a standby;
        nothing under plain torchrun, where every failure is a group restart already."""
        if self.env.mode in (Mode.STANDBY, Mode.PLAIN):
            return
        if self.rank == 0:
            log(f"rank 0: {why}: a failure of this job takes the group restart, not an in-place replacement")
        self.require_store().set(keys.UNHEALABLE, why)

    def _say_gloo_replaced(self, asked: str) -> None:
        """Rank 0 (not a standby) says once that the script's gloo group is a tmrun group here."""
        if self.env.mode is not Mode.STANDBY and self.rank == 0:
            log(f"rank 0: {gloo_groups.replaced(asked)}")

    def _job_has_subgroups(self) -> bool:
        """A standby: whether the job's ranks made subgroups (a device mesh, ``new_group``),
        which they say when their first step starts (:meth:`publish_subgroups`); until then the
        standby waits here (watching for the controller's abort, SIGTERM and its agent)."""
        raw = self.await_standby_key(keys.SUBGROUPS)
        return raw == b"1"

    def _startup_recording(self) -> list[Any] | None:
        """A standby's rehearsal at its first receive: the P2P messages rank 0 received in its
        first step (tmrun.worker.startup_replay), once that step's body ran."""
        def check() -> None:
            try:
                self._check_waiting(float("inf"), "rank 0's first step")
            except RecoveryError as gave_up:
                log(f"standby {self.env.standby_id} leaves: {gave_up}")
                exit_now(0)

        store = self.require_store()
        messages = startup_replay.await_recording(store, check)
        if messages is None:
            messages = startup_replay.published_startups(store, 0)
            what = ("with the pipeline start-ups rank 0 recorded before it" if messages is not None
                    else "without the messages rank 0 received in it")
            log(f"standby {self.env.standby_id}: rank 0's first step did not end (within {startup_replay.WAIT:.0f}s, "
                f"or {startup_replay.AFTER_LOSS:.0f}s after a worker reported a lost peer); it rehearses {what}")
        return messages

    def await_standby_key(self, key: str, idle: Callable[[], None] | None = None) -> bytes:
        """A standby waits for ``key`` as long as the job runs. If the controller abandons
        in-place replacement meanwhile (the group restarts with a new pool), this standby is not
        needed: it leaves with one line (exit 0), not a traceback."""
        try:
            return self.await_key(key, float("inf"), poll=POLL / 2, idle=idle)
        except RecoveryError as gave_up:
            log(f"standby {self.env.standby_id} leaves: {gave_up}")
            exit_now(0)

    def publish_subgroups(self, has_subgroups: bool) -> None:
        """An active rank at its first step: whether the job has subgroups (for its standbys)."""
        if not self.subgroups_published:
            self.subgroups_published = True
            self.require_store().set(keys.SUBGROUPS, "1" if has_subgroups else "0")
            if has_subgroups and self.ddp_used:
                why = next(filter(None, map(ddp_buckets.refusal, self.interrupter.ddp_models)), "")
                if why:
                    self.refuse_in_place(DDP_WITH_SUBGROUPS.format(why=why))

    # -- the recovery's instants (docs/events.md; one clock: time.time()) ----------------------------

    def publish_healed(self, connected: float, redone: bool | None = None) -> None:
        """This rank's instants of its recovery into ``gen`` (before it counts itself recovered),
        and whether it redoes the step it was in (None: a joiner)."""
        timing = proto.RecoveryTiming(rank=self.rank, gen=self.gen, connected=connected, healed=time.time(),
                                      noticed=self.loss_noticed, redone=redone)
        self.require_store().set(keys.timing(self.gen, self.rank), timing.encode())
        self.loss_noticed = None
        self.first_step_due = timing

    def publish_first_step(self) -> None:
        """After the first step committed since a recovery: its end, then the counter."""
        timing, self.first_step_due = self.first_step_due, None
        if timing is None or timing.gen != self.gen:
            return  # a later change came first: its record is the one that counts
        store = self.require_store()
        store.set(keys.timing(timing.gen, self.rank), replace(timing, first_step=time.time()).encode())
        store.add(keys.first_steps(timing.gen), 1)

    # -- waiting for the controller ---------------------------------------------------------------

    def await_key(self, key: str, deadline: float, poll: float = POLL,
                  idle: Callable[[], None] | None = None) -> bytes:
        """Wait for ``key`` (polled: a timed-out store wait would log a warning each time),
        watching for the controller's abort, SIGTERM, the agent's death and ``deadline``;
        ``idle`` (a standby's work while it waits) is called between looks, at POLL's pace."""
        try:
            return self._await_key(key, deadline, poll, idle)
        except dist.DistError as exc:  # the store's host (the leader's node) is gone
            if self.env.mode is Mode.STANDBY and self.life.is_(Role.STANDBY):
                log(f"the job's store is gone ({type(exc).__name__}); this standby exits")
                exit_now(1)
            raise RecoveryError(f"lost the job's store while waiting for {key} ({type(exc).__name__})") from None

    def newest_gen(self, wake: "GenerationFile | None" = None, ask_store: bool = True) -> int:
        """The controller's current generation: its file on this node when it has one (``wake``
        re-reads it), else (or with ``ask_store``) the store's ``gen`` key."""
        newest = -1
        if wake is not None and wake.usable:
            wake.changed()
            newest = wake.value()
        if newest < 0 or ask_store:
            newest = max(newest, proto.read_gen(self.require_store()))
        return newest

    def returned_after(self, gen: int) -> set[int]:
        """Ranks that a generation newer than ``gen`` gave back to their process: the migration
        of a superseded planned generation was cancelled before its switch (the leaver keeps
        its rank)."""
        store = self.require_store()
        returned: set[int] = set()
        for newer in range(gen + 1, self.newest_gen() + 1):
            key = keys.plan(newer)
            if store.check([key]):
                returned.update(proto.ReplacementPlan.decode(key, store.get(key)).returned)
        return returned

    def address_getter(self, gen: int) -> Callable[[Any, str], str]:
        """How a change to generation ``gen`` waits for a peer's address (the native bootstrap,
        :mod:`tmrun.comm.native`): polled, and given up at once (:class:`Superseded`) when the
        controller published a newer generation meanwhile (the peer was lost: it will never
        publish), instead of waiting up to the store's timeout. Also watches what
        :meth:`await_key` watches (abort, SIGTERM, the agent's death, the recovery timeout)."""

        # a look: one store check, and every tenth the watch's three (the generation, the abort;
        # store_pace: a large job's survivors, who all read every joiner's address, look less often)
        fast = store_pace.interval(self.world_size, FAST_POLL, requests_per_look=1.3)
        slow = store_pace.interval(self.world_size, POLL, requests_per_look=1.3)

        def get(store: Any, key: str) -> str:
            watch = self.generation_watch(gen, key)
            polls = 0
            while not store.check([key]):
                watch()
                polls += 1
                # fast while a peer is about to publish (the downtime), then at a standby's pace
                time.sleep(fast if polls < 100 else slow)
            value = store.get(key)
            return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)

        return get

    def generation_watch(self, gen: int, what: str) -> Callable[[], None]:
        """A check to call while waiting inside the change to ``gen``: raises :class:`Superseded`
        once the controller published a newer generation (the node's generation file at every
        call when there is one, the store every tenth), and stops as :meth:`await_key` does
        (abort, SIGTERM, the agent's death, the recovery timeout)."""
        wake = GenerationFile(self.env.gen_file)
        deadline = time.monotonic() + self.env.recovery_timeout
        calls = [0]

        def watch() -> None:
            calls[0] += 1
            tenth = calls[0] % 10 == 0
            if tenth or wake.usable:
                newest = self.newest_gen(wake, ask_store=tenth)
                if newest > gen:
                    raise Superseded(gen, newest, what)
            if tenth:
                self._check_waiting(deadline, what)

        return watch

    def reassignment(self, after_gen: int) -> proto.Assignment | None:
        """This standby's assignment, when the controller wrote one newer than ``after_gen``."""
        if self.env.standby_id < 0:
            return None
        key = keys.standby_assign(self.env.standby_id)
        store = self.require_store()
        if not store.check([key]):
            return None
        assignment = proto.Assignment.decode(key, store.get(key))
        return assignment if assignment.gen > after_gen else None

    def await_reassignment(self, after_gen: int, why: str) -> proto.Assignment:
        """A joiner whose generation was superseded: the controller gives it its rank again in
        the newer generation (an unplanned one, while the superseded one recovers). Without one
        within a few seconds the joiner leaves (its rank is replaced like a lost joiner)."""
        deadline = time.monotonic() + 5.0
        while True:
            assignment = self.reassignment(after_gen)
            if assignment is not None and not assignment.stop:
                return assignment
            if time.monotonic() > deadline or (assignment is not None and assignment.stop):
                log(f"joiner: {why}; no new assignment: this joiner leaves (its rank is replaced)")
                exit_now(1)
            self._check_waiting(float("inf"), why)
            time.sleep(POLL)

    def _check_waiting(self, deadline: float, what: str, missing: str = "nothing") -> None:
        """Between two looks at what a waiting worker waits for: the controller gave up, this
        process is asked to stop, its agent is gone, or ``deadline`` passed (``missing`` names
        what did not come, in the error)."""
        store = self.require_store()
        if store.check([keys.ABORT]):
            notice = proto.AbortNotice.decode(keys.ABORT, store.get(keys.ABORT))
            raise Abandoned(f"in-place recovery abandoned by the controller: {notice.reason}")
        if self.stop_requested:
            self._leave(0)
        if orphan_guard.orphaned(self.env.agent_pid):
            self._leave(0)  # orphaned: the agent is gone
        if time.monotonic() > deadline:
            raise RecoveryError(f"{missing} within {self.env.recovery_timeout:.0f}s ({what})")

    def leave_for_restart(self, why: Abandoned) -> NoReturn:
        """A rank in recovery whose recovery the controller gave up: one line, then leave (exit
        1; the agent restarts the group), never a traceback through the script."""
        log(f"rank {self.rank}: {why}; this worker leaves for the group restart")
        self._leave(1)

    def _leave(self, status: int) -> NoReturn:
        """Leave while waiting: a standby (or a joiner not yet healed) at once, with nothing to
        swallow its exit (:func:`tmrun.worker.leave.exit_now`); an active rank unwinds its
        script (``SystemExit``)."""
        if self.life.role in (Role.STANDBY, Role.JOINING):
            exit_now(status)
        raise SystemExit(status)

    def _await_key(self, key: str, deadline: float, poll: float, idle: Callable[[], None] | None) -> bytes:
        store = self.require_store()
        wake = GenerationFile(self.env.gen_file)
        if wake.usable:
            poll = min(poll, FAST_POLL)  # a file read per poll; the store only when it changed ...
            # ... and every `every`-th poll (the key, then the controller's abort): store_pace
            every = store_pace.looks_per_store_ask(self.world_size, poll, 10, requests_per_ask=2)
        else:
            # the key every poll, the abort every tenth (or every poll, once polls are POLL apart)
            poll, every = store_pace.interval(self.world_size, poll, requests_per_look=2), 10
        polls = 0
        while True:
            if (not wake.usable or wake.changed() or polls % every == 0) and store.check([key]):
                return store.get(key)
            polls += 1
            if polls % every and poll < POLL:
                time.sleep(poll)
                continue  # the other checks at POLL's pace
            self._check_waiting(deadline, key, missing="no replacement plan")
            if idle is not None:
                idle()
            time.sleep(poll)


class GenerationFile:
    """The controller's generation file on this node (written after the plan and the
    assignments are in the store): a waiting worker reads it every few milliseconds, which
    costs a small file read, and asks the store only when it changed (and every tenth poll,
    in case it is stale). Not usable when there is none or it cannot be read."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._last: bytes | None = None
        self.usable = bool(path) and self._read() is not None

    def _read(self) -> bytes | None:
        try:
            with open(self._path, "rb") as flag:
                self._last = flag.read()
                return self._last
        except OSError:
            return None

    def changed(self) -> bool:
        previous = self._last
        return self._read() != previous

    def current(self) -> int | None:
        """The generation in the file now (None: it cannot be read)."""
        return None if self._read() is None else self.value()

    def value(self) -> int:
        """The generation last read (-1: none readable)."""
        try:
            return int(self._last or b"-1")
        except ValueError:
            return -1
