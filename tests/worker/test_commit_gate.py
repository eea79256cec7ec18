"""The optimizer guard's gate (tmrun.worker.loop.StepLoop.step_aborted) for a step with several
optimizer steps: after the step committed at its first, a peer lost before another is either
harmless (optimizers stepped back to back: gradients of before the vote) or makes the step
impossible to finish or redo (collectives since the vote: a GAN's generator after its
discriminator), which ends the job's in-place path in one line, never half a step trained on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from tmrun.protocol import keys
from tmrun.worker import loop as loop_module
from tmrun.worker.loop import StepLoop
from tmrun.worker.roles import Role


class _Life:
    def is_(self, role: Role) -> bool:
        return role is Role.ACTIVE


def _gate(monkeypatch: pytest.MonkeyPatch, ops: list[int]) -> tuple[StepLoop, SimpleNamespace]:
    store = dist.HashStore()
    ctx = SimpleNamespace(in_place=True, life=_Life(), current_step=5, committed_step=4, aborted_by=None, rank=1,
                          require_store=lambda: store)
    gate = StepLoop(ctx, None, None, None)  # type: ignore[arg-type]  (only the gate is used)
    monkeypatch.setattr(StepLoop, "_commit_vote", lambda self: None)
    monkeypatch.setattr(loop_module.subgroups, "operations", lambda: ops[0])
    return gate, ctx


def _first_update(gate: StepLoop, ctx: SimpleNamespace) -> None:
    assert gate.step_aborted() is False  # votes; the update is applied
    ctx.committed_step = ctx.current_step


def test_back_to_back_optimizers_after_a_loss_are_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = [10]
    gate, ctx = _gate(monkeypatch, ops)
    _first_update(gate, ctx)
    ctx.aborted_by = 3  # the loss watcher saw rank 3 go between the two optimizer steps
    assert gate.step_aborted() is False


def test_an_update_after_collectives_that_lost_a_peer_stops_the_in_place_path(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = [10]
    gate, ctx = _gate(monkeypatch, ops)
    _first_update(gate, ctx)
    ops[0] = 14  # the second model's backward ran collectives, and one lost rank 3
    ctx.aborted_by = 3
    with pytest.raises(SystemExit):
        gate.step_aborted()
    assert b"cannot be applied" in ctx.require_store().get(keys.UNHEALABLE)


def test_without_a_loss_every_update_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = [10]
    gate, ctx = _gate(monkeypatch, ops)
    _first_update(gate, ctx)
    ops[0] = 14
    assert gate.step_aborted() is False


def test_a_loss_before_the_vote_skips_every_update(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = [10]
    gate, ctx = _gate(monkeypatch, ops)
    ctx.aborted_by = 3
    assert gate.step_aborted() is True
    assert gate.step_aborted() is True
