"""tmrun.worker.gloo_groups: in an in-place job ``dist.new_group(backend="gloo")`` makes a tmrun
background group instead (said once); another named backend is said once and made as asked."""

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


def test_without_a_stand_in_a_gloo_group_is_said_once_and_made_as_asked(world: None) -> None:
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


def test_a_gloo_group_is_a_tmrun_background_group_and_nccl_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    from tmrun.comm.backend import TmrunProcessGroup

    original = dist.new_group
    monkeypatch.setenv("TMRUN_COMM_LOCAL", "1")  # a sandbox's world: every group local
    dist.init_process_group("tmrun", store=dist.HashStore(), rank=0, world_size=1)
    try:
        foreign: list[str] = []
        replaced: list[str] = []
        gloo_groups.watch(foreign.append, "tmrun", on_gloo=replaced.append)
        side = dist.new_group(backend="gloo", pg_options=object())  # gloo's own options are dropped
        again = dist.new_group(None, None, "cpu:gloo")
        assert replaced == ["gloo"] and foreign == []  # said once
        for group in (side, again):
            assert isinstance(group, TmrunProcessGroup) and group.background and dist.get_backend(group) == "tmrun"
        plain = dist.new_group()  # the default backend's: not a background group
        assert isinstance(plain, TmrunProcessGroup) and not plain.background
        with pytest.raises(Exception):  # noqa: B017 (torch's own error: no nccl here; said first)
            dist.new_group(backend="nccl")
        assert foreign == ["nccl"]
    finally:
        dist.destroy_process_group()
        dist.new_group = original  # type: ignore[assignment]


def test_the_lines_name_the_backend() -> None:
    assert gloo_groups.why("nccl") == "the script made a nccl group (dist.new_group(backend='nccl')), which no standby can join"
    said = gloo_groups.replaced("gloo")
    assert said.startswith("the script made a gloo group (dist.new_group(backend='gloo'); "
                           "torchtitan: --checkpoint.async_mode async): it is a tmrun group here"), said


def test_a_cut_off_save_is_found_in_dcps_exception_and_nothing_else_is() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from tmrun.comm.backend import BackgroundInterrupted

    cut = BackgroundInterrupted("tmrun allreduce ...: the job's membership changed")
    assert gloo_groups.cut_by_a_change(cut)
    try:  # raised from, inside the save
        try:
            raise cut
        except BackgroundInterrupted as inner:
            raise RuntimeError("DCP's planning failed") from inner
    except RuntimeError as outer:
        assert gloo_groups.cut_by_a_change(outer)
    # DCP's exception of every rank: rank -> (exception, traceback)
    assert gloo_groups.cut_by_a_change(CheckpointException("save", {0: (ValueError("x"), []), 1: (cut, [])}))
    assert not gloo_groups.cut_by_a_change(CheckpointException("save", {0: (ValueError("disk full"), [])}))
    assert not gloo_groups.cut_by_a_change(OSError("No space left on device"))
