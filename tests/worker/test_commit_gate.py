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
from tmrun.worker import loop as loop_module, per_rank_records, rng_records, step_records
from tmrun.worker.loop import StepLoop
from tmrun.worker.roles import Role


class _Life:
    def is_(self, role: Role) -> bool:
        return role is Role.ACTIVE


def _gate(monkeypatch: pytest.MonkeyPatch, ops: list[int]) -> tuple[StepLoop, SimpleNamespace]:
    store = dist.HashStore()
    ctx = SimpleNamespace(in_place=True, life=_Life(), current_step=5, committed_step=4, aborted_by=None, rank=1,
                          require_store=lambda: store, tracked=SimpleNamespace(per_rank={}),
                          rng_inherited=None, per_rank_inherited=None)
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


def test_the_next_steps_records_are_written_before_the_vote(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank lost once its vote went through (the others commit, the group resumes at the next
    step) has already left its joiner the next step's per-rank state and random state: they are
    written before the vote. Written after it, a rank SIGKILLed between the two left neither, and
    a nanoGPT job fell back to its group restart (1 random kill in 10, 2026-11-29)."""
    gate, ctx = _gate(monkeypatch, [10])
    store = ctx.require_store()
    ctx.tracked = SimpleNamespace(per_rank={"loader": object()}, per_rank_blob=lambda: b"position after step 5")
    seen: dict[str, object] = {}

    def vote(self: StepLoop) -> None:  # what the store holds when the vote runs
        seen["per_rank"] = step_records.read(store, per_rank_records.PER_RANK_STATE, 1)
        seen["rng"] = rng_records.read(store, 1)

    monkeypatch.setattr(StepLoop, "_commit_vote", vote)
    assert gate.step_aborted() is False
    per_rank = seen["per_rank"]
    assert isinstance(per_rank, step_records.Record) and per_rank.states == {6: b"position after step 5"}
    record = seen["rng"]
    assert isinstance(record, rng_records.Record) and 6 in record.states


def test_a_loss_before_the_vote_skips_every_update(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = [10]
    gate, ctx = _gate(monkeypatch, ops)
    ctx.aborted_by = 3
    assert gate.step_aborted() is True
    assert gate.step_aborted() is True


def test_a_redone_step_drops_the_records_of_its_aborted_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt's vote recorded step 6's state, then the step was aborted and is redone: the
    redo starts without those records (its own commit makes them again)."""
    gate, ctx = _gate(monkeypatch, [10])
    store = ctx.require_store()
    ctx.tracked = SimpleNamespace(per_rank={"loader": object()}, per_rank_blob=lambda: b"position after step 5")
    assert gate.step_aborted() is False  # the attempt's vote: records of step 6 written
    gate._forget_attempt(5)
    per_rank = step_records.read(store, per_rank_records.PER_RANK_STATE, 1)
    assert per_rank is not None and 6 not in per_rank.states
    record = rng_records.read(store, 1)
    assert record is not None and 6 not in record.states


def test_a_commits_record_is_used_only_once_a_boundary_checked_the_script(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first commit's record of the next step cannot be checked yet (a script that changes
    its per-rank state after ``opt.step()`` would hand a joiner the state before that change): a
    rank lost after it makes the job fall back to its group restart. From the next boundary on,
    where the record proved right, it is used; where it proved wrong, no commit record is made
    again."""
    from tmrun.worker.transfer import NoReplicaError

    for changes_after_step, usable_at_step_7 in ((False, True), (True, False)):
        gate, ctx = _gate(monkeypatch, [10])
        position = [b"5"]
        ctx.tracked = SimpleNamespace(per_rank={"loader": object()}, per_rank_blob=lambda: position[0])
        store = ctx.require_store()
        gate._record_at_start(5)  # the boundary into step 5: its random and per-rank records
        position[0] = b"6"  # the step's batch consumed before opt.step()
        assert gate.step_aborted() is False  # the commit: step 6's record, provisional
        with pytest.raises(NoReplicaError, match="once a step boundary showed"):
            per_rank_records.check(store, [1], 6)
        if changes_after_step:
            position[0] = b"6 and a bit"
        ctx.current_step = 6
        gate._record_at_start(6)  # the boundary: the provisional record is checked
        per_rank_records.check(store, [1], 6)  # the boundary's own record: always usable
        position[0] = b"7"
        gate._voted_for = -1
        assert gate.step_aborted() is False  # step 6's commit
        if usable_at_step_7:
            per_rank_records.check(store, [1], 7)
        else:
            with pytest.raises(NoReplicaError):
                per_rank_records.check(store, [1], 7)
