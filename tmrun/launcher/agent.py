"""TmrunAgent: torch's LocalElasticAgent plus instant failure detection and tmrun membership.

What it adds to the elastic agent (and nothing else):
* it waits on the workers' pidfds, so a worker that exits is seen at once, not a poll later;
* it tells the tmrun leader which node failed and how (signal or exception), so a standby node
  can take that node's group rank;
* on a single node it keeps the standby worker processes warm and stops them at the end;
* it publishes its workers for ``tmrun-ctl status``.
"""

from __future__ import annotations

import os
import select
import signal
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs

from tmrun.console import say
from tmrun.launcher.standby_pool import StandbyPool
from tmrun.rendezvous.handler import TmrunRendezvousHandler


class TmrunAgent(LocalElasticAgent):
    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        start_method: str,
        monitor_interval: float,
        standby_workers: int,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
    ) -> None:
        super().__init__(
            spec=spec,
            logs_specs=logs_specs,
            start_method=start_method,
            log_line_prefix_template=log_line_prefix_template,
            shutdown_timeout=shutdown_timeout,
        )
        # The elastic loop sleeps spec.monitor_interval before each check; we wait on the
        # workers instead (woken by an exit), so its sleep is only a yield.
        self._wait_interval = monitor_interval
        spec.monitor_interval = 0.0
        self._pidfds: dict[int, int] = {}
        self._standby_pool = StandbyPool(standby_workers, spec.rdzv_handler.get_run_id()) if standby_workers else None
        self.failures_reported = 0

    @property
    def tmrun_handler(self) -> TmrunRendezvousHandler | None:
        handler = self._worker_group.spec.rdzv_handler
        return handler if isinstance(handler, TmrunRendezvousHandler) else None

    # -- detection --------------------------------------------------------------------------

    def _wait_for_exit(self, timeout: float) -> None:
        """Block until a worker process exits or ``timeout`` passes."""
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
        self._wait_for_exit(self._wait_interval)
        if self._standby_pool is not None and self._standby_pool.changed():
            self._publish(worker_group, self._pcontext.pids() if self._pcontext else {})
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._report_failure(result)
        return result

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
        pids = super()._start_workers(worker_group)
        if self._standby_pool is not None:
            self._standby_pool.fill()
        self._publish(worker_group, pids)
        return pids

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._close_pidfds()
        super()._stop_workers(worker_group)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        self._close_pidfds()
        try:
            super()._shutdown(death_sig, timeout)
        finally:
            if self._standby_pool is not None:
                self._standby_pool.stop()

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
