"""TrackedState: the step-start snapshot (what an aborted step advanced besides tensors goes back),
what healing moves (the live tensors, by identity), the replica check's tensors, per-rank state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tmrun.worker.tracked import TrackError, TrackedState


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


# -- healing moves what a module holds, by identity (issue 29) --------------------------------------


class FusedQKV(torch.nn.Module):
    """torchtitan's shape: one fused projection whose state_dict shows unfused q/k/v copies."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = torch.nn.Linear(4, 12, bias=False)
        self.register_buffer("steps_seen", torch.zeros(1))
        self._register_state_dict_hook(FusedQKV._unfuse)

    @staticmethod
    def _unfuse(module: "FusedQKV", state: dict[str, Any], prefix: str, _local: Any) -> dict[str, Any]:
        fused = state.pop(f"{prefix}wqkv.weight")
        for name, part in zip("qkv", fused.chunk(3)):
            state[f"{prefix}w{name}.weight"] = part.clone()  # copies, as a real unfusing hook gives
        return state


def test_tracked_tensors_are_the_live_parameters_and_buffers_never_state_dict_copies() -> None:
    """A joiner's healing writes into these tensors: through state_dict() it wrote into the
    hook's copies and left the live weights at their fresh initialisation (replicas diverged
    silently)."""
    model = torch.nn.Sequential(FusedQKV(), torch.nn.Linear(12, 4))
    model[1].weight = torch.nn.Parameter(torch.randn(4, 12))
    torch.nn.utils.parametrize.register_parametrization(model[1], "weight", Doubled())
    state = TrackedState()
    state.track(model=model)
    live = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    moved = [t for _, t in state.tensors()]
    assert {t.data_ptr() for t in moved} == live and len(moved) == len(live)
    # a write through what healing receives into changes the module itself
    for t in moved:
        t.data.fill_(0.25) if t.is_floating_point() else None
    assert bool((model[0].wqkv.weight == 0.25).all()) and bool((model[1].parametrizations.weight.original == 0.25).all())


class Doubled(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2


def test_tied_weights_are_moved_once() -> None:
    embed = torch.nn.Embedding(5, 4)
    head = torch.nn.Linear(4, 5, bias=False)
    head.weight = embed.weight
    state = TrackedState()
    state.track(model=torch.nn.ModuleDict({"embed": embed, "head": head}))
    assert [name for name, _ in state.tensors()] == ["model.embed.weight"]


def test_the_replica_check_covers_parameters_and_optimizer_state_not_buffers() -> None:
    model = torch.nn.BatchNorm1d(3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = TrackedState()
    state.track(model=model, optimizer=opt)
    names = [name for name, _ in state.replica_tensors()]
    assert "model.weight" in names and "model.running_mean" not in names
    assert any(name.startswith("optimizer.state.") for name in names)


# -- per-rank state (issue 29) ------------------------------------------------------------------------


def test_per_rank_state_round_trips_and_stays_out_of_what_donors_send() -> None:
    mine, joiner = Position(), Position()
    mine.at = 1007  # e.g. rank 1's data position
    donor, receiver = TrackedState(), TrackedState()
    donor.track_per_rank(loader=mine)
    receiver.track_per_rank(loader=joiner)
    assert b"1007" not in donor.rest() and donor.per_rank
    receiver.apply_per_rank(donor.per_rank_blob())
    assert joiner.at == 1007
    snapshot = receiver.snapshot_per_rank()
    joiner.at = 5
    receiver.restore_per_rank(snapshot)
    assert joiner.at == 1007


def test_per_rank_refuses_modules_duplicates_and_objects_without_state() -> None:
    state = TrackedState()
    with pytest.raises(TrackError, match="replicas"):
        state.track_per_rank(model=torch.nn.Linear(1, 1))
    with pytest.raises(TrackError, match="state_dict"):
        state.track_per_rank(offset=3)
    state.track_per_rank(loader=Position())
    with pytest.raises(TrackError, match="already"):
        state.track(loader=Position())


def test_missing_optimizer_state_of_dtensor_parameters_is_allocated_as_the_optimizer_makes_it(tmp_path) -> None:
    """A joiner's optimizer that never stepped gets the donor's state allocated before it is
    received: for a DTensor parameter, a zero DTensor sharded as the parameter (same mesh,
    placements, local shape), and of the donor's dtype; equal, spec for spec, to what the same
    optimizer makes by stepping."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weights = [torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])) for _ in range(2)]
        stepped = torch.optim.AdamW(weights, lr=0.1)
        for w in weights:
            w.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
        stepped.step()
        donor = TrackedState()
        donor.track(opt=stepped)
        fresh = torch.optim.AdamW(weights, lr=0.1)
        joiner = TrackedState()
        joiner.track(opt=fresh)
        joiner.allocate_missing(donor.specs())
        assert joiner.specs() == donor.specs()
        for w in weights:
            for key in ("exp_avg", "exp_avg_sq"):
                value = fresh.state[w][key]
                assert isinstance(value, DTensor) and value.placements == w.placements and value.device_mesh is mesh
                assert value.to_local().shape == w.to_local().shape and not value.to_local().any()
        # a spec of another dtype than its parameter's: allocated in the spec's dtype
        other = TrackedState()
        other.track(opt=torch.optim.AdamW(weights, lr=0.1))
        halves = [type(s)(s.name, s.shape, "torch.float16") if s.name.endswith("exp_avg") else s for s in donor.specs()]
        other.allocate_missing(halves)
        assert other.specs() == halves
    finally:
        dist.destroy_process_group()


def test_a_healing_walks_each_module_once_and_sees_changes_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within ``walked_once`` (a healing) each tracked module's members are walked once, however
    often its tensors, specs, shard key or replica tensors are asked for; nested blocks share the
    walk; after the block a module's new parameter is seen again (no stale walk in a later change)."""
    from tmrun.worker import tracked as tracked_module

    walks: list[int] = []
    real = tracked_module._module_members
    monkeypatch.setattr(tracked_module, "_module_members", lambda module: walks.append(1) or real(module))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    state = TrackedState()
    state.track(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with state.walked_once():
        names = [name for name, _ in state.tensors()]
        state.specs(), state.layout_digest(), state.shard_key(), state.replica_tensors()
        with state.walked_once():
            assert [name for name, _ in state.tensors()] == names
    assert len(walks) == 1
    model.register_buffer("scale", torch.ones(1))
    assert [name for name, _ in state.tensors()] == names + ["model.scale"] and len(walks) == 2
