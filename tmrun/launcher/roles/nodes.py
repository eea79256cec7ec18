"""Several nodes with standby nodes (``--nnodes N --standby K``): a member is a node.

While the node stands by (inside the rendezvous), the role keeps one standby worker per local
rank warm for the active group's epoch and tells the leader which they are. When the leader
gives this node a failed node's ranks in place, the role adopts those warm workers as its
workers; otherwise it starts workers as torch would. While the node is active, a
:class:`~tmrun.control.replacement.nodes.NodeWatch` watches and fences its workers; the leader
decides who takes over.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from tmrun.console import say
from tmrun.control.detection import Detection
from tmrun.control.replacement.nodes import NodeWatch
from tmrun.launcher.roles.base import HEALTHY, AgentRole, in_place_env, succeeded, worker_environ
from tmrun.launcher.standby_pool import StandbyPool
from tmrun.protocol import environment, keys
from tmrun.protocol import messages as proto
from tmrun.protocol.membership import Membership, Phase

if TYPE_CHECKING:
    from tmrun.launcher.agent import AgentSettings, TmrunAgent
    from tmrun.rendezvous.handler import TmrunRendezvousHandler


STOPPED_GAP = 1.0  # seconds between two looks at the workers after which the agent asks whether it was replaced


class NodeRole(AgentRole):
    def __init__(self, agent: TmrunAgent, settings: AgentSettings, handler: TmrunRendezvousHandler) -> None:
        super().__init__(agent)
        self._handler = handler
        self._last_monitor = 0.0  # monotonic: the previous look at the workers
        self._standby_log_dir = settings.standby_log_dir
        self._dir = tempfile.mkdtemp(prefix="tmrun-node-")
        self._watch: NodeWatch | None = None
        self._pool: StandbyPool | None = None
        self._published_standby: list[dict[str, object]] | None = None  # what tmrun-ctl status last got
        self._settings = settings
        self._standby_epoch = -1  # the epoch this standby node's workers are warm for
        self._standby_ids: list[int] = []
        handler.on_standby = self._keep_warm

    def _epoch_store(self, epoch: int) -> Store:
        """The in-place protocol's store of ``epoch``."""
        return PrefixStore(keys.node_prefix(self._handler.get_run_id(), epoch), self._handler.raw_store)

    def _gen_file(self, epoch: int) -> str:
        return os.path.join(self._dir, f"gen-{epoch}")

    def _progress_dir(self, epoch: int) -> str:
        path = os.path.join(self._dir, f"progress-{epoch}")
        os.makedirs(path, exist_ok=True)
        return path

    # -- active ---------------------------------------------------------------------------------

    def start(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start this node's workers, or, on a standby node given a failed node's ranks in place,
        adopt its warm standby workers as the workers."""
        handler = self._handler
        store = self._epoch_store(handler.epoch)
        world_size = worker_group.workers[0].world_size if worker_group.workers else worker_group.spec.local_world_size
        if self._watch is not None and self._watch.detection is not None:
            self._watch.detection.publish_final()  # the previous epoch's workers stopped
            self._watch.detection.close()
        detection = Detection(replace(self._settings.detection, progress_dir=self._progress_dir(handler.epoch)),
                              handler.store, worker_group.group_rank or 0,
                              {w.global_rank: w.local_rank for w in worker_group.workers}, epoch=handler.epoch)
        watch = self._watch = NodeWatch(store, world_size, self._gen_file(handler.epoch), handler.report_failure,
                                        detection, handler.store)
        ranks = [w.global_rank for w in worker_group.workers]
        store.set(keys.node_ranks(worker_group.group_rank or 0), proto.NodeRanks(handler.node_id or 0, ranks).encode())
        prefix = keys.node_prefix(handler.get_run_id(), handler.epoch)
        os.environ.update(worker_environ(in_place_env(self.agent, handler, prefix, self._gen_file(handler.epoch),
                                                      self._progress_dir(handler.epoch))))
        adopted = self._adopt_standby_workers(worker_group)
        if adopted is not None:
            self.agent.forget_group_processes()
            watch.adopt(adopted, promoted=True)
            pids = {w.local_rank: adopted[w.global_rank].pid for w in worker_group.workers if w.global_rank in adopted}
            say(f"this standby node now runs ranks {sorted(adopted)} in place (pids {sorted(pids.values())})")
        else:
            self._stop_pool()
            pids = self.agent.start_group(worker_group)
            watch.adopt(self.agent.group_processes(worker_group), promoted=False)
        self.agent.publish(worker_group, pids, self.standby_members())
        return pids

    def _adopt_standby_workers(self, worker_group: WorkerGroup) -> dict[int, Any] | None:
        """rank -> process of the standby workers the leader assigned this group's ranks (same
        epoch as they were warmed for), or None when this is an ordinary start."""
        handler = self._handler
        if self._pool is None or self._standby_epoch != handler.epoch:
            return None
        store = self._epoch_store(handler.epoch)
        ranks = {w.global_rank for w in worker_group.workers}
        adopted: dict[int, Any] = {}
        for standby in self._pool.members:
            key = keys.standby_assign(standby.index)
            if store.check([key]):
                assignment = proto.Assignment.decode(key, store.get(key))
                if assignment.rank in ranks:
                    adopted[assignment.rank] = standby.process
                    self._pool.take(standby)
        self._stop_pool()
        return adopted or None

    def monitor(self, worker_group: WorkerGroup) -> RunResult:
        watch = self._watch
        if watch is None or not watch.enabled():
            self.agent.wait_for_exit(min(self.agent.wait_interval, 0.1))
            return self.agent.elastic_check(worker_group)
        now = time.monotonic()
        if self._last_monitor and now - self._last_monitor > STOPPED_GAP:
            # this agent did not run for a while (stopped, cut off, starved): the leader may have
            # declared its node lost and given its ranks to a standby node meanwhile; then it
            # leaves at once, before its workers' failures are reported as a new failure
            self._handler.check_retired()
        self._last_monitor = now
        self.agent.wait_for_exit(0.05, watch.slots.pids())
        outcome = watch.step()
        if outcome.finished or outcome.failed:
            # raises once a standby node took this node's ranks (a failure, or a migration whose
            # workers handed over and left); if the leader falls back to a new epoch instead, the
            # elastic loop restarts the group (num_nodes_waiting)
            self._handler.check_retired()
        if outcome.finished:
            watch.publish_last_progress()  # before the leader closes the job
            return succeeded(worker_group)
        return HEALTHY

    # -- standing by ---------------------------------------------------------------------------

    def _keep_warm(self, membership: Membership) -> None:
        """Called while this node stands by: keep one standby worker per local rank warm for
        the active group's epoch, and tell the leader which they are."""
        handler = self._handler
        if membership.phase is not Phase.RUNNING or not membership.active:
            return
        spec = self.agent.spec
        if self._standby_epoch != membership.epoch:
            self._stop_pool()
            self._standby_epoch = membership.epoch
            self._pool = StandbyPool(spec.local_world_size, handler.get_run_id(),
                                     first_index=1000 * (handler.node_id or 0), by_local_rank=True,
                                     log_dir=self._standby_log_dir)
            prefix = keys.node_prefix(handler.get_run_id(), membership.epoch)
            self._pool.worker_env = {
                **worker_environ(in_place_env(self.agent, handler, prefix, self._gen_file(membership.epoch),
                                              self._progress_dir(membership.epoch))),
                environment.ENV_WORLD_SIZE: str(len(membership.active) * spec.local_world_size),
                environment.ENV_LOCAL_WORLD_SIZE: str(spec.local_world_size),
                environment.ENV_RANK: "0",
                environment.ENV_GROUP_RANK: "-1",
                environment.ENV_TORCHELASTIC_RUN_ID: handler.get_run_id(),
            }
            self._standby_ids = []
        pool = self._pool
        assert pool is not None
        pool.fill()
        ids = [m.index for m in sorted(pool.members, key=lambda m: m.local_rank)]
        self._publish_standby(membership.epoch)
        if ids != self._standby_ids and len(ids) == spec.local_world_size:
            self._epoch_store(membership.epoch).set(keys.standby_node(handler.node_id or 0),
                                                    proto.StandbyNode(ids).encode())
            self._standby_ids = ids

    def standby_members(self) -> list[dict[str, object]]:
        """This node's standby workers (a standby node's pool), for ``tmrun-ctl status``."""
        return [m.describe() for m in self._pool.members] if self._pool is not None else []

    def _publish_standby(self, epoch: int) -> None:
        """A standby node tells ``tmrun-ctl status`` its standby workers (pid and state) when
        they change: it runs no worker group, so nothing else publishes them."""
        members = self.standby_members()
        if members == self._published_standby:
            return
        self._published_standby = members
        self._handler.publish_workers(proto.WorkersInfo(epoch=epoch, group_rank=None, agent_pid=os.getpid(),
                                                  workers=[], standby_workers=members))

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool = None
            self._standby_epoch = -1

    # -- stopping ------------------------------------------------------------------------------

    def stop_promoted(self) -> None:
        if self._watch is not None:
            self._watch.stop_promoted()

    def close(self) -> None:
        self._stop_pool()
        self.stop_promoted()
        if self._watch is not None and self._watch.detection is not None:
            self._watch.detection.close()
        shutil.rmtree(self._dir, ignore_errors=True)

