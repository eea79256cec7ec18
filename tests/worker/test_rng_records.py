"""tmrun.worker.rng_records: the random state a joiner continues from, on a real torch HashStore.

A step's draws (a batch sampled with ``torch.randint``, dropout) happen before its optimizer
step; a rank lost in or after that optimizer step leaves the group resuming at the next step,
whose random state only the commit's record holds (nanoGPT under tmrun handed its joiner the
state of the step before: a silent wrong batch; tests/e2e/test_nanogpt.py)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from tmrun.worker import rng, rng_records
from tmrun.worker.transfer import NoReplicaError

RANK = 1


class CountingStore:
    """A HashStore that counts the writes (a loop drawing nothing must cost none)."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.writes = 0

    def set(self, key: str, value: bytes) -> None:
        self.writes += 1
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)


@pytest.fixture()
def store() -> CountingStore:
    return CountingStore()


@pytest.fixture(autouse=True)
def _keep_rng() -> object:
    states = rng.capture()
    yield
    rng.restore(states)


def _publisher(store: CountingStore) -> rng_records.Publisher:
    return rng_records.Publisher(lambda: store, lambda: RANK)


def _step(publisher: rng_records.Publisher, step: int, draws: int = 1, after_commit: int = 0) -> dict:
    """One step of a script that draws ``draws`` numbers before its optimizer step and
    ``after_commit`` after it; returns the state the next step starts with."""
    publisher.at_start(step)
    if draws:
        torch.rand(draws)
        random.random()
    publisher.at_commit(step)
    torch.rand(after_commit) if after_commit else None
    return rng.capture()


def _attempt_of_step_2(publisher: rng_records.Publisher, draws: int) -> dict:
    """Steps 0 and 1, then step 2 up to its commit vote (drawing ``draws`` numbers); returns the
    state step 2 started with."""
    _step(publisher, 0)
    _step(publisher, 1)
    start_of_2 = rng.capture()
    publisher.at_start(2)
    torch.rand(draws)
    publisher.at_commit(2)  # recorded before the vote
    return start_of_2


def _resumed_state(store: CountingStore, resume: int) -> dict | None:
    record = rng_records.read(store, RANK)
    assert record is not None
    return record.usable_for(resume)


def test_a_rank_lost_after_its_commit_hands_over_the_next_steps_state(store: CountingStore) -> None:
    publisher = _publisher(store)
    _step(publisher, 0)
    _step(publisher, 1)
    expected_start_of_3 = _step(publisher, 2)  # lost in step 2's optimizer step: the group resumes at 3
    got = _resumed_state(store, 3)
    assert got is not None and rng.same(got, expected_start_of_3)
    rng_records.check(store, [RANK], 3)  # nothing to refuse
    for step in range(3, 20):
        _step(publisher, step)
    record = rng_records.read(store, RANK)
    assert record is not None and len(record.states) <= 2  # the current step's and the next one's


def test_a_rank_lost_before_its_commit_hands_over_the_steps_own_state(store: CountingStore) -> None:
    start_of_2 = _attempt_of_step_2(_publisher(store), draws=3)  # the vote then failed: the group redoes step 2
    got = _resumed_state(store, 2)
    assert got is not None and rng.same(got, start_of_2)


def test_the_record_of_the_old_code_was_one_step_behind(store: CountingStore) -> None:
    """What the boundary record alone gives for the step after a commit (the bug): not it."""
    publisher = _publisher(store)
    _step(publisher, 0)
    start_of_1 = rng.capture()
    publisher.at_start(1)
    torch.rand(1)
    publisher.at_commit(1)
    record = rng_records.read(store, RANK)
    assert record is not None and not rng.same(record.usable_for(2), start_of_1)


