"""A group restart's cost from the node agents' progress records (control.restarts)."""

from __future__ import annotations

from tmrun.control.restarts import POLL_INTERVAL, RestartAccounts
from tmrun.protocol import keys
from tmrun.protocol.messages import NodeProgress, RankProgress


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.gets: dict[str, int] = {}

    def check(self, names: list[str]) -> bool:
        return all(n in self.data for n in names)

    def get(self, name: str) -> bytes:
        self.gets[name] = self.gets.get(name, 0) + 1
        return self.data[name].encode()

    def set(self, name: str, value: str) -> None:
        self.data[name] = value


def _progress(node: int, epoch: int, *ranks: tuple[int, int, float, float, int]) -> str:
    """ranks: (rank, step, time, step_seconds, resumed)"""
    return NodeProgress(node, 0.0, tuple(RankProgress(rank=r, step=s, step_seconds=secs, busy_seconds=0.0, time=t,
                                                      pid=100 + r, role="active", resumed=res)
                                         for r, s, t, secs, res in ranks), epoch=epoch).encode()


def _polled(accounts: RestartAccounts, clock: list[float]) -> list:
    clock[0] += POLL_INTERVAL
    return accounts.poll(now=clock[0])


def test_a_restart_from_a_checkpoint_counts_the_steps_done_again_and_the_time_until_back() -> None:
    store, clock = _Store(), [0.0]
    accounts = RestartAccounts(store)
    assert accounts.begin(old_epoch=1, new_epoch=2, old_nodes=2, new_nodes=2, failed=1000.0) == []
    # node 0's last records of epoch 1: rank 1 completed step 25, rank 0 step 24; node 1 was lost
    store.set(keys.final_progress(1, 0), _progress(0, 1, (0, 24, 999.0, 1.0, 0), (1, 25, 999.5, 1.0, 0)))
    # the new epoch: node 1 has not published yet, node 0 still shows epoch 1
    store.set(keys.node_progress(0), _progress(0, 1, (0, 24, 999.0, 1.0, 0)))
    assert _polled(accounts, clock) == []
    store.set(keys.node_progress(0), _progress(0, 2, (0, 20, 1010.0, 1.0, 20), (1, 21, 1011.0, 1.0, 20)))
    store.set(keys.node_progress(1), _progress(1, 2, (2, 22, 1012.0, 1.0, 20), (3, 22, 1012.0, 1.0, 20)))
    assert _polled(accounts, clock) == []  # rank 0 has not completed step 26 yet
    assert accounts.poll(now=clock[0] + POLL_INTERVAL / 2) == []  # not looked at more often than that
    store.set(keys.node_progress(0), _progress(0, 2, (0, 28, 1018.0, 1.0, 20), (1, 26, 1016.0, 1.0, 20)))
    store.set(keys.node_progress(1), _progress(1, 2, (2, 27, 1017.0, 1.0, 20), (3, 27, 1017.0, 1.0, 20)))
    [done] = _polled(accounts, clock)
    # step 26 completed at 1016 on every rank (rank 0: 1018 less two steps); resumed at 20 after 25
    assert (done.high_water, done.resumed, done.steps_recomputed) == (25, 20, 6)
    assert done.back == 1016.0 and done.seconds == 16.0 and done.failed == 1000.0
    assert "6 steps recomputed" in done.describe() and done.fields()["marks"] == {"failed": 1000.0, "back": 1016.0}
    assert _polled(accounts, clock) == [] and accounts.finish(2000.0) == []
    assert store.gets[keys.final_progress(1, 0)] == 1  # an epoch's last records are written once: read once


def test_a_restart_without_progress_records_is_not_measured() -> None:
    """A script without the worker API writes no progress: nothing is claimed about its restart."""
    store = _Store()
    accounts = RestartAccounts(store)
    accounts.begin(1, 2, 1, 1, failed=10.0)
    store.set(keys.node_progress(0), _progress(0, 2))
    assert accounts.poll(now=1.0) == []
    [ended] = accounts.finish(50.0)
    assert ended.seconds is None and ended.steps_recomputed is None and "not measured" in ended.describe()


def test_a_restart_that_never_got_back_is_counted_until_the_end_or_the_next_restart() -> None:
    store = _Store()
    accounts = RestartAccounts(store)
    accounts.begin(1, 2, 1, 1, failed=10.0)
    store.set(keys.final_progress(1, 0), _progress(0, 1, (0, 9, 9.0, 1.0, 0)))
    store.set(keys.node_progress(0), _progress(0, 2, (0, 6, 14.0, 1.0, 0)))
    assert accounts.poll(now=1.0) == []
    # a second failure before the group got back to step 10: the first restart ends there
    [first] = accounts.begin(2, 3, 1, 1, failed=15.0)
    assert first.back is None and first.seconds == 5.0 and first.steps_recomputed == 7  # steps 0..6 done again
    assert "until the end: the group did not get back" in first.describe()
    [second] = accounts.finish(20.0)
    assert second.old_epoch == 2 and second.seconds is None  # no record of epoch 3 yet: not measured


def test_a_group_back_since_the_last_poll_is_closed_at_its_return_when_the_job_ends() -> None:
    """The job ends between two polls, after the group got back: the restart ends where the
    records say it got back, not at the job's end (which counted the whole rest of the training
    as the restart's cost, and its summary said it never got back)."""
    store, clock = _Store(), [0.0]
    accounts = RestartAccounts(store)
    accounts.begin(1, 2, 1, 1, failed=10.0)
    store.set(keys.final_progress(1, 0), _progress(0, 1, (0, 4, 9.0, 1.0, 0), (1, 4, 9.0, 1.0, 0)))
    store.set(keys.node_progress(0), _progress(0, 2, (0, 2, 14.0, 1.0, 0), (1, 2, 14.0, 1.0, 0)))
    assert _polled(accounts, clock) == []  # back at step 2 of 5: not back yet
    store.set(keys.node_progress(0), _progress(0, 2, (0, 9, 21.0, 1.0, 0), (1, 9, 21.0, 1.0, 0)))
    [ended] = accounts.finish(22.0)  # no poll since: the job ended first
    assert ended.back == 17.0 and ended.seconds == 7.0 and ended.steps_recomputed == 5, ended
    assert "did not get back" not in ended.describe(), ended.describe()


def test_nothing_completed_before_the_failure_recomputes_nothing() -> None:
    store = _Store()
    accounts = RestartAccounts(store)
    accounts.begin(1, 2, 1, 1, failed=10.0)
    store.set(keys.final_progress(1, 0), _progress(0, 1, (0, -1, 0.0, 0.0, 0)))
    store.set(keys.node_progress(0), _progress(0, 2, (0, 0, 13.0, 1.0, 0), (1, 0, 13.0, 1.0, 0)))
    [done] = accounts.poll(now=1.0)
    assert done.high_water is None and done.steps_recomputed == 0 and done.back == 13.0 and done.seconds == 3.0
    assert done.describe() == ("epoch 2: the group restart cost 3.000s (failure to its first step), resumed at step 0 "
                               "with no step completed before: 0 steps recomputed")


def test_a_malformed_record_counts_as_none() -> None:
    store = _Store()
    accounts = RestartAccounts(store)
    accounts.begin(1, 2, 1, 1, failed=10.0)
    store.set(keys.node_progress(0), '{"node": 0, "time": 1, "ranks": [{"rank": 0, "step": "x"}], "epoch": 2}')
    assert accounts.poll(now=1.0) == []
