"""A joiner's pipeline start-up served from the lost rank's recording (tmrun.worker.pipeline_startup):
each rank records its first training start-up, a joiner replays its rank's alone, and survivors
and joiner agree once on which way it goes."""

from __future__ import annotations

import pickle
import weakref
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from tmrun.comm import backend as tb
from tmrun.protocol import keys
from tmrun.worker import pipeline_startup, startup_replay
from tmrun.worker.tracked import TrackedState
from tests.worker.test_pipeline import _Schedule


@pytest.fixture(autouse=True)
def no_hooks() -> Iterator[None]:
    created = list(tb._CREATED)
    yield
    tb._CREATED[:] = created
    tb._P2P_RECORDERS = ()
    tb.set_p2p_replay(None)


class _Comm:
    """Stands for a group's communicator: nothing may reach it in these tests."""

    world_size, rank = 2, 0

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the network was used ({name})")


class _StartingSchedule(_Schedule):
    """A schedule whose start-ups receive from ``pg`` as torch 2.14's do: the first a warm-up
    vote (tag 7) and the metadata (tag 9), a switch between ``eval()`` and ``step()`` the metadata
    again (a network receive is recorded as the backend records one: its recorders are called; a
    local one is served as the backend serves it)."""

    def __init__(self, pg: tb.TmrunProcessGroup, sent: int) -> None:
        super().__init__({0, 1})
        self.pg, self.sent, self.got = pg, sent, None
        self._has_backward = True
        self._stage_forward_initialized = self._stage_backward_initialized = False
        self.startups = 0
        self.vote: int | None = None

    def _receive(self, tag: int) -> int:
        buf = torch.full((1,), -1, dtype=torch.int64)
        if self.pg.local:
            self.pg.recv([buf], 1, tag).wait()
        else:  # what a receive from the neighbour gives, recorded by the backend
            buf.fill_(self.sent + tag)
            for record in tb._P2P_RECORDERS:
                record(self.pg.group_name, 1, tag, buf)
        return int(buf.item())

    def _initialize_stage(self, *args: Any, **kwargs: Any) -> None:
        if self._stage_forward_initialized and self._has_backward == self._stage_backward_initialized:
            return
        self.startups += 1
        if not self._stage_forward_initialized:
            self.vote = self._receive(7)
        self.got = self._receive(9)
        if self.got == 0:  # torch unpickles the metadata: zeros fail (EOFError)
            raise EOFError("Ran out of input")
        self._stage_forward_initialized, self._stage_backward_initialized = True, self._has_backward

    def eval(self) -> None:
        self._has_backward = False
        try:
            self._initialize_stage()
        finally:
            self._has_backward = True


def _group(local: bool, name: str = "pp0") -> tb.TmrunProcessGroup:
    pg = tb.TmrunProcessGroup(0, 2, local=True)
    pg.setGroupName(name)
    tb._CREATED.append(weakref.ref(pg))  # as the backend's group factory does
    if not local:
        pg.attach(_Comm())
        pg.set_local(False)
    return pg


def _startups(store: dist.Store, rank: int, logs: list[str]) -> tuple[pipeline_startup.Startups, TrackedState]:
    tracked = TrackedState()
    startups = pipeline_startup.Startups(lambda: (store, rank), logs.append, tracked.shard_key)
    tracked.on_pipeline = startups.wrap
    return startups, tracked


def _lost_rank(sent: int = 42) -> tuple[dist.Store, list[str], _StartingSchedule]:
    """Rank 1's tracked schedule, in a fresh store, before any start-up."""
    store, logs = dist.HashStore(), []
    _, tracked = _startups(store, 1, logs)
    schedule = _StartingSchedule(_group(local=False), sent=sent)
    tracked.track(schedule=schedule)
    return store, logs, schedule


def _joiner(store: dist.Store, logs: list[str], gen: int, sent: int = -100) -> tuple[pipeline_startup.Startups,
                                                                                     _StartingSchedule]:
    """A joiner of rank 1 in generation ``gen``: its fresh schedule, tracked (a network receive
    gives ``sent`` + tag)."""
    joiner, tracked = _startups(store, 1, logs)
    schedule = _StartingSchedule(_group(local=False), sent=sent)
    tracked.track(schedule=schedule)
    joiner.expect_join(gen, 1)
    return joiner, schedule


