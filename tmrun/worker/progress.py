"""This rank's progress record on the node (:mod:`tmrun.protocol.progress`): written at the end
of every completed step and whenever a collective starts or ends being outstanding. A memory
write each time (a shared map), never a store round trip; the agent reads it."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

from tmrun.comm.backend import COMM_CLOCK
from tmrun.protocol import progress


class ProgressWriter:
    def __init__(self, directory: str) -> None:
        self._dir = directory
        self._file: progress.ProgressFile | None = None
        self._rank = -1
        self._record = progress.ProgressRecord(pid=os.getpid())
        self._lock = threading.Lock()
        self._began = 0.0
        self._comm_at_begin = 0.0
        self.last_busy = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self._dir)

    def bind(self, rank: int, gen: int, role: str) -> None:
        """This process plays ``rank`` from now on (its first step, or a promotion)."""
        if not self._dir:
            return
        with self._lock:
            if rank != self._rank:
                try:
                    self._file = progress.ProgressFile(progress.path_for(self._dir, rank))
                except OSError:
                    self._file = None
                self._rank = rank
                COMM_CLOCK.listener = self._comm_changed
            self._record = replace(self._record, gen=gen, role=role)
            self._write()

    def resume_at(self, step: int) -> None:
        """This process's loop starts at ``step`` (0, or where the script resumed from its
        checkpoint): the leader counts a group restart's recomputed steps from it."""
        with self._lock:
            self._record = replace(self._record, resumed=step)

    def begin_step(self) -> None:
        self._began = time.time()
        self._comm_at_begin = COMM_CLOCK.seconds()

    def end_step(self, step: int, gen: int, role: str) -> float:
        """The step completed; returns its own work in seconds (wall time outside collectives)."""
        now = time.time()
        wall = max(0.0, now - self._began) if self._began else 0.0
        busy = max(0.0, wall - (COMM_CLOCK.seconds() - self._comm_at_begin))
        self.last_busy = busy
        if self._file is not None:
            with self._lock:
                self._record = replace(self._record, step=step, step_end=now, step_seconds=wall, busy_seconds=busy,
                                       gen=gen, role=role)
                self._write()
        return busy

    def _comm_changed(self, since: float) -> None:
        with self._lock:
            self._record = replace(self._record, comm_since=since)
            self._write()

    def _write(self) -> None:
        if self._file is not None:
            self._record = replace(self._record, updated=time.time())
            self._file.write(self._record)
