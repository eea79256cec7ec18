"""Whether a healed member's background read of the optimizer state overlaps with anything.

Deferred healing (:class:`tmrun.worker.transfer.DeferredRead`) returns once the model arrived
and reads the optimizer state (two thirds of AdamW's bytes) out of the donors' memory while the
healed member runs its first forward and backward. That hides the read only when the host has
CPU cores nobody computes on: the read is a copy thread and a checksum thread in the healed
member, and a checksum thread in each donor. Where the ranks' own compute already takes every
core (CPU training: each worker's torch threads), the read takes its cores from that step,
which then ends later on every rank. Reading the whole state before resuming is then faster:
during healing the donors only wait, so the read has the host to itself.

On this repository's 2-core machine, 100M parameters (1.2 GB of state), 2 workers of one thread
each: the first step after the recovery took 1.40 s (median) against a steady 1.03 s with the
read in the background, and 1.09 s with the read done first; the recovery stall's p90 went from
0.86 s to 0.43 s (docs/benchmarks.md, "overlap only with spare cores").

``TMRUN_HEAL_OVERLAP``: ``auto`` (the default) overlaps only when :attr:`CpuBudget.spare`
leaves room for the read's threads; ``on`` and ``off`` decide for every host. Every member of a
healing computes its own answer; :func:`tmrun.worker.transfer.agree` defers only when every
member said yes, so all members take the same path. A planned migration's joiner decides
alone for its handover (:meth:`tmrun.worker.migration.Migration.take_over`): the leaver only
waits for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from tmrun.protocol import environment

READ_THREADS = 2  # a healed member's copy thread and checksum thread (peer_read.BackgroundRead)


@dataclass(frozen=True)
class CpuBudget:
    """This host's cores as one worker sees them: the cores it may run on (its affinity), the
    workers of its node and the threads each computes with."""

    usable: int
    local_workers: int
    threads_per_worker: int

    @property
    def spare(self) -> int:
        """Cores the ranks' compute leaves idle (never negative)."""
        return max(0, self.usable - self.local_workers * self.threads_per_worker)

    def describe(self) -> str:
        return (f"{self.usable} usable core{'s' if self.usable != 1 else ''}, {self.local_workers} "
                f"worker{'s' if self.local_workers != 1 else ''} x {self.threads_per_worker} "
                f"thread{'s' if self.threads_per_worker != 1 else ''}")


def this_worker(environ: Mapping[str, str] | None = None) -> CpuBudget:
    """The budget of the calling worker: its CPU affinity, ``LOCAL_WORLD_SIZE`` (1 when unset)
    and torch's intra-op threads."""
    import torch  # a worker has it loaded already

    env = os.environ if environ is None else environ
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        usable = os.cpu_count() or 1
    try:
        local_workers = max(1, int(env.get(environment.ENV_LOCAL_WORLD_SIZE, "1")))
    except ValueError:
        local_workers = 1
    return CpuBudget(usable, local_workers, max(1, torch.get_num_threads()))


def overlap_reads(policy: str, budget: CpuBudget) -> bool:
    """Whether this member lets the optimizer state be read in the background (``policy``: one
    of :data:`tmrun.protocol.environment.HEAL_OVERLAPS`)."""
    if policy == "on":
        return True
    if policy == "off":
        return False
    return budget.spare >= READ_THREADS


def decide(environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """This worker's answer: whether it lets state be read in the background, and if not why
    (for its log line). A bad ``TMRUN_HEAL_OVERLAP`` is refused by the CLI at start; a worker
    launched otherwise keeps the default."""
    env = os.environ if environ is None else environ
    try:
        policy = environment.heal_overlap(env)
    except ValueError:
        policy = "auto"
    budget = this_worker(env)
    if overlap_reads(policy, budget):
        return True, ""
    if policy == "off":
        return False, f"{environment.ENV_HEAL_OVERLAP}=off"
    return False, (f"{budget.describe()} leave fewer than {READ_THREADS} cores for a background read "
                   f"({environment.ENV_HEAL_OVERLAP}=on overlaps anyway)")
