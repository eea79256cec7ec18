"""TmrunAgent: torch's LocalElasticAgent plus instant failure detection and tmrun membership.

What it adds to the elastic agent (and nothing else):
* it waits on the workers' pidfds, so a worker that exits is seen at once, not a poll later;
* it tells the tmrun leader which node failed and how (signal or exception), so a standby node
  can take that node's group rank;
* on a single node it keeps the standby worker processes warm and stops them at the end;
* across nodes (``--standby`` nodes) a standby agent keeps one standby worker per local rank
  warm for the active group's epoch, and adopts them as its workers when the leader gives it a
  failed node's ranks in place; an active agent looks after its node (see node_member.py);
* it publishes its workers for ``tmrun-ctl status``.
"""

from __future__ import annotations

import inspect
import json
import os
import select
import shutil
import signal
import tempfile
import time
from typing import Any

from torch.distributed import PrefixStore
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tmrun.console import say
from tmrun.protocol import keys, messages as proto
from tmrun.launcher.inplace import InplaceController
from tmrun.launcher.node_member import NodeMember
from tmrun.launcher.standby_pool import StandbyPool
from tmrun.rendezvous.handler import TmrunRendezvousHandler
from tmrun.protocol.membership import Membership, Phase


class TmrunAgent(LocalElasticAgent):
    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        start_method: str,
        monitor_interval: float,
        standby_workers: int,
        standby_wait: float = 60.0,
        refill_delay: float = 5.0,
        standby_nodes: int = 0,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
    ) -> None:
        if "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters:  # torch >= 2.12
            extra: dict[str, int] = {"shutdown_timeout": shutdown_timeout}
        else:
            extra = {}
        super().__init__(
            spec=spec,
            logs_specs=logs_specs,
            start_method=start_method,
            log_line_prefix_template=log_line_prefix_template,
            **extra,
        )
        # The elastic loop sleeps spec.monitor_interval before each check; we wait on the
        # workers instead (woken by an exit), so its sleep is only a yield.
        self._wait_interval = monitor_interval
        spec.monitor_interval = 0.0
        self._pidfds: dict[int, int] = {}
        self._standby_pool = StandbyPool(standby_workers, spec.rdzv_handler.get_run_id()) if standby_workers else None
        self.failures_reported = 0
        self._standby_wait = standby_wait
        self._refill_delay = refill_delay
        self._inplace: InplaceController | None = None
        self._group_starts = 0
        # several nodes with standby nodes: in-place replacement of whole nodes
        self._member: NodeMember | None = None
        self._node_pool: StandbyPool | None = None
        self._standby_epoch = -1  # the epoch this standby node's workers are warm for
        self._standby_ids: list[int] = []
        self._node_dir = ""
        handler = spec.rdzv_handler
        if standby_nodes and not standby_workers and isinstance(handler, TmrunRendezvousHandler):
            self._node_dir = tempfile.mkdtemp(prefix="tmrun-node-")
            handler.on_standby = self._keep_standby_node_warm

    @property
    def tmrun_handler(self) -> TmrunRendezvousHandler | None:
        handler = self._worker_group.spec.rdzv_handler
        return handler if isinstance(handler, TmrunRendezvousHandler) else None

    # -- detection --------------------------------------------------------------------------

    def _wait_for_exit(self, timeout: float, watched: list[int] | None = None) -> None:
        """Block until a worker process exits or ``timeout`` passes."""
        if watched is not None:
            pids = set(watched)
        else:
            pids = set(self._pcontext.pids().values()) if self._pcontext is not None else set()
        for pid in list(self._pidfds):
            if pid not in pids:
                os.close(self._pidfds.pop(pid))
        for pid in pids - self._pidfds.keys():
            try:
                self._pidfds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                return  # already gone and reaped: let the check below see it
        if not self._pidfds:
            time.sleep(timeout)
            return
        select.select(list(self._pidfds.values()), [], [], timeout)

    def _close_pidfds(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._member is not None and self._member.enabled():
            return self._monitor_node(worker_group, self._member)
        if self._inplace is not None and self._inplace.enabled():
            return self._monitor_inplace(worker_group, self._inplace)
        in_place = self._inplace is not None or self._member is not None
        self._wait_for_exit(min(self._wait_interval, 0.1) if in_place else self._wait_interval)
        if self._standby_pool is not None and self._standby_pool.changed():
            self._publish(worker_group, self._pcontext.pids() if self._pcontext else {})
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._report_failure(result)
        return result

    def _monitor_inplace(self, worker_group: WorkerGroup, controller: InplaceController) -> RunResult:
        """Workers that use the tmrun API: a failed rank is replaced in place by a standby;
        the group is done when every rank's current process exited 0."""
        self._wait_for_exit(0.05, controller.pids())
        before = controller.replacements
        outcome = controller.step()
        if controller.replacements != before:
            self._publish(worker_group, {s.rank: s.pid for s in controller.slots.values()})
        if outcome.finished:
            return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in worker_group.workers})
        if outcome.failed:
            failures = {}
            for rank, code in outcome.failed.items():
                slot = controller.slots[rank]
                local_rank = rank - worker_group.workers[0].global_rank
                error_file = "" if slot.promoted or self._pcontext is None else self._pcontext.error_files.get(local_rank, "")
                failures[rank] = ProcessFailure(local_rank=local_rank, pid=slot.pid, exitcode=code, error_file=error_file)
            result = RunResult(state=WorkerState.FAILED, failures=failures)
            if outcome.final:
                self._remaining_restarts = 0
            self._report_failure(result)
            return result
        return RunResult(state=WorkerState.HEALTHY)

    def _monitor_node(self, worker_group: WorkerGroup, member: NodeMember) -> RunResult:
        """Several nodes, workers that use the tmrun API: a failed node is replaced in place by
        a standby node (the leader decides); this node only watches and fences its workers."""
        self._wait_for_exit(0.05, member.pids())
        outcome = member.step()
        if outcome.finished or outcome.failed:
            handler = self.tmrun_handler
            assert handler is not None
            # raises once a standby node took this node's ranks (a failure, or a migration whose
            # workers handed over and left); if the leader falls back to a new epoch instead, the
            # elastic loop restarts the group (num_nodes_waiting)
            handler.check_retired()
        if outcome.finished:
            return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in worker_group.workers})
        return RunResult(state=WorkerState.HEALTHY)

    def _report_failure(self, result: RunResult) -> None:
        handler = self.tmrun_handler
        failures = result.failures or {}
        # A worker killed by a signal is a root cause; SIGABRT is excluded because it is how
        # a library (gloo, NCCL) reacts to a peer that vanished: a consequence, not a cause.
        by_signal = any(
            f.exitcode is not None and f.exitcode < 0 and -f.exitcode != signal.SIGABRT for f in failures.values()
        )
        parts = []
        for rank, failure in sorted(failures.items()):
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            parts.append(f"rank {rank} (pid {failure.pid}) {how}")
        detail = ", ".join(parts) or result.state.name.lower()
        say(f"worker failure on this node: {detail}")
        self.failures_reported += 1
        if handler is not None:
            handler.report_failure(by_signal=by_signal, detail=detail)

    # -- start / stop ---------------------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._prepare_inplace(worker_group)
        if self._member is not None:
            return self._start_node_workers(worker_group, self._member)
        pids = super()._start_workers(worker_group)
        if self._standby_pool is not None:
            self._standby_pool.fill()
        if self._inplace is not None and self._pcontext is not None:
            handlers = getattr(self._pcontext, "subprocess_handlers", {})
            self._inplace.adopt({w.global_rank: handlers[w.local_rank].proc for w in worker_group.workers if w.local_rank in handlers})
        self._publish(worker_group, pids)
        return pids

    def _start_node_workers(self, worker_group: WorkerGroup, member: NodeMember) -> dict[int, Any]:
        """Start this node's workers, or, on a standby node given a failed node's ranks in place,
        adopt its warm standby workers as the workers."""
        adopted = self._adopt_standby_workers(worker_group)
        if adopted is not None:
            self._pcontext = None
            member.adopt(adopted, promoted=True)
            pids = {w.local_rank: adopted[w.global_rank].pid for w in worker_group.workers if w.global_rank in adopted}
            say(f"this standby node now runs ranks {sorted(adopted)} in place (pids {sorted(pids.values())})")
        else:
            self._stop_node_pool()
            pids = super()._start_workers(worker_group)
            handlers = getattr(self._pcontext, "subprocess_handlers", {})
            member.adopt({w.global_rank: handlers[w.local_rank].proc for w in worker_group.workers
                          if w.local_rank in handlers}, promoted=False)
        self._publish(worker_group, pids)
        return pids

    def _adopt_standby_workers(self, worker_group: WorkerGroup) -> dict[int, Any] | None:
        """rank -> process of the standby workers the leader assigned this group's ranks (same
        epoch as they were warmed for), or None when this is an ordinary start."""
        handler = self.tmrun_handler
        if self._node_pool is None or handler is None or self._standby_epoch != handler.epoch:
            return None
        store = self._node_store(handler, handler.epoch)
        ranks = {w.global_rank for w in worker_group.workers}
        adopted: dict[int, Any] = {}
        for standby in self._node_pool.members:
            key = keys.standby_assign(standby.index)
            if store.check([key]):
                assignment = proto.Assignment.decode(key, store.get(key))
                if assignment.rank in ranks:
                    adopted[assignment.rank] = standby.process
                    self._node_pool.take(standby)
        self._stop_node_pool()
        return adopted or None

    def _keep_standby_node_warm(self, membership: Membership) -> None:
        """Called while this node stands by: keep one standby worker per local rank warm for
        the active group's epoch, and tell the leader which they are."""
        handler = self.tmrun_handler
        if handler is None or membership.phase is not Phase.RUNNING or not membership.active:
            return
        spec = self._worker_group.spec
        if self._standby_epoch != membership.epoch:
            self._stop_node_pool()
            self._standby_epoch = membership.epoch
            self._node_pool = StandbyPool(spec.local_world_size, handler.get_run_id(),
                                          first_index=1000 * (handler.node_id or 0), by_local_rank=True)
            self._node_pool.worker_env = {
                **self._inplace_env(handler, keys.node_prefix(handler.get_run_id(), membership.epoch),
                                    os.path.join(self._node_dir, f"gen-{membership.epoch}")),
                "WORLD_SIZE": str(len(membership.active) * spec.local_world_size),
                "LOCAL_WORLD_SIZE": str(spec.local_world_size),
                "RANK": "0",
                "GROUP_RANK": "-1",
                "TORCHELASTIC_RUN_ID": handler.get_run_id(),
            }
            self._standby_ids = []
        pool = self._node_pool
        assert pool is not None
        pool.fill()
        ids = [m.index for m in sorted(pool.members, key=lambda m: m.local_rank)]
        if ids != self._standby_ids and len(ids) == spec.local_world_size:
            self._node_store(handler, membership.epoch).set(keys.standby_node(handler.node_id or 0), json.dumps({"ids": ids}))
            self._standby_ids = ids

    @staticmethod
    def _node_store(handler: TmrunRendezvousHandler, epoch: int) -> PrefixStore:
        """The in-place protocol's store of ``epoch`` (several nodes)."""
        return PrefixStore(keys.node_prefix(handler.get_run_id(), epoch), handler.raw_store)

    def _stop_node_pool(self) -> None:
        if self._node_pool is not None:
            self._node_pool.stop()
            self._node_pool = None
            self._standby_epoch = -1

    def _inplace_env(self, handler: TmrunRendezvousHandler, prefix: str, gen_file: str) -> dict[str, str]:
        """Where workers and standby workers find the in-place protocol."""
        spec = self._worker_group.spec
        entry = [spec.entrypoint, *map(str, spec.args)] if isinstance(spec.entrypoint, str) else []
        return {
            "TMRUN_IP_GEN_FILE": gen_file,
            "TMRUN_IP_STORE": str(handler.endpoint),
            "TMRUN_IP_PREFIX": prefix,
            "TMRUN_RUN_ID": handler.get_run_id(),
            "TMRUN_AGENT_PID": str(os.getpid()),
            "TMRUN_ENTRYPOINT": json.dumps(entry),
        }

    def _prepare_inplace(self, worker_group: WorkerGroup) -> None:
        """Tell workers and standbys where the in-place protocol lives: a fresh key prefix for
        every start of the worker group on a single node, one per epoch across nodes."""
        handler = self.tmrun_handler
        if self._node_dir and handler is not None:
            self._prepare_node(worker_group, handler)
            return
        if self._standby_pool is None or handler is None:
            return
        spec = worker_group.spec
        prefix = f"tmrun/{handler.get_run_id()}/ip/{self._group_starts}/"
        self._group_starts += 1
        store = PrefixStore(prefix, handler.raw_store)
        events = handler.store
        world_size = worker_group.workers[0].world_size if worker_group.workers else spec.local_world_size
        gen_file = os.path.join(self._standby_pool.directory, f"gen-{self._group_starts - 1}")
        self._inplace = InplaceController(store, self._standby_pool, world_size, self._standby_wait,
                                          max(spec.max_restarts, 0), events, gen_file, self._refill_delay)
        shared = self._inplace_env(handler, prefix, gen_file)
        os.environ.update(shared)  # the workers torch starts inherit these
        previous = self._standby_pool.worker_env.get("TMRUN_IP_PREFIX")
        self._standby_pool.worker_env = {
            **shared,
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": handler.get_run_id(),
        }
        if previous is not None and previous != prefix:
            self._standby_pool.stop(final=False)  # standbys of the previous group start again

    def _prepare_node(self, worker_group: WorkerGroup, handler: TmrunRendezvousHandler) -> None:
        store = self._node_store(handler, handler.epoch)
        gen_file = os.path.join(self._node_dir, f"gen-{handler.epoch}")
        world_size = worker_group.workers[0].world_size if worker_group.workers else worker_group.spec.local_world_size
        self._member = NodeMember(store, world_size, gen_file, handler.report_failure)
        ranks = [w.global_rank for w in worker_group.workers]
        store.set(keys.node_ranks(worker_group.group_rank or 0), json.dumps({"node_id": handler.node_id, "ranks": ranks}))
        prefix = keys.node_prefix(handler.get_run_id(), handler.epoch)
        os.environ.update(self._inplace_env(handler, prefix, gen_file))  # the workers torch starts inherit these

    def _stop_promoted(self) -> None:
        if self._inplace is not None:
            self._inplace.stop_promoted()
        if self._member is not None:
            self._member.stop_promoted()

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._close_pidfds()
        self._stop_promoted()
        super()._stop_workers(worker_group)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # Also called by the elastic agent between restarts of the group: the standby pool
        # lives on (see run()); only the workers, promoted standbys included, stop here.
        self._close_pidfds()
        self._stop_promoted()
        if "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters:  # torch >= 2.12
            super()._shutdown(death_sig, timeout)
        else:
            super()._shutdown(death_sig)

    def run(self, role: str = "default") -> RunResult:
        try:
            return super().run(role)
        finally:
            if self._standby_pool is not None:
                self._standby_pool.stop()
            self._stop_node_pool()
            self._stop_promoted()
            if self._node_dir:
                shutil.rmtree(self._node_dir, ignore_errors=True)

    def _publish(self, worker_group: WorkerGroup, pids: dict[int, int]) -> None:
        handler = self.tmrun_handler
        if handler is None:
            return
        standby = [m.describe() for m in self._standby_pool.members] if self._standby_pool else []
        handler.publish_workers(
            {
                "epoch": handler.epoch,
                "group_rank": worker_group.group_rank,
                "agent_pid": os.getpid(),
                "workers": [
                    {"local_rank": w.local_rank, "rank": w.global_rank, "pid": pids.get(w.local_rank)}
                    for w in worker_group.workers
                ],
                "standby_workers": standby,
            }
        )

    def standby_members(self) -> list[dict[str, object]]:
        return [m.describe() for m in self._standby_pool.members] if self._standby_pool else []
