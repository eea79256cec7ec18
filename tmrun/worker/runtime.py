"""The worker runtime behind ``tm = tmrun.init()``: ranks, DDP, tracked state and ``steps()``.

In an in-place job (tmrun with standby workers) a failure inside a step never raises into user
code: the collective that lost a peer is absorbed by the "tmrun" backend, the optimizer step is
skipped, and ``steps()`` recovers before it yields again: it waits for the controller's plan,
reconnects only the lost rank's links, lets every member agree on the last committed step,
streams the state to whoever is behind, and re-yields the first step not committed everywhere.

A standby worker runs the same script in a sandbox: collectives are served locally, the first
``TMRUN_SHADOW_STEPS`` steps run as shadow steps (``tm.is_shadow`` is true), then ``steps()``
waits inside until the controller promotes it to a rank.

:class:`Runtime` is a facade; the parts behind it:

* :mod:`tmrun.worker.roles`: the worker's role (STANDBY, JOINING, ACTIVE, RECOVERING,
  SWITCHING, LEAVING) and its transition table;
* :mod:`tmrun.worker.context`: what the parts share (role, rank, generation, steps, stores);
* :mod:`tmrun.worker.loop`: ``steps()``;
* :mod:`tmrun.worker.recovery`: unexpected failures, and the healing every change ends with;
* :mod:`tmrun.worker.migration`: planned migrations (switch step, handover, take-over);
* :mod:`tmrun.worker.standby`: the sandbox, shadow steps, the assignment and the join;
* :mod:`tmrun.worker.optimizer`: the optimizer guard (``tm.optimizer``, ``tm.track``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Any, Iterator

import torch
import torch.distributed as dist

from tmrun.comm import backend as tmrun_backend, ddp as tmrun_ddp
from tmrun.protocol import messages as proto, orphan_guard
from tmrun.protocol.environment import LaunchEnv
from tmrun.worker import drills, gloo_groups, group, optimizer as guarded, pipeline
from tmrun.worker.context import Context, RecoveryError, log
from tmrun.worker.loop import StepLoop
from tmrun.worker.loss_watch import LossWatcher
from tmrun.worker.migration import Migration
from tmrun.worker.recovery import Recovery
from tmrun.worker.roles import Role
from tmrun.worker.standby import Standby

__all__ = ["RecoveryError", "Role", "Runtime", "init"]


class Runtime:
    """What ``tmrun.init()`` returns (one per process)."""

    def __init__(self, env: LaunchEnv) -> None:
        orphan_guard.start(env.agent_pid, log)  # never outlive the agent (a stalled step included)
        self._ctx = ctx = Context(env)
        self._recovery = Recovery(ctx)
        self._migration = Migration(ctx, self._recovery)
        self._standby = Standby(ctx, self._recovery, self._migration)
        self._loop = StepLoop(ctx, self._recovery, self._migration, self._standby)
        self._hooked: set[int] = set()  # DDP and tracked FSDP2 modules given the failure drills' hooks
        ctx.connect(on_comm_failure=self._recovery.on_comm_failure, on_term=self._standby.on_term)
        self._loss_watcher: LossWatcher | None = None
        if ctx.in_place:  # a loss dooms the step at once (tmrun.worker.interrupt)
            self._loss_watcher = LossWatcher(group.comm, self._recovery.on_loss_seen)
            self._loss_watcher.start()
        if ctx.join_at_init:  # a job with subgroups: the standby gets its rank before the script goes on
            self._standby.join_in_init()

    # -- public API -----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def local_rank(self) -> int:
        return self._ctx.env.local_rank

    @property
    def role(self) -> Role:
        """This process's role (see :mod:`tmrun.worker.roles`)."""
        return self._ctx.role

    @property
    def is_standby(self) -> bool:
        return self._ctx.life.is_(Role.STANDBY)

    @property
    def is_shadow(self) -> bool:
        """True during a standby's shadow steps: skip side effects (logging, saving) then."""
        return self._standby.shadow

    @property
    def in_place(self) -> bool:
        return self._ctx.in_place

    @property
    def values(self) -> dict[str, Any]:
        """Plain values given to :meth:`track`; a joiner receives them too."""
        return self._ctx.tracked.values

    @property
    def aborted(self) -> bool:
        """True for the rest of a step that ``steps()`` will yield again: a collective of it lost
        a peer before its update was applied (the update is skipped, the step redone). Its
        values are void too (:attr:`void`)."""
        ctx = self._ctx
        return ctx.aborted_by is not None and ctx.committed_step < ctx.current_step

    @property
    def void(self) -> bool:
        """True for the rest of a step in which a collective lost a peer, redone or not: what the
        script's collectives returned since is void (skip logging, metrics and saving). A step
        is void but not aborted when the loss came after its update was applied (a metrics
        all-reduce after ``opt.step()``): it stays committed and is not yielded again."""
        return self._ctx.aborted_by is not None

    @property
    def voided_step(self) -> int | None:
        """The step before this one, when its *tail* (what the script did after its update was
        applied: an evaluation, a metrics all-reduce, a checkpoint) was void on some rank
        (:attr:`void` there: a peer was lost after the commit) and the step, committed, is not
        redone. Every rank sees it, the joiner too, in the first step ``steps()`` yields after the
        recovery (and in that step again if it is redone), and after the loop when it was the
        last step; ``None`` otherwise. The model, optimizer and tracked values are then exactly as
        that step left them, so a script redoes its evaluation or checkpoint of that step first
        thing, on every rank (they are collectives), and gets torchrun's values. A training-loss
        metric of that step cannot be redone (the lost rank's share of it is gone)."""
        ctx = self._ctx
        tail = ctx.void_tail
        if tail is None or tail != ctx.committed_step or not (ctx.current_step > tail or ctx.loop_finished):
            return None
        return tail

    def refuse_in_place(self, why: str) -> None:
        """Make every failure of this job take the group restart, for ``why`` (a set-up that an
        in-place replacement cannot follow, or gave wrong values with): rank 0 says so in one
        line, the controller falls back at once and refuses planned migrations. Call it on every
        rank (a standby's call does nothing)."""
        self._ctx.refuse_in_place(why)

    @contextlib.contextmanager
    def tolerate_void(self, what: str = "a collective block") -> Iterator[None]:
        """Around code whose collectives can lose a peer mid-way and then fail on what the
        locally served ones returned: a checkpoint save (``torch.distributed.checkpoint`` decodes
        the plans it gathers and broadcasts: a survivor got ``EOFError`` or "Failed to validate
        global plan" and died, turning the failure into the group restart), an evaluation with
        object collectives. An ``Exception`` raised in the block while the step is :attr:`void`
        is swallowed, in one line naming ``what`` and the error: the block's result is void,
        and when it ran after the update, :attr:`voided_step` asks for it again in the next step.
        Raised while the step is not void, it propagates unchanged."""
        try:
            yield
        except Exception as error:
            if not self.void:
                raise
            first = (str(error).splitlines() or [""])[0][:200]
            log(f"rank {self._ctx.rank}: {what} failed in a void step ({type(error).__name__}: {first}); "
                "its result is void: nothing raised")

    def cut_by_a_change(self, error: BaseException) -> bool:
        """Whether ``error`` (an asynchronous checkpoint save's future raised it, say) comes from
        an operation of a script's thread on its gloo group's stand-in that a change of the job's
        members cut off: that save is not finished (DCP wrote no ``.metadata``; nothing loads it)
        and the job goes on; any other error is the script's (:mod:`tmrun.worker.gloo_groups`)."""
        return gloo_groups.cut_by_a_change(error)

    @property
    def committed_step(self) -> int:
        return self._ctx.committed_step

    @property
    def recoveries(self) -> list[dict[str, float | int]]:
        """One entry per change this process went through: generation, seconds, resume step, bytes."""
        return self._ctx.recoveries

    def ddp(self, module: torch.nn.Module, **kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
        """``DistributedDataParallel`` over the job's group (:func:`tmrun.comm.ddp.wrap`), with the
        "forward" and "backward" failure drills."""
        drills.install_hooks(module, self._ctx.fire)
        model = tmrun_ddp.wrap(module, group.process_group(), **kwargs)
        self._adopt_ddp(model, drills_installed=True)
        return model

    def _adopt_ddp(self, model: torch.nn.parallel.DistributedDataParallel, drills_installed: bool = False) -> None:
        """A DDP model of this job, from ``tm.ddp`` or wrapped by the script and given to
        ``tm.track``: failure drills, the standby's DDP warm-up and, in place, the stop of a
        doomed step at the next layer."""
        if id(model) in self._hooked:
            return
        self._hooked.add(id(model))
        if not drills_installed:
            drills.install_hooks(model.module, self._ctx.fire)
        self._ctx.ddp_used = True
        if self._ctx.in_place:
            self._ctx.interrupter.install(model)  # a doomed step stops at the next layer

    def track(self, **objects: Any) -> None:
        """What a joiner receives: modules, optimizers, objects with ``state_dict`` /
        ``load_state_dict``, plain picklable values. A user's optimizer given here keeps being
        stepped as ``opt.step()`` and is guarded (:mod:`tmrun.worker.optimizer`)."""
        self._ctx.tracked.track(**objects)
        for obj in objects.values():
            if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
                self._adopt_ddp(obj)  # wrapped by the script itself rather than by tm.ddp
            elif self._ctx.in_place and pipeline.is_schedule(obj) and id(obj) not in self._hooked:
                self._hooked.add(id(obj))
                for stage in pipeline.stages_of(obj):  # the "forward" and "backward" drills of its stages
                    if not drills.is_sharded(stage.submod):  # (a sharded stage has them from tm.track)
                        drills.install_sharded_hooks(stage.submod, self._ctx.fire)
            elif self._ctx.in_place and drills.is_sharded(obj) and id(obj) not in self._hooked:
                self._hooked.add(id(obj))
                drills.install_sharded_hooks(obj, self._ctx.fire)  # the "forward" and "backward" drills
                self._ctx.interrupter.install_sharded(obj)  # a doomed step stops at the next layer
            if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, guarded.GuardedOptimizer):
                guarded.guard_in_place(obj, self._loop)

    def set_shard(self, label: Any) -> None:
        """Which part of the model this rank holds where no DTensor says so: a pipeline stage's
        index (``tm.set_shard(stage_index)``). Only ranks with equal labels (and equal DTensor
        shards) are replicas: a lost rank is healed from one of them, and the replica check
        compares them alone. Without it a pipeline's stages look like replicas of each other."""
        self._ctx.tracked.set_shard(label)

    def track_per_rank(self, **objects: Any) -> None:
        """State that differs by rank (objects with ``state_dict`` / ``load_state_dict``: a data
        loader keyed by data-parallel rank, a per-rank sampler): a joiner receives the record
        its rank published as it started the step the group resumes at; survivors keep their
        own (rewound to the step's start when they redo it). A step that is not redone
        everywhere leaves every rank's record as its own body left it."""
        self._ctx.tracked.track_per_rank(**objects)

    def optimizer(self, optimizer: torch.optim.Optimizer) -> guarded.GuardedOptimizer:
        """``optimizer`` guarded: its ``step()`` is skipped in an aborted step and counts as the
        step's commit otherwise. Step the returned object (``tm.track`` it too, for joiners)."""
        return guarded.guard(optimizer, self._loop)

    def migrate(self, rank: int | None = None, reason: str = "requested by the job") -> None:
        """Ask the controller to move ``rank`` (default: this one) to a warm standby at the next
        step boundary: the leaver hands its state over, nothing is recomputed."""
        if not self.in_place:
            raise RecoveryError("migration needs tmrun with a standby worker (--standby 1)")
        proto.request_migration(self._ctx.job_store, self._ctx.rank if rank is None else rank, reason)

    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """The step numbers to run, ``start .. total - 1``; a step a failure aborted comes again.
        ``start``: where a script that resumed from its own checkpoint goes on (the checkpoint's
        step + 1); steps before it count as committed. A standby needs none: it is healed from
        the ranks (skip loading the checkpoint where ``tm.is_standby``)."""
        if start < 0 or start > total:
            raise ValueError(f"tm.steps: start must be within 0..{total} (got {start})")
        return self._loop.steps(total, start)


_runtime: Runtime | None = None


def drop_for_second_run() -> None:
    """A standby's rehearsal is over (tmrun.worker.rehearsal): its runtime and every process
    group it made (all local) are dropped; the script's second run starts a new runtime, and
    torch numbers and names its groups from the start again, as the job's ranks did."""
    global _runtime
    if _runtime is not None and _runtime._loss_watcher is not None:
        _runtime._loss_watcher.stop()
    _runtime = None
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a standby between two runs: nothing to save
    if dist.is_initialized():
        dist.destroy_process_group()
    tmrun_backend.forget_groups()
    # DTensor's random-state tracker is made once per process, from the first random op's mesh
    # (the rehearsal's): the second run makes its own, as a fresh process would
    dtensor_random = sys.modules.get("torch.distributed.tensor._random")
    if dtensor_random is not None and getattr(dtensor_random, "_rng_tracker", None) is not None:
        dtensor_random._rng_tracker = None


def init() -> Runtime:
    """Start (or return) this process's runtime. See the module docstring."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime(LaunchEnv.from_environ())
    return _runtime
