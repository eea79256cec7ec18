"""Failure drills: ``tmrun --inject-failure rank=1,step=8[,at=backward][,signal=KILL]``.

The option may be given several times (one drill each). ``signal=RAISE`` raises a Python
exception in the worker instead of sending a signal. ``node=G`` instead of ``rank=`` kills a
whole node: the agent of group rank G and every worker of that node (local rank 0 fires it).

The launcher checks the spec and passes it to every worker as ``TMRUN_INJECT_FAILURE``; the
worker whose rank matches kills itself once, at the named point of the named step. Only the
process that started as that rank fires (a joiner that takes the rank over does not), unless
``who=joiner``, which fires in the standby promoted to that rank, during its promotion.

Points (``at=``): ``step`` (start of the step, default; a rank that a failure elsewhere sends
into recovery at the end of the step before fires it there), ``forward`` (the tracked module's
forward), ``backward`` (while gradients are being reduced), ``optimizer`` (inside
``optimizer.step``), ``transfer`` (while donating state to a joiner; ``step=`` may be left out),
``promotion`` (a joiner, after it joined and before it received the state), ``handover`` (a
migration's leaver, once its joiner is connected and before it sends anything), ``switch`` (a
rank that stays during a migration, once it prepared its links to the joiner, before the switch),
``recovery`` (a survivor that read the next generation's plan, before it publishes its address),
``subgroups`` (a survivor whose default group took the joiner in, before it repairs the joiner's
subgroups: the joiner is building its groups and model). ``time=SECONDS`` fires that many seconds
after the worker's runtime started instead of at a step.

``signal=STALL`` does not end the process: it stops the training loop at that point for good
(the process and its communicator threads live on: a hang that no peer's heartbeat sees; the
agent's ``--hang-timeout`` does). ``rank=R,slow=3x[,step=N]`` is a straggler, not a failure:
from step N on, rank R's original process sleeps at the start of every step so that its own
work (outside collectives) takes about three times as long (the agent's straggler detection
migrates it). ``rank=R,step=N[,at=P],delay=S`` is not a failure either: rank R sleeps S seconds
at that point, once (a rank late to a point: a race made certain in a test).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from tmrun.protocol import environment
from tmrun.protocol.drills import ANY_STEP, ENV, Drill, parse_all

if TYPE_CHECKING:
    import torch

def _signal_node(signum: int) -> None:
    """Signal this node's agent first (so that it cannot react), then its other children."""
    import psutil

    agent_pid = int(os.environ.get(environment.ENV_AGENT_PID, "0") or 0)
    if not agent_pid:
        return
    try:
        agent = psutil.Process(agent_pid)
        siblings = [p for p in agent.children() if p.pid != os.getpid()]
        agent.send_signal(signum)
    except psutil.NoSuchProcess:
        return
    for sibling in siblings:
        try:
            sibling.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


class InjectedFailure(RuntimeError):
    """Raised by a drill with ``signal=RAISE`` (a worker that fails with a Python exception)."""


