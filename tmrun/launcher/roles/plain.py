"""No standby to take over in place (``--standby 0``, or another rendezvous backend): the
agent only adds its instant failure detection and its report to the leader; the group
restarts as torchrun's would.

With tmrun's rendezvous the workers also write progress records (a worker that uses the worker
API: its last completed step, a memory write per step), which the agent publishes, so that the
leader can count what each group restart cost (:mod:`tmrun.control.restarts`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from tmrun.control.detection import Detection
from tmrun.launcher.roles.base import AgentRole
from tmrun.protocol import environment

if TYPE_CHECKING:
    from tmrun.launcher.agent import AgentSettings, TmrunAgent
    from tmrun.rendezvous.handler import TmrunRendezvousHandler


class PlainRole(AgentRole):
    def __init__(self, agent: TmrunAgent, settings: AgentSettings | None = None,
                 handler: TmrunRendezvousHandler | None = None) -> None:
        super().__init__(agent)
        self._settings = settings
        self._handler = handler
        self._dir = tempfile.mkdtemp(prefix="tmrun-progress-") if settings is not None and handler is not None else ""
        self._progress: Detection | None = None
        self._ranks: dict[int, int] = {}  # local rank -> global rank

    def start(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._dir and self._settings is not None and self._handler is not None:
            if self._progress is not None:
                self._progress.publish_final()  # the previous epoch's workers stopped
                self._progress.close()
            directory = os.path.join(self._dir, str(self._handler.epoch))
            os.makedirs(directory, exist_ok=True)
            self._ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
            self._progress = Detection(replace(self._settings.detection, progress_dir=directory, gpu_health=False),
                                       self._handler.store, worker_group.group_rank or 0,
                                       {g: local for local, g in self._ranks.items()}, epoch=self._handler.epoch)
            os.environ[environment.ENV_PROGRESS_DIR] = directory  # the workers torch starts inherit it
        return super().start(worker_group)

    def monitor(self, worker_group: WorkerGroup) -> RunResult:
        result = super().monitor(worker_group)
        if self._progress is not None:
            pids = {self._ranks[local]: pid for local, pid in self.agent.group_pids().items() if local in self._ranks}
            if result.state is WorkerState.SUCCEEDED:
                self._progress.publish_last(pids)  # before the leader closes the job and reads them
            else:
                self._progress.publish_progress(pids)
        return result

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
