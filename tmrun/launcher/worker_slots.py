"""What an in-place controller keeps of its node's workers: one slot per rank (the process that
plays it now), whether every rank runs the worker API, and the node's generation file."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from torch.distributed import Store

from tmrun.console import say
from tmrun.protocol import keys, messages as proto


@dataclass
class Slot:
    """One rank of this node and the process that currently plays it (a child of the agent:
    the worker torch started, or a promoted standby)."""

    rank: int
    process: subprocess.Popen[bytes]
    promoted: bool = False
    fenced: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()


def write_gen_file(path: str, gen: int) -> None:
    """Workers on this node read the generation here at every step boundary (a file read instead
    of a store round trip). Written after the plan is in the store, replaced atomically."""
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as flag:
        flag.write(str(gen))
    os.replace(partial, path)


class WorkerSlots:
    def __init__(self, store: Store, world_size: int) -> None:
        self._store = store
        self._world_size = world_size
        self._enabled = False
        self._reports_seen = 0
        self.slots: dict[int, Slot] = {}

    def enabled(self) -> bool:
        """True once every rank of the job runs the tmrun worker API."""
        if not self._enabled and self._store.check([keys.API]):
            self._enabled = self._store.add(keys.MEMBERS, 0) >= self._world_size
        return self._enabled

    def pids(self) -> list[int]:
        return [s.pid for s in self.slots.values() if s.poll() is None]

    def _new_reports(self) -> Iterator[proto.WorkerReport]:
        """Workers' reports written since the last call, in order (a malformed one is logged
        and skipped)."""
        for number, key in proto.numbered(self._store, keys.REPORT_SEQ, keys.report, self._reports_seen):
            self._reports_seen = number + 1
            try:
                yield proto.WorkerReport.decode(key, self._store.get(key))
            except proto.ProtocolMessageError as exc:
                say(f"ignored a malformed worker report: {exc}")
