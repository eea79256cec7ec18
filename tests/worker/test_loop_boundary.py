"""The step loop at the boundary between two steps when a failure elsewhere ends the first: a
drill "at the start of step N" still fires there (two ranks killed at one step both die, whichever
reaches the boundary last), before the rank recovers; a drill of a later step does not."""

from __future__ import annotations

from unittest import mock

import pytest

from tmrun.protocol.drills import Drill
from tmrun.worker.context import Context
from tmrun.worker.drills import DrillRunner, InjectedFailure
from tmrun.worker.loop import StepLoop
from tmrun.worker.roles import Role


def _loop(drill: str, pending_plan: bool) -> tuple[StepLoop, mock.MagicMock, mock.MagicMock]:
    ctx = mock.MagicMock()
    ctx.pending_join = None
    ctx.in_place = False
    ctx.env.agent_pid = 0
    ctx.aborted_by = None
    ctx.committed_step = -1
    ctx.void_tail = None
    ctx.first_step_due = None
    ctx.life.is_.side_effect = lambda role: role is Role.ACTIVE
    ctx.drills = DrillRunner([Drill.parse(drill)], rank=3, promoted=False)
    ctx.progress.end_step.return_value = 0.0
    ctx.fire = lambda point, step=None: Context.fire(ctx, point, step)  # the real drills
    recovery = mock.MagicMock()
    recovery.pending_plan.return_value = None
    plan = mock.MagicMock(planned=False)

    def recover() -> int:
        ctx.aborted_by = None
        recovery.pending_plan.return_value = None
        return ctx.committed_step + 1

    recovery.recover.side_effect = recover
    loop = StepLoop(ctx, recovery, mock.MagicMock(), mock.MagicMock())

    def end_step_one() -> None:  # step 1 commits, then a peer's loss (or its plan) arrives
        ctx.committed_step = 1
        if pending_plan:
            recovery.pending_plan.return_value = plan
        else:
            ctx.aborted_by = 0

    ctx.end_step_one = end_step_one
    return loop, ctx, recovery


@pytest.mark.parametrize("pending_plan", [False, True], ids=["loss-seen", "plan-seen"])
def test_a_drill_at_the_next_steps_start_fires_at_the_boundary(pending_plan: bool) -> None:
    loop, ctx, recovery = _loop("rank=3,step=2,signal=RAISE", pending_plan)
    with pytest.raises(InjectedFailure, match="step of step 2"):
        for step in loop.steps(5):
            ctx.committed_step = step
            if step == 1:
                ctx.end_step_one()
    recovery.recover.assert_not_called()  # it fired before the rank went recovering


@pytest.mark.parametrize("pending_plan", [False, True], ids=["loss-seen", "plan-seen"])
def test_a_drill_of_a_later_step_waits_for_that_step(pending_plan: bool) -> None:
    loop, ctx, recovery = _loop("rank=3,step=3,signal=RAISE", pending_plan)
    seen = []
    with pytest.raises(InjectedFailure, match="step of step 3"):
        for step in loop.steps(5):
            seen.append(step)
            ctx.committed_step = step
            if step == 1 and len(seen) == 2:
                ctx.end_step_one()
    assert seen == [0, 1, 2] and recovery.recover.call_count == 1
