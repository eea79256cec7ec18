"""Recovery from an unexpected failure, and the healing every change of the group ends with.

A collective that loses a peer never raises into the script: the backend calls
:meth:`Recovery.on_comm_failure` (on whichever thread saw it), which marks the step aborted and
reports the loss to the controller; the optimizer skips the step (:mod:`tmrun.worker.optimizer`)
and, at the end of the step, the rank goes RECOVERING (:meth:`Recovery.recover`): it waits for
the controller's plan of the next generation, lets the native communicator reconnect only the
lost rank's links (prepare, commit), and heals. A rank whose own step went through also
recovers as soon as it sees an unplanned plan (:meth:`Recovery.pending_plan`).

:func:`heal` ends every change (recovery, a migration's switch, a standby's promotion): every
member agrees on the last committed step from one allgather
(:func:`tmrun.worker.transfer.agree`), the members that hold it move the state to those
behind (read out of their memory on one host, unless ``TMRUN_HEAL_PATH=socket``; else over the
socket), and the rank resumes ACTIVE at the first step not committed everywhere.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection
from typing import Any, Callable, NoReturn

import torch.distributed as dist

from tmrun.comm import native
from tmrun.comm.backend import TmrunProcessGroup
from tmrun.protocol import keys, messages as proto
from tmrun.worker import (cpu_budget, ddp_buckets, group, per_rank_records, pipeline, pipeline_startup,
                          replica_check, rng, rng_records, step_records, subgroups, vote)
from tmrun.worker.buffers import unsynchronised_buffers
from tmrun.worker.context import FAST_POLL, Abandoned, Context, GenerationFile, RecoveryError, Superseded, log
from tmrun.worker.device_transfer import device_link
from tmrun.worker.roles import Role
from tmrun.worker.transfer import (MISPLACED, READ_TIMEOUT, HealPlan, NoReplicaError, TransferError, agree,
                                   heal as transfer_state)


class Recovery:
    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._cached_plan: proto.ReplacementPlan | None = None
        self._gen_file: GenerationFile | None = None  # the controller's generation file (same node)
        # (generation, aborted_by) change together: a loss seen by the watcher thread for the
        # generation being left must not abort the first step of the next one
        self._lock = threading.Lock()
        # ranks of a generation superseded before this rank's links to them were prepared: the
        # next generation's prepare replaces their links too
        self._folded: set[int] = set()
        # a plan that gives this rank to another process (a migration's leaver that lost a
        # member before its switch step, a fenced rank that came back): set by the migration
        self.on_replaced: Callable[[proto.ReplacementPlan], NoReturn] | None = None
        self._published = (-1, -2)  # (generation, committed step) of this rank's last commit record
        self._subgroups = subgroups.SubgroupWatch(self.on_comm_failure, self.on_subgroup_loss)

    def adopt_groups(self) -> None:
        """Give the subgroups the script created since the last call the failure handler and a
        loss watcher (an active rank, at a step's start)."""
        self._subgroups.adopt()

    # -- failures (any thread) ----------------------------------------------------------------

    def on_comm_failure(self, exc: BaseException, pg: TmrunProcessGroup | None = None) -> bool:
        """The backend's failure handler: True absorbs the error (the step is aborted). ``pg``:
        the subgroup whose collective failed (None: the default group); its lost rank is a
        group rank, reported as the global rank it stands for. Every other group of the
        process is aborted too: the step is redone as a whole (docs/mesh.md, section 2)."""
        if isinstance(exc, native.ProtocolError):
            # Not a lost peer: two live ranks disagree (different collectives, a foreign frame).
            # That is a bug to report, not a member to replace: it raises into the script.
            return False
        lost = getattr(exc, "peer", -1)
        lost = lost if isinstance(lost, int) else -1
        if pg is not None:
            lost = subgroups.to_global(pg, lost)
        self._abort(lost, f"{type(exc).__name__}: {exc}", gen=None, skip=pg if pg is not None else group.backend())
        return True  # absorbed: the step is aborted, not the program

    def on_subgroup_loss(self, epoch: int, lost: int, protocol: bool, message: str, pg: TmrunProcessGroup) -> None:
        """:meth:`on_loss_seen` for a subgroup's communicator (``lost``: a group rank)."""
        self.on_loss_seen(epoch, subgroups.to_global(pg, lost), protocol, message)

    def on_loss_seen(self, epoch: int, lost: int, protocol: bool, message: str) -> None:
        """The loss watcher (:mod:`tmrun.worker.loss_watch`): the communicator recorded a loss
        in generation ``epoch`` while this rank computed. Dooms the step at once (its compute
        stops, :mod:`tmrun.worker.interrupt`) and reports the loss, unless the rank is not
        training (recovering or joining handle their losses themselves, a finished loop has
        none), the peer simply finished its steps and exited, or a migration is under way (the
        survivors retire their links to its leaver when they switch, which the leaver sees as
        a loss before it reaches the switch step itself)."""
        ctx = self._ctx
        if protocol or ctx.loop_finished or not ctx.life.is_(Role.ACTIVE):
            return
        if lost >= 0 and ctx.require_store().check([keys.done(lost)]):
            return  # the peer's loop ended: its process exiting is no failure
        plan = self.pending_plan()
        if plan is not None and plan.planned:
            return  # a migration under way retires links on purpose; its boundary handles losses
        self._abort(lost, f"PeerLostError: {message}", gen=epoch)

    def mark_lost(self, lost: int, detail: str) -> None:
        """The step is aborted by ``lost`` as if a collective had lost it (every group aborted,
        the loss reported); test hooks only (tmrun.worker.loop: TMRUN_TEST_LOSE_VOTE)."""
        group.backend().abort_collectives()
        self._abort(lost, detail, gen=None)

    def _abort(self, lost: int, detail: str, gen: int | None, skip: TmrunProcessGroup | None = None) -> None:
        """Mark the current step aborted by ``lost`` (once), abort every group of the process
        (``skip``: the one whose failure handler runs) and report it; ``gen``: only if the loss
        belongs to this generation."""
        ctx = self._ctx
        with self._lock:
            if ctx.aborted_by is not None or (gen is not None and gen != ctx.gen):
                return
            ctx.loss_noticed = time.time()
            ctx.aborted_by = max(lost, -1)
        # (outside _lock: a group's handler runs under that group's lock, and may call _abort)
        if ctx.life.is_(Role.ACTIVE) and subgroups.subgroups():
            subgroups.abort_all(skip=skip)
        if ctx.life.is_(Role.ACTIVE):
            self.publish_commit(ctx.gen, ctx.committed_step)
        self._report(max(lost, -1), detail)

    def publish_commit(self, gen: int, committed_step: int) -> None:
        """This rank's record for a member whose commit vote lost a peer (tmrun.worker.vote); once
        per generation and step (the loss, then the recovery's start: no second write)."""
        if self._published == (gen, committed_step):
            return
        try:
            vote.publish(self._ctx.require_store(), gen, self._ctx.rank, committed_step)
            self._published = (gen, committed_step)
        except dist.DistError:
            pass  # the store's host is gone: the wait for the plan says so

    def _report(self, lost: int, detail: str) -> None:
        ctx = self._ctx
        store = ctx.require_store()
        message = proto.WorkerReport(reporter=ctx.rank, lost=max(lost, -1), gen=ctx.gen, detail=detail[:300])
        try:
            seq = store.add(keys.REPORT_SEQ, 1) - 1
            store.set(keys.report(seq), message.encode())
        except dist.DistError:
            # the store's host is gone (the lost peer was on it): nobody is left to read the report;
            # the agent says so in its one line, and this rank's wait for a plan ends the same way
            # (a failure handler that raised here printed a traceback through the backend)
            pass

    # -- the controller's plans -----------------------------------------------------------------

    def pending_plan(self) -> proto.ReplacementPlan | None:
        """The next generation's plan, once the controller published it (active ranks only)."""
        ctx = self._ctx
        if not ctx.in_place or ctx.life.is_(Role.STANDBY):
            return None
        store = ctx.require_store()
        key = keys.plan(ctx.gen + 1)
        if self._cached_plan is not None and self._cached_plan.gen == ctx.gen + 1:
            return self._cached_plan
        if ctx.env.gen_file and self._published_gen() <= ctx.gen:
            return None  # the controller's generation file (same node): no store round trip per step
        if not store.check([key]):
            return None
        self._cached_plan = proto.ReplacementPlan.decode(key, store.get(key))
        return self._cached_plan

    def _published_gen(self) -> int:
        """The generation in the controller's file (written after the plan is in the store)."""
        if self._gen_file is None:
            self._gen_file = GenerationFile(self._ctx.env.gen_file)
        published = self._gen_file.current()
        return self._ctx.gen + 1 if published is None else published  # unreadable: ask the store

    def clear_abort(self) -> None:
        """A joiner joining again (its generation was superseded): what the lost generation
        aborted does not carry over to the new communicator."""
        group.clear_aborted()
        with self._lock:
            self._ctx.aborted_by = None

    def superseded(self, plan: proto.ReplacementPlan, exc: Superseded) -> None:
        """A newer generation was published while this rank prepared for ``plan`` (a member was
        lost meanwhile): skip ``plan``'s change; its joiners' links are replaced in the next."""
        ctx = self._ctx
        self._folded.update(set(plan.replaced.keys()) - ctx.returned_after(plan.gen))  # not the cancelled moves
        with self._lock:
            ctx.gen = max(ctx.gen, plan.gen)
            ctx.aborted_by = None
        log(f"rank {ctx.rank}: {exc}; recovering into the newer generation")

    # -- recovering -------------------------------------------------------------------------------

    def recover(self) -> int:
        """ACTIVE or JOINING -> RECOVERING -> ACTIVE: wait for the controller's plan, switch the
        communicator to it, heal; repeat when a member is lost again on the way (each loss gets a
        plan of its own). Returns the step to resume at. Given up by the controller meanwhile:
        one line, and this worker leaves for the group restart."""
        try:
            return self._recover()
        except Abandoned as exc:
            self._ctx.leave_for_restart(exc)

    def _recover(self) -> int:
        ctx = self._ctx
        if not ctx.in_place:
            raise RecoveryError(f"a collective lost rank {ctx.aborted_by} and this job has no standby")
        if ctx.life.is_(Role.ACTIVE):  # for a member whose commit vote lost a peer (tmrun.worker.vote)
            self.publish_commit(ctx.gen, ctx.committed_step)
        ctx.life.to(Role.RECOVERING)
        started = time.monotonic()
        aborted_step = ctx.current_step
        while True:
            key = keys.plan(ctx.gen + 1)
            raw = ctx.await_key(key, started + ctx.env.recovery_timeout, poll=FAST_POLL)
            plan = proto.ReplacementPlan.decode(key, raw)
            if ctx.rank in plan.replaced and self.on_replaced is not None \
                    and ctx.rank not in ctx.returned_after(plan.gen):
                try:
                    self.on_replaced(plan)  # never returns, unless a newer generation gives the rank back
                except Superseded as exc:  # this leaver's migration was cancelled before its switch
                    self.superseded(plan, exc)
                    continue
            ctx.fire("recovery")  # drills: a survivor lost once the plan is out, before its links
            try:
                if ctx.newest_gen() > plan.gen:
                    # a member was lost while this plan's generation was still under way: its
                    # joiners (a migration's too) take their rank again in the newer generation and
                    # no longer connect for this one; nobody commits toward them here
                    raise Superseded(plan.gen, ctx.newest_gen(), "its recovery")
                comm = group.comm()
                # the native communicator's "epoch" is the generation
                replaced = self._folded | set(plan.replaced.keys())
                # every wait for a peer's address gives up (Superseded) once a newer plan is out:
                # a joiner lost before it re-created a subgroup never publishes its address there
                get = ctx.address_getter(plan.gen)

                def move_default(comm=comm, replaced=replaced, gen=plan.gen, get=get) -> None:
                    native.prepare_replacement(ctx.comm_store(), comm, replaced, gen, get=get)
                    native.commit_unless(comm, lambda: ctx.newest_gen() > gen)  # ends if a newer plan comes
                    ctx.fire("subgroups")  # drills: a survivor lost while the joiner builds its groups

                subgroups.move_all(replaced, plan.gen, get, move_default)
                self._folded = set()
                connected = time.time()
                # (not under _lock: the backend calls on_comm_failure under its own)
                group.clear_aborted()
                subgroups.clear_all()
                with self._lock:
                    ctx.gen = plan.gen
                    ctx.aborted_by = None
                return heal(ctx, started=started, aborted_step=aborted_step, connected=connected,
                            replaced=replaced, lost=() if plan.planned else replaced)
            except Superseded as exc:
                self.superseded(plan, exc)
            except native.CommError as exc:
                with self._lock:
                    ctx.gen = max(ctx.gen, plan.gen)
                    ctx.aborted_by = None
                self.on_comm_failure(exc)
                log(f"rank {ctx.rank}: lost a member again during recovery ({exc}); waiting for the next plan")


def _start_pipelines(ctx: Context, store: Any, joined: set[int]) -> None:
    """A joiner runs its pipeline's start-up alone, from the lost rank's recording
    (tmrun.worker.pipeline_startup); where that rank left none, the survivors of its pipeline (of
    every pipeline, where the stages hold DTensors) run the start-up again with it."""
    schedules = len(ctx.tracked.pipelines)
    if ctx.life.is_(Role.JOINING) and not any(map(pipeline.started, ctx.tracked.pipelines)):
        ctx.pipeline_startups.expect_join(ctx.gen, ctx.rank)  # a standby's (or a migration's) new process
        return
    # schedules last started for an evaluation start again for training over the network: the
    # joiner then runs its start-up with them (the network way)
    trained = all(map(pipeline.started, ctx.tracked.pipelines))
    networked = {rank for rank in joined if not pipeline_startup.local_way(store, ctx.gen, rank, schedules, trained)}
    everywhere = bool(networked) and any(map(pipeline.tensor_parallel, ctx.tracked.pipelines))
    if pipeline.restart_where_joined(ctx.tracked.pipelines, networked, everywhere):
        whose = ("every pipeline (the stages hold DTensors: TP or FSDP) runs" if everywhere
                 else f"the pipeline of rank(s) {sorted(networked)} runs")
        why = ("the lost rank left no recording of its own" if trained
               else "the schedules were last started for an evaluation")
        log(f"rank {ctx.rank}: {whose} torch's start-up again at the next step, with the joiner "
            f"(its P2P warm-up and shape inference: {why})")


def heal(ctx: Context, started: float, aborted_step: int, connected: float, replaced: Collection[int] = (),
         lost: Collection[int] = ()) -> int:
    """Agree on the last committed step, move the state to whoever is behind, restore the random
    state the resumed step needs; the rank is ACTIVE afterwards. Returns the step to resume at.
    ``started`` (monotonic) is for the log; ``connected`` (Unix time) is when this rank's links
    to the new generation were up, published with the other instants of its recovery.
    ``replaced``: the ranks the new generation gives to other processes; ``lost``: those of them
    whose process is gone (it publishes no record any more: a survivor reads their records
    before it waits for their joiners)."""
    settle_heal(ctx, skip=replaced, in_change=True)  # what the previous change left to read first
    sharded_reset = ctx.interrupter.reset_sharded()  # FSDP2 blocks a stopped step left unsharded
    with ctx.tracked.walked_once():  # from here no module gains or loses a parameter or buffer
        return _heal(ctx, started, aborted_step, connected, replaced, lost, sharded_reset)


def _heal(ctx: Context, started: float, aborted_step: int, connected: float, replaced: Collection[int],
          lost: Collection[int], sharded_reset: bool) -> int:
    store = ctx.require_store()
    records = step_records.ReadOnce(store)  # the lost ranks' records: checked here, adopted by their joiners
    if not ctx.fresh:  # read while the joiners still build (off their path), not after the agreement
        records.prefetch([rng_records.RANDOM_STATE] + ([per_rank_records.PER_RANK_STATE] if ctx.tracked.per_rank
                                                      else []), lost)
    comm = group.comm()
    shard_key = ctx.tracked.shard_key()
    if ctx.fresh and shard_key and not ctx.built_as_rank:  # built as rank 0 of a standby's sandbox
        shard_key = MISPLACED  # every member refuses the plan at once (a 1-D FSDP job: docs/mesh.md)
    # tracked tensors on the device plane (CUDA on NCCL) heal device to device: no deferral then
    link = device_link(group.backend(), ctx.tracked.tensors())
    overlap, no_overlap_because = cpu_budget.decide()
    try:
        plan = agree(comm, ctx.committed_step, ctx.tracked.layout_digest(), ctx.fresh, ctx.env.heal_reads,
                     state_tensors=None if link is not None else ctx.tracked.tensors(), shard_key=shard_key,
                     overlap=overlap, reset_models=ctx.interrupter.reducers_need_reset(),
                     void_tail=-1 if ctx.void_tail is None else ctx.void_tail,
                     adopt_buckets=ctx.fresh and ddp_buckets.needs_buckets(ctx.interrupter.ddp_models))
        ctx.void_tail = plan.target_step if plan.void_tail else None  # every member, joiners too
        if ctx.tracked.per_rank:
            per_rank_records.check(records, plan.fresh, plan.target_step + 1)
        rng_records.check(records, plan.fresh, plan.target_step + 1)
    except NoReplicaError as exc:  # every member at once: the controller falls back without waiting
        # An expected end, not a bug: one line per worker, then exit for the group restart (a
        # RecoveryError would print a traceback through the script on every rank)
        store.set(keys.UNHEALABLE, str(exc))
        log(f"rank {ctx.rank}: {exc}")
        raise SystemExit(1) from None
    step_meta = {"committed_step": ctx.committed_step}
    healed = transfer_state(comm, ctx.tracked, plan, step_meta, on_donate=lambda: ctx.fire("transfer"),
                            board=StoreCrcBoard(store, ctx.gen), device=link)
    if healed.deferred is not None:  # the optimizer state still arrives (transfer: deferred healing)
        gen, rank = ctx.gen, ctx.rank
        healed.deferred.start(lambda status: store.set(keys.heal_done(gen, rank), status))
        ctx.heal_read = healed.deferred
    if healed.served:
        ctx.heal_served = (ctx.gen, list(healed.served))
    checked = _check_replicas(ctx, comm, shard_key, plan.defer)
    if plan.adopt_buckets:  # before the reset: a joiner's DDP models take their donors' buckets
        _take_donors_buckets(ctx, comm, store, plan)
    if plan.reset_models:  # every member alike: DDP rebuilds its buckets on all of them in one step
        ctx.interrupter.reset_models()
    if ctx.tracked.pipelines:
        _start_pipelines(ctx, store, set(replaced) | set(plan.needy))  # a migration's joiner: not needy
    resume = plan.target_step + 1
    redone = None if ctx.fresh else resume == aborted_step  # the step this survivor was in, recomputed
    if ctx.fresh:
        _say_buffers_lost(ctx, plan.donors_of(comm.rank))
        ctx.rng_inherited = rng_records.adopt(records, ctx.rank, resume)
        if ctx.tracked.per_rank:
            ctx.per_rank_inherited = per_rank_records.adopt(records, ctx.rank, resume, ctx.tracked.apply_per_rank)
    elif redone and ctx.step_rng is not None:
        rng.restore(ctx.step_rng)  # redo the aborted step from the same random state
    comm.barrier()
    ctx.fresh = False
    ctx.committed_step = plan.target_step
    ctx.publish_healed(connected, redone)
    store.add(keys.recovered(ctx.gen), 1)
    elapsed = time.monotonic() - started
    ctx.recoveries.append({"gen": ctx.gen, "seconds": elapsed, "resume": resume, "bytes": healed.nbytes})
    ctx.life.to(Role.ACTIVE)
    rest = "; the optimizer state follows in the background" if healed.deferred is not None else ""
    if plan.read_first:
        because = no_overlap_because or "another member has no CPU core to spare for a background read"
        rest = f"; the optimizer state read before resuming: {because}"
    if plan.reset_models:
        rest += "; DDP reducers reset (their buckets are rebuilt in the second step)"
    if sharded_reset:
        rest += "; FSDP's iteration state reset (the stopped step left it mid-step)"
    rest += (f"; replicas agree ({checked.tensors} tensors, {checked.nbytes / 1e6:.0f} MB checked in "
             f"{checked.seconds:.3f}s)")
    log(
        f"rank {ctx.rank}: recovered into generation {ctx.gen} in {elapsed:.3f}s; "
        f"resume at step {resume} (donors {plan.donors}, healed {plan.needy}, {healed.describe()}{rest})"
    )
    return resume


def _take_donors_buckets(ctx: Context, comm: Any, store: dist.Store, plan: HealPlan) -> None:
    """Members that built their DDP models after their promotion take the gradient buckets of
    a donor of their shard (:mod:`tmrun.worker.ddp_buckets`); each such donor publishes its own
    once. Every member then learns whether every one of them could: where one could not, all
    fall back to the group restart at once, in one line each (a joiner that trained on would
    pair other gradients with the survivors' in its first step)."""
    models = ctx.interrupter.ddp_models
    me = comm.rank
    why = ""
    if me in {plan.donors_of(member)[0] for member in plan.adopt_buckets if plan.donors_of(member)}:
        try:
            published: object = [ddp_buckets.layout(model) for model in models]
        except ddp_buckets.BucketLayoutError as exc:
            why = f"rank {ctx.rank} cannot read its DDP model's gradient buckets: {exc}"
            published = {"error": why}
        store.set(keys.ddp_buckets(ctx.gen, me), json.dumps(published))
    if me in plan.adopt_buckets:
        donor = plan.donors_of(me)[0]
        raw = ctx.await_key(keys.ddp_buckets(ctx.gen, donor), time.monotonic() + ctx.env.recovery_timeout,
                            poll=FAST_POLL)
        targets = json.loads(raw)
        try:
            if isinstance(targets, dict):
                raise ddp_buckets.BucketLayoutError(str(targets.get("error", "no buckets published")))
            if len(targets) != len(models):
                raise ddp_buckets.BucketLayoutError(f"rank {donor} trains {len(targets)} DDP model(s), this "
                                                    f"member {len(models)}")
            changed = sum(ddp_buckets.adopt(model, target) for model, target in zip(models, targets))
        except ddp_buckets.BucketLayoutError as exc:
            why = f"rank {ctx.rank}'s DDP model cannot take rank {donor}'s gradient buckets: {exc}"
        else:
            log(f"rank {ctx.rank}: {changed} of its {len(models)} DDP model(s) took rank {donor}'s gradient buckets "
                "(built after its promotion, they held DDP's first assignment)")
    refused = [member for member, (ok,) in enumerate(replica_check.allgather_ints(comm, [0 if why else 1])) if not ok]
    if refused:
        if why:
            store.set(keys.UNHEALABLE, why)
        log(f"rank {ctx.rank}: " + (why if why else f"rank(s) {refused} could not take their donors' DDP gradient "
                                    "buckets") + "; falling back to the group restart")
        raise SystemExit(1)


def _say_buffers_lost(ctx: Context, donors: list[int]) -> None:
    """A joiner of a job whose buffers are per rank (tmrun.worker.buffers): one line."""
    names = unsynchronised_buffers(ctx.tracked.modules_with_own_buffers())
    if names:
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        log(f"rank {ctx.rank}: the tracked modules keep buffers that no collective synchronises ({shown}; DDP with "
            f"broadcast_buffers=False, FSDP2, or the script's own): the values the lost process held are gone with it, "
            f"and this joiner continues from rank {donors[0] if donors else '?'}'s (a run without the failure gives "
            "the same numbers only if these buffers never differ by rank)")


def _check_replicas(ctx: Context, comm: native.Communicator, shard_key: int, deferred: bool) -> replica_check.Checked:
    """Every group of replicas compares what it holds once healed (tmrun.worker.replica_check);
    a disagreement stops the job: one line, the controller's ``diverged`` event, no restart (a
    restart would train from a checkpoint as if nothing happened; the cause needs a person).
    ``deferred``: the optimizer state is still arriving on the healed members (its own CRC
    checks it when read): the model only. Likewise where a migration's joiner still reads its
    optimizer state in the background (``ctx.handover_arriving``; seen on a 16-core GPU host,
    where the read overlaps: the check read the joiner's optimizer state before it arrived and
    stopped a correct job as diverged)."""
    named = ctx.tracked.replica_tensors()
    later = frozenset(ctx.tracked.deferrable())
    if deferred:
        named = [(name, t) for name, t in named if name.partition(".")[0] not in later]
    try:
        # a migration's joiner whose optimizer state still arrives: its group compares the rest
        return replica_check.check(comm, shard_key, named, f"generation {ctx.gen}", later=later,
                                   arriving=ctx.handover_arriving)
    except replica_check.ReplicasDiverged as exc:
        ctx.require_store().set(keys.DIVERGED, str(exc))
        log(f"rank {ctx.rank}: {exc}")
        raise SystemExit(1) from None


class StoreCrcBoard:
    """Deferred healing's CRCs through the in-place store (transfer.CrcBoard)."""

    def __init__(self, store: dist.Store, gen: int) -> None:
        self._store, self._gen = store, gen

    def put(self, donor: int, needy: int, crc: int) -> None:
        self._store.set(keys.heal_crc(self._gen, donor, needy), str(crc))

    def get(self, donor: int, needy: int, timeout: float) -> int:
        key = keys.heal_crc(self._gen, donor, needy)
        deadline = time.monotonic() + timeout
        while not self._store.check([key]):
            if time.monotonic() > deadline:
                raise TransferError(f"rank {donor} posted no checksum within {timeout:.0f}s")
            time.sleep(0.001)
        return int(self._store.get(key))


def settle_heal(ctx: Context, skip: Collection[int] = (), in_change: bool = False) -> None:
    """Finish what deferred healing left (before an optimizer step, a new change, the end): a
    healed member waits for its optimizer state, a donor until every member it served has read
    it (``skip``: members that are gone). A healed member whose read failed is healed again
    in the change under way (``in_change``: fresh); outside one it cannot step, and stops."""
    read, ctx.heal_read = ctx.heal_read, None
    if read is not None:
        waiting = time.monotonic()
        try:
            read.wait()
        except TransferError as exc:
            if not in_change:
                raise RecoveryError(f"rank {ctx.rank}: {exc}") from None
            log(f"rank {ctx.rank}: {exc}; healed again in this change")
            ctx.fresh = True
        else:
            log(f"rank {ctx.rank}: the optimizer state arrived ({read.nbytes / 1e6:.0f} MB) {read.seconds or 0.0:.3f}s "
                f"after healing; waited {time.monotonic() - waiting:.3f}s for it")
    served, ctx.heal_served = ctx.heal_served, None
    if served is None:
        return
    gen, ranks = served
    store = ctx.require_store()
    deadline = time.monotonic() + READ_TIMEOUT
    # in a change, a generation published meanwhile (a member lost) ends the wait at once (Superseded)
    watch = ctx.generation_watch(max(ctx.gen, ctx.newest_gen()), "the healed members' reads") if in_change else None
    for rank in ranks:
        key = keys.heal_done(gen, rank)
        while rank not in skip and not store.check([key]):
            if watch is not None:
                watch()
            if time.monotonic() > deadline:
                raise RecoveryError(f"rank {rank} did not finish reading the optimizer state within {READ_TIMEOUT:.0f}s")
            time.sleep(0.001)
