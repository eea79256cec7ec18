"""tmrun.worker.untracked_state: the LR schedulers and the gradient scaler a script did not give
to tm.track are tracked for it where unambiguous, under names every rank derives alike, and
healed and undone like tracked objects; where ambiguous, nothing is guessed and they are named."""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable, Iterator

import pytest
import torch

from tmrun.worker import untracked_state
from tmrun.worker.optimizer import guard_in_place
from tmrun.worker.tracked import TrackedState


class _Gate:
    def step_aborted(self) -> bool:
        return False

    def before_optimizer_step(self) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass


@pytest.fixture
def only_this_tests_objects() -> Iterator[Callable[[], None]]:
    """The scan sees the objects this test made, not another test's still alive; calling the
    fixture's value hides those made so far too (a second "process": a joiner's). Hidden as a
    rehearsed standby hides what its first run kept: frozen out of the collector's view
    (``gc.freeze()``; tmrun.worker.live_objects), which also keeps each scan to this test's objects."""

    gc.freeze()  # garbage too: hidden as well, and collected after the test
    try:
        yield gc.freeze
    finally:
        gc.unfreeze()


def _job(scheduler: str = "step", scaler: bool = True) -> tuple[TrackedState, dict[str, Any]]:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrackedState()
    state.track(model=model, optimizer=opt)
    made: dict[str, Any] = {"model": model, "opt": opt}
    if scheduler == "step":
        made["sched"] = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    elif scheduler == "sequential":
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
        decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        made["sched"] = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[2])
    elif scheduler == "plateau":
        made["sched"] = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    if scaler:
        made["scaler"] = torch.amp.GradScaler("cpu", growth_interval=1)
    return state, made


