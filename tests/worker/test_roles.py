"""The worker's role table: every written transition is allowed, nothing else."""

from __future__ import annotations

import itertools

import pytest

from tmrun.worker.roles import TRANSITIONS, IllegalTransition, Lifecycle, Role

ALLOWED = {
    (Role.STANDBY, Role.JOINING),
    (Role.JOINING, Role.ACTIVE),
    (Role.JOINING, Role.RECOVERING),
    (Role.ACTIVE, Role.RECOVERING),
    (Role.ACTIVE, Role.SWITCHING),
    (Role.ACTIVE, Role.LEAVING),
    (Role.RECOVERING, Role.ACTIVE),
    (Role.RECOVERING, Role.LEAVING),
    (Role.RECOVERING, Role.JOINING),  # a joiner whose generation was superseded joins the newer one  # a migration's leaver that lost a member before its switch
    (Role.SWITCHING, Role.ACTIVE),
    (Role.SWITCHING, Role.RECOVERING),  # a member lost during a migration's switch
}


def test_the_table_is_the_documented_one() -> None:
    assert set(TRANSITIONS) == set(Role)
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == ALLOWED


@pytest.mark.parametrize("start,target", list(itertools.product(Role, Role)))
def test_every_pair(start: Role, target: Role) -> None:
    life = Lifecycle(start)
    if (start, target) in ALLOWED:
        life.to(target)
        assert life.role is target and life.history == [start, target]
    else:
        with pytest.raises(IllegalTransition, match=f"{start.name} -> {target.name}"):
            life.to(target)
        assert life.role is start


def test_a_standby_promoted_then_migrated_away() -> None:
    life = Lifecycle(Role.STANDBY)
    for role in (Role.JOINING, Role.RECOVERING, Role.ACTIVE, Role.SWITCHING, Role.ACTIVE, Role.LEAVING):
        life.to(role)
    assert life.is_(Role.LEAVING) and not life.is_(Role.ACTIVE, Role.STANDBY)
