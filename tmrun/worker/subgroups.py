"""The subgroups of a job (``new_group``, a device mesh's dimension groups) as the runtime sees them.

Every "tmrun" group of an active rank is part of the in-place protocol (docs/mesh.md, section 2):
a loss seen in any of them aborts the step everywhere in the process, and a recovery repairs them
all in one generation. This module knows how to name a subgroup's members by their global ranks
and which groups a replacement touches; :class:`SubgroupWatch` gives each subgroup the
runtime's failure handler and a loss watcher as the script creates them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Callable

import torch.distributed as dist

from tmrun.comm import backend as tmrun_backend
from tmrun.comm.backend import TmrunProcessGroup
from tmrun.worker.loss_watch import LossWatcher

# (exc, group) -> absorbed: the runtime's handler, told which group failed
GroupFailureHandler = Callable[[BaseException, TmrunProcessGroup], bool]
# (epoch, lost group rank, protocol, message, group)
GroupLossHandler = Callable[[int, int, bool, str, TmrunProcessGroup], None]


def default_group() -> TmrunProcessGroup:
    return tmrun_backend.get_group()


def subgroups() -> list[TmrunProcessGroup]:
    """Every tmrun group of this process except the default group, in creation order."""
    default = default_group()
    return [pg for pg in tmrun_backend.created_groups() if pg is not default]


def whole_world_background(pg: TmrunProcessGroup) -> bool:
    """A background group (a gloo group's stand-in, :mod:`tmrun.worker.gloo_groups`) of every
    rank: the same group whatever a process's rank, which a warm standby makes in its sandbox
    and joins at its promotion (:func:`join_background`)."""
    return pg.background and members(pg) == list(range(dist.get_world_size()))


def mesh_subgroups() -> list[TmrunProcessGroup]:
    """The subgroups whose membership depends on a process's rank (a device mesh's, a
    ``new_group`` of some ranks): a standby cannot keep them from its sandbox, so a job with
    one rehearses (docs/mesh.md, section 1b). Background groups of the whole world are not."""
    return [pg for pg in subgroups() if not whole_world_background(pg)]


def join_background(rank: int, gen: int) -> int:
    """A warm standby promoted to ``rank`` in generation ``gen``: each background group of the
    whole world it made in its sandbox (local mode) takes its link in the survivors' same group,
    in creation order (the survivors repair them after the default group, in that order),
    through the store torch handed it (the sandbox's default group was made over the job's
    group store: :func:`tmrun.worker.group.init_local`). Returns how many."""
    joined = 0
    for pg in subgroups():
        if pg.local and whole_world_background(pg):
            tmrun_backend.join_as(pg, pg.store, rank, gen)
            joined += 1
    return joined


def operations() -> int:
    """Collectives issued so far on every tmrun group of this process (served or sent)."""
    total = 0
    for pg in tmrun_backend.created_groups():
        stats = pg.stats()
        total += stats["local_ops"] + stats["network_ops"]
    return total


def members(pg: TmrunProcessGroup | None) -> list[int]:
    """The global ranks of ``pg``'s members, by group rank."""
    if pg is None or pg is default_group():
        return list(range(dist.get_world_size()))
    return [int(r) for r in dist.get_process_group_ranks(pg)]


def to_global(pg: TmrunProcessGroup, group_rank: int) -> int:
    """The global rank of ``pg``'s member ``group_rank`` (-1 stays -1: unknown)."""
    if group_rank < 0:
        return -1
    ranks = members(pg)
    return ranks[group_rank] if group_rank < len(ranks) else -1


def replaced_in(pg: TmrunProcessGroup, replaced: Collection[int]) -> list[int]:
    """The group ranks of ``pg`` that the global ranks ``replaced`` hold (empty: ``pg`` only
    resynchronises in the replacement)."""
    ranks = members(pg)
    return sorted(ranks.index(r) for r in replaced if r in ranks)


def split(replaced: Collection[int]) -> tuple[list[TmrunProcessGroup], list[TmrunProcessGroup]]:
    """This process's network subgroups (creation order) that hold a rank of ``replaced``
    (global ranks), and the others (both empty in a job without subgroups)."""
    others = [pg for pg in subgroups() if not pg.local]
    touched = [pg for pg in others if replaced_in(pg, replaced)]
    return touched, [pg for pg in others if pg not in touched]


def repair(pg: TmrunProcessGroup, replaced: list[int], gen: int, get: Callable | None) -> None:
    """Move subgroup ``pg``'s communicator to generation ``gen``: its members ``replaced``
    (group ranks) are taken by joiners, which connect as they re-create the group (join mode);
    with none replaced, every link only discards the aborted step's frames (a resynchronisation).
    A member still inside one of the aborted step's collectives on ``pg`` ends it when this
    rank's switch reaches it (its collective fails with the peer's epoch switch, absorbed).
    ``get``: how to wait for a joiner's address (gives up when the plan is superseded)."""
    pg.prepare_replacement(replaced, gen, get=get)
    pg.comm.commit()


def move_all(replaced: Collection[int], gen: int, get: Callable | None, move_default: Callable[[], None]) -> None:
    """Every group of this process to generation ``gen``, in a change's order (docs/mesh.md,
    section 2): first the subgroups that lose nobody, then the default group
    (``move_default``), then the subgroups of ``replaced`` in creation order (the joiner
    re-creates them in that order, each once its default group's join returned)."""
    touched, untouched = split(replaced)
    # The subgroups that lose nobody are committed all at once, not one after another: each
    # commit's switch releases a member still inside one of the aborted step's collectives on
    # that group. Two survivors may share several such groups (torchtitan's TP x DP: the
    # dp_replicate, batch, loss and dp groups of one pair of ranks): committed one at a time,
    # this rank would wait in the first group's switch for a peer still stuck in a collective on
    # a later one, which only this rank's switch of that later group releases.
    for pg in untouched:
        pg.prepare_replacement([], gen, get=get)
    for work in [pg.comm.commit_async() for pg in untouched]:
        work.wait()
    move_default()
    for pg in touched:
        repair(pg, replaced_in(pg, replaced), gen, get)


def abort_all(skip: TmrunProcessGroup | None = None) -> None:
    """Every tmrun group of this process enters the aborted state (``skip``: the group whose
    failure handler is running: it enters it by itself, and holds its lock)."""
    for pg in tmrun_backend.created_groups():
        if pg is not skip and not pg.local:
            pg.abort_collectives()


def clear_all() -> None:
    for pg in tmrun_backend.created_groups():
        pg.clear_aborted()


class SubgroupWatch:
    """Gives every subgroup the runtime's failure handler and a loss watcher, once, as soon as
    the runtime sees it (at each step's start: the script creates its groups before its loop)."""

    def __init__(self, on_failure: GroupFailureHandler, on_loss: GroupLossHandler) -> None:
        self._on_failure = on_failure
        self._on_loss = on_loss
        self._adopted: set[int] = set()
        self._watchers: list[LossWatcher] = []

    def adopt(self) -> int:
        """Hook up the subgroups not seen yet (network groups only); returns how many."""
        count = 0
        for pg in subgroups():
            if id(pg) in self._adopted or pg.local:
                continue
            self._adopted.add(id(pg))
            pg.set_failure_handler(lambda exc, pg=pg: self._on_failure(exc, pg))
            watcher = LossWatcher(lambda pg=pg: pg.comm,
                                  lambda epoch, lost, protocol, message, pg=pg: self._on_loss(epoch, lost, protocol,
                                                                                              message, pg))
            watcher.start()
            self._watchers.append(watcher)
            count += 1
        return count
