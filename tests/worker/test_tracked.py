"""TrackedState's step-start snapshot: what an aborted step advanced besides tensors goes back."""

from __future__ import annotations

import torch

from tmrun.worker.tracked import TrackedState


class Position:
    def __init__(self) -> None:
        self.at = 0

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


def _step(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
          scaler: torch.amp.GradScaler, model: torch.nn.Module, loader: Position) -> None:
    loader.at += 1
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    opt.zero_grad()


def test_an_aborted_step_is_undone_for_schedulers_scalers_loaders_and_hyperparameters() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    loader = Position()
    state = TrackedState()
    state.track(model=model, optimizer=opt, scheduler=sched, scaler=scaler, loader=loader, epoch=3)
    snapshot = state.snapshot_stateful()
    _step(opt, sched, scaler, model, loader)
    assert (opt.param_groups[0]["lr"], scaler.get_scale(), loader.at, sched.last_epoch) == (0.5, 8.0, 1, 1)
    state.restore_stateful(snapshot)
    assert (opt.param_groups[0]["lr"], scaler.get_scale(), loader.at, sched.last_epoch) == (1.0, 4.0, 0, 0)
    assert sched.get_last_lr() == [1.0]
    # the snapshot is a copy: restoring twice works, and a later step does not change it
    _step(opt, sched, scaler, model, loader)
    state.restore_stateful(snapshot)
    assert (opt.param_groups[0]["lr"], loader.at) == (1.0, 0)