def _train(made: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        made["scaler"].scale(made["model"](torch.ones(1, 2)).sum()).backward()
        made["scaler"].step(made["opt"])
        made["scaler"].update()
        made["opt"].zero_grad()
        made["sched"].step()


@pytest.mark.parametrize("scheduler", ["step", "sequential", "plateau"])
def test_the_scheduler_and_the_scaler_are_tracked_and_a_joiner_receives_them(
        only_this_tests_objects: Callable[[], None], scheduler: str) -> None:
    """One scheduler of the tracked optimizer (a SequentialLR as itself, not its parts) and the
    one enabled scaler: tracked under names from the script's own; a joiner that found the
    same receives the donor's epoch, learning rate and scale; a step undone goes back in them."""
    donor, donor_made = _job(scheduler)
    adopted = untracked_state.adopt(donor)
    assert adopted.tracked == {"optimizer/lr_scheduler": type(donor_made["sched"]).__name__,
                               "tmrun/grad_scaler": "GradScaler"}, adopted
    assert adopted.unsure_schedules == [] and adopted.unsure_scalers == 0
    assert donor.objects()["optimizer/lr_scheduler"] is donor_made["sched"]
    assert untracked_state.adopt(donor).tracked == {}  # tracked now: nothing more to adopt
    if scheduler != "plateau":
        _train(donor_made, 3)
    before = donor.snapshot_stateful()
    donor_lr, donor_scale = donor_made["opt"].param_groups[0]["lr"], donor_made["scaler"].get_scale()
    only_this_tests_objects()  # the joiner's process does not hold the donor's objects
    joiner, joiner_made = _job(scheduler)
    assert untracked_state.adopt(joiner).tracked.keys() == adopted.tracked.keys()
    joiner.apply_rest(donor.rest())
    assert joiner_made["sched"].state_dict().keys() == donor_made["sched"].state_dict().keys()
    assert joiner_made["sched"].last_epoch == donor_made["sched"].last_epoch
    assert joiner_made["opt"].param_groups[0]["lr"] == donor_lr
    assert joiner_made["scaler"].get_scale() == donor_scale != 2.0 ** 16 or scheduler == "plateau"
    if scheduler != "plateau":
        _train(donor_made, 1)  # an aborted step's scheduler and scaler updates ...
        assert donor_made["opt"].param_groups[0]["lr"] != donor_lr or scheduler == "sequential"
        donor.restore_stateful(before)  # ... go back
        assert donor_made["opt"].param_groups[0]["lr"] == donor_lr
        assert donor_made["scaler"].get_scale() == donor_scale


def test_a_scheduler_the_script_tracked_is_left_alone(only_this_tests_objects: None) -> None:
    """Tracked by the script (itself, or in a container such as torchtitan's): nothing adopted,
    made before or after the optimizer's guard."""
    for scheduler_first in (True, False):
        state, made = _job(None, scaler=False)
        if scheduler_first:
            sched = torch.optim.lr_scheduler.StepLR(made["opt"], 1)
            guard_in_place(made["opt"], _Gate())
        else:
            guard_in_place(made["opt"], _Gate())
            sched = torch.optim.lr_scheduler.StepLR(made["opt"], 1)
        container = type("Container", (), {"schedulers": [sched], "state_dict": dict, "load_state_dict": print})()
        state.track(schedulers=container)
        adopted = untracked_state.adopt(state)
        assert adopted.tracked == {} and adopted.unsure_schedules == [], (scheduler_first, adopted)


def test_two_schedulers_of_one_optimizer_and_two_scalers_are_named_not_guessed(only_this_tests_objects: None) -> None:
    """Which of two is which on another rank cannot be told: nothing tracked, each named in a
    warning. Disabled scalers do not count; a dead weak proxy among the collector's objects
    does not break the scan."""
    state, made = _job(None, scaler=False)
    schedulers = [torch.optim.lr_scheduler.StepLR(made["opt"], 1), torch.optim.lr_scheduler.StepLR(made["opt"], 2)]
    scalers = [torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")]
    disabled = torch.amp.GradScaler("cpu", enabled=False)

    class Gone:
        pass

    holder = [weakref.proxy(Gone())]  # a container the collector tracks, holding a dead proxy
    adopted = untracked_state.adopt(state)
    assert adopted.tracked == {} and adopted.unsure_schedules == ["optimizer"] and adopted.unsure_scalers == 2
    lines = untracked_state.describe(adopted)
    assert len(lines) == 2 and all(line.startswith("warning: ") for line in lines), lines
    assert "'optimizer'" in lines[0] and "tm.track" in lines[0] and "2 gradient scalers" in lines[1], lines
    state.track(sched=schedulers[0], scaler=scalers[0])  # the script tracks one of each: the other is adopted
    adopted = untracked_state.adopt(state)
    assert adopted.tracked == {"tmrun/grad_scaler": "GradScaler"} and adopted.unsure_schedules == [], adopted
    assert state.objects()["tmrun/grad_scaler"] is scalers[1]
    del disabled, holder


def test_a_joiner_that_did_not_find_what_its_donor_tracked_fails_its_healing(
        only_this_tests_objects: Callable[[], None]) -> None:
    """A rank whose script made no scaler where the donor's did: healing raises (never a silent
    mismatch)."""
    from tmrun.worker.tracked import TrackError

    donor, _donor_made = _job("step")
    untracked_state.adopt(donor)
    only_this_tests_objects()
    joiner, _joiner_made = _job("step", scaler=False)
    untracked_state.adopt(joiner)
    with pytest.raises(TrackError, match="tmrun/grad_scaler"):
        joiner.apply_rest(donor.rest())


def test_describe_says_what_was_tracked() -> None:
    lines = untracked_state.describe(untracked_state.Adopted(tracked={"optimizer/lr_scheduler": "StepLR"}))
    assert lines == ["tracked for the script: 'optimizer/lr_scheduler' (StepLR): a joiner receives their state and "
                     "a step that a failure aborts is undone in them (give them to tm.track to name them yourself)"]