def test_a_rank_records_its_first_training_start_up_once() -> None:
    store, _, schedule = _lost_rank()
    schedule._initialize_stage()
    schedule._initialize_stage()  # started: nothing more
    assert schedule.startups == 1 and (schedule.vote, schedule.got) == (49, 51)
    (training, messages), = pickle.loads(store.get(keys.pipeline_startup(1, 0)))
    assert training and [key for key, _ in messages] == [("pp0", 1, 7, 8, "torch.int64"),
                                                         ("pp0", 1, 9, 8, "torch.int64")]
    assert tb._P2P_RECORDERS == ()
    assert pipeline_startup.local_way(store, gen=1, rank=1, schedules=1)


def test_a_joiner_runs_its_start_up_alone_from_the_lost_ranks_recording() -> None:
    store, logs, first = _lost_rank()
    first._initialize_stage()  # the lost rank's first step, recorded
    assert pipeline_startup.local_way(store, gen=2, rank=1, schedules=1)  # a survivor asks first
    joiner, tracked = _startups(store, 1, logs)
    pg = _group(local=False)
    schedule = _StartingSchedule(pg, sent=-5)  # a network receive would give -5; the recording gives 42
    tracked.track(schedule=schedule)
    joiner.expect_join(2, 1)
    schedule._initialize_stage()
    assert (schedule.vote, schedule.got) == (49, 51) and schedule.startups == 1 and joiner.served_locally == 1
    assert not pg.local  # back on the network for its first step's messages
    assert tb._P2P_REPLAYER is None
    assert "rank 1: the pipeline start-up of schedule 0 ran on this joiner alone (2 of the 2 messages" in logs[-1]


def test_without_the_lost_ranks_recording_the_pipeline_starts_again_with_the_joiner() -> None:
    """The lost rank died before its first start-up ended: the survivors run the start-up again
    with the joiner (the network way), whoever asks first; the joiner's start-up is recorded."""
    store, logs = dist.HashStore(), []
    joiner, tracked = _startups(store, 1, logs)
    pg = _group(local=False)
    schedule = _StartingSchedule(pg, sent=9)
    tracked.track(schedule=schedule)
    joiner.expect_join(3, 1)
    schedule._initialize_stage()  # the joiner asks first: network
    assert schedule.got == 18 and joiner.served_locally == 0
    assert store.get(keys.pipeline_startup_way(3, 1)) == pipeline_startup.NETWORK
    # its recording is in the store now, but the way was decided: every survivor reads network
    assert store.check([keys.pipeline_startup(1, 0)])
    assert not pipeline_startup.local_way(store, gen=3, rank=1, schedules=1)
    assert pipeline_startup.local_way(store, gen=4, rank=1, schedules=1)  # the next joiner of rank 1: local


def test_a_standbys_start_up_is_neither_recorded_nor_served() -> None:
    store, logs = dist.HashStore(), []
    standby = pipeline_startup.Startups(lambda: None, logs.append)
    schedule = _StartingSchedule(_group(local=True), sent=1)
    standby.wrap(schedule)
    tb.set_p2p_replay(lambda group, src, tag, t: t.fill_(3) is not None)  # its rehearsal's replay
    schedule._initialize_stage()
    assert schedule.got == 3 and not store.check([keys.pipeline_startup(0, 0)])


def test_a_rank_that_evaluates_first_publishes_both_start_ups_and_its_joiner_replays_them() -> None:
    """nanoGPT's shape: an evaluation at the start of step 0, then training. torch 2.14 starts
    the stages for the evaluation (with the warm-up), then again for training (a switch)."""
    store, logs, first = _lost_rank()
    first.eval()
    assert not store.check([keys.pipeline_startup(1, 0)])  # published once its training start-up ran
    first._initialize_stage()
    history = pickle.loads(store.get(keys.pipeline_startup(1, 0)))
    assert [(training, [key[2] for key, _ in messages]) for training, messages in history] == [(False, [7, 9]),
                                                                                                (True, [9])]
    assert pipeline_startup.local_way(store, gen=2, rank=1, schedules=1)
    joiner, schedule = _joiner(store, logs, gen=2)
    schedule._initialize_stage()  # its first step trains: both start-ups alone, in the lost rank's order
    assert (schedule.vote, schedule.got, schedule.startups) == (49, 51, 2) and joiner.served_locally == 2
    assert schedule._stage_backward_initialized


