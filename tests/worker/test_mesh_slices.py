"""A joiner's set-up slices each device mesh once per dimension (tmrun.worker.mesh_slices)."""

from __future__ import annotations

import gc
import weakref

import pytest

from tmrun.worker import stale_meshes
from tmrun.worker.mesh_slices import SliceMemo


class Mesh:
    """Stands for torch's DeviceMesh: a new sub-mesh object on every slice."""

    built = 0

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def __getitem__(self, names: str | tuple[str, ...]) -> Mesh:
        Mesh.built += 1
        return Mesh((names,) if isinstance(names, str) else tuple(names))


@pytest.fixture
def memo(monkeypatch: pytest.MonkeyPatch) -> SliceMemo:
    monkeypatch.setattr(stale_meshes, "mesh_class", lambda: Mesh)
    Mesh.built = 0
    memo = SliceMemo()
    yield memo
    memo.stop()


def test_a_repeated_slice_of_one_mesh_is_built_once_while_the_memo_runs(memo: SliceMemo) -> None:
    original = Mesh.__getitem__
    root, other = Mesh(("replicate", "shard")), Mesh(("replicate", "shard"))
    memo.start()
    shard = root["shard"]
    assert root["shard"] is shard and root[("shard",)] is shard  # a name or a tuple of one
    assert root["replicate"] is not shard and other["shard"] is not shard  # per dimension, per mesh object
    assert Mesh.built == 3 and memo.hits == 2
    assert memo.stop() == 2 and Mesh.__getitem__ is original  # torch's method again
    assert root["shard"] is not shard and Mesh.built == 4


def test_a_mesh_collected_meanwhile_does_not_lend_its_slices_to_one_at_the_same_address(memo: SliceMemo) -> None:
    memo.start()
    root = Mesh(("replicate", "shard"))
    old = root["shard"]
    ref = weakref.ref(root)
    del root
    gc.collect()
    assert ref() is None
    new = Mesh(("replicate", "shard"))
    # what the memo holds for a collected mesh whose address the new one took (CPython reuses them)
    memo._slices[(id(new), ("shard",))] = (ref, old)
    assert new["shard"] is not old and memo.hits == 0


def test_nothing_to_do_without_torchs_device_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stale_meshes, "mesh_class", lambda: None)  # a job that never imported it
    memo = SliceMemo()
    memo.start()
    assert memo.stop() == 0


@pytest.mark.e2e
def test_fully_shard_under_the_memo_builds_what_it_builds_without_it() -> None:
    """HSDP on a 2 x 2 mesh as rank 1 (torch's fake process group): with the memo, FSDP2's one
    slice per parameter is built once, and every parameter's local shard, placements and mesh
    coordinates are those of a build without it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def build() -> list[tuple[torch.Tensor, tuple, tuple]]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return [(p.to_local().clone(), p.placements, list(p.device_mesh.get_coordinate())) for p in model.parameters()]

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        plain = build()
        memo = SliceMemo()
        memo.start()
        try:
            memoized = build()
        finally:
            hits = memo.stop()
        assert hits >= len(plain) - 1  # one slice per parameter in torch 2.13-2.15's FSDP2; built once here
        assert len(memoized) == len(plain)
        for (a, placements_a, coord_a), (b, placements_b, coord_b) in zip(plain, memoized):
            assert torch.equal(a, b) and placements_a == placements_b and coord_a == coord_b == [0, 1]
    finally:
        dist.destroy_process_group()
