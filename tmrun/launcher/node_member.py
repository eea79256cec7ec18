"""One active node of an in-place job over several nodes, seen from its agent.

Across nodes a member is a node: the leader (:mod:`tmrun.control.node_inplace`) decides which
standby node takes a failed node's ranks; each agent only looks after its own workers:

* it copies the epoch's generation from the store into the node's generation file (workers read
  it at every step boundary);
* when a survivor reports one of this node's ranks lost while its process lives on (hung, cut
  off), or when one of its workers fails, it stops every worker of the node (fencing: nothing
  they do later can reach the new generation) and reports the node failed to the leader;
* it owns the promoted standby workers of a standby node that took over in place.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed import Store

from tmrun.console import say
from tmrun.protocol import keys, messages as proto
from tmrun.launcher.standby_pool import terminate
from tmrun.launcher.worker_slots import Slot, WorkerSlots, write_gen_file


@dataclass
class NodeOutcome:
    finished: bool = False  # every rank of this node exited 0
    failed: bool = False  # this node's workers failed and were stopped; the leader decides


class NodeMember(WorkerSlots):
    def __init__(self, store: Store, world_size: int, gen_file: str,
                 report_failure: Callable[[bool, str], None]) -> None:
        super().__init__(store, world_size)
        self._gen_file = gen_file
        self._report_failure = report_failure
        self._gen = -1
        self.failed = False
        self._mirror_gen()

    def adopt(self, processes: dict[int, subprocess.Popen[bytes]], promoted: bool) -> None:
        self.slots = {rank: Slot(rank, process, promoted=promoted) for rank, process in processes.items()}
        self.failed = False

    def step(self) -> NodeOutcome:
        self._mirror_gen()
        if self.failed:
            return NodeOutcome(failed=True)
        lost = self._read_reports()
        if lost:
            self._fail(lost)
            return NodeOutcome(failed=True)
        codes = {s.rank: s.poll() for s in self.slots.values()}
        bad = {rank: code for rank, code in codes.items() if code not in (None, 0)}
        if bad:
            self._fail(", ".join(f"rank {rank} {self._how(code)}" for rank, code in sorted(bad.items())),
                       by_signal=any(code < 0 for code in bad.values()))
            return NodeOutcome(failed=True)
        if all(code == 0 for code in codes.values()):
            return NodeOutcome(finished=True)
        return NodeOutcome()

    @staticmethod
    def _how(code: int) -> str:
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def _mirror_gen(self) -> None:
        gen = proto.read_gen(self._store)
        if gen != self._gen:
            write_gen_file(self._gen_file, gen)
            self._gen = gen

    def _read_reports(self) -> str:
        """A survivor's report that it lost one of this node's live ranks (this generation)."""
        for report in self._new_reports():
            slot = self.slots.get(report.lost)
            if report.gen == self._gen and slot is not None and slot.poll() is None and report.lost != report.reporter:
                return f"rank {report.lost} (pid {slot.pid}) lost by rank {report.reporter}, its process still running"
        return ""

    def _fail(self, detail: str, by_signal: bool = True) -> None:
        """Stop every worker of this node and tell the leader (a member is a node)."""
        say(f"this node failed ({detail}); stopping its workers for the standby node to take over")
        for slot in self.slots.values():
            if slot.poll() is None:
                try:
                    os.kill(slot.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for slot in self.slots.values():
            try:
                slot.process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in the kernel: report anyway, it cannot compute
                say(f"rank {slot.rank} (pid {slot.pid}) did not exit 10 s after SIGKILL")
        self.failed = True
        self._report_failure(by_signal, detail)

    def stop_promoted(self, timeout: float = 5.0) -> None:
        terminate([s.process for s in self.slots.values() if s.promoted], timeout)
