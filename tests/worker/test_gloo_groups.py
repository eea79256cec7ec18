"""tmrun.worker.gloo_groups: ``dist.new_group`` says when the script asks for gloo (an in-place
job cannot follow a replacement with such a group), once, and makes the group as asked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tmrun.worker import gloo_groups


@pytest.fixture
def world() -> Iterator[None]:
    original = dist.new_group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        dist.new_group = original  # type: ignore[assignment]


def test_a_gloo_group_is_said_once_and_made_as_asked(world: None) -> None:
    asked: list[str] = []
    gloo_groups.watch(asked.append, "tmrun")
    gloo_groups.watch(asked.append, "tmrun")  # idempotent: one wrapper
    plain = dist.new_group()  # the default backend: nothing said
    dist.new_group(backend="undefined")
    assert asked == []
    side = dist.new_group(None, None, "gloo")  # positional, as torch's signature allows
    assert asked == ["gloo"] and dist.get_backend(side) == "gloo"
    dist.new_group(backend="cpu:gloo")
    assert asked == ["gloo"]  # said once
    t = torch.ones(1)
    dist.all_reduce(t, group=side)  # the group works as gloo's
    assert t.item() == 1.0 and plain is not None


def test_the_reason_names_the_backend() -> None:
    assert gloo_groups.why("gloo") == ("the script made a gloo group (dist.new_group(backend='gloo'); torchtitan: "
                                       "--checkpoint.async_mode async), which no standby can join")
    assert gloo_groups.why("nccl") == "the script made a nccl group (dist.new_group(backend='nccl')), which no standby can join"
