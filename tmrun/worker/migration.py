"""Planned migration: a rank moves to a warm standby at a step boundary, nothing is recomputed.

The controller publishes a *planned* plan for the next generation. At the end of every
committed step while it is pending, :meth:`Migration.at_boundary`:

1. fixes the *switch step* (the first rank to see the plan proposes the end of the next step;
   ranks are never more than one step apart, so nobody can be past it);
2. on a rank that stays, prepares the links to the joiner in the background (phase 1);
3. at the switch step, the leaver (ACTIVE -> LEAVING) hands its state over on a 2-member link
   to its joiner and exits (:func:`tmrun.worker.leave.leave`); every other rank
   (ACTIVE -> SWITCHING) commits the links (phase 2) and heals, which lets the joiner take any
   part the handover could not deliver from the other ranks. In a job with subgroups every
   group moves to the new generation there (docs/mesh.md, "Planned migration").

The joiner's side (:meth:`Migration.take_over`, called by :mod:`tmrun.worker.standby`) receives
the model before it returns; where the host has idle cores (:mod:`tmrun.worker.cpu_budget`,
``TMRUN_HEAL_OVERLAP``) the optimizer's state keeps arriving while the joiner computes its
first forward and backward, until :meth:`Migration.finish_handover` (before the optimizer
steps, and at the end of the joiner's first step at the latest); elsewhere it is read before
the joiner resumes.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

from tmrun.comm import native
from tmrun.protocol import keys, messages as proto
from tmrun.worker import cpu_budget, ddp_buckets, group, rng, subgroups
from tmrun.worker.context import Context, RecoveryError, Rejoin, Superseded, log
from tmrun.worker.leave import exit_now, leave
from tmrun.worker.recovery import Recovery, heal, settle_heal
from tmrun.worker.roles import Role
from tmrun.worker.transfer import PendingPart, TransferError, hand_over, take_over


class Migration:
    def __init__(self, ctx: Context, recovery: Recovery) -> None:
        self._ctx = ctx
        self._recovery = recovery
        recovery.on_replaced = self.leave_replaced
        self._prepared_gen = -1  # the generation whose links to the joiner are being built
        self._handover: tuple[Any, PendingPart, float] | None = None  # a joiner's state still arriving

    # -- every rank of the group ------------------------------------------------------------------

    def at_boundary(self, plan: proto.ReplacementPlan, done_step: int) -> int:
        """Called after every committed step while a migration is pending. Returns the step to
        run next (``done_step + 1`` before the switch; after it, the step healing resumes at)."""
        ctx = self._ctx
        store = ctx.require_store()
        switch_at = int(store.compare_set(keys.switch(plan.gen), "", str(done_step + 1)).decode())
        leaving = ctx.rank in plan.replaced
        if not leaving and self._prepared_gen != plan.gen:
            # phase 1 while training goes on: links to the joiner are built in the background
            # (the native communicator's "epoch" is the generation). Subgroups wait for the
            # switch: a joiner promoted in tmrun.init() creates them (publishing its addresses)
            # only once the default group's switch let its join return
            try:
                native.prepare_replacement(ctx.comm_store(), group.comm(), plan.replaced.keys(), plan.gen,
                                           get=ctx.address_getter(plan.gen))
            except Superseded as exc:  # the joiner was lost before it published its address
                self._recovery.superseded(plan, exc)
                return self._recovery.recover()
            self._prepared_gen = plan.gen
            # and the default group's device communicator of the plan's generation (two-phase:
            # no NCCL init at the switch); the joiner builds its side as it waits for its links
            group.backend().prepare_device_plane(plan.gen)
            ctx.fire("switch")  # drills: a rank that stays, killed while the migration is under way
        if done_step < switch_at:
            return done_step + 1
        if done_step > switch_at:
            raise RecoveryError(f"rank {ctx.rank} passed the switch step {switch_at} of generation {plan.gen}")
        started = time.monotonic()
        if leaving:
            try:
                if ctx.rank in ctx.returned_after(plan.gen):  # a member was lost: the migration is cancelled
                    raise Superseded(plan.gen, ctx.newest_gen(), "the migration's switch")
                settle_heal(ctx, skip=plan.replaced.keys(), in_change=True)  # nobody reads this process any more
                ctx.interrupter.reset_sharded()  # FSDP2's root, unsharded by an evaluation's forward: its shards
                self._hand_over(plan, switch_at, rng.capture())
            except Superseded as exc:  # this rank stays: it recovers into the newer generation
                self._recovery.superseded(plan, exc)
                return self._recovery.recover()
        ctx.loss_noticed = time.time()  # a migration's "noticed": training stopped at the switch
        ctx.life.to(Role.SWITCHING)
        try:
            if ctx.newest_gen() > plan.gen:
                # a member was lost before the switch (the joiner, or a rank that stays; the
                # controller published a newer generation meanwhile, which cancels this migration
                # or replaces its lost joiner): no survivor commits toward this generation's joiner
                # (each would wait out its connect timeout, and the ones still in the switch would
                # then count the others lost); all recover into the newer generation, which
                # replaces the links prepared for this one
                raise Superseded(plan.gen, ctx.newest_gen(), "the migration's switch")
            # phase 2, at the step boundary. Every group moves to the plan's generation, in the
            # order of a recovery (docs/mesh.md, section 2): the subgroups without the leaver
            # (a resynchronisation: nothing is in flight at a step boundary), the default group,
            # then the leaver's subgroups in creation order, each as the joiner re-creates it
            # (its script builds its mesh once the default group's switch let its join return)
            # the default group's links were prepared in phase 1; a rank lost just as this one got
            # here (the newer generation published after the check above) ends the commit at once
            subgroups.move_all(plan.replaced.keys(), plan.gen, ctx.address_getter(plan.gen),
                               lambda: native.commit_unless(group.comm(), lambda: ctx.newest_gen() > plan.gen))
            ctx.gen = plan.gen
            return heal(ctx, started=started, aborted_step=-1, connected=time.time(), replaced=plan.replaced.keys())
        except Superseded as exc:  # the joiner was lost before it re-created a subgroup
            self._recovery.superseded(plan, exc)
            return self._recovery.recover()
        except native.CommError as exc:  # a member (the joiner, another rank) lost during the switch
            ctx.gen = max(ctx.gen, plan.gen)
            self._recovery.on_comm_failure(exc)
            log(f"rank {ctx.rank}: lost a member during the migration's switch ({exc}); waiting for the next plan")
            return self._recovery.recover()

    def _handoff_comm(self, plan_gen: int, rank: int) -> Any:
        """A 2-member link between this rank's leaver (0) and joiner (1), made for generation
        ``plan_gen`` (its own native epoch is 0: a new communicator)."""
        ctx = self._ctx
        store = ctx.require_store()
        job_id = store.get(keys.JOB_ID).decode()
        return native.connect_via_store(
            ctx.comm_store(), rank, 2, f"{job_id}/handoff{plan_gen}/{ctx.rank}", 0,
            prefix=keys.handoff_prefix(plan_gen, ctx.rank), timeout=ctx.env.comm_timeout,
            # the leaver gives up once a newer generation shows its joiner was lost; the joiner
            # waits for its live leaver whatever happens elsewhere
            get=ctx.address_getter(plan_gen) if rank == 0 else None,
            connect_timeout=ctx.env.recovery_timeout, op_timeout=ctx.env.recovery_timeout,
        )

    # -- the leaver -------------------------------------------------------------------------------

    def leave_replaced(self, plan: proto.ReplacementPlan) -> NoReturn:
        """Recovering, this rank found a plan that gives it to another process. A migration's
        leaver (a member was lost before the switch step) still hands its last committed state
        to its joiner, then leaves; a process replaced by an unplanned plan (it was fenced, or
        cut off, and came back) leaves at once: it must not touch the new generation."""
        ctx = self._ctx
        again = ctx.reassignment(plan.gen - 1)
        if again is not None and again.gen == plan.gen and not again.stop:
            raise Rejoin(again)  # a joiner that had not recovered: it reconnects for this generation
        if not plan.planned:
            log(f"rank {ctx.rank}: generation {plan.gen} gave this rank to another process; this process leaves")
            raise SystemExit(1)
        settle_heal(ctx, skip=plan.replaced.keys(), in_change=True)
        redo = ctx.committed_step < ctx.current_step and ctx.step_rng is not None
        log(f"rank {ctx.rank}: a member was lost before the switch step of generation {plan.gen}; "
            f"handing over the state of step {ctx.committed_step}")
        self._hand_over(plan, ctx.committed_step, ctx.step_rng if redo else rng.capture())

    def _hand_over(self, plan: proto.ReplacementPlan, switch_at: int, rng_state: Any) -> NoReturn:
        """ACTIVE (or RECOVERING) -> LEAVING: stream the state to the joiner (the model first,
        then the optimizer's state, which the joiner receives while it computes), then leave
        cleanly. ``rng_state``: the random state the joiner's first step starts from. Raises
        :class:`Superseded` (still ACTIVE or RECOVERING) when a newer generation cancelled the
        migration before the joiner connected: this rank stays."""
        ctx = self._ctx
        started = time.monotonic()
        try:
            handoff = self._handoff_comm(plan.gen, 0)
        except Superseded as exc:
            if ctx.rank in ctx.returned_after(plan.gen):
                raise  # a member was lost before the switch: the migration is cancelled, this rank stays
            # the joiner was lost before it connected: the newer generation gives this rank to
            # another standby, which heals from the other ranks; nothing is left to hand over
            handoff, nobody = None, exc
        ctx.life.to(Role.LEAVING)
        if handoff is None:
            log(f"rank {ctx.rank}: {nobody}; nobody to hand over to: leaving")
            leave()
        try:
            ctx.fire("handover")
            meta = {"committed_step": switch_at, "rng": rng_state}
            if ctx.tracked.per_rank:
                meta["per_rank"] = ctx.tracked.per_rank_blob()  # this rank's own (tm.track_per_rank)
            if ctx.interrupter.ddp_models and subgroups.mesh_subgroups():
                # the joiner of a job with subgroups built its DDP models before the switch: it
                # takes their buckets (a DDP job's standby rebuilt its own in its shadow steps;
                # reading them costs a gradient-sized allocation, not spent where not needed)
                meta["ddp_buckets"] = [ddp_buckets.layout(model) for model in ctx.interrupter.ddp_models]
            moved = hand_over(handoff, ctx.tracked, meta, same_host_reads=ctx.env.same_host_reads)
        finally:
            handoff.close()
        log(f"rank {ctx.rank}: handed {moved} bytes to the joiner in {time.monotonic() - started:.3f}s; leaving")
        leave()

    # -- the joiner -------------------------------------------------------------------------------

    def take_over(self, plan_gen: int) -> None:
        """A JOINING rank of a migration: receive the model from the leaver; the optimizer's state
        keeps arriving in the background until :meth:`finish_handover`, or (no core to spare for
        that: :mod:`tmrun.worker.cpu_budget`) is read before this returns. If the leaver cannot
        hand over (it died, its state arrived damaged), this joiner stays fresh and heals from
        the other ranks, which hold the same committed state."""
        ctx = self._ctx
        started = time.monotonic()
        handoff = None
        # the optimizer state's read overlaps with the first step only where cores are idle
        overlap, because = cpu_budget.decide()
        try:
            handoff = self._handoff_comm(plan_gen, 1)
            meta, pending, received = take_over(handoff, ctx.tracked, same_host_reads=ctx.env.same_host_reads)
            model_took = time.monotonic() - started
            if not overlap:
                pending.finish()  # the leaver only waits meanwhile: the read has its core
        except BaseException as exc:
            if handoff is not None:
                handoff.close()
            if not isinstance(exc, (native.CommError, TransferError)):
                raise
            log(f"rank {ctx.rank}: the leaver's handover failed ({exc}); healing from the other ranks instead")
            return
        if overlap:
            self._handover = (handoff, pending, started)
            ctx.handover_arriving = True
        else:
            handoff.close()
        ctx.committed_step = int(meta["committed_step"])  # type: ignore[call-overload]
        rng.restore(meta["rng"])  # type: ignore[arg-type]
        if ctx.tracked.per_rank and "per_rank" in meta:
            ctx.tracked.apply_per_rank(meta["per_rank"])  # type: ignore[arg-type]
        self._take_leavers_buckets(meta.get("ddp_buckets"))
        ctx.fresh = False
        log(f"rank {ctx.rank}: received the model ({received} bytes) in {model_took:.3f}s ({pending.path}); "
            f"{pending.nbytes} bytes of optimizer state "
            + ("follow in the background" if overlap else f"read before resuming: {because}"))
        if not overlap:
            self._log_complete(pending.nbytes, started)

    def _take_leavers_buckets(self, targets: Any) -> None:
        """This joiner's DDP models, built before the switch, take the leaver's gradient buckets
        (:mod:`tmrun.worker.ddp_buckets`); the survivors keep theirs, as at any migration. One that
        cannot would pair other gradients with theirs in its first step: this joiner fails then
        (a failure of its rank, replaced like any), never trains on."""
        models = self._ctx.interrupter.ddp_models
        if not models or not ddp_buckets.needs_buckets(models):
            return
        try:
            if targets is None or len(targets) != len(models):
                raise ddp_buckets.BucketLayoutError(f"the leaver handed over buckets for {len(targets or [])} "
                                                    f"DDP model(s), this joiner trains {len(models)}")
            changed = sum(ddp_buckets.adopt(model, target) for model, target in zip(models, targets))
        except ddp_buckets.BucketLayoutError as exc:
            log(f"rank {self._ctx.rank}: its DDP model cannot take the leaver's gradient buckets ({exc}); this "
                "joiner leaves, and its rank is replaced as a lost one")
            exit_now(1)
        log(f"rank {self._ctx.rank}: {changed} of its {len(models)} DDP model(s) took the leaver's gradient buckets")

    def finish_handover(self) -> None:
        """Wait for the rest of a migration's state (nothing to do unless a handover is pending)."""
        if self._handover is None:
            return
        handoff, pending, started = self._handover
        self._handover = None
        try:
            pending.finish()
        finally:
            self._ctx.handover_arriving = False
            handoff.close()
        self._log_complete(pending.nbytes, started)

    def _log_complete(self, nbytes: int, started: float) -> None:
        log(f"rank {self._ctx.rank}: optimizer state complete ({nbytes} bytes), "
            f"{time.monotonic() - started:.3f}s after the handover began")
