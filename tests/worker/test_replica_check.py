"""The replica check (tmrun.worker.replica_check): after a change, members with equal shard keys
must hold the same parameters and optimizer state; a difference stops the job with one line
naming the tensor and the ranks."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "native"))
from conftest import close_all, make_group, run_ranks  # noqa: E402

from tmrun.worker.replica_check import ReplicasDiverged, check, disagreement, first_difference  # noqa: E402
from tmrun.worker.tracked import TrackedState  # noqa: E402


def _member(seed: int) -> TrackedState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    state = TrackedState()
    state.track(model=model, optimizer=opt)
    return state


def test_groups_are_compared_within_their_shard_key_only() -> None:
    assert disagreement([0, 0, 0], [5, 5, 5]) == []
    assert disagreement([1, 2, 1, 2], [5, 6, 5, 6]) == []  # two shards, each agreeing
    assert disagreement([1, 2, 1, 2], [5, 6, 5, 7]) == [[1, 3]]
    assert first_difference(["a", "b"], {0: [1, 2], 3: [1, 9]}) == ("b", [0], [3])


def test_replicas_that_agree_pass_and_every_member_counts_the_same() -> None:
    comms = make_group(3, job="replicas-agree")
    try:
        members = {r: _member(seed=1) for r in range(3)}
        results, _ = run_ranks(comms, lambda c: check(c, 0, members[c.rank].replica_tensors(), "generation 1"))
        assert {(r.groups, r.tensors) for r in results} == {(1, 4 + 12)}  # 4 parameters, 3 Adam tensors each (step, exp_avg, exp_avg_sq)
    finally:
        close_all(comms)


def test_a_replica_that_differs_stops_every_member_naming_the_tensor_and_the_ranks() -> None:
    comms = make_group(3, job="replicas-differ")
    try:
        members = {r: _member(seed=1) for r in range(3)}
        with torch.no_grad():
            next(iter(members[2]._objects["model"][1].parameters())).add_(1e-7)  # one weight, rank 2
        _, errors = run_ranks(comms, lambda c: check(c, 0, members[c.rank].replica_tensors(), "generation 4"),
                              raise_errors=False)
        assert len(errors) == 3 and all(isinstance(e, ReplicasDiverged) for e in errors)
        line = str(errors[0])
        assert "'model.1.weight'" in line and "ranks 0, 1 and rank 2" in line and "generation 4" in line
        assert "\n" not in line
    finally:
        close_all(comms)


def test_members_of_different_shards_are_not_compared() -> None:
    comms = make_group(2, job="replicas-shards")
    try:
        members = {r: _member(seed=r) for r in range(2)}  # different state, different shard keys
        results, _ = run_ranks(comms, lambda c: check(c, 10 + c.rank, members[c.rank].replica_tensors(), "g"))
        assert [r.groups for r in results] == [0, 0]
    finally:
        close_all(comms)


def _arriving_check(members: dict, arriving_rank: int, what: str):  # type: ignore[no-untyped-def]
    return lambda c: check(c, 0, members[c.rank].replica_tensors(), what, later=frozenset({"optimizer"}),
                           arriving=c.rank == arriving_rank)


def test_a_joiner_whose_optimizer_state_still_arrives_is_compared_on_the_rest() -> None:
    """A migration's joiner reads the leaver's optimizer state in the background: its group
    compares the model only (on an H200 the check read that state before it arrived and stopped
    a correct job as diverged); a model that differs still stops the job."""
    comms = make_group(3, job="replicas-arriving")
    try:
        members = {r: _member(seed=1) for r in range(3)}
        with torch.no_grad():  # rank 1's optimizer state has not arrived yet
            for state in members[1]._objects["optimizer"].state.values():
                state["exp_avg"].zero_()
        results, _ = run_ranks(comms, _arriving_check(members, 1, "generation 1"))
        assert {r.groups for r in results} == {1}
        # the same state without the arriving flag is a divergence, named on the optimizer's tensor
        _, errors = run_ranks(comms, _arriving_check(members, -1, "generation 2"), raise_errors=False)
        assert len(errors) == 3 and "optimizer.state.0.exp_avg" in str(errors[0])
        with torch.no_grad():
            next(iter(members[2]._objects["model"][0].parameters())).add_(1e-7)
        _, errors = run_ranks(comms, _arriving_check(members, 1, "generation 3"), raise_errors=False)
        assert len(errors) == 3 and all(isinstance(e, ReplicasDiverged) for e in errors)
        assert "'model.0.weight'" in str(errors[0]) and "rank 2" in str(errors[0])
    finally:
        close_all(comms)
