"""A pipeline's start-up in a standby's rehearsal (tmrun.worker.startup_replay): rank 0 records the
small messages it receives in its first step, the rehearsal's local receives replay them."""

from __future__ import annotations

import pickle
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from tmrun.comm import backend as tb
from tmrun.protocol import keys
from tmrun.worker import startup_replay


@pytest.fixture(autouse=True)
def no_hooks() -> Iterator[None]:
    yield
    tb._P2P_RECORDERS = ()
    tb.set_p2p_replay(None)


def test_rank_0_records_small_messages_and_publishes_them_once() -> None:
    store = dist.HashStore()
    recorder = startup_replay.Recorder()
    recorder.start()
    assert len(tb._P2P_RECORDERS) == 1
    size = torch.tensor([5], dtype=torch.int64)
    blob = torch.arange(5, dtype=torch.uint8)
    big = torch.zeros(startup_replay.MAX_MESSAGE // 4 + 1)  # an activation over the cap: not recorded
    for t in (size, blob, big):
        tb._P2P_RECORDERS[0]("3", 1, 0, t)
    recorder.publish(store)
    assert tb._P2P_RECORDERS == () and not recorder.active
    messages = pickle.loads(store.get(keys.STARTUP_MESSAGES))
    assert [key for key, _ in messages] == [("3", 1, 0, 8, "torch.int64"), ("3", 1, 0, 5, "torch.uint8")]
    recorder.publish(dist.HashStore())  # once only


def test_the_recording_stops_at_its_total_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(startup_replay, "MAX_TOTAL", 16)
    store = dist.HashStore()
    recorder = startup_replay.Recorder()
    recorder.start()
    for _ in range(3):
        tb._P2P_RECORDERS[0]("3", 1, 0, torch.zeros(2, dtype=torch.float32))  # 8 bytes each
    recorder.publish(store)
    assert len(pickle.loads(store.get(keys.STARTUP_MESSAGES))) == 2


def test_a_rehearsals_local_receives_get_the_recorded_messages_in_order_then_zeros() -> None:
    first, second = torch.tensor([7], dtype=torch.int64), torch.tensor([9], dtype=torch.int64)
    messages = [(("0", 1, 0, 8, "torch.int64"), startup_replay.tensor_bytes(first)),
                (("0", 1, 0, 8, "torch.int64"), startup_replay.tensor_bytes(second))]
    replayer = startup_replay.replay(messages)
    pg = tb.TmrunProcessGroup(0, 2, local=True)
    pg.setGroupName("0")
    got = []
    for _ in range(3):
        buf = torch.full((1,), -1, dtype=torch.int64)
        pg.recv([buf], 1, 0).wait()
        got.append(int(buf.item()))
    assert got == [7, 9, 0] and replayer is not None and replayer.replayed == 2
    other = torch.full((2,), -1.0)  # another size, source or group: zeros
    pg.recv([other], 1, 0).wait()
    assert other.tolist() == [0.0, 0.0]
    startup_replay.replay(None)
    buf = torch.full((1,), -1, dtype=torch.int64)
    pg.recv([buf], 1, 0).wait()
    assert int(buf.item()) == 0  # the rehearsal is over: zeros again


def test_a_standby_does_not_wait_for_a_recording_that_never_comes() -> None:
    calls: list[int] = []
    assert startup_replay.await_recording(dist.HashStore(), lambda: calls.append(1), wait=0.1) is None
    assert calls  # it watched for the job's end meanwhile
    store = dist.HashStore()
    store.set(keys.STARTUP_MESSAGES, pickle.dumps([]))
    assert startup_replay.await_recording(store, lambda: None) == []


def test_the_recording_is_fetched_at_the_rehearsals_first_receive_only() -> None:
    fetched: list[int] = []
    message = torch.tensor([3], dtype=torch.int64)

    def fetch() -> list:
        fetched.append(1)
        return [(("0", 1, 0, 8, "torch.int64"), startup_replay.tensor_bytes(message))]

    replayer = startup_replay.replay(fetch)
    pg = tb.TmrunProcessGroup(0, 2, local=True)
    pg.setGroupName("0")
    t = torch.ones(2)
    pg.allreduce([t]).wait()  # a job without point-to-point traffic never waits for rank 0's first step
    assert fetched == []
    got = []
    for _ in range(2):
        buf = torch.full((1,), -1, dtype=torch.int64)
        pg.recv([buf], 1, 0).wait()
        got.append(int(buf.item()))
    assert got == [3, 0] and fetched == [1] and replayer is not None and replayer.replayed == 1
    startup_replay.replay(lambda: None)  # rank 0's first step never ended: zeros
    buf = torch.full((1,), -1, dtype=torch.int64)
    pg.recv([buf], 1, 0).wait()
    assert int(buf.item()) == 0


def test_a_standby_stops_waiting_for_rank_0s_first_step_soon_after_a_lost_peer_is_reported() -> None:
    """A rank lost in the job's first step: rank 0's first step never ends (or rank 0 is the lost
    rank), and the controller waits for this standby to be warm. It waited the whole 30 s before;
    now it rehearses without the recording a short while after a worker reported the loss."""
    import time


    store = dist.HashStore()
    started = time.monotonic()
    assert startup_replay.await_recording(store, lambda: None, wait=0.3) is None  # no report: the whole wait
    assert time.monotonic() - started >= 0.3
    store.add(keys.REPORT_SEQ, 1)
    started = time.monotonic()
    assert startup_replay.await_recording(store, lambda: None, wait=30.0, after_loss=0.2) is None
    assert time.monotonic() - started < 5.0
    store.set(keys.STARTUP_MESSAGES, pickle.dumps([("pp0", 1, 9, b"x")]))
    assert startup_replay.await_recording(store, lambda: None, wait=30.0, after_loss=0.2) == [("pp0", 1, 9, b"x")]


def test_without_rank_0s_first_step_a_rehearsal_takes_the_start_ups_rank_0_published() -> None:
    """Rank 0 lost in its first step after its pipeline's start-up ended: its first step's
    recording never comes, and the rehearsal failed on zeros (a cold standby). The start-ups it
    published (tmrun.worker.pipeline_startup) are what the rehearsal's start-up receives."""
    store = dist.HashStore()
    assert startup_replay.published_startups(store, 0) is None
    vote, meta, again = (("pp0", 1, 7, 8, "torch.int64"), b"v"), (("pp0", 1, 9, 8, "torch.int64"), b"m"), \
        (("pp0", 1, 9, 8, "torch.int64"), b"e")
    store.set(keys.pipeline_startup(0, 0), pickle.dumps([(False, [vote, meta]), (True, [again])]))
    store.set(keys.pipeline_startup(0, 1), pickle.dumps([(True, None)]))
    assert startup_replay.published_startups(store, 0) == [vote, meta, again]
