"""Membership rules of the leader, without processes."""

from __future__ import annotations

import pytest

from tmrun.control import planner
from tmrun.control.planner import HOLE, FailureReport, GroupLimits
from tmrun.protocol.membership import Membership, Phase

FIXED = GroupLimits(min_nodes=2, max_nodes=2, standby=1)
ELASTIC = GroupLimits(min_nodes=1, max_nodes=3, standby=0)


def formed(joined: list[int], limits: GroupLimits = FIXED) -> Membership:
    return planner.form_group(Membership(), joined, limits)


def test_first_nodes_are_active_the_rest_stand_by() -> None:
    m = formed([5, 3, 9])
    assert (m.active, m.standby, m.epoch, m.phase) == ([5, 3], [9], 1, Phase.RUNNING)
    assert Membership.from_json(m.to_json()) == m


def test_cannot_form_without_enough_nodes() -> None:
    with pytest.raises(ValueError):
        planner.form_group(Membership(), [1], FIXED)


def test_standby_join_does_not_change_the_epoch() -> None:
    m = planner.admit_node(formed([0, 1]), 7, FIXED)
    assert m.standby == [7] and m.epoch == 1


def test_elastic_join_grows_the_group() -> None:
    m = planner.admit_node(formed([0], ELASTIC), 4, ELASTIC)
    assert m.active == [0, 4] and m.epoch == 2


def test_standby_takes_the_failed_rank_and_the_culprit_stands_by() -> None:
    m = planner.replace_failed(formed([0, 1, 2]), [1], set(), FIXED)
    assert m.active == [0, 2] and m.standby == [1] and m.epoch == 2


def test_dead_node_is_not_put_back_in_the_pool() -> None:
    m = planner.replace_failed(formed([0, 1, 2]), [0], {0}, FIXED)
    assert m.active == [2, 1] and m.standby == [] and m.dead == [0]


def test_no_standby_live_culprit_restarts_in_place() -> None:
    m = planner.replace_failed(formed([0, 1]), [1], set(), FIXED)
    assert m.active == [0, 1] and m.epoch == 2


def test_no_standby_dead_node_leaves_a_hole_that_a_joiner_fills() -> None:
    m = planner.replace_failed(formed([0, 1]), [1], {1}, FIXED)
    assert m.active == [0, HOLE]
    filled = planner.admit_node(m, 8, FIXED)
    assert filled.active == [0, 8] and filled.epoch == m.epoch + 1


def test_elastic_group_shrinks_instead_of_waiting() -> None:
    m = planner.replace_failed(formed([0, 1, 2], ELASTIC), [1], {1}, ELASTIC)
    assert m.active == [0, 2]


def test_two_failures_one_standby() -> None:
    m = planner.replace_failed(formed([0, 1, 2]), [0, 1], {0, 1}, FIXED)
    assert m.active == [2, HOLE]


def test_blame_prefers_signals_and_dead_nodes_over_exceptions() -> None:
    exception_first = FailureReport(0, 1, by_signal=False)
    killed = FailureReport(1, 1, by_signal=True)
    assert planner.blame([exception_first, killed]) == [1]
    assert planner.blame([exception_first, FailureReport(2, 1, by_signal=False)]) == [0]
    assert planner.blame([FailureReport(3, 1, by_signal=False, node_dead=True), exception_first]) == [3]
    assert planner.blame([]) == []


def test_lost_standby_leaves_the_pool_only() -> None:
    m = planner.drop_standby(formed([0, 1, 2]), 2)
    assert m.standby == [] and m.dead == [2] and m.epoch == 1


def test_in_place_replacement_keeps_the_epoch() -> None:
    m = formed([0, 1, 2])
    swapped = planner.replace_in_place(m, {1: 2}, dead={1})
    assert (swapped.active, swapped.standby, swapped.dead, swapped.epoch) == ([0, 2], [], [1], m.epoch)
    assert "in place" in swapped.reason
    assert Membership.from_json(swapped.to_json()) == swapped


def test_in_place_replacement_retires_a_live_node() -> None:
    swapped = planner.replace_in_place(formed([0, 1, 2]), {1: 2}, dead=set())
    assert (swapped.retired, swapped.dead, swapped.role_of(1)) == ([1], [], "retired")
    assert Membership.from_json(swapped.to_json()).retired == [1]


def test_in_place_replacement_needs_an_active_culprit_and_a_standby() -> None:
    m = formed([0, 1, 2])
    with pytest.raises(ValueError):
        planner.replace_in_place(m, {2: 1}, dead=set())  # 2 is not active, 1 is not standing by


def test_membership_without_retired_field_still_reads() -> None:
    old = '{"active": [0], "dead": [], "epoch": 1, "phase": "running", "reason": "", "standby": []}'
    assert Membership.from_json(old).retired == []
