"""The optimizer guard: a step is skipped when aborted, otherwise applied bit for bit as without
the guard; both usages (the user's own object after tm.track, and the returned wrapper) work
with LR schedulers made before or after."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from tmrun.worker import optimizer as guarded


class Gate:
    def __init__(self) -> None:
        self.aborted = False
        self.calls: list[str] = []

    def step_aborted(self) -> bool:
        return self.aborted

    def before_optimizer_step(self) -> None:
        self.calls.append("before")

    def after_optimizer_step(self) -> None:
        self.calls.append("after")


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, step: object, steps: int, zero: object) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        step()  # type: ignore[operator]
        zero()  # type: ignore[operator]


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_in_place_guard_is_bitwise_identical_and_skips_aborted_steps() -> None:
    ref_model, ref_opt = make()
    train(ref_model, ref_opt.step, 5, ref_opt.zero_grad)
    model, opt = make()
    gate = Gate()
    g = guarded.guard_in_place(opt, gate)
    assert type(opt) is torch.optim.AdamW and guarded.guarded_in_place(opt)
    assert guarded.guard_in_place(opt, gate) is g  # idempotent: one guard, one route
    train(model, opt.step, 5, opt.zero_grad)
    assert same(params(model), params(ref_model))
    assert gate.calls == ["before", "after"] * 5
    before = params(model)
    gate.aborted = True
    train(model, opt.step, 1, opt.zero_grad)
    assert same(params(model), before) and gate.calls == ["before", "after"] * 5  # skipped, no callbacks
    assert opt.state_dict()["state"][0]["step"].item() == 5


def test_wrapper_is_an_optimizer_that_delegates() -> None:
    ref_model, ref_opt = make()
    train(ref_model, ref_opt.step, 3, ref_opt.zero_grad)
    model, opt = make()
    gate = Gate()
    wrapper = guarded.guard(opt, gate)
    assert isinstance(wrapper, torch.optim.Optimizer) and guarded.unwrap(wrapper) is opt
    assert not guarded.guarded_in_place(opt)  # the user's object is untouched
    assert wrapper.param_groups is opt.param_groups and wrapper.state is opt.state
    train(model, wrapper.step, 3, wrapper.zero_grad)
    assert same(params(model), params(ref_model))
    assert wrapper.state_dict()["state"][0]["step"].item() == 3
    wrapper.load_state_dict(ref_opt.state_dict())
    with pytest.raises(TypeError):
        pickle.dumps(wrapper)
    with pytest.raises(TypeError):
        guarded.GuardedOptimizer(wrapper, gate)


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_lr_scheduler_made_before_or_after_the_guard(scheduler_first: bool, recwarn) -> None:
    ref_model, ref_opt = make()
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    model, opt = make()
    gate = Gate()
    if scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        guarded.guard_in_place(opt, gate)
    else:
        guarded.guard_in_place(opt, gate)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for m, o, s in ((ref_model, ref_opt, ref_sched), (model, opt, sched)):
        for _ in range(3):
            train(m, o.step, 1, o.zero_grad)
            s.step()
    assert same(params(model), params(ref_model))
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 1e-2 / 8
    assert gate.calls == ["before", "after"] * 3
    if not scheduler_first:  # it wrapped the guarded step: it saw the steps (made before, it warns
        # once that the step was overridden after it, as it did with the runtime's earlier patch)
        assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]
    assert guarded.guarded_in_place(opt)  # under the scheduler's wrapper too
    guarded.guard_in_place(opt, gate)  # tracked again: nothing changes
    train(model, opt.step, 1, opt.zero_grad)
    assert gate.calls == ["before", "after"] * 4 and getattr(opt, "_opt_called", False)


def test_scheduler_on_the_wrapper() -> None:
    model, opt = make()
    wrapper = guarded.guard(opt, Gate())
    sched = torch.optim.lr_scheduler.StepLR(wrapper, step_size=1, gamma=0.1)
    train(model, wrapper.step, 1, wrapper.zero_grad)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_in_place_guard_leaves_pickling_and_copies_alone() -> None:
    model, opt = make()
    guarded.guard_in_place(opt, Gate())
    train(model, opt.step, 1, opt.zero_grad)
    clone = pickle.loads(pickle.dumps(opt))
    assert type(clone) is torch.optim.AdamW and not guarded.guarded_in_place(clone)
    assert not guarded.guarded_in_place(copy.deepcopy(opt))
