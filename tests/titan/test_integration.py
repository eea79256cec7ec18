"""Unit checks of tmrun.integrations.torchtitan and the test-only CPU shim, without processes
(skipped where torchtitan is not installed): the ``--module``/``--config`` lookup through
torchtitan's own ConfigManager, the loader position's restore flag, the shim's SDPA swap."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

# e2e: each test imports torchtitan (about 5 s on 2 cores), too slow for the unit subset
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                 reason="torchtitan is not installed (pip install -e '.[torchtitan]')"),
              pytest.mark.e2e]


def test_torchtitans_config_manager_builds_the_integrations_trainer_from_any_registry_config() -> None:
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from tmrun.integrations.torchtitan import TmrunTrainer

    config = ConfigManager().parse_args(["--module", "tmrun.integrations.torchtitan", "--config", "llama3_debugmodel",
                                         "--training.steps", "3", "--debug.seed", "7"])
    assert isinstance(config, TmrunTrainer.Config) and type(config)._owner is TmrunTrainer
    assert config.training.steps == 3 and config.debug.seed == 7
    own = llama3_debugmodel()
    assert config.training.seq_len == own.training.seq_len and config.model_spec.name == own.model_spec.name


def test_an_unknown_config_name_is_not_found() -> None:
    import tmrun.integrations.torchtitan as integration

    with pytest.raises(AttributeError):
        integration.no_such_config  # noqa: B018
    with pytest.raises(AttributeError):
        integration.NotAConfig  # noqa: B018


def test_a_restored_loader_position_restarts_the_batch_iterator() -> None:
    from tmrun.integrations.torchtitan import _LoaderPosition

    class Loader:
        def __init__(self) -> None:
            self.state: dict[str, Any] = {"dp_rank_0": b"0"}

        def state_dict(self) -> dict[str, Any]:
            return dict(self.state)

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.state = dict(state)

    loader = Loader()
    position = _LoaderPosition(loader)
    assert position.restored  # no iterator yet
    position.restored = False
    saved = position.state_dict()
    loader.state = {"dp_rank_0": b"1"}
    position.load_state_dict(saved)
    assert loader.state == {"dp_rank_0": b"0"} and position.restored


def test_the_cpu_shim_swaps_every_flex_attention_for_sdpa() -> None:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from tests.titan.cpu_shim import sdpa_everywhere

    model = llama3_debugmodel().model_spec.model
    assert list(model.traverse(FlexAttention.Config))
    sdpa_everywhere(model)
    assert not list(model.traverse(FlexAttention.Config))
    assert len(list(model.traverse(ScaledDotProductAttention.Config))) == 6  # the debug model's layers


def _fake_tm() -> Any:
    """What the integration uses of ``tm``: ``void``, ``is_shadow`` and the real ``tolerate_void``."""
    from types import SimpleNamespace

    from tmrun.worker.runtime import Runtime

    tm = SimpleNamespace(void=False, is_shadow=False, _ctx=SimpleNamespace(rank=0))
    tm.tolerate_void = lambda what="": Runtime.tolerate_void(tm, what)  # type: ignore[arg-type]
    return tm


def test_a_void_tail_is_redone_on_every_rank_and_logged_once() -> None:
    """tm.voided_step: the committed step's checkpoint and validation run again (collectives: on
    every rank) with torchtitan's step number set to that step; metrics are logged where this
    process had not logged that validation, and not again where it had."""
    from types import SimpleNamespace

    from tmrun.integrations.torchtitan import TmrunTrainer

    trainer = object.__new__(TmrunTrainer)
    calls: list[tuple] = []
    logged: list[tuple] = []
    trainer.tm = _fake_tm()
    trainer.config = SimpleNamespace(training=SimpleNamespace(steps=10), validator=SimpleNamespace(enable=True))
    trainer.checkpointer = SimpleNamespace(save=lambda step, last_step: calls.append(("save", step, last_step)))
    trainer.metrics_processor = SimpleNamespace(log=lambda *args, **kwargs: logged.append(args),
                                                log_validation=lambda loss, step: logged.append((step, loss)))
    trainer._guard_metrics()

    def validate(_parts: list, step: int) -> None:
        calls.append(("validate", step, trainer.step))
        trainer.metrics_processor.log_validation(loss="validation loss", step=step)  # as torchtitan's validator

    trainer.validator = SimpleNamespace(should_validate=lambda step: step % 5 == 0, validate=validate)
    trainer.model_parts = []
    trainer.step = 6  # a joiner's counters, or a survivor's: set back after the redo
    trainer._redo_void_tail(5)
    assert calls == [("save", 5, False), ("validate", 5, 5)] and trainer.step == 6
    assert logged == [(5, "validation loss")] and trainer._tail_done == 5
    calls.clear()
    trainer._redo_void_tail(5)  # this process logged step 5's validation: it runs, unlogged
    assert calls == [("save", 5, False), ("validate", 5, 5)] and logged == [(5, "validation loss")]
    trainer._redo_void_tail(10)  # the last step: its checkpoint is the last one
    assert calls[-2] == ("save", 10, True) and logged[-1] == (10, "validation loss")
    trainer.tm.void, trainer._tail_done = True, 0  # the redo itself lost a peer: nothing logged, not done
    trainer._redo_void_tail(10)
    assert len(logged) == 2 and trainer._tail_done == 0


def test_no_metric_is_logged_in_a_void_step() -> None:
    """Every logging method of torchtitan's metrics processor is quiet where tm.void (or a shadow
    step): the validator's ``log_validation`` logged a made-up validation loss when a peer was
    lost during the validation (its collectives' values are void)."""
    from types import SimpleNamespace

    from tmrun.integrations.torchtitan import TmrunTrainer

    trainer = object.__new__(TmrunTrainer)
    logged: list[str] = []
    trainer.tm = SimpleNamespace(void=False, is_shadow=False)
    trainer.metrics_processor = SimpleNamespace(log=lambda *_: logged.append("log"),
                                                log_validation=lambda **_: logged.append("log_validation"),
                                                close=lambda: logged.append("close"))
    trainer._guard_metrics()
    trainer.metrics_processor.log({}, 1)
    trainer.metrics_processor.log_validation(loss=1.0, step=1)
    assert logged == ["log", "log_validation"]
    for void, shadow in ((True, False), (False, True)):
        trainer.tm.void, trainer.tm.is_shadow = void, shadow
        trainer.metrics_processor.log({}, 2)
        trainer.metrics_processor.log_validation(loss=9.0, step=2)
    trainer.metrics_processor.close()  # not a logging method: runs
    assert logged == ["log", "log_validation", "close"]


def test_a_checkpoint_save_failing_in_a_void_step_is_redone_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    """A rank lost during torchtitan's checkpoint save (DCP gathers and broadcasts its plans: a
    survivor decoding what a locally served collective gave raised ``EOFError`` or "Failed to
    validate global plan" and died; the job restarted from its last checkpoint). Raised in a void
    step, the error is one line and the step's tail is not done (tm.voided_step redoes it); raised
    in a step that is not void, it propagates."""
    from types import SimpleNamespace

    from tmrun.integrations.torchtitan import TmrunTrainer

    trainer = object.__new__(TmrunTrainer)
    trainer.tm = _fake_tm()
    trainer.config = SimpleNamespace(training=SimpleNamespace(steps=10), validator=SimpleNamespace(enable=False))
    saves: list[int] = []

    def save(step: int, last_step: bool) -> None:
        saves.append(step)
        trainer.tm.void = True  # a peer lost in the save's first collective
        raise EOFError("Ran out of input")

    trainer.checkpointer = SimpleNamespace(save=save)
    trainer.model_parts = []
    trainer._tail_done = 0
    trainer._step_tail(4)
    assert saves == [4] and trainer._tail_done == 0  # not done: redone through tm.voided_step
    line = "rank 0: step 4's checkpoint save failed in a void step (EOFError: Ran out of input)"
    assert line in capsys.readouterr().err
    trainer.tm.void = False
    trainer.checkpointer = SimpleNamespace(save=lambda step, last_step: saves.append(step))
    trainer.step = 5
    trainer._redo_void_tail(4)
    assert saves == [4, 4] and trainer._tail_done == 4 and trainer.step == 5

    def broken(step: int, last_step: bool) -> None:
        raise OSError("disk full")

    trainer.checkpointer = SimpleNamespace(save=broken)
    with pytest.raises(OSError, match="disk full"):  # not void: the script's own error
        trainer._step_tail(6)



def _async_trainer(news_of_peers: list[int], seen: list[int]) -> Any:
    """A TmrunTrainer with background saves guarded, a fake checkpointer (interval 2, each save
    recorded with the interval it ran under) and a fake all-reduce (MAX with ``news_of_peers``,
    the value this rank gave appended to ``seen``)."""
    from types import SimpleNamespace

    from tmrun.integrations.torchtitan import TmrunTrainer

    trainer = object.__new__(TmrunTrainer)
    trainer.tm = _fake_tm()
    trainer.tm.recoveries = []
    trainer.tm.cut_by_a_change = lambda error: "cut" in str(error)
    trainer.config = SimpleNamespace(training=SimpleNamespace(steps=10), validator=SimpleNamespace(enable=False))
    saves: list[tuple[int, int]] = []

    def save(step: int, last_step: bool) -> bool:  # as torchtitan's: it waits only for a save it makes
        if step % trainer.checkpointer.interval and not last_step:
            return False
        trainer.checkpointer.maybe_wait_for_saving()
        saves.append((step, trainer.checkpointer.interval))
        return True

    def wait() -> None:
        future, trainer.checkpointer.save_future = trainer.checkpointer.save_future, None
        if future is not None:
            future.result()

    trainer.checkpointer = SimpleNamespace(enable=True, pg=object(), interval=2, save_future=None, save=save,
                                           maybe_wait_for_saving=wait)
    trainer.saves = saves
    trainer.model_parts = []
    trainer._guard_background_saves()

    def all_reduce(tensor: Any, op: Any = None) -> None:
        seen.append(int(tensor.item()))
        tensor.fill_(max([int(tensor.item()), *news_of_peers]))

    trainer.all_reduce = all_reduce
    return trainer


def test_a_background_save_cut_off_by_a_change_is_taken_again_at_the_next_step(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``--checkpoint.async_mode async``: a background save that a change cut off is never
    finished; before, the job's next checkpoint came at torchtitan's next interval. Now every
    rank, at the first step's tail after a recovery, agrees (one all-reduce) whether any rank's
    save was cut, and if so saves the step now, out of the interval (the interval put back
    after); the joiner, with no save of its own, joins."""
    from concurrent.futures import Future

    import torch

    seen: list[int] = []
    peers: list[int] = []
    trainer = _async_trainer(peers, seen)
    monkeypatch.setattr(torch.distributed, "all_reduce", trainer.all_reduce)
    trainer._step_tail(3)  # no change: no all-reduce, no save out of the interval
    trainer._step_tail(4)
    assert trainer.saves == [(4, 2)] and seen == []

    cut: Future = Future()
    cut.set_exception(RuntimeError("cut off by a change"))
    trainer.checkpointer.save_future = cut  # step 4's save, then a change
    trainer.tm.recoveries = [{"gen": 1}]
    trainer._step_tail(5)
    assert seen == [1] and trainer.saves == [(4, 2), (5, 1)] and trainer.checkpointer.interval == 2
    assert trainer._saved_step == 5
    trainer._step_tail(6)  # settled: no more all-reduces for that change
    assert seen == [1] and trainer.saves[-1] == (6, 2)

    joiner_seen: list[int] = []
    joiner = _async_trainer([1], joiner_seen)  # a peer's save was cut; the joiner has none in flight
    monkeypatch.setattr(torch.distributed, "all_reduce", joiner.all_reduce)
    joiner.tm.recoveries = [{"gen": 1}]
    joiner._step_tail(5)
    assert joiner_seen == [0] and joiner.saves == [(5, 1)]
    assert "saving step 5's checkpoint now, out of the interval" in caplog.text


def test_a_background_save_still_running_after_a_recovery_is_left_to_torchtitans_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A save still writing at the first tail after a recovery: no rank waits for it and, if no
    rank's save was cut, nothing is saved out of the interval; that save is settled by
    torchtitan's own wait at its next interval (cut: said there, and that interval's save takes
    its place: not counted as cut at the next recovery). One all-reduce per recovery. A peer lost
    in the all-reduce (tm.void) leaves the question to the void tail's redo."""
    from concurrent.futures import Future

    import torch

    seen: list[int] = []
    peers: list[int] = []
    trainer = _async_trainer(peers, seen)
    monkeypatch.setattr(torch.distributed, "all_reduce", trainer.all_reduce)
    running: Future = Future()
    trainer.checkpointer.save_future = running
    trainer.tm.recoveries = [{"gen": 3}]
    trainer._step_tail(5)
    assert seen == [0] and trainer.saves == [] and trainer.checkpointer.save_future is running
    trainer._step_tail(7)  # settled: no second all-reduce for that recovery
    assert seen == [0] and trainer.saves == []
    running.set_exception(RuntimeError("cut off by a change"))  # the change reached it as it gathered
    trainer._step_tail(8)  # torchtitan's wait before step 8's save says it; step 8's save takes its place
    assert seen == [0] and trainer.saves == [(8, 2)] and not trainer._cut_seen

    trainer.tm.recoveries.append({"gen": 4})
    trainer._step_tail(9)  # this rank's news: no cut save (step 8's cut one was replaced)
    assert seen == [0, 0] and trainer.saves == [(8, 2)]
    trainer.tm.recoveries.append({"gen": 5})
    peers.append(1)

    def lost_peer(tensor: Any, op: Any = None) -> None:
        seen.append(int(tensor.item()))
        trainer.tm.void = True  # served locally: its value is void

    monkeypatch.setattr(torch.distributed, "all_reduce", lost_peer)
    trainer._step_tail(9)
    assert trainer._change_seen == 4 and trainer.saves == [(8, 2)]
    trainer.tm.void = False
    monkeypatch.setattr(torch.distributed, "all_reduce", trainer.all_reduce)
    trainer.step = 10
    trainer._redo_void_tail(9)  # the void tail's redo: asked again, a peer's save was cut
    assert trainer.saves == [(8, 2), (9, 1)] and trainer._change_seen == 5
