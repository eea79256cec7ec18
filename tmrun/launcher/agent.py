"""TmrunAgent: torch's LocalElasticAgent plus instant failure detection and tmrun membership.

What it adds to the elastic agent (and nothing else):
* it waits on the workers' pidfds, so a worker that exits is seen at once, not a poll later;
* it tells the tmrun leader which node failed and how (signal or exception), so a standby node
  can take that node's group rank;
* it publishes its workers for ``tmrun-ctl status``;
* everything that depends on the job's shape (standby processes on one node, standby nodes
  across nodes, neither) is its *role*, chosen once at construction (:mod:`tmrun.launcher.roles`):
  torch's loop calls the agent's hooks (start, monitor, stop), and they ask the role.
"""

from __future__ import annotations

import inspect
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException

from tmrun.console import say
from tmrun.control.detection import DetectionSettings
from tmrun.launcher.roles import AgentRole, choose_role
from tmrun.launcher.stop_signals import announce_stop, reinstall_stop_signals
from tmrun.launcher.worker_errors import error_line
from tmrun.protocol.messages import WorkersInfo
from tmrun.rendezvous.handler import TmrunRendezvousHandler


@dataclass(frozen=True)
class AgentSettings:
    """tmrun's options of an agent (torch's are in the WorkerSpec)."""

    standby_workers: int = 0  # one node: standby worker processes
    standby_nodes: int = 0  # several nodes: this job has standby nodes
    standby_wait: float = 60.0  # in-place: how long a failure waits for a warm standby
    refill_delay: float = 5.0  # one node: seconds after a recovery before the replacement standby starts
    standby_log_dir: str = ""  # where standby workers write their output (else: the agent's terminal)
    detection: DetectionSettings = DetectionSettings()  # hangs, stragglers, GPU health (one node)


class TmrunAgent(LocalElasticAgent):
    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        start_method: str,
        monitor_interval: float,
        settings: AgentSettings,
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
        self.wait_interval = monitor_interval
        spec.monitor_interval = 0.0
        self._pidfds: dict[int, int] = {}
        self.failures_reported = 0
        # whether a worker of the current start reached tmrun.init(), by the node's own keys (the
        # one-node in-place role keeps them under its group's prefix): said in failure reports
        self.api_reached: Callable[[], bool] = lambda: False
        self._role: AgentRole = choose_role(self, settings)

    @property
    def spec(self) -> WorkerSpec:
        return self._worker_group.spec

    @property
    def tmrun_handler(self) -> TmrunRendezvousHandler | None:
        handler = self._worker_group.spec.rdzv_handler
        return handler if isinstance(handler, TmrunRendezvousHandler) else None

    # -- torch's hooks: the role answers ---------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return self._role.start(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return self._role.monitor(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._close_pidfds()
        self._role.stop_promoted()
        super()._stop_workers(worker_group)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # Also called by the elastic agent between restarts of the group: the standby pool
        # lives on (see run()); only the workers, promoted standbys included, stop here.
        self._close_pidfds()
        self._role.stop_promoted()
        if "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters:  # torch >= 2.12
            super()._shutdown(death_sig, timeout)
        else:
            super()._shutdown(death_sig)

    def run(self, role: str = "default") -> RunResult:
        try:
            return super().run(role)
        finally:
            self._role.close()

    def _invoke_run(self, role: str = "default") -> RunResult:
        try:
            return super()._invoke_run(role)
        except SignalException as exc:  # said before torch's shutdown of the workers
            announce_stop(self.tmrun_handler, exc.sigval)
            raise

    # -- what roles use ------------------------------------------------------------------------

    def start_group(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start the group's workers as torch does (local rank -> pid); torch's raise-every-time
        signal handler it installs on the way is replaced by the agent's one-shot one."""
        pids = super()._start_workers(worker_group)
        reinstall_stop_signals()
        return pids

    def group_processes(self, worker_group: WorkerGroup) -> dict[int, subprocess.Popen[bytes]]:
        """Global rank -> process of the workers torch started."""
        handlers = getattr(self._pcontext, "subprocess_handlers", {}) if self._pcontext is not None else {}
        return {w.global_rank: handlers[w.local_rank].proc for w in worker_group.workers if w.local_rank in handlers}

    def group_pids(self) -> dict[int, int]:
        return self._pcontext.pids() if self._pcontext is not None else {}

    def forget_group_processes(self) -> None:
        """The workers are adopted standbys, not processes torch started."""
        self._pcontext = None

    def error_file(self, local_rank: int) -> str:
        return self._pcontext.error_files.get(local_rank, "") if self._pcontext is not None else ""

    def no_more_restarts(self) -> None:
        self._remaining_restarts = 0

    def wait_for_exit(self, timeout: float, watched: list[int] | None = None) -> None:
        """Block until a worker process (or one of ``watched``) exits, or ``timeout`` passes."""
        pids = set(watched) if watched is not None else set(self.group_pids().values())
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

    def elastic_check(self, worker_group: WorkerGroup) -> RunResult:
        """torch's check of the workers; a failure is reported to the leader."""
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self.report_failure(result)
        return result

    def report_failure(self, result: RunResult, node_fallback: str = "") -> None:
        """Tell the leader (``node_fallback``: why this node's in-place controller gave up, if it ran)."""
        handler = self.tmrun_handler
        failures = result.failures or {}
        # A worker killed by a signal is a root cause; SIGABRT is excluded because it is how
        # a library (gloo, NCCL) reacts to a peer that vanished: a consequence, not a cause.
        by_signal = any(
            f.exitcode is not None and f.exitcode < 0 and -f.exitcode != signal.SIGABRT for f in failures.values()
        )
        parts = []
        stderrs = getattr(self._pcontext, "stderrs", None) or {}
        for rank, failure in sorted(failures.items()):
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            own = error_line(failure, stderrs.get(failure.local_rank))  # the script's own error, where readable
            parts.append(f"rank {rank} (pid {failure.pid}) {how}" + (f": {own}" if own else ""))
        detail = ", ".join(parts) or result.state.name.lower()
        say(f"worker failure on this node: {detail}")
        self.failures_reported += 1
        if handler is not None:
            handler.report_failure(by_signal=by_signal, detail=detail, node_fallback=node_fallback,
                                   reached_api=bool(node_fallback) or self.api_reached())

    def publish(self, worker_group: WorkerGroup, pids: dict[int, int], standby: list[dict[str, object]]) -> None:
        """Tell ``tmrun-ctl status`` which processes this node runs."""
        handler = self.tmrun_handler
        if handler is None:
            return
        workers = [{"local_rank": w.local_rank, "rank": w.global_rank, "pid": pids.get(w.local_rank)}
                   for w in worker_group.workers]
        handler.publish_workers(WorkersInfo(epoch=handler.epoch, group_rank=worker_group.group_rank,
                                            agent_pid=os.getpid(), workers=workers, standby_workers=standby))

    def standby_members(self) -> list[dict[str, object]]:
        return self._role.standby_members()

    def _close_pidfds(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
