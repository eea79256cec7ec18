"""``tm.steps(total)``: the training loop's driver, and the optimizer guard's gate.

Per step: a STANDBY runs it as a shadow step until it is assigned and warm, then joins
(:mod:`tmrun.worker.standby`). Otherwise the step is yielded to the script; afterwards:

* the step was aborted (a collective lost a peer): recover, redo the first step not committed
  everywhere (:mod:`tmrun.worker.recovery`);
* else the step is committed; an unplanned plan pending (a failure elsewhere): recover too;
* else go on, publishing the random state the next step starts with; a planned plan pending:
  the migration's boundary (:mod:`tmrun.worker.migration`).
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from tmrun.protocol import environment, keys, orphan_guard
from tmrun.worker import (group, per_rank_records, rng, rng_records, startup_replay, subgroups, untracked_state, vote,
                          warm_imports)
from tmrun.worker.buffers import BufferSnapshot, persistent_buffers
from tmrun.worker.context import Context, Rejoin, log
from tmrun.worker.migration import Migration
from tmrun.worker.recovery import Recovery, settle_heal
from tmrun.worker.roles import Role
from tmrun.worker.standby import Standby


def _lose_vote(spec: str) -> tuple[tuple[int, int] | None, int]:
    if not spec:
        return None, -1
    rank, step, lost = (int(part) for part in spec.split(":"))
    return (rank, step), lost


class StepLoop:
    def __init__(self, ctx: Context, recovery: Recovery, migration: Migration, standby: Standby) -> None:
        self._ctx = ctx
        self._recovery = recovery
        self._migration = migration
        self._standby = standby
        # the random states this rank starts its steps with, for a joiner (tmrun.worker.rng_records)
        self._rng_records = rng_records.Publisher(ctx.require_store, lambda: ctx.rank)
        self._recorded_for = -1  # the step whose start _record_at_start published (random and per-rank state)
        self._begun = -1  # the last step _begin_step began (the same again: a redo)
        self._stateful_at_start: dict[str, Any] = {}  # tracked schedulers, scalers, loaders
        self._buffers_at_start = BufferSnapshot()  # the tracked modules' persistent buffers
        self._untracked_state_adopted = False  # the untracked LR schedulers and gradient scalers were looked for (once)
        self._per_rank_at_start: dict[str, Any] = {}  # tm.track_per_rank's objects
        # ... and what this rank publishes of them for a joiner (tmrun.worker.per_rank_records)
        self._per_rank_records = per_rank_records.Publisher(lambda: ctx.tracked.per_rank_blob(), ctx.require_store,
                                                            lambda: ctx.rank)
        self._voted_for = -1  # the step whose commit vote this rank took part in
        self._vote = environment.commit_vote(os.environ)  # checked by the CLI at start
        # the vote lost a peer on this rank but another survivor committed: apply the update
        self._late_commit = False
        self._ops_at_vote = 0  # the collectives this process had issued when the step's vote ended
        # Test only (tests/e2e/test_mesh.py): TMRUN_TEST_LOSE_VOTE="RANK:STEP:LOST" makes rank
        # RANK treat its commit vote of step STEP as having lost rank LOST, after the vote went
        # through everywhere, while LOST is killed at its optimizer step (a drill): the outcome
        # of a rank lost *during* the vote that reached some members and not others, which no
        # kill from outside hits on purpose.
        self._warm_imports = warm_imports.Publisher()  # what a standby waiting in tmrun.init() imports ahead
        # rank 0's first step: the P2P messages it receives, for a standby's rehearsal (a pipeline's start-up)
        self._startup_recorder: startup_replay.Recorder | None = startup_replay.Recorder()
        self._lose_vote_at, self._lose_vote_of = _lose_vote(os.environ.get("TMRUN_TEST_LOSE_VOTE", ""))

    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        ctx = self._ctx
        step = start
        if not ctx.life.is_(Role.STANDBY) and ctx.committed_step < start - 1:
            ctx.committed_step = start - 1  # resumed from the script's checkpoint of step start - 1
        if not ctx.life.is_(Role.STANDBY):
            ctx.progress.resume_at(start)
        if ctx.in_place and not self._untracked_state_adopted:
            # every role, before any healing: a joiner must track what its donors track
            self._untracked_state_adopted = True
            self._adopt_untracked_state()
        if ctx.pending_join is not None:  # a standby promoted in tmrun.init(): its model is built now
            step = self._standby.heal_after_init()
        while True:
            if ctx.life.is_(Role.STANDBY):
                resume = self._standby.join_if_needed(step, total)
                if resume is not None:
                    step = resume
                    continue
                step = self._standby.shadow_step(step, total)
            if step >= total:
                break
            self._begin_step(step)
            yield step
            if self._startup_recorder is not None and self._startup_recorder.active:
                self._startup_recorder.publish(ctx.require_store())  # the first step's body ran
                self._startup_recorder = None
            self._standby.end_of_step()
            self._migration.finish_handover()
            if ctx.aborted_by is not None:
                aborted, after_body = step, None
                if ctx.committed_step < step:  # undo what the aborted step advanced
                    ctx.tracked.restore_stateful(self._stateful_at_start)
                    self._buffers_at_start.restore()  # batch norm's statistics, moved by its forward
                    if ctx.tracked.per_rank:  # this rank's own, kept in case the others committed the step
                        after_body = ctx.tracked.snapshot_per_rank()
                        ctx.tracked.restore_per_rank(self._per_rank_at_start)
                else:  # this rank's step went through: the boundary into the next one is here
                    log(f"rank {ctx.rank}: step {step} committed and then lost a peer: what the script's collectives "
                        "returned after the loss is void (tm.void); the step is not redone (tm.voided_step: "
                        "redo its evaluation or checkpoint in the next step)")
                    ctx.void_tail = step
                    self._fire_at_boundary(step + 1)
                step = self._recover()
                if after_body is not None and step == aborted + 1:
                    # the others committed the step (this rank received it from them): the state
                    # its own body left is its next step's
                    ctx.tracked.restore_per_rank(after_body)
                continue
            ctx.committed_step = step
            if ctx.void_tail is not None and ctx.void_tail < step:
                ctx.void_tail = None  # the step after it committed: its tail was redone there
            if ctx.in_place and not ctx.life.is_(Role.STANDBY):
                self._warm_imports.after_commit(ctx.require_store(), ctx.rank, step,
                                                lambda: bool(subgroups.mesh_subgroups()))
            self._progress(step)
            if ctx.first_step_due is not None:
                ctx.publish_first_step()  # the recovery's last phase (docs/events.md)
            plan = self._recovery.pending_plan()
            if plan is not None and not plan.planned:
                self._fire_at_boundary(step + 1)
                step = self._recover()  # a failure elsewhere: this rank's step went through
                continue
            step += 1
            self._record_at_start(step)
            if plan is not None:
                try:
                    step = self._migration.at_boundary(plan, done_step=step - 1)
                except Rejoin as again:
                    step = self._standby.rejoin(again.assignment)
        ctx.loop_finished = True
        ctx.drills.steps_ended()
        # a migration's joiner that took over at the last step's boundary (it resumes at
        # ``total``: no step, no optimizer step): its state must be complete before the script
        # reads it, and the leaver waits for its receipt
        self._migration.finish_handover()
        if ctx.in_place and not ctx.life.is_(Role.STANDBY):
            settle_heal(ctx)  # nobody may still be reading this process when it exits
        if ctx.in_place and not ctx.life.is_(Role.STANDBY):
            ctx.require_store().set(keys.done(ctx.rank), str(ctx.committed_step))

    def _fire_at_boundary(self, step: int) -> None:
        """Drills at the start of ``step`` where this rank recovers at the boundary into it
        instead of starting it (a failure elsewhere ended its previous step): two ranks killed
        "at the start of step N" both die, however far apart they reach the boundary (the first
        one's loss would otherwise send the second into recovery before step N)."""
        self._ctx.fire("step", step)

    def _recover(self) -> int:
        try:
            return self._recovery.recover()
        except Rejoin as again:  # a joiner whose generation was superseded before every rank recovered
            return self._standby.rejoin(again.assignment)

    def _begin_step(self, step: int) -> None:
        ctx = self._ctx
        if orphan_guard.orphaned(ctx.env.agent_pid):
            # The agent (supervisor, store, controller) was killed: nobody can replace a rank or
            # collect this job's result any more. The job ends; every worker and standby leaves
            # at its next step boundary (a peer's departure ends a collective in flight, whose
            # recovery then finds the agent gone too), before writing anything of its result.
            log(f"the tmrun agent (pid {ctx.env.agent_pid}) is gone; this worker exits (the job ends)")
            raise SystemExit(1)
        ctx.current_step = step
        self._voted_for = -1  # a redone step votes again
        self._late_commit = False
        if ctx.in_place and not ctx.life.is_(Role.STANDBY):
            # the script made its groups by now: each gets the failure handler and a loss watcher,
            # and the standbys learn whether to wait in tmrun.init() (docs/mesh.md, section 1)
            self._recovery.adopt_groups()
            has_subgroups = bool(subgroups.mesh_subgroups())  # (a standby keeps a background group of all)
            self._warm_imports.at_step_start(ctx.require_store(), ctx.rank, has_subgroups)
            if self._startup_recorder is not None and not self._startup_recorder.active:
                if ctx.rank == 0 and has_subgroups and not ctx.subgroups_published:
                    self._startup_recorder.start()  # what its standby's rehearsal (as rank 0) replays
                else:
                    self._startup_recorder = None
            ctx.publish_subgroups(has_subgroups)
        if ctx.progress.enabled and not ctx.life.is_(Role.STANDBY):
            ctx.progress.bind(ctx.rank, ctx.gen, ctx.life.role.value)
        ctx.progress.begin_step()
        ctx.fire("step")
        ctx.step_rng = rng.capture()
        if ctx.in_place and not ctx.life.is_(Role.STANDBY):
            self._stateful_at_start = ctx.tracked.snapshot_stateful()
            self._buffers_at_start.take([b for module in ctx.tracked.modules() for b in persistent_buffers(module)])
            if ctx.tracked.per_rank:
                self._per_rank_at_start = ctx.tracked.snapshot_per_rank()
        if self._recorded_for != step:
            self._record_at_start(step)
        elif self._begun == step:  # recorded by this rank at its first attempt: a redo
            self._forget_attempt(step)
        self._begun = step

    def _forget_attempt(self, step: int) -> None:
        """``step`` is redone: the records its aborted attempt made at its commit vote (the next
        step's, provisional) are dropped, so the redo's own commit records them anew."""
        ctx = self._ctx
        if not ctx.in_place or ctx.life.is_(Role.STANDBY):
            return
        self._rng_records.at_start(step)
        if ctx.tracked.per_rank:
            self._per_rank_records.at_start(step)

    def _adopt_untracked_state(self) -> None:
        """Track the script's untracked LR schedulers and gradient scaler where unambiguous
        (tmrun.worker.untracked_state); rank 0 (not a standby) says what, in a line each."""
        ctx = self._ctx
        adopted = untracked_state.adopt(ctx.tracked)
        if ctx.rank == 0 and not ctx.life.is_(Role.STANDBY):
            for line in untracked_state.describe(adopted):
                log(line)

    def _progress(self, step: int) -> None:
        """The node's agent sees this step completed (a memory write, see worker.progress)."""
        ctx = self._ctx
        if not ctx.life.is_(Role.STANDBY):
            ctx.drills.observe(ctx.progress.end_step(step, ctx.gen, ctx.life.role.value))

    def _record_at_start(self, step: int) -> None:
        """Publish the state this rank starts ``step`` with, for a joiner that takes this rank
        over, at the boundary into ``step``, where it changed: its random state
        (tmrun.worker.rng_records) and its per-rank state (tmrun.worker.per_rank_records); the
        next step's is recorded at the commit too (:meth:`_record_next`)."""
        ctx = self._ctx
        if ctx.in_place and not ctx.life.is_(Role.STANDBY):
            if ctx.rng_inherited is not None:  # a joiner: what its rank's records knew of the script
                self._rng_records.inherit(ctx.rng_inherited)
                ctx.rng_inherited = None
            if ctx.per_rank_inherited is not None:
                self._per_rank_records.inherit(ctx.per_rank_inherited)
                ctx.per_rank_inherited = None
            self._rng_records.at_start(step)
            self._recorded_for = step
            if ctx.tracked.per_rank:
                self._per_rank_records.at_start(step)

    def _record_next(self) -> None:
        """At the step's commit (just before the commit vote, or before the optimizer step where
        the vote is off): the state the next step starts with, as it stands now, published beside
        the current step's. A rank lost in its optimizer step (or later in the step) leaves its
        joiner the records of the step the group resumes at."""
        ctx = self._ctx
        if ctx.in_place and ctx.life.is_(Role.ACTIVE):
            self._rng_records.at_commit(ctx.current_step)
            if ctx.tracked.per_rank:
                self._per_rank_records.at_commit(ctx.current_step)

    # -- the optimizer guard's gate (tmrun.worker.optimizer.StepGate) -------------------------------

    def step_aborted(self) -> bool:
        """Whether the current step's update must be skipped: this rank lost a peer in it, or
        (the commit vote) any rank did. Every in-place rank votes once per step, at its first
        optimizer step: one tiny all-reduce (MAX of "aborted") over the job's group. A rank
        whose step lost a peer cannot complete that all-reduce (the lost rank takes no part)
        nor can any other: the step is skipped, and redone, on every rank alike. Without the
        vote a rank whose collectives all went through committed a step that another rank of
        the same failure could not: under HSDP the shard of the rank that could not then had
        no holder at the step the others reached, and the job lost its in-place path (1 kill in
        9 at random moments); under DDP that rank was healed past a step it had seen aborted
        (``tm.aborted`` true, and the step not redone). A rank lost *during* the vote can leave
        ranks on both sides (an all-reduce whose result reached some): a rank whose vote lost the
        peer applies its update when another survivor committed (:mod:`tmrun.worker.vote`).
        A later optimizer step of the same step is checked by :meth:`_check_later_update`."""
        ctx = self._ctx
        if self._vote and ctx.in_place and ctx.life.is_(Role.ACTIVE):
            if self._voted_for != ctx.current_step:
                if ctx.aborted_by is None:
                    # before the vote: a rank lost before these writes has not voted, so no rank
                    # commits the step (after it, a rank lost before its records left none for the
                    # step the group resumes at: its per-rank state fell back to the group restart)
                    self._record_next()
                    self._voted_for = ctx.current_step
                    self._commit_vote()
                    self._ops_at_vote = subgroups.operations()
            elif ctx.aborted_by is not None and ctx.committed_step == ctx.current_step:
                self._check_later_update()
                return False
        return ctx.aborted_by is not None and not self._late_commit

    def _check_later_update(self) -> None:
        """Another optimizer step of a step that committed (one optimizer after another), after a
        peer was lost. Stepped back to back, it applies gradients computed before the vote: it
        is applied. With collectives run since the vote (a second model's backward: a GAN's
        generator after its discriminator), its gradients are void, and the step cannot be redone
        either (the first update is applied): every member says so in one line and the job
        falls back to its group restart (its checkpoint), never trains on half a step."""
        ctx = self._ctx
        if subgroups.operations() == self._ops_at_vote:
            return
        why = (f"step {ctx.current_step} applied an optimizer step, then lost a peer in collectives before another "
               "optimizer step of the same step: that update cannot be applied (its gradients are void) nor the "
               "step redone (the first one is applied); falling back to the group restart")
        try:
            ctx.require_store().set(keys.UNHEALABLE, why)
        except dist.DistError:
            pass
        log(f"rank {ctx.rank}: {why}")
        raise SystemExit(1)

    def _commit_vote(self) -> None:
        """The commit vote (see :meth:`step_aborted`): a peer lost in it marks this step aborted
        through the backend's failure handler; a peer that voted "aborted" marks it here. A
        rank whose vote itself lost a peer applies its update if another survivor committed
        the step (:mod:`tmrun.worker.vote`)."""
        flag = torch.zeros(1, dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.process_group())
        ctx = self._ctx
        if self._lose_vote_at == (ctx.rank, ctx.current_step):  # test only: see __init__
            self._recovery.mark_lost(self._lose_vote_of, "PeerLostError: (test) the commit vote lost a peer")
        if ctx.aborted_by is not None:
            self._late_commit = self._decide_after_lost_vote()
        elif int(flag.item()):
            ctx.aborted_by = -1  # another rank's step lost a peer (it reported the loss)

    def _decide_after_lost_vote(self) -> bool:
        """This rank's vote lost a peer (its own step was clean: it voted). Whether to apply the
        update: exactly when another survivor committed the step (tmrun.worker.vote)."""
        ctx = self._ctx
        store = ctx.require_store()
        step = ctx.current_step
        self._recovery.publish_commit(ctx.gen, ctx.committed_step)  # written already where the loss was seen
        try:
            committed = vote.others_committed(store, ctx.gen, ctx.rank, ctx.world_size, step,
                                              lambda: ctx.newest_gen(), time.monotonic() + ctx.env.recovery_timeout)
        except dist.DistError:  # the store's host is gone: the recovery says so
            committed = None
        if committed:
            log(f"rank {ctx.rank}: the commit vote of step {step} lost a peer, and another survivor committed the "
                "step: this rank applies its update too")
        elif committed is None:
            log(f"rank {ctx.rank}: the commit vote of step {step} lost a peer and the survivors' records did not "
                "all arrive; the step is skipped here (healing brings this rank to the step the others reached)")
        return bool(committed)

    def before_optimizer_step(self) -> None:
        self._record_next()  # done at the vote already, unless it is off
        settle_heal(self._ctx)  # deferred healing: the optimizer state read (or no longer read) here
        self._migration.finish_handover()  # a joiner of a migration: its optimizer state is complete
        self._ctx.fire("optimizer")

    def after_optimizer_step(self) -> None:
        self._ctx.committed_step = self._ctx.current_step