def test_a_loop_that_draws_nothing_writes_nothing_once_verified(store: CountingStore) -> None:
    publisher = _publisher(store)
    _step(publisher, 0, draws=0)
    publisher.at_start(1)  # verified here: the state is the one step 0's commit saw
    writes = store.writes
    state = rng.capture()
    publisher.at_commit(1)
    for step in range(2, 10):
        publisher.at_start(step)
        publisher.at_commit(step)
    assert store.writes == writes
    got = _resumed_state(store, 10)  # an older record, valid: nothing was drawn since
    assert got is not None and rng.same(got, state)


def test_draws_after_the_optimizer_step_are_noticed_and_never_handed_over_wrong(store: CountingStore,
                                                                               capsys: pytest.CaptureFixture) -> None:
    publisher = _publisher(store)
    _step(publisher, 0, after_commit=2)
    _step(publisher, 1, after_commit=2)  # its start differs from step 0's commit: noticed here
    assert "draws random numbers after opt.step() (torch)" in capsys.readouterr().err
    record = rng_records.read(store, RANK)
    assert record is not None and record.after_commit and not record.trusted
    # lost after step 1's commit (after its later draws): no record of step 2 exists
    assert record.usable_for(2) is None
    with pytest.raises(NoReplicaError, match="draws random numbers after opt.step"):
        rng_records.check(store, [RANK], 2)
    # lost before: the boundary record of step 1 is right
    assert record.usable_for(1) is not None
    # and the boundary records go on every step, changed or not
    writes = store.writes
    publisher.at_start(2)
    assert store.writes == writes + 1


def test_a_first_step_lost_after_its_commit_is_not_guessed(store: CountingStore) -> None:
    """Nothing is known of the script before one boundary: a provisional record is not trusted."""
    publisher = _publisher(store)
    _step(publisher, 0)
    with pytest.raises(NoReplicaError, match="not yet seen"):
        rng_records.check(store, [RANK], 1)
    assert _resumed_state(store, 0) is not None  # the step's own start is right


def test_a_redone_step_drops_the_provisional_record_of_its_failed_attempt(store: CountingStore) -> None:
    publisher = _publisher(store)
    start_of_2 = _attempt_of_step_2(publisher, draws=5)  # an attempt that is then aborted
    rng.restore(start_of_2)  # the step is redone from its own start
    publisher.at_start(2)
    record = rng_records.read(store, RANK)
    assert record is not None and 3 not in record.states and len(record.states) == 1
    torch.rand(1)  # the redo draws differently (another batch size): its commit is recorded anew
    after = rng.capture()
    publisher.at_commit(2)
    got = _resumed_state(store, 3)
    assert got is not None and rng.same(got, after)


def test_a_joiner_inherits_what_its_ranks_record_knew(store: CountingStore) -> None:
    publisher = _publisher(store)
    for step in range(3):
        _step(publisher, step)
    record = rng_records.adopt(store, RANK, 3)
    assert record is not None and record.trusted
    joiner_store = CountingStore()
    joiner = rng_records.Publisher(lambda: joiner_store, lambda: RANK)
    joiner.inherit(record)
    _step(joiner, 3)  # lost in its first step after its commit: trusted, so healed in place
    rng_records.check(joiner_store, [RANK], 4)


def test_a_rank_that_published_nothing_is_not_refused(store: CountingStore) -> None:
    rng_records.check(store, [RANK], 5)
    assert rng_records.adopt(store, RANK, 5) is None


def test_the_generators_that_moved_are_named() -> None:
    """What the one line names: torchtitan's validator moved "torch" (a DataLoader iterator's
    base seed); a numpy imported after the commit is one the commit did not capture."""
    before = {name: state for name, state in rng.capture().items() if name != "numpy"}
    random.random()
    after = {**rng.capture(), "numpy": ("MT19937", bytes(8), 0, 0, 0.0)}
    assert rng.differing(before, after) == ["numpy (imported since)", "python"]
    now = rng.capture()
    assert rng.differing(now, now) == [] and rng.same(now, rng.capture())
    torch.rand(1)
    assert rng.differing(now, rng.capture()) == ["torch"]
