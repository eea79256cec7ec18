"""One node with standby worker processes (``--standby N`` on one node).

The role keeps the pool of warm standby processes, gives every start of the worker group a
fresh in-place prefix, and drives :class:`~tmrun.control.replacement.processes.ProcessReplacement`
once every rank runs the worker API (before that, or for a plain torchrun script, failures
restart the group as torchrun's would, and the standbys only stand ready).
"""

from __future__ import annotations

import os
import time
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dataclasses import replace

from tmrun.control.detection import Detection
from tmrun.control.replacement.processes import ProcessReplacement
from tmrun.launcher.roles.base import HEALTHY, AgentRole, in_place_env, succeeded, worker_environ
from tmrun.launcher import standby_devices
from tmrun.launcher.standby_pool import StandbyPool
from tmrun.protocol import environment, keys

if TYPE_CHECKING:
    from tmrun.launcher.agent import AgentSettings, TmrunAgent
    from tmrun.rendezvous.handler import TmrunRendezvousHandler


class LocalStandbyRole(AgentRole):
    def __init__(self, agent: TmrunAgent, settings: AgentSettings, handler: TmrunRendezvousHandler) -> None:
        super().__init__(agent)
        self._settings = settings
        self._handler = handler
        self._pool = StandbyPool(settings.standby_workers, handler.get_run_id(), log_dir=settings.standby_log_dir,
                                 gpus=standby_devices.visible_gpus())
        self._controller: ProcessReplacement | None = None
        self._group_starts = 0
        self._warm: set[int] = set()  # standbys known to have finished their shadow steps
        self._next_warm_check = 0.0
        self._progress_root = tempfile.mkdtemp(prefix="tmrun-progress-")  # workers' progress records

    def start(self, worker_group: WorkerGroup) -> dict[int, Any]:
        controller = self._prepare(worker_group)
        pids = self.agent.start_group(worker_group)
        self._pool.fill()
        controller.adopt(self.agent.group_processes(worker_group))
        self.agent.publish(worker_group, pids, self.standby_members())
        return pids

    def _prepare(self, worker_group: WorkerGroup) -> ProcessReplacement:
        """A fresh in-place prefix for every start of the worker group; the standbys of the
        previous group start again."""
        handler, spec = self._handler, worker_group.spec
        prefix = keys.group_prefix(handler.get_run_id(), self._group_starts)
        gen_file = os.path.join(self._pool.directory, f"gen-{self._group_starts}")
        self._group_starts += 1
        world_size = worker_group.workers[0].world_size if worker_group.workers else spec.local_world_size
        progress_dir = os.path.join(self._progress_root, str(self._group_starts - 1))
        os.makedirs(progress_dir, exist_ok=True)
        if self._controller is not None and self._controller.detection is not None:
            self._controller.detection.publish_final()  # the previous start's workers stopped
            self._controller.detection.close()
        first = worker_group.workers[0].global_rank if worker_group.workers else 0
        detection = Detection(replace(self._settings.detection, progress_dir=progress_dir), handler.store,
                              worker_group.group_rank or 0,
                              {w.global_rank: w.global_rank - first for w in worker_group.workers}, epoch=handler.epoch)
        group_store = PrefixStore(prefix, handler.raw_store)
        self.agent.api_reached = lambda: _api_reached(group_store)
        self._controller = ProcessReplacement(
            group_store, self._pool, world_size, self._settings.standby_wait,
            max(spec.max_restarts, 0), handler.store, gen_file, self._settings.refill_delay, detection)
        env = in_place_env(self.agent, handler, prefix, gen_file, progress_dir)
        os.environ.update(worker_environ(env))  # the workers torch starts inherit these
        previous = self._pool.worker_env.get(environment.ENV_PREFIX)
        self._pool.nproc = spec.local_world_size  # standbys on the devices after the active ranks'
        self._pool.worker_env = {
            **worker_environ(env),
            environment.ENV_WORLD_SIZE: str(world_size),
            environment.ENV_LOCAL_WORLD_SIZE: str(spec.local_world_size),
            environment.ENV_RANK: "0",
            environment.ENV_GROUP_RANK: "0",
            environment.ENV_TORCHELASTIC_RUN_ID: handler.get_run_id(),
        }
        if previous is not None and previous != prefix:
            self._pool.stop(final=False)
        return self._controller

    def monitor(self, worker_group: WorkerGroup) -> RunResult:
        controller = self._controller
        if controller is None or not controller.enabled():
            self.agent.wait_for_exit(min(self.agent.wait_interval, 0.1))
            if self._pool.changed():
                self.agent.publish(worker_group, self.agent.group_pids(), self.standby_members())
            return self.agent.elastic_check(worker_group)
        return self._monitor_in_place(worker_group, controller)

    def _monitor_in_place(self, worker_group: WorkerGroup, controller: ProcessReplacement) -> RunResult:
        """Workers that use the tmrun API: a failed rank is replaced in place by a standby;
        the group is done when every rank's current process exited 0."""
        self.agent.wait_for_exit(0.05, controller.slots.pids())
        before = controller.replacements
        outcome = controller.step()
        if controller.replacements != before or self._pool.changed() or self._standbys_warmed(controller):
            self.agent.publish(worker_group, controller.slots.rank_pids(), self.standby_members())
        if outcome.finished:
            controller.publish_last_progress()  # before the leader closes the job
            return succeeded(worker_group)
        if not outcome.failed:
            return HEALTHY
        failures = {}
        for rank, code in outcome.failed.items():
            slot = controller.slots[rank]
            local_rank = rank - worker_group.workers[0].global_rank
            error_file = "" if slot.promoted else self.agent.error_file(local_rank)
            failures[rank] = ProcessFailure(local_rank=local_rank, pid=slot.pid, exitcode=code, error_file=error_file)
        result = RunResult(state=WorkerState.FAILED, failures=failures)
        if outcome.final:
            self.agent.no_more_restarts()
        # the leader must not look for the worker API in its epoch's store (this node's workers
        # use the group's prefix): this node's controller ran, and says why it gave up
        self.agent.report_failure(result, node_fallback=outcome.reason or "in-place replacement gave up")
        return result

    def stop_promoted(self) -> None:
        if self._controller is not None:
            self._controller.stop_promoted()

    def close(self) -> None:
        self._pool.stop()
        self.stop_promoted()
        if self._controller is not None and self._controller.detection is not None:
            self._controller.detection.close()
        shutil.rmtree(self._progress_root, ignore_errors=True)

    WARM_CHECK_EVERY = 0.5  # seconds between looks at the standbys' "warm" keys (a store round trip)

    def _standbys_warmed(self, controller: ProcessReplacement) -> bool:
        """True once after a standby finished its shadow steps (so tmrun-ctl status and the
        console can tell a warm standby from one that only imported torch)."""
        now = time.monotonic()
        if now < self._next_warm_check:
            return False
        self._next_warm_check = now + self.WARM_CHECK_EVERY
        warm = {m.index for m in self._pool.members if controller.standby_warm(m.index)}
        changed, self._warm = warm != self._warm, warm
        return changed

    def standby_members(self) -> list[dict[str, object]]:
        """The pool's members; state "warm" once a standby finished its shadow steps and waits
        (before that "warming", then "ready" when it imported torch)."""
        members = [m.describe() for m in self._pool.members]
        for member in members:
            if member["index"] in self._warm and member["state"] == "ready":
                member["state"] = "warm"
        return members


def _api_reached(store: Store) -> bool:
    """Whether a worker of this start of the group reached tmrun.init() (False where the store
    cannot say: the failure report goes on without it)."""
    try:
        return bool(store.check([keys.API]))
    except Exception:  # noqa: BLE001 (the store host may be gone with the failure)
        return False
