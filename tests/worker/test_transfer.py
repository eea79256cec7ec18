"""Healing over real native communicators (one thread per rank): members agree on the last
committed step, and whoever is behind receives the tracked state bit for bit, in place."""

from __future__ import annotations

import sys
import os

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "native"))
from conftest import close_all, make_group, run_ranks  # noqa: E402

from tmrun.worker.tracked import TrackedState, TrackError  # noqa: E402
from tmrun.worker.transfer import TransferError, agree, heal  # noqa: E402


def make_member(seed: int, steps: int, width: int = 33) -> tuple[TrackedState, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        model(torch.randn(8, width, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    state = TrackedState()
    state.track(model=model, optimizer=opt, scheduler=sched, epoch=steps * 10)
    return state, model, opt


def snapshot(state: TrackedState) -> list[bytes]:
    return [bytes(t.detach().reshape(-1).view(torch.uint8).tolist()) for _, t in state.tensors()]


@pytest.mark.parametrize("n,needy", [(2, [1]), (3, [1]), (4, [0, 3]), (5, [2])])
def test_joiners_receive_the_state_bit_for_bit(n, needy):
    comms = make_group(n, job=f"heal{n}")
    try:
        members = {}
        for rank in range(n):
            fresh = rank in needy
            # donors: identical replicas after 3 steps; joiners: another init, never stepped
            members[rank] = make_member(seed=1 if not fresh else 100 + rank, steps=3 if not fresh else 0)
        # where every tensor lives before: the state must arrive in place (same storage)
        params_before = {r: [p.data_ptr() for p in members[r][1].parameters()] for r in range(n)}

        def body(comm):
            state = members[comm.rank][0]
            fresh = comm.rank in needy
            plan = agree(comm, -1 if fresh else 3, state.layout_digest(), fresh)
            moved, meta = heal(comm, state, plan, {"committed_step": 3})
            return plan, moved, meta

        results, _ = run_ranks(comms, body, timeout=60)
        plans = [r[0] for r in results]
        assert all(p == plans[0] for p in plans)
        assert plans[0].target_step == 3 and plans[0].needy == needy
        reference = snapshot(members[plans[0].donors[0]][0])
        for rank in range(n):
            state, model, opt = members[rank]
            assert snapshot(state) == reference, f"rank {rank} differs"
            assert state.values["epoch"] == 30
            assert opt.param_groups[0]["lr"] == members[plans[0].donors[0]][2].param_groups[0]["lr"]
        for rank in needy:
            assert results[rank][1] == sum(len(b) for b in reference)  # every byte arrived here
            assert results[rank][2] == {"committed_step": 3}
        for rank, ptrs in params_before.items():
            assert [p.data_ptr() for p in members[rank][1].parameters()] == ptrs
    finally:
        close_all(comms)


def test_a_member_one_step_behind_heals_from_the_others():
    comms = make_group(3, job="behind")
    try:
        members = {0: make_member(1, 4), 1: make_member(1, 3), 2: make_member(1, 4)}

        def body(comm):
            state = members[comm.rank][0]
            committed = 3 if comm.rank == 1 else 4
            plan = agree(comm, committed, state.layout_digest(), False)
            heal(comm, state, plan, {})
            return plan

        results, _ = run_ranks(comms, body, timeout=60)
        assert results[0].target_step == 4 and results[0].donors == [0, 2] and results[0].needy == [1]
        assert snapshot(members[1][0]) == snapshot(members[0][0])
    finally:
        close_all(comms)


def test_nobody_holding_the_state_is_an_error():
    comms = make_group(2, job="nobody")
    try:
        members = {r: make_member(r, 0) for r in range(2)}
        _, errors = run_ranks(
            comms, lambda c: agree(c, -1, members[c.rank][0].layout_digest(), True), raise_errors=False
        )
        assert all(isinstance(e, TransferError) for e in errors)
    finally:
        close_all(comms)


def test_track_refuses_what_cannot_move():
    state = TrackedState()
    with pytest.raises(TrackError, match="picklable"):
        state.track(handle=lambda: None)
