"""Pure membership decisions of the leader: formation, joins, failures, deaths.

Every function takes the current :class:`Membership` and returns a new one (never mutates),
so the rules are tested without processes or stores.
"""

from __future__ import annotations

import copy

from tmrun.protocol.membership import GroupLimits, Membership, Phase
from tmrun.protocol.messages import FailureReport

HOLE = -1  # an active group rank whose node is gone and not yet replaced


def _copy(membership: Membership) -> Membership:
    return copy.deepcopy(membership)


def form_group(membership: Membership, joined: list[int], limits: GroupLimits) -> Membership:
    """The first active group: the first max_nodes joiners are active, the rest stand by."""
    if membership.phase is not Phase.FORMING:
        raise ValueError("the group is already formed")
    if len(joined) < limits.min_nodes:
        raise ValueError(f"{len(joined)} nodes joined, {limits.min_nodes} needed")
    formed = _copy(membership)
    formed.active = list(joined[: limits.max_nodes])
    formed.standby = list(joined[limits.max_nodes :])
    formed.phase = Phase.RUNNING
    formed.epoch = membership.epoch + 1
    formed.reason = f"formed with {len(formed.active)} active, {len(formed.standby)} standby"
    return formed


def admit_node(membership: Membership, node_id: int, limits: GroupLimits) -> Membership:
    """A node joined a running job: fill a hole, grow an elastic group, or stand by.

    Only filling a hole or growing changes the active group (and the epoch): a node that
    only stands by never makes the active group restart.
    """
    admitted = _copy(membership)
    if HOLE in admitted.active:
        rank = admitted.active.index(HOLE)
        admitted.active[rank] = node_id
        admitted.epoch += 1
        admitted.reason = f"node {node_id} took group rank {rank}"
    elif limits.elastic and len(admitted.active) < limits.max_nodes:
        admitted.active.append(node_id)
        admitted.epoch += 1
        admitted.reason = f"node {node_id} joined as group rank {len(admitted.active) - 1}"
    else:
        admitted.standby.append(node_id)
        admitted.reason = f"node {node_id} stands by"
    return admitted


def blame(reports: list[FailureReport]) -> list[int]:
    """Which nodes caused a failure.

    A node whose agent is gone, or whose worker was killed by a signal, is a root cause; the
    exceptions that follow on other nodes (a collective that lost its peer) are not. When only
    exceptions were seen, the first reporter is the cause.
    """
    certain = [r.node_id for r in reports if r.node_dead or r.by_signal]
    if certain:
        return sorted(set(certain), key=certain.index)
    return [reports[0].node_id] if reports else []


def replace_failed(
    membership: Membership,
    culprits: list[int],
    dead: set[int],
    limits: GroupLimits,
) -> Membership:
    """A new epoch in which a standby takes each culprit's group rank.

    A culprit that is still alive goes to the back of the standby pool (its node may be
    faulty, so it is the last to be promoted). Without a standby, a live culprit keeps its
    rank (the group restarts, as torchrun does); a dead one leaves a hole, or the group
    shrinks when --nnodes allows it.
    """
    plan = _copy(membership)
    plan.dead = sorted(set(plan.dead) | dead)
    plan.standby = [n for n in plan.standby if n not in dead]
    moves: list[str] = []
    for culprit in culprits:
        if culprit not in plan.active:
            continue
        rank = plan.active.index(culprit)
        if plan.standby:
            replacement = plan.standby.pop(0)
            plan.active[rank] = replacement
            moves.append(f"node {replacement} replaces node {culprit} at group rank {rank}")
            if culprit not in dead:
                plan.standby.append(culprit)
        elif culprit in dead:
            plan.active[rank] = HOLE
            moves.append(f"group rank {rank} (node {culprit}) lost, no standby")
        else:
            moves.append(f"node {culprit} restarts in place at group rank {rank} (no standby)")
    if HOLE in plan.active and limits.elastic:
        survivors = [n for n in plan.active if n != HOLE]
        if len(survivors) >= limits.min_nodes:
            plan.active = survivors
            moves.append(f"group shrinks to {len(survivors)} nodes")
    plan.epoch = membership.epoch + 1
    plan.reason = "; ".join(moves) if moves else "restart"
    return plan


def replace_in_place(membership: Membership, moves: dict[int, int], dead: set[int]) -> Membership:
    """Standby nodes take failed nodes' group ranks *without* a new epoch: the survivors keep
    their workers (in-place replacement). ``moves`` maps a failed node to the standby node that
    takes its group rank; a failed node that is still alive is retired (it leaves the job)."""
    swapped = _copy(membership)
    steps: list[str] = []
    for culprit, replacement in moves.items():
        if culprit not in swapped.active or replacement not in swapped.standby:
            raise ValueError(f"node {replacement} cannot replace node {culprit} in place")
        rank = swapped.active.index(culprit)
        swapped.active[rank] = replacement
        swapped.standby.remove(replacement)
        if culprit in dead:
            swapped.dead = sorted(set(swapped.dead) | {culprit})
        else:
            swapped.retired = sorted(set(swapped.retired) | {culprit})
        steps.append(f"node {replacement} replaces node {culprit} at group rank {rank} in place")
    swapped.reason = "; ".join(steps)
    return swapped


def drop_standby(membership: Membership, node_id: int) -> Membership:
    """A standby node is gone: remove it from the pool (the active group is untouched)."""
    dropped = _copy(membership)
    dropped.standby = [n for n in dropped.standby if n != node_id]
    if node_id not in dropped.dead:
        dropped.dead.append(node_id)
    dropped.reason = f"standby node {node_id} is gone"
    return dropped


def close(membership: Membership, phase: Phase, reason: str) -> Membership:
    closed = _copy(membership)
    closed.phase = phase
    closed.reason = reason
    return closed