def test_a_joiner_whose_first_use_is_an_evaluation_trains_alone_then_switches_with_its_peers() -> None:
    store, logs, first = _lost_rank()
    first._initialize_stage()
    assert pipeline_startup.local_way(store, gen=2, rank=1, schedules=1)
    joiner, schedule = _joiner(store, logs, gen=2)
    schedule.eval()  # the redone step evaluates first: its peers switch to evaluation, over the network
    assert (schedule.vote, schedule.got, schedule.startups) == (49, -91, 2) and joiner.served_locally == 1
    assert schedule._stage_forward_initialized and not schedule._stage_backward_initialized


def test_survivors_last_started_for_an_evaluation_take_the_network_way() -> None:
    store, _, first = _lost_rank()
    first._initialize_stage()
    assert not pipeline_startup.local_way(store, gen=2, rank=1, schedules=1, trained=False)
    assert not pipeline_startup.local_way(store, gen=2, rank=1, schedules=1)  # decided once


class _DoomedMidway(_StartingSchedule):
    """Its peer is lost after the first receive of its next start-up: the rest is served locally."""

    doom = False

    def _receive(self, tag: int) -> int:
        got = super()._receive(tag)
        if self.doom:
            self.pg.set_local(True)
        return got


def test_a_start_up_in_a_doomed_step_gets_the_messages_of_the_last_start_up_of_its_kind() -> None:
    """A survivor's schedule switches between evaluation and training in a step whose peer was
    lost: its receives are served locally. Zeros killed it (EOFError): the survivor died and the
    job restarted. They now get what the same receives got in the last start-up of that kind."""
    store, logs = dist.HashStore(), []
    active, tracked = _startups(store, 0, logs)
    pg = _group(local=False)
    schedule = _DoomedMidway(pg, sent=42)
    tracked.track(schedule=schedule)
    schedule._initialize_stage()  # the first start-up
    schedule.eval()  # a switch to evaluation and back
    schedule.sent = 1000
    schedule._initialize_stage()
    pg.set_local(True)  # a peer lost: the next step's evaluation is served locally
    schedule.eval()
    assert schedule.got == 51 and tb._P2P_REPLAYER is None and tb._P2P_RECORDERS == ()
    schedule._initialize_stage()  # and its training again
    assert schedule.got == 1009  # the last training switch's
    pg.set_local(False)  # healed: the network again, and what it says is kept
    schedule.sent = 2000
    schedule.eval()
    schedule._initialize_stage()
    assert schedule.got == 2009
    schedule._stage_forward_initialized = schedule._stage_backward_initialized = False  # its pipeline restarts
    schedule.doom = True  # lost after the vote: the metadata is served locally
    schedule._initialize_stage()
    assert (schedule.vote, schedule.got) == (2007, 51)  # the vote from the network, the metadata as last time


def test_the_jobs_first_evaluation_in_a_doomed_step_gets_the_training_start_ups_messages() -> None:
    """The job's first ``eval()`` comes in a step whose peer was lost (an evaluation every few
    steps, the first one not in step 0): no evaluation start-up was seen yet. Zeros killed the
    survivor (EOFError; with both stages' survivors dead the job restarted). It now gets the
    training start-up's metadata (the same stages' tensors), used in the doomed step only; the
    next evaluation over the network replaces it."""
    store, logs = dist.HashStore(), []
    active, tracked = _startups(store, 0, logs)
    pg = _group(local=False)
    schedule = _StartingSchedule(pg, sent=42)
    tracked.track(schedule=schedule)
    schedule._initialize_stage()  # the first start-up (training)
    pg.set_local(True)  # a peer lost: the step's evaluation is served locally
    schedule.eval()
    assert schedule.got == 51  # the training start-up's metadata, not zeros
    pg.set_local(False)
    schedule.sent = 1000
    schedule._initialize_stage()  # healed: the next training step's switch, from the network
    schedule.sent = 2000
    schedule.eval()  # the next evaluation's: kept for its kind
    assert schedule.got == 2009
    schedule._initialize_stage()
    pg.set_local(True)
    schedule.eval()
    assert schedule.got == 2009