class DrillRunner:
    """The worker side: ``fire(point, step)`` at every point; each drill fires once."""

    def __init__(self, drills: list[Drill], rank: int, promoted: bool, group_rank: int = -1,
                 local_rank: int = -1) -> None:
        self._drills = list(drills)
        self._index = {drill: i for i, drill in enumerate(drills)}
        # claim(i) -> True for the first process of the job to fire drill i (set by the runtime
        # from its store, so that a joiner or a restarted group does not fire it again)
        self.claim: Callable[[int], bool] = lambda index: True
        self._rank = rank
        self._promoted = promoted
        self._node_leader = local_rank == 0 and group_rank >= 0
        self._group_rank = group_rank
        self._slow = [d for d in self._drills if d.slow]
        self._drills = [d for d in self._drills if not d.slow]
        self._slept = 0.0  # seconds the slow drill slept in the current step
        self._base = 0.0  # the last step's own work without that sleep
        self._started = time.monotonic()  # what time= counts from (the runtime's start)
        for drill in drills:
            if drill.seconds >= 0 and drill.who == "original" and not promoted:
                timer = threading.Timer(drill.seconds, self._fire_timed, args=(drill,))
                timer.daemon = True
                timer.start()

    @classmethod
    def from_environ(cls, rank: int, promoted: bool) -> DrillRunner:
        group_rank = int(os.environ.get(environment.ENV_GROUP_RANK, "-1") or -1)
        local_rank = int(os.environ.get(environment.ENV_LOCAL_RANK, "-1") or -1)
        return cls(parse_all(os.environ.get(ENV, "")), rank, promoted, group_rank, local_rank)

    def rebind(self, rank: int, promoted: bool) -> None:
        self._rank, self._promoted = rank, promoted

    def _targets(self, drill: Drill) -> bool:
        if drill.node >= 0:  # a node drill: fired by local rank 0 of that node's original workers
            return self._node_leader and drill.node == self._group_rank
        return drill.rank == self._rank

    def _matches(self, drill: Drill, point: str, step: int) -> bool:
        if not self._targets(drill) or drill.at != point or drill.seconds >= 0:
            return False
        if (drill.who == "joiner") != self._promoted:
            return False
        return drill.step < 0 or drill.step == step or point in ANY_STEP

    def _trigger(self, drill: Drill, where: str) -> None:
        """Fire ``drill`` once per job: the first process to claim it kills itself (or raises)."""
        self._drills.remove(drill)
        if not self.claim(self._index[drill]):
            return
        if drill.delay:
            print(f"[tmrun drill] rank {self._rank} sleeps {drill.delay:g}s at {where}", flush=True)
            time.sleep(drill.delay)
            return
        if drill.signal_name == "RAISE":
            raise InjectedFailure(f"injected failure: rank {self._rank} at {where}")
        if drill.signal_name == "STALL":
            print(f"[tmrun drill] rank {self._rank} stalls at {where} (the process lives on)", flush=True)
            while True:
                time.sleep(3600)
        signum = getattr(signal, f"SIG{drill.signal_name}")
        if drill.node >= 0:
            _signal_node(signum)
        os.kill(os.getpid(), signum)

    def _fire_timed(self, drill: Drill) -> None:
        if self._targets(drill) and not self._promoted and drill in self._drills:
            self._trigger(drill, f"{drill.seconds}s")

    def observe(self, busy_seconds: float) -> None:
        """The step that just ended took ``busy_seconds`` of this rank's own work."""
        self._base = max(0.0, busy_seconds - self._slept)
        self._slept = 0.0

    def _slow_down(self, step: int) -> None:
        for drill in list(self._slow):
            if drill.rank != self._rank or self._promoted or step < drill.step:
                continue
            if drill in self._drills or self.claim(self._index[drill]):
                if drill not in self._drills:  # claimed: this process is the straggler from now on
                    self._drills.append(drill)
                    print(f"[tmrun drill] rank {self._rank} is {drill.slow:g}x slower from step {step}", flush=True)
                self._slept = (drill.slow - 1) * self._base
                time.sleep(self._slept)
            else:
                self._slow.remove(drill)

    def fire(self, point: str, step: int) -> None:
        if point == "step" and self._slow:
            self._slow_down(step)
        if point == "step":
            self._say_missed(step)
        for drill in list(self._drills):
            if drill.slow:
                continue
            if self._matches(drill, point, step):
                self._trigger(drill, f"{point} of step {step}")

    def steps_ended(self) -> None:
        """The script's steps are over: a timed drill of this process that has not fired says so
        in one line (a test whose process ends first runs without its failure, silently
        otherwise)."""
        for drill in list(self._drills):
            if drill.seconds < 0 or not self._targets(drill) or self._promoted or drill.who != "original":
                continue
            print(f"[tmrun drill] rank {self._rank}: --inject-failure {drill.encode()} has not fired: this rank's "
                  f"steps ended {time.monotonic() - self._started:.2f}s after its runtime started (it fires only if the "
                  "process lives that long)", file=sys.stderr, flush=True)

    def _say_missed(self, step: int) -> None:
        """A "forward" or "backward" drill of this process whose step passed without that point
        firing (the script's model has none of the hooks tmrun installs: a plain module without
        DDP, FSDP2, TP or a tracked pipeline schedule): one line, instead of a test that silently
        ran without its failure."""
        for drill in list(self._drills):
            if drill.at not in HOOKED_POINTS or drill.step < 0 or drill.step >= step or drill.seconds >= 0:
                continue
            if not self._targets(drill) or (drill.who == "joiner") != self._promoted:
                continue
            self._drills.remove(drill)
            print(f"[tmrun drill] rank {self._rank}: --inject-failure {drill.encode()} never fired: no {drill.at} "
                  f"hook ran in step {drill.step} (tmrun hooks DDP (tm.ddp), FSDP2 or tensor-parallel modules "
                  "given to tm.track, and tracked pipeline schedules)", file=sys.stderr, flush=True)


HOOKED_POINTS = ("forward", "backward")  # fired by the hooks tmrun installs on the script's model


def install_hooks(module: torch.nn.Module, fire: Callable[[str], None]) -> None:
    """The "forward" and "backward" points of a module given to ``tm.ddp``: ``fire(point)`` at
    the start of its forward, and when its last parameter's gradient is ready (among the first of
    backward, while gradients are being reduced)."""
    module.register_forward_pre_hook(lambda *_: fire("forward"))
    params = [p for p in module.parameters() if p.requires_grad]
    if params:
        params[-1].register_hook(lambda grad: (fire("backward"), grad)[1])


def install_sharded_hooks(module: torch.nn.Module, fire: Callable[[str], None]) -> None:
    """The "forward" and "backward" points of a tracked module with sharded parameters (FSDP2's
    ``fully_shard``, tensor parallelism; no ``tm.ddp``): "forward" at the start of its forward
    (after FSDP gathered its own parameters), "backward" when the gradient of its first FSDP
    submodule's output is ready (every later submodule's backward ran and issued its gradient
    reduction by then), or of its own output (the start of backward) without one."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    module.register_forward_pre_hook(lambda *_: fire("forward"))
    inner = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]
    target = inner[0] if inner else module

    def on_output(_module: torch.nn.Module, _inputs: object, output: object) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: (fire("backward"), grad)[1])

    target.register_forward_hook(on_output)


def is_sharded(module: object) -> bool:
    """A module with sharded parameters (DTensors: FSDP2's ``fully_shard``, tensor parallelism)
    that is not a DDP model (``tm.ddp`` hooks those)."""
    import torch

    if not isinstance(module, torch.nn.Module) or isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


STANDBY_DELAY_ENV = "TMRUN_TEST_STANDBY_DELAY"  # tests only: "ID:SECONDS[,ID:SECONDS]"


def standby_ready_delay(standby_id: int) -> float:
    """Seconds standby ``standby_id`` waits before it says it is warm (tests only: standbys that
    turn warm at different moments, as on a loaded machine)."""
    for item in os.environ.get(STANDBY_DELAY_ENV, "").split(","):
        sid, _, seconds = item.partition(":")
        if sid.strip() == str(standby_id) and seconds:
            return float(seconds)
    return 0.0
