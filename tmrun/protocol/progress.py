"""Per-rank progress records: how a worker tells its agent, on the same node, how far it got.

A worker writes one fixed-size record (:class:`ProgressRecord`) into a small file on the node,
``<TMRUN_PROGRESS_DIR>/rank-<rank>``, through a shared memory map: a memory write per step and per
collective, no store round trip and no system call. A sequence number makes a torn read
detectable (odd while the writer is writing; the reader retries). The agent reads the records
at a bounded rate (:mod:`tmrun.control.detection`) and publishes them per node in the store
(:class:`tmrun.protocol.messages.NodeProgress`).

Times are ``time.time()`` (wall clock, comparable across processes of the node).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from dataclasses import dataclass

# seq, step, step_end, step_seconds, busy_seconds, comm_since, updated, pid, gen, resumed, role
_FORMAT = "<QqdddddqqqI4x"
SIZE = struct.calcsize(_FORMAT)
ROLES = ("", "standby", "joining", "active", "recovering", "switching", "leaving")


def path_for(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}")


@dataclass(frozen=True)
class ProgressRecord:
    step: int = -1  # the last step this process completed (committed); -1: none yet
    step_end: float = 0.0  # when it completed (time.time())
    step_seconds: float = 0.0  # that step's wall time
    busy_seconds: float = 0.0  # that step's wall time outside collectives (its own work)
    comm_since: float = 0.0  # a collective outstanding since (time.time()); 0: none now
    updated: float = 0.0  # the record's last change
    pid: int = 0
    gen: int = -1
    role: str = ""
    resumed: int = -1  # the step this process's loop started at (tm.steps(total, start)); -1: unknown (a standby)

    def pack(self, seq: int) -> bytes:
        role = ROLES.index(self.role) if self.role in ROLES else 0
        return struct.pack(_FORMAT, seq, self.step, self.step_end, self.step_seconds, self.busy_seconds,
                           self.comm_since, self.updated, self.pid, self.gen, self.resumed, role)

    @classmethod
    def unpack(cls, raw: bytes) -> tuple[int, ProgressRecord]:
        seq, step, end, secs, busy, since, updated, pid, gen, resumed, role = struct.unpack(_FORMAT, raw)
        return seq, cls(step, end, secs, busy, since, updated, pid, gen, ROLES[role] if role < len(ROLES) else "",
                        resumed)


class ProgressFile:
    """The writer's side: one record, rewritten in place (seqlock: odd sequence while writing)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < SIZE:
                os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._seq = struct.unpack_from("<Q", self._map, 0)[0] & ~1
        self._lock = threading.Lock()

    def write(self, record: ProgressRecord) -> None:
        with self._lock:
            self._seq += 1
            struct.pack_into("<Q", self._map, 0, self._seq)
            self._map[8:SIZE] = record.pack(self._seq + 1)[8:]
            self._seq += 1
            struct.pack_into("<Q", self._map, 0, self._seq)


def read(path: str, tries: int = 5) -> ProgressRecord | None:
    """The record in ``path``, or None (no file yet, or always caught mid-write)."""
    try:
        with open(path, "rb") as f:
            for _ in range(tries):
                f.seek(0)
                raw = f.read(SIZE)
                if len(raw) < SIZE:
                    return None
                seq, record = ProgressRecord.unpack(raw)
                if seq and seq % 2 == 0:
                    return record
    except OSError:
        return None
    return None
