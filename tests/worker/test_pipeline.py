"""tm.set_shard and pipeline schedules given to tm.track (tmrun.worker.pipeline): which ranks are
replicas, and which pipelines run torch's start-up again after a rank joined."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.pipelining.schedules import _PipelineSchedule

from tmrun.worker import pipeline
from tmrun.worker.tracked import TrackError, TrackedState


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


def test_the_shard_label_makes_same_shaped_stages_different_shards() -> None:
    """Two pipeline stages of equal shapes looked like replicas: a lost rank of one stage was
    healed from the other stage (the replica check then stopped the job)."""
    stage0, stage1, replica = TrackedState(), TrackedState(), TrackedState()
    for state, label in ((stage0, 0), (stage1, 1), (replica, 0)):
        state.track(model=_model())
        state.set_shard(label)
    unlabelled = TrackedState()
    unlabelled.track(model=_model())
    assert unlabelled.shard_key() == 0  # nothing sharded: every member a replica (DDP)
    assert stage0.shard_key() == replica.shard_key() != 0
    assert stage0.shard_key() != stage1.shard_key()


def test_the_stages_of_a_tracked_schedule_are_the_ranks_shard() -> None:
    """Without tm.set_shard (torchtitan's integration): tracking the schedule is enough."""
    keys = []
    for index in (0, 1, 0):
        state = TrackedState()
        state.track(model=_model())
        schedule = _Schedule({0, 1})
        schedule._stage.stage_index = index
        state.track(schedule=schedule)
        keys.append(state.shard_key())
    assert keys[0] == keys[2] != keys[1] and keys[0] != 0


def test_a_second_different_shard_label_and_an_unhashable_one_are_refused() -> None:
    state = TrackedState()
    state.set_shard("stage-0")
    state.set_shard("stage-0")  # the same again: fine
    with pytest.raises(TrackError, match="shard is 'stage-0' already"):
        state.set_shard("stage-1")
    with pytest.raises(TrackError, match="hashable"):
        TrackedState().set_shard(["a", "list"])


class _Stage:
    """What tmrun reads of a torch 2.14 pipeline stage: its module and its group."""

    def __init__(self) -> None:
        self.submod = _model()
        self.group = None
        self.stage_index = 0


class _Schedule(_PipelineSchedule):
    """A single-stage schedule's start-up flags, without a process group."""

    def __init__(self, ranks: set[int]) -> None:  # noqa: D107  (no super().__init__: no stage, no group)
        self.ranks = ranks
        self._stage = _Stage()
        self._stage_forward_initialized = True
        self._stage_backward_initialized = True

    def _initialize_stage(self, *args: Any, **kwargs: Any) -> None:
        self._stage_forward_initialized = self._stage_backward_initialized = True

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError


def test_only_the_pipelines_with_a_joiner_start_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "ranks_of", lambda schedule: schedule.ranks)
    first, second = _Schedule({0, 1}), _Schedule({2, 3})  # two replicas' pipelines
    assert pipeline.restart_where_joined([first, second], {3}) == 1
    assert first._stage_forward_initialized and first._stage_backward_initialized
    assert not second._stage_forward_initialized and not second._stage_backward_initialized
    assert pipeline.restart_where_joined([first], {2}) == 0


def test_a_pipeline_started_again_sets_up_its_p2p_again_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.15 keeps the P2P set-up's flag apart from the start-up's: kept, the survivor
    skipped the set-up its joiner ran, and the link failed ("ranks called different collectives")."""
    monkeypatch.setattr(pipeline, "ranks_of", lambda schedule: schedule.ranks)
    schedule = _Schedule({0, 1})
    schedule._p2p_initialized = True
    assert pipeline.restart_where_joined([schedule], {1}) == 1
    assert not schedule._p2p_initialized and not schedule._stage_forward_initialized


def test_every_pipeline_starts_again_where_the_stages_are_tensor_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """PP x TP x DP: the joiner's shape inference runs TP collectives with its "tp" peers, whose
    pipelines must run their start-up too (the joiner's pipeline alone hung)."""
    monkeypatch.setattr(pipeline, "ranks_of", lambda schedule: schedule.ranks)
    first, second = _Schedule({0, 2}), _Schedule({4, 6})
    assert pipeline.restart_where_joined([first, second], {5}, everywhere=True) == 2
    assert not first._stage_forward_initialized and not second._stage_forward_initialized


def test_a_stage_of_plain_parameters_is_not_tensor_parallel() -> None:
    """(A stage with DTensor parameters: tests/e2e/test_pipeline.py's PP x TP x DP job.)"""

    assert not pipeline.tensor_parallel(_Schedule({0, 1}))


def test_tm_track_takes_a_schedule_as_a_pipeline_not_as_state() -> None:
    state = TrackedState()
    schedule = _Schedule({0, 1})
    state.track(schedule=schedule)
    state.track(again=schedule)
    assert state.pipelines == [schedule] and not state.values and "schedule" not in state.names


def test_a_schedule_without_the_known_start_up_flags_is_refused_when_tracked() -> None:
    schedule = _Schedule({0, 1})
    del schedule._stage_backward_initialized
    with pytest.raises(TypeError, match="start-up state"):
        TrackedState().track(schedule=schedule)


def test_a_schedule_whose_stage_names_its_module_otherwise_is_refused_when_tracked() -> None:
    class _Stage:
        module = _model()  # not torch 2.14's "submod"
        group = None

    schedule = _Schedule({0, 1})
    schedule._stage = _Stage()
    with pytest.raises(TypeError, match="submod, group"):
        TrackedState().track(schedule=schedule)


def _schedule_classes() -> list[type]:
    from torch.distributed.pipelining import schedules

    return sorted((cls for name, cls in vars(schedules).items()
                   if name.startswith("Schedule") and isinstance(cls, type) and issubclass(cls, _PipelineSchedule)),
                  key=lambda cls: cls.__name__)


@pytest.mark.parametrize("schedule_class", _schedule_classes(), ids=lambda cls: cls.__name__)
def test_every_schedule_of_this_torch_is_supported(tmp_path: Any, schedule_class: type) -> None:
    """Every public schedule class of the installed torch (GPipe, 1F1B, the interleaved and zero
    bubble ones, DualPipeV) keeps its start-up state where tmrun finds it: a torch that renames it
    fails here, not at a user's recovery. Real stages on a world of one (a V or a loop of two)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        single = issubclass(schedule_class, PipelineScheduleSingle)
        stages = [PipelineStage(_model(), index, 1 if single else 2, torch.device("cpu"))
                  for index in range(1 if single else 2)]
        schedule = schedule_class(stages[0] if single else stages, n_microbatches=2,
                                  loss_fn=torch.nn.MSELoss())
        pipeline.check_supported(schedule)
        assert not pipeline.started(schedule)
        assert [stage.submod for stage in pipeline.stages_of(schedule)] == [stage.submod for stage in stages]
        assert pipeline.ranks_of(schedule) == {0}
        state = TrackedState()
        state.track(schedule=schedule)
        assert state.pipelines == [schedule]
    finally:
        dist.destroy_process_group()
