"""A change's waits keep a large job's load on the in-place store bounded (tmrun.worker.store_pace):
every survivor waits at once (the plan, every joiner's address, a lost vote's records), so at 2 ms
a look 1,000 ranks would ask one TCPStore server about 500,000 times a second. Counted with a
store that counts its requests and a sleep that only adds up the time it was asked to wait: a
small job's waits look as often as before, a large job's whole set of waiting workers stays
under STORE_BUDGET requests a second."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tmrun.control.replacement.core import write_gen_file
from tmrun.protocol import keys
from tmrun.protocol.environment import LaunchEnv
from tmrun.worker import context as context_module, store_pace, vote
from tmrun.worker.context import FAST_POLL, POLL, Context

LOOKS = 400  # sleeps a wait is allowed before the test stops it
BUDGET = store_pace.STORE_BUDGET * 1.0001  # (rounding)


class _CountingStore:
    """The store calls a waiting worker makes, counted; nothing it waits for ever comes."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {keys.GEN: b"1"}
        self.requests = 0

    def check(self, names: list[str]) -> bool:
        self.requests += 1
        return all(name in self.data for name in names)

    def get(self, name: str) -> bytes:
        self.requests += 1
        return self.data[name]

    def set(self, name: str, value: str) -> None:
        self.requests += 1
        self.data[name] = value.encode()

    def add(self, name: str, amount: int) -> int:
        self.requests += 1
        value = int(self.data.get(name, b"0")) + amount
        self.data[name] = str(value).encode()
        return value


class _Stop(Exception):
    pass


class _Sleeps:
    """Stands in for time.sleep: adds up what it was asked, stops the wait after LOOKS."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)
        if len(self.slept) >= LOOKS:
            raise _Stop


class _VirtualTime:
    """The ``time`` module as the waits see it, with the counting sleep."""

    def __init__(self, sleep: _Sleeps) -> None:
        self.sleep = sleep

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> _Sleeps:
    fake = _Sleeps()
    for module in (context_module, vote):  # those modules only: no other thread's sleep is touched
        monkeypatch.setattr(module, "time", _VirtualTime(fake))
    return fake


def _context(tmp_path: Path, world_size: int, gen_file: bool) -> tuple[Context, _CountingStore]:
    path = tmp_path / "gen"
    if gen_file:
        write_gen_file(str(path), 1)
    ctx = Context(LaunchEnv(gen_file=str(path) if gen_file else "", recovery_timeout=120.0, world_size=world_size))
    store = _CountingStore()
    ctx.store = store  # type: ignore[assignment]
    return ctx, store


def _job_rate(store: _CountingStore, sleeps: _Sleeps, world_size: int) -> float:
    """Store requests a second of the whole job, were every worker waiting like this one."""
    return store.requests / sum(sleeps.slept) * world_size


def test_the_pace_is_the_small_jobs_up_to_the_budget_and_the_budget_above() -> None:
    assert store_pace.interval(8, FAST_POLL) == FAST_POLL
    assert store_pace.interval(1000, FAST_POLL) == pytest.approx(0.02)
    for world in (1, 2, 64, 256, 1000, 4096, 16384):
        pace = store_pace.interval(world, FAST_POLL, requests_per_look=3)
        assert world * 3 / pace <= BUDGET
    assert store_pace.looks_per_store_ask(8, FAST_POLL, 10, requests_per_ask=2) == 10
    assert store_pace.looks_per_store_ask(1000, FAST_POLL, 10, requests_per_ask=2) == 20
    for world in (501, 777, 1025, 3333):  # spaced up, never under the budget's spacing
        every = store_pace.looks_per_store_ask(world, FAST_POLL, 10, requests_per_ask=2)
        assert world * 2 / (every * FAST_POLL) <= BUDGET


@pytest.mark.parametrize("gen_file", [True, False], ids=["gen-file", "store-only"])
def test_a_small_jobs_address_wait_looks_every_2_ms(tmp_path: Path, sleeps: _Sleeps, gen_file: bool) -> None:
    ctx, store = _context(tmp_path, 8, gen_file)
    with pytest.raises(_Stop):
        ctx.address_getter(1)(store, "never")
    assert sleeps.slept[:99] == [FAST_POLL] * 99 and set(sleeps.slept[99:]) == {POLL}


@pytest.mark.parametrize("gen_file", [True, False], ids=["gen-file", "store-only"])
def test_a_large_jobs_address_waits_stay_under_the_budget(tmp_path: Path, sleeps: _Sleeps, gen_file: bool) -> None:
    ctx, store = _context(tmp_path, 1000, gen_file)
    with pytest.raises(_Stop):
        ctx.address_getter(1)(store, "never")
    assert _job_rate(store, sleeps, 1000) <= BUDGET
    assert max(sleeps.slept) <= 0.03  # still looks within a few tens of milliseconds


def test_a_small_jobs_plan_wait_asks_the_store_every_tenth_look(tmp_path: Path, sleeps: _Sleeps) -> None:
    ctx, store = _context(tmp_path, 8, gen_file=True)
    with pytest.raises(_Stop):
        ctx.await_key(keys.plan(2), float("inf"), poll=FAST_POLL)
    assert set(sleeps.slept) == {FAST_POLL}
    assert store.requests == 2 * LOOKS // 10  # the plan and the abort, every tenth look


@pytest.mark.parametrize("gen_file", [True, False], ids=["gen-file", "store-only"])
def test_a_large_jobs_plan_waits_stay_under_the_budget(tmp_path: Path, sleeps: _Sleeps, gen_file: bool) -> None:
    ctx, store = _context(tmp_path, 1000, gen_file)
    with pytest.raises(_Stop):
        ctx.await_key(keys.plan(2), float("inf"), poll=FAST_POLL)
    assert _job_rate(store, sleeps, 1000) <= BUDGET
    if gen_file:  # the node's generation file is still read every 2 ms: the plan is seen as fast
        assert set(sleeps.slept) == {FAST_POLL}


@pytest.mark.parametrize("world_size", [4, 1000])
def test_a_lost_votes_wait_for_the_others_records_stays_under_the_budget(sleeps: _Sleeps, world_size: int) -> None:
    store = _CountingStore()
    with pytest.raises(_Stop):
        vote.others_committed(store, 1, 0, world_size, 5, lambda: 1, float("inf"))  # type: ignore[arg-type]
    if world_size == 4:
        assert set(sleeps.slept) == {vote.POLL}
    else:
        assert _job_rate(store, sleeps, world_size) <= BUDGET
