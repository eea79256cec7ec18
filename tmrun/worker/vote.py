"""What a rank does when its commit vote loses a peer (tmrun.worker.loop: the commit vote).

The vote is one all-reduce (MAX of "aborted") at a step's first optimizer step. A rank lost
*during* it can leave the survivors on both sides: those whose all-reduce completed received
"commit" and apply the step; those whose all-reduce lost the peer did not. Under HSDP the shard
of a rank that did not apply may then have no holder at the step the others reached, and the job
lost its in-place path (healing only moves state forward from a replica).

A survivor whose vote lost a peer can tell which side it is on without a collective: it took
part in the vote, so its own step was clean, and any member that received "commit" knows that
every member (the lost one too) voted "clean". Every rank publishes its record (its last
committed step, :func:`publish`) the moment it learns of the loss (its failure handler or loss
watcher, on whichever thread) and again as it starts recovering; the undecided rank publishes
its own and applies its update exactly when some survivor committed the step: as soon as one
record says so, or, to skip it, once the controller's plan says which ranks are lost and every
other survivor's record is in. A committed survivor may be blocked in a collective with the
undecided rank (which only the undecided rank's switch to the next generation releases): its
record comes from the thread that saw the loss, not from its training thread. The records travel through the in-place
store; nothing is added to a step without a failure. A wait that cannot finish (the store gone,
the recovery timeout) ends undecided: the step is skipped and healing brings this rank forward
from a replica if the others committed (or the job falls back to its group restart in one line,
as before this module).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from tmrun.protocol import keys, messages as proto
from tmrun.worker import store_pace

POLL = 0.002


def publish(store: dist.Store, gen: int, rank: int, committed_step: int) -> None:
    """``rank`` is in the steps of ``gen`` with ``committed_step`` committed (a rank's first record
    of a generation is final unless its own vote lost a peer; a later one may then say more)."""
    store.set(keys.commit_record(gen, rank), str(committed_step))
    store.add(keys.committed_at(gen, committed_step), 1)
    store.add(keys.commit_records(gen), 1)


def lost_ranks(store: dist.Store, gen: int, newest: int) -> set[int] | None:
    """The ranks that the plans after ``gen`` (up to generation ``newest``) replace; None while
    the plan of ``gen + 1`` is not published."""
    lost: set[int] = set()
    for later in range(gen + 1, max(newest, gen + 1) + 1):
        key = keys.plan(later)
        if not store.check([key]):
            if later == gen + 1:
                return None
            break
        lost.update(proto.ReplacementPlan.decode(key, store.get(key)).replaced)
    return lost


def others_committed(store: dist.Store, gen: int, rank: int, world_size: int, step: int,
                     newest_gen: Callable[[], int], deadline: float) -> bool | None:
    """Whether a surviving member of ``gen`` other than ``rank`` (whose own record, ``step - 1``,
    is published) committed ``step``: True as soon as a record says so; False once the plan is
    out and every other survivor's record is in, none saying so; None when ``deadline``
    (monotonic) passed first. Two counter reads per poll; the records themselves are read only
    once the counter says they can all be there."""
    known: dict[int, int] = {}
    pace = store_pace.interval(world_size, POLL, requests_per_look=3)  # two counters and the plan's check a look
    while True:
        if store.add(keys.committed_at(gen, step), 0) > 0:
            return True
        count = store.add(keys.commit_records(gen), 0)
        lost = lost_ranks(store, gen, newest_gen())
        if lost is not None:
            others = [r for r in range(world_size) if r != rank and r not in lost]
            if count >= len(others) + 1:
                for r in others:
                    key = keys.commit_record(gen, r)
                    if r not in known and store.check([key]):
                        known[r] = int(store.get(key))
                if any(value >= step for value in known.values()):
                    return True
                if all(r in known for r in others):
                    return False
        if time.monotonic() > deadline:
            return None
        time.sleep(pace)
