"""A job that trains a DDP model and made subgroups: its standby builds after its promotion (it
rehearses, docs/mesh.md section 1b), and a DDP model built then holds DDP's first bucket
assignment while the survivors' were rebuilt in their second step. Found 2026-12-07 (eleventh
session): its construction all-gathered on the default group in the middle of the survivors'
healing; built locally, the job trained on with replicas that differed after the first step. The
eleventh session made such jobs take the group restart; now the joiner takes its donors' buckets
(tmrun.worker.ddp_buckets, tests/worker/test_ddp_buckets.py) and only a model whose buckets cannot
be rebuilt that way (a static graph, a comm hook) makes its job refuse the in-place path, said by
rank 0 in one line at the first step."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

pytest.importorskip("tmrun_native")

from tmrun.comm import backend as tb  # noqa: E402
from tmrun.protocol import keys  # noqa: E402
from tmrun.protocol.environment import LaunchEnv, Mode  # noqa: E402
from tmrun.worker.context import Context  # noqa: E402


def _active(rank: int) -> tuple[Context, dist.Store]:
    ctx = Context(LaunchEnv(mode=Mode.ACTIVE, rank=rank, world_size=2))
    store = dist.HashStore()
    ctx.store = store
    return ctx, store


@pytest.fixture
def local_group():  # type: ignore[no-untyped-def]
    pg = tb.create_process_group(None, 0, 2, datetime.timedelta(seconds=30), "0", tb.Options(local=True))
    yield pg
    pg.shutdown()


@pytest.mark.parametrize("kind, refused", [("plain", False), ("static_graph", True), ("comm_hook", True)])
@pytest.mark.parametrize("subgroups", [True, False])
def test_ddp_with_subgroups_is_refused_in_place_only_where_its_buckets_cannot_be_taken(
        local_group, kind: str, refused: bool, subgroups: bool, capsys: pytest.CaptureFixture[str]) -> None:
    refused = refused and subgroups
    for rank in (0, 1):
        ctx, store = _active(rank)
        model = DistributedDataParallel(torch.nn.Linear(4, 4), process_group=local_group,
                                        static_graph=kind == "static_graph")
        if kind == "comm_hook":
            model.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
        ctx.ddp_used = True
        ctx.interrupter.install(model)
        ctx.publish_subgroups(subgroups)
        ctx.publish_subgroups(subgroups)  # each step start: once
        assert store.check([keys.UNHEALABLE]) == refused
        if refused:
            assert "must then take the survivors' gradient buckets, which it cannot: it " in \
                store.get(keys.UNHEALABLE).decode()
        assert store.get(keys.SUBGROUPS).decode() == ("1" if subgroups else "0")
    said = capsys.readouterr().err
    assert said.count("rank 0: the script trains a DistributedDataParallel model") == int(refused)
    assert ("a failure of this job takes the group restart" in said) == refused