def test_a_first_start_up_in_a_doomed_step_gets_a_replicas_recording_of_the_same_stages() -> None:
    """A peer lost in the job's first step, before this rank's own first start-up ended: it has
    nothing of its own to serve its receives from, and zeros killed it (EOFError; by hand, both
    ranks of the other replica died and the job restarted). It now gets the recording of a rank
    that holds the same stages (a replica: equal shard keys), published in the store under that
    key, whatever its pipeline group's name; not published as its own (not whole)."""
    store, logs = dist.HashStore(), []
    _, replica_tracked = _startups(store, 1, logs)
    replica = _StartingSchedule(_group(local=False, name="pp0"), sent=42)
    replica_tracked.track(schedule=replica)
    replica._initialize_stage()  # rank 1's first start-up, over the network: recorded, published
    survivor, tracked = _startups(store, 3, logs)
    schedule = _StartingSchedule(_group(local=True, name="pp1"), sent=1000)  # doomed: every receive local
    tracked.track(schedule=schedule)
    assert tracked.shard_key() == replica_tracked.shard_key()
    schedule._initialize_stage()
    assert (schedule.vote, schedule.got) == (49, 51)  # rank 1's, not zeros
    assert "2 receive(s) served from a replica's recording of the same stages" in logs[-2], logs
    assert not store.check([keys.pipeline_startup(3, 0)])  # served, not whole: never a joiner's recording


def test_a_replicas_recording_passes_over_what_came_from_the_network_and_waits_a_bounded_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    recording = [(("pp0", 1, 7, 8, "torch.int64"), bytes(8)), (("pp0", 1, 9, 8, "torch.int64"), bytes([5]) + bytes(7))]
    replayer = startup_replay.Replayer(lambda: recording, any_group=True)
    buf = torch.zeros(1, dtype=torch.int64)
    replayer.skip("pp1", 1, 7, buf)  # the vote came from the network before the loss
    assert replayer("pp1", 1, 9, buf) and int(buf.item()) == 5  # the metadata: the replica's, by order
    monkeypatch.setattr(pipeline_startup, "REPLICA_WAIT", 0.1)
    store, logs = dist.HashStore(), []
    _, tracked = _startups(store, 3, logs)
    schedule = _StartingSchedule(_group(local=True, name="pp1"), sent=1000)
    tracked.track(schedule=schedule)
    with pytest.raises(EOFError):  # no replica recorded its start-up: zeros, as before
        schedule._initialize_stage()
    assert "nor a replica's after 0.1s: zeros" in logs[0], logs


def test_without_a_shard_key_no_replicas_recording_is_published_or_taken() -> None:
    """(A shard key of 0 would be every rank's: another stage's recording could be replayed.)"""
    store, logs = dist.HashStore(), []
    startups = pipeline_startup.Startups(lambda: (store, 1), logs.append)  # no shard key known
    tracked = TrackedState()
    tracked.on_pipeline = startups.wrap
    schedule = _StartingSchedule(_group(local=False), sent=42)
    tracked.track(schedule=schedule)
    schedule._initialize_stage()
    assert store.check([keys.pipeline_startup(1, 0)]) and not store.check([keys.pipeline_startup_of_shard(0, 0)])


def test_a_message_that_cannot_be_recorded_leaves_no_recording_and_the_receive_unharmed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(numpy is not a dependency: the recording once used it, and a receive's completion raised
    where it was not installed.)"""
    def unreadable(t: torch.Tensor) -> bytes:
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(startup_replay, "tensor_bytes", unreadable)
    store, logs = dist.HashStore(), []
    startups, tracked = _startups(store, 1, logs)
    schedule = _StartingSchedule(_group(local=False), sent=42)
    tracked.track(schedule=schedule)
    schedule._initialize_stage()
    assert schedule.got == 51  # the receive itself went through
    assert not store.check([keys.pipeline_startup(1, 0)])
    assert not pipeline_startup.local_way(store, gen=1, rank=1, schedules=1)
    assert "could not be recorded whole" in logs[-1]


def test_tensor_bytes_needs_no_numpy() -> None:
    t = torch.tensor([1, 258], dtype=torch.int16)
    assert startup_replay.tensor_bytes(t) == bytes([1, 0, 2, 1])
    assert startup_replay.tensor_bytes(torch.zeros(0)) == b""
