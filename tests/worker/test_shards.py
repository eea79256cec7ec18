"""Which members can heal which (docs/mesh.md): replicas share a shard key; a needy member whose
shard no live donor holds fails the agreement at once (NoReplicaError), on every member alike.
The keys of real FSDP2 / HSDP / TP jobs: tests/comm/test_mesh_dist.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tmrun_native")

from tmrun.worker.tracked import TrackedState  # noqa: E402
from tmrun.worker.transfer import HealPlan, NoReplicaError, TransferError, replica_donors  # noqa: E402


def test_ddp_every_donor_is_a_replica() -> None:
    keys = [0, 0, 0, 0]
    assert replica_donors(keys, [0, 2, 3], [1]) == {1: [0, 2, 3]}
    plan = HealPlan(5, [0, 2, 3], [1])  # no keys: the plan of a job without sharding
    assert plan.donors_of(1) == [0, 2, 3]


def test_hsdp_a_joiner_is_healed_by_the_replicas_of_its_shard() -> None:
    a, b = 11, 22  # 2 x 2 ("replicate", "shard"): ranks 0, 2 hold shard a; 1, 3 shard b
    keys = [a, b, a, b]
    assert replica_donors(keys, [0, 2, 3], [1]) == {1: [3]}
    assert replica_donors(keys, [1, 2, 3], [0]) == {0: [2]}
    plan = HealPlan(5, [0, 2, 3], [1], keys=keys)
    assert plan.donors_of(1) == [3] and plan.donors_of(0) == [0, 2]


def test_no_live_replica_is_said_at_once() -> None:
    keys = [1, 2, 3, 4]  # pure FSDP on 4 ranks: every shard has one holder
    with pytest.raises(NoReplicaError, match="rank 1 .*falling back to the group restart"):
        replica_donors(keys, [0, 2, 3], [1])
    with pytest.raises(NoReplicaError, match="ranks 1, 3"):  # HSDP, both replicas of shard b lost
        replica_donors([11, 22, 11, 22], [0, 2], [1, 3])
    assert issubclass(NoReplicaError, TransferError)


def test_shard_key_of_plain_state_is_zero() -> None:
    model = torch.nn.Linear(3, 2)
    tracked = TrackedState()
    tracked.track(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert tracked.shard_key() == 0


def test_a_joiner_with_sandbox_built_shards_is_refused_by_every_member() -> None:
    """A promoted standby built its mesh and shards as rank 0 of its sandbox: its state is for the
    wrong coordinates, so the plan fails on every member (they all run replica_donors on the
    same allgathered keys) instead of healing it from rank 0's replicas."""
    from tmrun.worker.transfer import MISPLACED

    with pytest.raises(NoReplicaError, match="rank 1 joined with sharded state built in a standby's sandbox"):
        replica_donors([11, MISPLACED, 11, 22], [0, 2, 3], [1])
