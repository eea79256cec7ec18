"""A job that trains a DDP model and made subgroups is not replaced in place: its standby builds
after its promotion (it rehearses, docs/mesh.md section 1b), and a DDP model built then buckets its
gradients unlike the survivors' in its first step (theirs were rebuilt in their second step; the
joiner's are DDP's first assignment). Found 2026-12-07 (eleventh session): such a joiner's DDP
construction all-gathered on the default group in the middle of the survivors' healing ("value
cannot be converted to type int without overflow"); built locally, the job trained on with
replicas that differed after the first step. Now the ranks record at their first step that the
job's failures take the group restart, and rank 0 says why in one line."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tmrun.protocol import keys
from tmrun.protocol.environment import LaunchEnv, Mode
from tmrun.worker.context import DDP_WITH_SUBGROUPS, Context


def _active(rank: int) -> tuple[Context, dist.Store]:
    ctx = Context(LaunchEnv(mode=Mode.ACTIVE, rank=rank, world_size=2))
    store = dist.HashStore()
    ctx.store = store
    return ctx, store


@pytest.mark.parametrize("ddp, subgroups", [(True, True), (True, False), (False, True), (False, False)])
def test_ddp_with_subgroups_is_refused_in_place_at_the_first_step(ddp: bool, subgroups: bool,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for rank in (0, 1):
        ctx, store = _active(rank)
        ctx.ddp_used = ddp
        ctx.publish_subgroups(subgroups)
        ctx.publish_subgroups(subgroups)  # each step start: once
        refused = ddp and subgroups
        assert store.check([keys.UNHEALABLE]) == refused
        if refused:
            assert store.get(keys.UNHEALABLE).decode() == DDP_WITH_SUBGROUPS
        assert store.get(keys.SUBGROUPS).decode() == ("1" if subgroups else "0")
    said = capsys.readouterr().err
    assert said.count("rank 0: the script trains a DistributedDataParallel model") == int(ddp and subgroups)
    assert "a failure of this job takes the group restart" in said or not (ddp and subgroups)
