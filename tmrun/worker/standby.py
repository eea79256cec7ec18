"""A standby worker: the job's script in a sandbox, warm, until the controller needs it.

The standby runs the same script as the ranks, with every collective served locally (the
backend's local mode: no network). Its first ``TMRUN_SHADOW_STEPS`` steps are *shadow steps*
(``tm.is_shadow``): they build DDP's buckets and warm the allocator and the code paths. Then
``steps()`` reports the standby ready and waits inside for an assignment. Assigned a rank, it
goes STANDBY -> JOINING: it connects for the assigned generation, takes over a migration's
handover if the assignment is planned, and heals (JOINING -> ACTIVE); a member lost on the way
sends it through recovery (JOINING -> RECOVERING -> ACTIVE).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from tmrun.comm import backend as tmrun_backend, native
from tmrun.protocol import keys, messages as proto
from tmrun.worker import compiled_code, ddp_buckets, drills, group, rehearsal, subgroups, warm_imports
from tmrun.worker.context import Context, Rejoin, Superseded, log
from tmrun.worker.leave import exit_now
from tmrun.worker.mesh_slices import SliceMemo
from tmrun.worker.migration import Migration
from tmrun.worker.recovery import Recovery, heal
from tmrun.worker.roles import Role

_T = TypeVar("_T")


class Standby:
    def __init__(self, ctx: Context, recovery: Recovery, migration: Migration) -> None:
        self._ctx = ctx
        self._recovery = recovery
        self._migration = migration
        self._assignment: proto.Assignment | None = None
        self._assigned_at = 0.0
        self._init_planned = False  # promoted in tmrun.init() by a planned migration: take over the leaver's state
        # a planned joiner building its model before the switch: (assignment, its default link's
        # thread, that thread's result)
        self._planned_join: tuple[proto.Assignment, threading.Thread, dict[str, Any]] | None = None
        self.shadow = False  # inside a shadow step
        self.shadow_done = 0
        self._slices = SliceMemo()  # a promoted joiner's set-up slices each mesh once (tmrun.worker.mesh_slices)
        self._ddp_built = ddp_buckets.LocalConstructions()  # and builds its DDP models without its peers

    def on_term(self, signum: int, frame: object) -> None:
        """SIGTERM: a standby leaves at once (it holds nothing to save: waiting, warming up or
        rehearsing; before, it left at its next check, after the module it was importing ahead:
        up to half a second of every job's end); a promoted one unwinds its script."""
        if self._ctx.stop_requested:
            return  # already stopping (SLURM signals every process of a step, the agent its workers)
        self._ctx.stop_requested = True
        if self._ctx.life.is_(Role.STANDBY):
            exit_now(0)
        raise SystemExit(128 + signum)

    # -- the steps of a standby --------------------------------------------------------------------

    def join_if_needed(self, step: int, total: int) -> int | None:
        """Before a standby's step: wait for the assignment once the shadow steps are done, and
        join as soon as it is assigned and warm. Returns the step to resume at after joining,
        or None: run ``shadow_step(step)`` instead."""
        if rehearsal.rehearsing() or rehearsal.left():
            self._rehearse(step, total)
            return None
        if self._assignment is None and step >= min(self._ctx.env.shadow_steps, total):
            self._assignment = self._await_assignment()
        if self._assignment is not None and self._warm():
            return self._join(self._assignment)
        return None

    def _rehearse(self, step: int, total: int) -> None:
        """A rehearsal's step boundary (tmrun.worker.rehearsal): once its shadow steps are done,
        report warm and leave the rehearsal (the script runs again and waits for its rank in
        ``tmrun.init()``); assigned before, leave it with the assignment (the script runs again
        as that rank)."""
        ctx = self._ctx
        if step == 1 and os.environ.get("TMRUN_TEST_REHEARSAL_RAISE"):  # tests only: a script failing in its rehearsal
            raise RuntimeError("test: the rehearsal raises")
        rehearsal.leave_again()  # the script swallowed the rehearsal's end and came back
        if step >= min(ctx.env.shadow_steps, total):
            rehearsal.remember_meshes()
            replayer = ctx.startup_replayer
            if replayer is not None and replayer.replayed:
                log(f"standby {ctx.env.standby_id}: its rehearsal's pipeline start-up received {replayer.replayed} "
                    "messages rank 0 received in its first step (replayed from the job's store)")
            self._report_warm()
            rehearsal.leave_warm()
        key = keys.standby_assign(ctx.env.standby_id)
        store = ctx.require_store()
        if store.check([key]):  # a rank lost before the rehearsal ended: leave it at once
            self._assigned_at = time.monotonic()
            assignment = proto.Assignment.decode(key, store.get(key))
            if assignment.stop:
                exit_now(0)
            log(f"standby {ctx.env.standby_id} assigned rank {assignment.rank} during its rehearsal's step {step}")
            rehearsal.end(assignment, self._assigned_at)

    def shadow_step(self, step: int, total: int) -> int:
        """A shadow step: before waiting, or (a cold standby) after it was assigned."""
        self.shadow = True
        return step % max(total, 1)

    def end_of_step(self) -> None:
        if self.shadow:
            self.shadow = False
            self.shadow_done += 1

    def _warm(self) -> bool:
        """DDP rebuilds its gradient buckets once, with a broadcast, in its second iteration:
        a joiner must have done that locally or its first collectives would not match the
        survivors'. A cold standby therefore runs its two local steps after it is assigned."""
        return not self._ctx.ddp_used or self.shadow_done >= 2

    def _await_assignment(self) -> proto.Assignment:
        ctx = self._ctx
        self._report_warm()
        key = keys.standby_assign(ctx.env.standby_id)
        raw = ctx.await_standby_key(key)
        self._assigned_at = time.monotonic()
        assignment = proto.Assignment.decode(key, raw)
        if assignment.stop:
            exit_now(0)  # the job ends (or needs no standby): nothing may swallow this exit
        if not self._warm():
            log(f"standby {ctx.env.standby_id} assigned rank {assignment.rank} cold: warming up first")
        return assignment

    def _report_warm(self) -> None:
        """The standby's shadow steps are done: say so to the controller (the store) and the log."""
        ctx = self._ctx
        store = ctx.require_store()
        traffic = group.traffic()
        finite = all(bool(torch.isfinite(t).all()) for _, t in ctx.tracked.tensors() if t.is_floating_point())
        time.sleep(drills.standby_ready_delay(ctx.env.standby_id))  # tests only (0 otherwise)
        ready = proto.StandbyReady(pid=os.getpid(), shadow_steps=self.shadow_done, finite=finite, **traffic)
        store.set(keys.standby_ready(ctx.env.standby_id), ready.encode())
        log(
            f"standby {ctx.env.standby_id} warm after {self.shadow_done} shadow steps "
            f"({traffic['local_ops']} collectives served locally, "
            f"{traffic['bytes_sent'] + traffic['bytes_recv']} bytes on the network, "
            f"tracked values {'finite' if finite else 'NOT finite'}); waiting"
        )

    def _join(self, assignment: proto.Assignment) -> int:
        """STANDBY -> JOINING: connect as the assigned rank for the assigned generation, then
        heal (JOINING -> ACTIVE). A newer generation published before this joiner recovered
        gives it its rank again: it joins that one (``Rejoin``)."""
        while True:
            try:
                return self._join_once(assignment)
            except Rejoin as again:
                log(f"rank {assignment.rank}: generation {assignment.gen} was superseded before it recovered; "
                    f"joining generation {again.assignment.gen}")
                assignment = again.assignment

    # -- a job with subgroups: the standby waits in tmrun.init() (docs/mesh.md, section 1) ---------

    def join_in_init(self) -> None:
        """STANDBY -> JOINING inside ``tmrun.init()``: report warm, wait for the assignment, take
        the rank's link in the survivors' default group and put the backend in join mode, so
        that the groups the script creates next (its device mesh) join the survivors' repaired
        communicators. The script then builds its model for this rank's coordinates; ``steps()``
        heals it (:meth:`heal_after_init`)."""
        ctx = self._ctx
        store = ctx.require_store()
        if ctx.carried_assignment is not None:  # assigned in its rehearsal (tmrun.worker.rehearsal)
            assignment, started = ctx.carried_assignment
            ctx.carried_assignment = None
            log(f"standby {ctx.env.standby_id} runs the script again as rank {assignment.rank} after its rehearsal "
                f"({time.monotonic() - started:.3f}s since its assignment)")
        elif rehearsal.waits_warm():  # reported warm in its rehearsal, collected, run again: it waits here
            assignment, started = self._await_after_rehearsal(store)
        else:
            assignment, started = self._await_in_init(store)
        if assignment.stop:
            exit_now(0)  # the job ends (or needs no standby): nothing may swallow this exit
        compiled_code.forget_for_new_rank(assignment.rank, log)
        if assignment.planned:
            self._build_before_switch(assignment, started)
            return
        while True:
            try:
                comm = self._connect(assignment)
                break
            except Superseded as exc:
                assignment = ctx.await_reassignment(assignment.gen, str(exc))
        connected = time.time()
        group.init_joined(dist.PrefixStore(keys.PG_PREFIX, store), comm, ctx.env.comm_timeout)
        group.set_failure_handler(self._recovery.on_comm_failure)
        tmrun_backend.set_joining(assignment.gen, *self._join_waits(assignment))
        # the survivors are recovering, not building: a collective of the script's set-up on the
        # default group would reach them in the middle of their healing (DDP's construction
        # all-gathered there and read garbage); refused like the subgroups' (JoiningCollectiveError)
        group.backend().joined_in = assignment.gen
        ctx.rank = assignment.rank
        ctx.gen = assignment.gen
        ctx.life.to(Role.JOINING)
        ctx.fresh = True
        ctx.built_as_rank = True
        ctx.pending_join = (started, connected)
        ctx.drills.rebind(ctx.rank, promoted=True)
        log(f"promoted to rank {ctx.rank} (generation {ctx.gen}) in tmrun.init(); the script builds its groups "
            f"and model as rank {ctx.rank}")
        self._slices.start()  # until its first steps(): the set-up is on the survivors' critical path
        self._ddp_built.start()  # its DDP models' construction-time collectives: no peer issues them now
        ctx.fire("promotion")

    def _join_waits(self, assignment: proto.Assignment) -> tuple[Callable[[Any, str], str], Callable[[], None]]:
        """How the groups the script creates next wait for the survivors' addresses and links
        (join mode): given up once a newer generation is published. A survivor lost while the
        script builds its groups never publishes its address in them, and the store's own wait
        would last its whole timeout (minutes), long after the survivors moved on. The script is
        half-way through its set-up then, which cannot be resumed as another generation: this
        joiner leaves in one line and its rank goes to another standby, as a lost joiner's does."""
        ctx = self._ctx

        def or_leave(wait: Callable[..., _T]) -> Callable[..., _T]:
            def waiting(*args: Any) -> _T:
                try:
                    return wait(*args)
                except Superseded as exc:
                    log(f"joiner of rank {assignment.rank}: {exc}, while the script built its groups (a survivor "
                        "was lost); this joiner leaves, its rank goes to another standby")
                    exit_now(1)

            return waiting

        return (or_leave(ctx.address_getter(assignment.gen)),
                or_leave(ctx.generation_watch(assignment.gen, f"the groups of generation {assignment.gen}")))

    def _await_after_rehearsal(self, store: dist.Store) -> tuple[proto.Assignment, float]:
        """The second run of a standby that left its rehearsal warm: wait for the assignment
        (the rehearsal reported warm), importing meanwhile what the ranks' first steps imported."""
        assignment, started = self._await_rank(store, warm_imports.Importer(store, log, quiet_if_none=True))
        if not assignment.stop:
            log(f"standby {self._ctx.env.standby_id} runs the script again as rank {assignment.rank} after its "
                "rehearsal (its rehearsal collected before the assignment; the script waited in tmrun.init())")
        return assignment, started

    def _await_in_init(self, store: dist.Store) -> tuple[proto.Assignment, float]:
        """A cold standby of a job with subgroups: report warm, then wait for the assignment,
        importing meanwhile what the ranks' set-up imported."""
        ctx = self._ctx
        time.sleep(drills.standby_ready_delay(ctx.env.standby_id))  # tests only (0 otherwise)
        ready = proto.StandbyReady(pid=os.getpid(), shadow_steps=0, finite=True)
        store.set(keys.standby_ready(ctx.env.standby_id), ready.encode())
        log(f"standby {ctx.env.standby_id} warm in tmrun.init() (the job has subgroups: the script runs "
            f"once this process has a rank); waiting")
        return self._await_rank(store, warm_imports.Importer(store, log))  # meanwhile: what the set-up imported

    def _await_rank(self, store: dist.Store, importer: warm_imports.Importer) -> tuple[proto.Assignment, float]:
        """Wait in ``tmrun.init()`` for this standby's assignment, the importer's poll run
        meanwhile. Returns it and when it was read (``time.monotonic()``)."""
        key = keys.standby_assign(self._ctx.env.standby_id)
        assignment = proto.Assignment.decode(key, self._ctx.await_standby_key(key, idle=importer.poll))
        return assignment, time.monotonic()

    def _build_before_switch(self, assignment: proto.Assignment, started: float) -> None:
        """A planned migration's joiner in ``tmrun.init()``: the leaver trains on until the switch
        step, and this process builds its mesh and model meanwhile, as its rank, every group in
        local mode; its default group's link is made in the background (the join returns when
        the survivors commit at the switch). At its first ``steps()`` each group joins the
        survivors' communicator (:meth:`_join_groups_built`), then it takes the leaver's state."""
        ctx = self._ctx
        result: dict[str, Any] = {}

        def connect() -> None:
            try:
                result["comm"] = self._connect(assignment)
            except BaseException as exc:  # noqa: BLE001  (re-raised on the main thread)
                result["error"] = exc

        thread = threading.Thread(target=connect, name="tmrun-planned-join", daemon=True)
        thread.start()
        group.init_local_as(dist.PrefixStore(keys.PG_PREFIX, ctx.require_store()), assignment.rank, ctx.world_size)
        ctx.rank = assignment.rank
        ctx.gen = assignment.gen
        ctx.life.to(Role.JOINING)
        ctx.fresh = True
        ctx.built_as_rank = True
        ctx.pending_join = (started, 0.0)
        self._planned_join = (assignment, thread, result)
        ctx.drills.rebind(ctx.rank, promoted=True)
        log(f"promoted to rank {ctx.rank} (generation {ctx.gen}) in tmrun.init(); the script builds its groups "
            f"and model as rank {ctx.rank} (in local mode: rank {ctx.rank} trains on until the switch step)")
        ctx.fire("promotion")

    def _join_groups_built(self) -> float:
        """The groups a planned joiner built in local mode join the survivors' communicators of
        its generation: the default group (its link made in the background), then every
        subgroup in creation order, as the survivors repair them at the switch. Returns when
        they were connected (Unix time)."""
        ctx = self._ctx
        assert self._planned_join is not None
        assignment, thread, result = self._planned_join
        self._planned_join = None
        thread.join()
        error = result.get("error")
        if isinstance(error, Superseded):  # a member lost before the switch: the newer generation gives this rank again
            assignment = ctx.await_reassignment(assignment.gen, str(error))
            result = {"comm": self._connect(assignment)}
            ctx.gen = assignment.gen
        elif error is not None:
            raise error
        group.attach(result["comm"])
        group.set_failure_handler(self._recovery.on_comm_failure)
        for pg in subgroups.subgroups():
            if pg.local:
                tmrun_backend.join_later(pg, ctx.gen)
        self._init_planned = assignment.planned
        return time.time()

    def heal_after_init(self) -> int:
        """The first ``steps()`` of a standby promoted in ``tmrun.init()``: its groups are joined
        and its model built; heal it (JOINING -> ACTIVE). Returns the step to resume at."""
        ctx = self._ctx
        assert ctx.pending_join is not None
        started, connected = ctx.pending_join
        ctx.pending_join = None
        # the script's groups join the survivors' in the background (tmrun.comm.backend's
        # _JoinQueue; a join's error is raised here); groups created from now on are new groups
        # of every rank
        reused = self._slices.stop()
        self._ddp_built.stop()
        waiting = time.monotonic()
        joined = tmrun_backend.finish_joins()
        tmrun_backend.set_joining(None)
        if joined:
            log(f"rank {ctx.rank}: the script's {joined} group(s) joined the survivors' in the background "
                f"({time.monotonic() - waiting:.3f}s waited for them after its set-up; {reused} device mesh "
                "slice(s) of its set-up reused)")
        self._finish_rehearsal_meshes()
        try:
            if self._planned_join is not None:
                connected = self._join_groups_built()
            planned, self._init_planned = self._init_planned, False
            if planned:  # the leaver hands its state over (the others heal what it could not)
                self._migration.take_over(ctx.gen)
            return heal(ctx, started=started, aborted_step=-1, connected=connected)
        except native.CommError as exc:
            self._recovery.on_comm_failure(exc)
            log(f"rank {ctx.rank}: lost a member while joining ({exc}); waiting for the next plan")
            return self._recovery.recover()

    def _finish_rehearsal_meshes(self) -> None:
        """After a rehearsal: say how many of the device meshes torch's caches kept from it this
        run's meshes replaced (tmrun.worker.stale_meshes); the others are retired now."""
        replaced, retired = rehearsal.finish_meshes()
        if replaced or retired:
            log(f"rank {self._ctx.rank}: {replaced} device mesh(es) that torch's caches kept from the rehearsal "
                f"replaced by this run's (rank {self._ctx.rank})" + (
                    f", {retired} retired (no mesh of this run matches)" if retired else ""))

    def rejoin(self, assignment: proto.Assignment) -> int:
        """A promoted joiner, past its healing but in a generation not every rank recovered
        into, given its rank again in the newer generation: it joins that one."""
        log(f"rank {assignment.rank}: generation {self._ctx.gen} was superseded before every rank recovered; "
            f"joining generation {assignment.gen}")
        return self._join(assignment)

    def _connect(self, assignment: proto.Assignment) -> native.Communicator:
        """This process's links as ``assignment.rank`` in the survivors' communicator of
        generation ``assignment.gen`` (the native "epoch"); raises Superseded when a newer
        generation is published meanwhile."""
        ctx = self._ctx
        job_id = ctx.require_store().get(keys.JOB_ID).decode()
        return native.join_via_store(
            ctx.comm_store(), assignment.rank, ctx.world_size, job_id, assignment.gen,
            get=ctx.address_getter(assignment.gen),
            watch=ctx.generation_watch(assignment.gen, f"the links of generation {assignment.gen}"),
            timeout=ctx.env.comm_timeout,
            connect_timeout=ctx.env.recovery_timeout,
        )

    def _join_once(self, assignment: proto.Assignment) -> int:
        ctx = self._ctx
        started = self._assigned_at
        if assignment.planned:  # the survivors build the generation's device communicator ahead too
            group.backend().prepare_device_plane(assignment.gen, rank=assignment.rank)
        try:
            comm = self._connect(assignment)
        except Superseded as exc:
            # A member was lost before it published its address for this generation (or before
            # this joiner's links were up): the controller published a newer one, which gives
            # this joiner its rank again and whose members replace its links too
            raise Rejoin(ctx.await_reassignment(assignment.gen, str(exc))) from None
        except native.CommError as exc:
            # a member died while the links came up: the controller replaces it in a newer
            # generation, which gives this joiner its rank again (or cancels its migration)
            raise Rejoin(ctx.await_reassignment(assignment.gen, f"lost a member while connecting ({exc})")) from None
        connected = time.time()
        old = group.attach_replacing(comm)
        if old is not None:
            old.close()  # the superseded generation's links (a joiner joining again)
            self._recovery.clear_abort()
        group.set_failure_handler(self._recovery.on_comm_failure)
        ctx.rank = assignment.rank
        ctx.gen = assignment.gen
        compiled_code.forget_for_new_rank(ctx.rank, log)
        if not ctx.life.is_(Role.JOINING):
            ctx.life.to(Role.JOINING)
        ctx.fresh = True
        ctx.drills.rebind(ctx.rank, promoted=True)
        # a standby keeps its device: its LOCAL_RANK is a spare one (tmrun.launcher.standby_devices)
        log(f"promoted to rank {ctx.rank} (generation {ctx.gen}); LOCAL_RANK {ctx.env.local_rank}")
        ctx.fire("promotion")
        try:
            if subgroups.join_background(ctx.rank, ctx.gen):
                log(f"rank {ctx.rank}: the script's background group(s) made in the sandbox joined the survivors'")
            if assignment.planned:
                self._migration.take_over(assignment.gen)
            return heal(ctx, started=started, aborted_step=-1, connected=connected)
        except Superseded as exc:  # heal's waits: a newer generation gives this joiner its rank again
            raise Rejoin(ctx.await_reassignment(assignment.gen, str(exc))) from None
        except native.CommError as exc:
            self._recovery.on_comm_failure(exc)
            log(f"rank {ctx.rank}: lost a member while joining ({exc}); waiting for the next plan")
            return self._recovery.recover()
