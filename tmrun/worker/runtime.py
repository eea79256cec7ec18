"""The worker runtime behind ``tm = tmrun.init()``: ranks, DDP, tracked state and ``steps()``.

In an in-place job (tmrun with standby workers) a failure inside a step never raises into user
code: the collective that lost a peer is absorbed by the "tmrun" backend, the optimizer step is
skipped, and ``steps()`` recovers before it yields again: it waits for the controller's plan,
reconnects only the lost rank's links, lets every member agree on the last committed step,
streams the state to whoever is behind, and re-yields the first step not committed everywhere.

A standby worker runs the same script in a sandbox: collectives are served locally, the first
``TMRUN_SHADOW_STEPS`` steps run as shadow steps (``tm.is_shadow`` is true), then ``steps()``
waits inside until the controller promotes it to a rank.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
import types
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from tmrun.comm import native
from tmrun.protocol import keys, messages as proto
from tmrun.worker import group, rng
from tmrun.worker.drills import DrillRunner
from tmrun.protocol.environment import LaunchEnv, Mode
from tmrun.worker.leave import leave
from tmrun.worker.tracked import TrackedState
from tmrun.worker.transfer import PendingPart, TransferError, agree, hand_over, heal, take_over

POLL = 0.02  # a standby waiting to be needed
FAST_POLL = 0.002  # a survivor waiting for the plan (downtime)


class RecoveryError(RuntimeError):
    """In-place recovery could not complete (the job falls back to the agent's restart)."""


def _log(message: str) -> None:
    now = time.time()  # one reading: seconds and milliseconds of the same instant
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    # one write per line: stderr is write-through, and print() writes the newline separately, so
    # lines of processes sharing the file could be glued together
    sys.stderr.write(f"[tmrun worker {os.getpid()} {stamp}] {message}\n")
    sys.stderr.flush()


class Runtime:
    """What ``tmrun.init()`` returns (one per process)."""

    def __init__(self, env: LaunchEnv) -> None:
        self._env = env
        self._rank = env.rank if env.mode is not Mode.STANDBY else 0
        self._world_size = env.world_size
        self._standby = env.mode is Mode.STANDBY
        self._shadow = False
        self._state = TrackedState()
        self._store: dist.Store | None = None
        self._job_store: dist.Store | None = None
        self._gen = 0
        self._aborted_by: int | None = None  # rank whose loss aborted the current step
        self._current_step = -1
        self._committed_step = -1
        self._step_rng: dict[str, Any] | None = None
        self._stop_requested = False
        self._fresh = False  # a joiner that has not received the state yet
        self._rng_recorded_for = -1
        self._assignment: proto.Assignment | None = None
        self._assigned_at = 0.0
        self._shadow_done = 0
        self._ddp_used = False
        self._rng_published: dict[str, Any] | None = None
        self._cached_plan: proto.ReplacementPlan | None = None
        self._prepared_gen = -1
        self._handover: tuple[Any, PendingPart, float] | None = None  # a migration's state still arriving
        self.recoveries: list[dict[str, float | int]] = []
        self._drills = DrillRunner.from_environ(self._rank if not self._standby else -1, promoted=False)
        self._connect()

    # -- public API -----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._env.local_rank

    @property
    def is_standby(self) -> bool:
        return self._standby

    @property
    def is_shadow(self) -> bool:
        """True during a standby's shadow steps: skip side effects (logging, saving) then."""
        return self._shadow

    @property
    def in_place(self) -> bool:
        return self._env.mode is not Mode.PLAIN

    @property
    def values(self) -> dict[str, Any]:
        """Plain values given to :meth:`track`; a joiner receives them too."""
        return self._state.values

    @property
    def aborted(self) -> bool:
        """True for the rest of a step whose collectives lost a peer: its results are void and
        ``steps()`` will yield it again (skip logging metrics of such a step)."""
        return self._aborted_by is not None

    @property
    def committed_step(self) -> int:
        return self._committed_step

    def ddp(self, module: torch.nn.Module, **kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
        self._install_drill_hooks(module)
        self._ddp_used = True
        return torch.nn.parallel.DistributedDataParallel(module, process_group=group.process_group(), **kwargs)

    def _fire(self, point: str) -> None:
        if not self._standby:
            self._drills.fire(point, self._current_step)

    def _install_drill_hooks(self, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(lambda *_: self._fire("forward"))
        params = [p for p in module.parameters() if p.requires_grad]
        if params:  # the last parameter's gradient is among the first of backward
            params[-1].register_hook(lambda grad: (self._fire("backward"), grad)[1])

    def migrate(self, rank: int | None = None, reason: str = "requested by the job") -> None:
        """Ask the controller to move ``rank`` (default: this one) to a warm standby at the next
        step boundary: the leaver hands its state over, nothing is recomputed."""
        if not self.in_place:
            raise RecoveryError("migration needs tmrun with a standby worker (--standby 1)")
        proto.request_migration(self._job_store, self._rank if rank is None else rank, reason)

    def track(self, **objects: Any) -> None:
        self._state.track(**objects)
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                self._guard_optimizer(obj)

    def steps(self, total: int) -> Iterator[int]:
        step = 0
        while True:
            if self._standby:
                if self._assignment is None and step >= min(self._env.shadow_steps, total):
                    self._assignment = self._await_assignment()
                if self._assignment is not None and self._warm():
                    step = self._join(self._assignment)
                    continue
                # a shadow step: before waiting, or (a cold standby) after it was assigned
                self._shadow = True
                step %= max(total, 1)
            if step >= total:
                break
            self._begin_step(step)
            yield step
            if self._shadow:
                self._shadow = False
                self._shadow_done += 1
            self._finish_handover()
            if self._aborted_by is not None:
                step = self._recover()
                continue
            self._committed_step = step
            plan = self._pending_plan()
            if plan is not None and not plan.planned:
                step = self._recover()  # a failure elsewhere: this rank's step went through
                continue
            step += 1
            self._record_rng(step)
            if plan is not None:
                step = self._planned_boundary(plan, done_step=step - 1)
        if self.in_place and not self._standby:
            assert self._store is not None
            self._store.set(keys.done(self._rank), str(self._committed_step))

    # -- setup ------------------------------------------------------------------------------

    def _connect(self) -> None:
        env = self._env
        if env.mode is Mode.PLAIN:
            group.init_plain()
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
            return
        tcp = dist.TCPStore(
            env.store_host, env.store_port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False
        )
        self._store = dist.PrefixStore(env.store_prefix, tcp)
        job_store = dist.PrefixStore(keys.job_prefix(env.run_id), tcp)
        self._job_store = job_store
        self._drills.claim = lambda index: job_store.add(keys.drill(index), 1) == 1
        if env.mode is Mode.STANDBY:
            signal.signal(signal.SIGTERM, self._on_term)
            group.init_local(env.world_size)
            return
        self._gen = proto.read_gen(self._store)
        group.init_active(dist.PrefixStore(keys.PG_PREFIX, self._store), env.rank, env.world_size, env.comm_timeout)
        group.set_failure_handler(self._on_comm_failure)
        if env.rank == 0:
            self._store.set(keys.JOB_ID, group.comm().job_id)
        self._store.set(keys.API, "1")
        self._store.add(keys.MEMBERS, 1)

    def _on_term(self, signum: int, frame: object) -> None:
        self._stop_requested = True
        if not self._standby:
            raise SystemExit(128 + signum)

    def _guard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        original = optimizer.step
        runtime = self

        def guarded_step(self_: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if runtime._aborted_by is not None:
                return None  # a collective of this step lost a peer: never apply a partial update
            runtime._finish_handover()  # a joiner of a migration: its optimizer state is complete
            runtime._fire("optimizer")
            result = original(*args, **kwargs)
            runtime._committed_step = runtime._current_step
            return result

        optimizer.step = types.MethodType(guarded_step, optimizer)  # type: ignore[method-assign]

    # -- steps --------------------------------------------------------------------------------

    def _begin_step(self, step: int) -> None:
        self._current_step = step
        self._fire("step")
        self._step_rng = rng.capture()
        if self._rng_recorded_for != step:
            self._record_rng(step)

    def _record_rng(self, step: int) -> None:
        """Publish the random state this rank starts ``step`` with (a joiner taking this rank
        over continues from it). Written when a step commits, so a rank that dies at the very
        start of the next step has already left it behind; skipped while the state is the one
        already published (a loop that draws no random numbers costs no store write)."""
        if self.in_place and not self._standby:
            assert self._store is not None
            states = rng.capture()
            if self._rng_published is None or not rng.same(states, self._rng_published):
                self._store.set(keys.rng(self._rank), pickle.dumps((step, states)))
                self._rng_published = states
            self._rng_recorded_for = step

    def _on_comm_failure(self, exc: BaseException) -> bool:
        if isinstance(exc, native.ProtocolError):
            # Not a lost peer: two live ranks disagree (different collectives, a foreign frame).
            # That is a bug to report, not a member to replace: it raises into the script.
            return False
        lost = getattr(exc, "peer", -1)
        if self._aborted_by is None:
            self._aborted_by = lost if isinstance(lost, int) else -1
            self._report(self._aborted_by, f"{type(exc).__name__}: {exc}")
        return True  # absorbed: the step is aborted, not the program

    def _report(self, lost: int, detail: str) -> None:
        assert self._store is not None
        seq = self._store.add(keys.REPORT_SEQ, 1) - 1
        message = proto.WorkerReport(reporter=self._rank, lost=max(lost, -1), gen=self._gen, detail=detail[:300])
        self._store.set(keys.report(seq), message.encode())

    def _pending_plan(self) -> proto.ReplacementPlan | None:
        """The next generation's plan, once the controller published it."""
        if not self.in_place or self._standby:
            return None
        assert self._store is not None
        key = keys.plan(self._gen + 1)
        if self._cached_plan is not None and self._cached_plan.gen == self._gen + 1:
            return self._cached_plan
        if self._env.gen_file and self._published_gen() <= self._gen:
            return None  # the controller's generation file (same node): no store round trip per step
        if not self._store.check([key]):
            return None
        self._cached_plan = proto.ReplacementPlan.decode(key, self._store.get(key))
        return self._cached_plan

    def _published_gen(self) -> int:
        """The generation in the controller's file (written after the plan is in the store)."""
        try:
            with open(self._env.gen_file, "rb") as flag:
                return int(flag.read() or b"0")
        except (OSError, ValueError):
            return self._gen + 1  # unreadable: ask the store

    # -- planned migration ------------------------------------------------------------------

    def _planned_boundary(self, plan: proto.ReplacementPlan, done_step: int) -> int:
        """Called after every committed step while a migration is pending. Ranks are never
        more than one step apart (every step has a collective), so the first rank to see the
        plan fixes the switch at the end of the *next* step: nobody can be past it."""
        assert self._store is not None
        switch_at = int(self._store.compare_set(keys.switch(plan.gen), "", str(done_step + 1)).decode())
        leaving = self._rank in plan.replaced
        cstore = dist.PrefixStore(keys.COMM_PREFIX, self._store)
        if not leaving and self._prepared_gen != plan.gen:
            # phase 1 while training goes on: links to the joiner are built in the background
            native.prepare_replacement(cstore, group.comm(), plan.replaced.keys(), plan.gen)
            self._prepared_gen = plan.gen
        if done_step < switch_at:
            return done_step + 1
        if done_step > switch_at:
            raise RecoveryError(f"rank {self._rank} passed the switch step {switch_at} of generation {plan.gen}")
        started = time.monotonic()
        if leaving:
            self._hand_over(plan, switch_at)
        group.comm().commit()  # phase 2, at the step boundary
        self._gen = plan.gen
        return self._heal(started=started, aborted_step=-1)

    def _handoff_comm(self, plan_gen: int, rank: int) -> Any:
        """A 2-member link between this rank's leaver (0) and joiner (1)."""
        assert self._store is not None
        job_id = self._store.get(keys.JOB_ID).decode()
        return native.connect_via_store(
            dist.PrefixStore(keys.COMM_PREFIX, self._store), rank, 2, f"{job_id}/handoff{plan_gen}/{self._rank}", 0,
            prefix=keys.handoff_prefix(plan_gen, self._rank), timeout=self._env.comm_timeout,
            connect_timeout=self._env.recovery_timeout, op_timeout=self._env.recovery_timeout,
        )

    def _hand_over(self, plan: proto.ReplacementPlan, switch_at: int) -> None:
        """The leaver of a migration: stream the state to the joiner (the model first, then the
        optimizer's state, which the joiner receives while it computes), then leave cleanly."""
        started = time.monotonic()
        handoff = self._handoff_comm(plan.gen, 0)
        try:
            self._fire("handover")
            meta = {"committed_step": switch_at, "rng": rng.capture()}
            moved = hand_over(handoff, self._state, meta, same_host_reads=self._env.same_host_reads)
        finally:
            handoff.close()
        _log(f"rank {self._rank}: handed {moved} bytes to the joiner in {time.monotonic() - started:.3f}s; leaving")
        leave()

    def _take_over(self, plan_gen: int) -> None:
        """The joiner of a migration: receive the model from the leaver; the optimizer's state
        keeps arriving in the background until :meth:`_finish_handover`. If the leaver cannot
        hand over (it died, its state arrived damaged), this joiner stays fresh and heals from
        the other ranks, which hold the same committed state."""
        started = time.monotonic()
        handoff = None
        try:
            handoff = self._handoff_comm(plan_gen, 1)
            meta, pending, received = take_over(handoff, self._state, same_host_reads=self._env.same_host_reads)
        except BaseException as exc:
            if handoff is not None:
                handoff.close()
            if not isinstance(exc, (native.CommError, TransferError)):
                raise
            _log(f"rank {self._rank}: the leaver's handover failed ({exc}); healing from the other ranks instead")
            return
        self._handover = (handoff, pending, started)
        self._committed_step = int(meta["committed_step"])  # type: ignore[call-overload]
        rng.restore(meta["rng"])  # type: ignore[arg-type]
        self._fresh = False
        _log(f"rank {self._rank}: received the model ({received} bytes) in {time.monotonic() - started:.3f}s "
             f"({pending.path}); {pending.nbytes} bytes of optimizer state follow in the background")

    def _finish_handover(self) -> None:
        """Wait for the rest of a migration's state (before the optimizer steps, and at the end of
        the joiner's first step at the latest)."""
        if self._handover is None:
            return
        handoff, pending, started = self._handover
        self._handover = None
        try:
            pending.finish()
        finally:
            handoff.close()
        _log(f"rank {self._rank}: optimizer state complete ({pending.nbytes} bytes), "
             f"{time.monotonic() - started:.3f}s after the handover began")

    # -- recovery ---------------------------------------------------------------------------

    def _await_key(self, key: str, deadline: float, poll: float = POLL) -> bytes:
        """Wait for ``key`` (polled: a timed-out store wait would log a warning each time),
        watching for the controller's abort, SIGTERM, the agent's death and ``deadline``."""
        assert self._store is not None
        polls = 0
        while True:
            if self._store.check([key]):
                return self._store.get(key)
            polls += 1
            if polls % 10 and poll < POLL:
                time.sleep(poll)
                continue  # the other checks at POLL's pace
            if self._store.check([keys.ABORT]):
                notice = proto.AbortNotice.decode(keys.ABORT, self._store.get(keys.ABORT))
                raise RecoveryError(f"in-place recovery abandoned by the controller: {notice.reason}")
            if self._stop_requested:
                raise SystemExit(0)
            if self._env.agent_pid and os.getppid() != self._env.agent_pid:
                raise SystemExit(0)  # orphaned standby: the agent is gone
            if time.monotonic() > deadline:
                raise RecoveryError(f"no replacement plan within {self._env.recovery_timeout:.0f}s ({key})")
            time.sleep(poll)

    def _recover(self) -> int:
        """Wait for the controller's plan, switch the communicator to it, heal; repeat when a
        member is lost again on the way (each loss gets a plan of its own)."""
        if not self.in_place:
            raise RecoveryError(f"a collective lost rank {self._aborted_by} and this job has no standby")
        assert self._store is not None
        started = time.monotonic()
        aborted_step = self._current_step
        while True:
            key = keys.plan(self._gen + 1)
            raw = self._await_key(key, started + self._env.recovery_timeout, poll=FAST_POLL)
            plan = proto.ReplacementPlan.decode(key, raw)
            try:
                comm = group.comm()
                cstore = dist.PrefixStore(keys.COMM_PREFIX, self._store)
                native.prepare_replacement(cstore, comm, plan.replaced.keys(), plan.gen)
                comm.commit()
                self._gen = plan.gen
                group.clear_aborted()
                self._aborted_by = None
                return self._heal(started=started, aborted_step=aborted_step)
            except native.CommError as exc:
                self._gen = max(self._gen, plan.gen)
                self._aborted_by = None
                self._on_comm_failure(exc)
                _log(f"rank {self._rank}: lost a member again during recovery ({exc}); waiting for the next plan")

    def _warm(self) -> bool:
        """DDP rebuilds its gradient buckets once, with a broadcast, in its second iteration:
        a joiner must have done that locally or its first collectives would not match the
        survivors'. A cold standby therefore runs its two local steps after it is assigned."""
        return not self._ddp_used or self._shadow_done >= 2

    def _await_assignment(self) -> proto.Assignment:
        assert self._store is not None
        traffic = group.traffic()
        finite = all(bool(torch.isfinite(t).all()) for _, t in self._state.tensors() if t.is_floating_point())
        report = {"pid": os.getpid(), "shadow_steps": self._shadow_done, "finite": finite, **traffic}
        self._store.set(keys.standby_ready(self._env.standby_id), json.dumps(report))
        _log(
            f"standby {self._env.standby_id} warm after {self._shadow_done} shadow steps "
            f"({traffic['local_ops']} collectives served locally, "
            f"{traffic['bytes_sent'] + traffic['bytes_recv']} bytes on the network, "
            f"tracked values {'finite' if finite else 'NOT finite'}); waiting"
        )
        key = keys.standby_assign(self._env.standby_id)
        raw = self._await_key(key, float("inf"), poll=POLL / 2)
        self._assigned_at = time.monotonic()
        assignment = proto.Assignment.decode(key, raw)
        if assignment.stop:
            raise SystemExit(0)
        if not self._warm():
            _log(f"standby {self._env.standby_id} assigned rank {assignment.rank} cold: warming up first")
        return assignment

    def _join(self, assignment: proto.Assignment) -> int:
        """Take the assigned rank: connect for the new generation, then heal."""
        assert self._store is not None
        started = self._assigned_at
        job_id = self._store.get(keys.JOB_ID).decode()
        cstore = dist.PrefixStore(keys.COMM_PREFIX, self._store)
        comm = native.join_via_store(
            cstore, assignment.rank, self._world_size, job_id, assignment.gen, timeout=self._env.comm_timeout,
            connect_timeout=self._env.recovery_timeout,
        )
        group.attach(comm)
        group.set_failure_handler(self._on_comm_failure)
        self._rank = assignment.rank
        self._gen = assignment.gen
        self._standby = False
        self._fresh = True
        self._drills.rebind(self._rank, promoted=True)
        _log(f"promoted to rank {self._rank} (generation {self._gen})")
        self._fire("promotion")
        try:
            if assignment.planned:
                self._take_over(assignment.gen)
            return self._heal(started=started, aborted_step=-1)
        except native.CommError as exc:
            self._on_comm_failure(exc)
            _log(f"rank {self._rank}: lost a member while joining ({exc}); waiting for the next plan")
            return self._recover()

    def _heal(self, started: float, aborted_step: int) -> int:
        assert self._store is not None
        comm = group.comm()
        plan = agree(comm, self._committed_step, self._state.layout_digest(), self._fresh)
        step_meta = {"committed_step": self._committed_step}
        moved, _ = heal(comm, self._state, plan, step_meta, on_donate=lambda: self._fire("transfer"))
        resume = plan.target_step + 1
        if self._fresh:
            self._adopt_rng_of(self._rank, resume)
        elif resume == aborted_step and self._step_rng is not None:
            rng.restore(self._step_rng)  # redo the aborted step from the same random state
        comm.barrier()
        self._fresh = False
        self._committed_step = plan.target_step
        self._store.add(keys.recovered(self._gen), 1)
        elapsed = time.monotonic() - started
        self.recoveries.append({"gen": self._gen, "seconds": elapsed, "resume": resume, "bytes": moved})
        _log(
            f"rank {self._rank}: recovered into generation {self._gen} in {elapsed:.3f}s; "
            f"resume at step {resume} (donors {plan.donors}, healed {plan.needy}, {moved} bytes here)"
        )
        return resume

    def _adopt_rng_of(self, rank: int, step: int) -> None:
        assert self._store is not None
        key = keys.rng(rank)
        if not self._store.check([key]):
            return
        recorded_step, states = pickle.loads(self._store.get(key))
        if recorded_step > step:
            _log(f"rank {rank}'s random state was recorded at step {recorded_step}, after {step}; using it")
        rng.restore(states)  # unchanged since it was recorded (only changes are written)


_runtime: Runtime | None = None


def init() -> Runtime:
    """Start (or return) this process's runtime. See the module docstring."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime(LaunchEnv.from_environ())
    return _runtime
