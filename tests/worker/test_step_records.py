"""The records a rank leaves its joiner (tmrun.worker.step_records), one mechanism for its random
state (tests/worker/test_rng_records.py) and its per-rank state: what differs between the kinds."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tmrun.worker import per_rank_records, rng_records, step_records
from tmrun.worker.transfer import NoReplicaError


def test_a_rank_that_left_no_per_rank_record_is_refused_and_one_without_a_random_record_is_not() -> None:
    """Per-rank state is the script's (every rank of it publishes some): none means it was lost.
    A random-state record is absent where there was nothing to hand over."""
    store = dist.HashStore()
    rng_records.check(store, [2], 5)
    with pytest.raises(NoReplicaError, match=r"rank 2's per-rank state \(tm.track_per_rank\) is recorded for step\(s\) "
                                             r"none, and its joiner resumes at step 5"):
        per_rank_records.check(store, [2], 5)


def test_the_kinds_are_kept_apart_and_a_joiner_loads_its_ranks_state() -> None:
    store = dist.HashStore()
    position = [b"batch 40"]
    per_rank = per_rank_records.Publisher(lambda: position[0], lambda: store, lambda: 1)
    rng_records.Publisher(lambda: store, lambda: 1).at_start(4)
    per_rank.at_start(4)
    position[0] = b"batch 48"
    per_rank.at_commit(4)  # provisional, not usable before a boundary verified the script
    with pytest.raises(NoReplicaError, match="once a step boundary showed"):
        per_rank_records.check(store, [1], 5)
    per_rank.at_start(5)  # the boundary: the commit's record proved right
    position[0] = b"batch 56"
    per_rank.at_commit(5)
    per_rank_records.check(store, [1], 6)
    loaded: list[bytes] = []
    record = per_rank_records.adopt(store, 1, 6, loaded.append)
    assert loaded == [b"batch 56"] and record.trusted
    random_record = rng_records.read(store, 1)
    assert random_record is not None and 4 in random_record.states and b"batch 40" not in random_record.states.values()
    assert step_records.read(store, per_rank_records.PER_RANK_STATE, 1) == record


def test_a_script_that_moves_its_per_rank_state_after_the_optimizer_step_is_named_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    store = dist.HashStore()
    position = [b"0"]
    per_rank = per_rank_records.Publisher(lambda: position[0], lambda: store, lambda: 3)
    for step in range(3):
        per_rank.at_start(step)
        position[0] = f"{step + 1}".encode()
        per_rank.at_commit(step)
        position[0] += b" and the prefetch"  # moved after opt.step()
    assert capsys.readouterr().err.count("rank 3: the script changes its per-rank state after opt.step()") == 1
    with pytest.raises(NoReplicaError):
        per_rank_records.check(store, [3], 3)  # only the boundary's own record is usable: step 2's
    per_rank_records.check(store, [3], 2)


class CountingStore:
    """A HashStore that counts its round trips."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.trips = 0

    def check(self, keys: list[str]) -> bool:
        self.trips += 1
        return self.inner.check(keys)

    def get(self, key: str) -> bytes:
        self.trips += 1
        return self.inner.get(key)


def test_a_healing_fetches_each_record_once_for_its_check_and_its_joiners_adoption() -> None:
    """Every member checks the joiner's records and the joiner adopts them: through ReadOnce the
    store is asked once per record (check + get), with the same verdicts and state as without."""
    store = CountingStore()
    position = [b"batch 40"]
    per_rank = per_rank_records.Publisher(lambda: position[0], lambda: store.inner, lambda: 1)
    random = rng_records.Publisher(lambda: store.inner, lambda: 1)
    for step in (4, 5):
        random.at_start(step)
        per_rank.at_start(step)
    records = step_records.ReadOnce(store)
    rng_records.check(records, [1], 5)
    per_rank_records.check(records, [1], 5)
    loaded: list[bytes] = []
    per_rank_records.adopt(records, 1, 5, loaded.append)
    assert rng_records.adopt(records, 1, 5) is not None
    assert loaded == [b"batch 40"]
    assert store.trips == 4  # two records, each one check and one get (eight without ReadOnce)
    early = step_records.ReadOnce(store)  # a survivor reads the lost rank's records before its joiner arrives
    early.prefetch([rng_records.RANDOM_STATE, per_rank_records.PER_RANK_STATE], [1])
    trips = store.trips
    rng_records.check(early, [1], 5)
    per_rank_records.check(early, [1], 5)
    assert store.trips == trips == 8  # the checks after the agreement: no round trip
    absent = step_records.ReadOnce(store)
    rng_records.check(absent, [3], 5)  # a rank that published none: no record, asked once
    assert rng_records.adopt(absent, 3, 5) is None and store.trips == 9
    with pytest.raises(NoReplicaError):
        per_rank_records.check(absent, [3], 5)
