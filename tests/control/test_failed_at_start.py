"""The crash-loop rule (a script that fails at start ends the job after two starts) must not take
a one-node job with ``--standby N`` for one: its workers keep the worker API's keys under the
group's prefix, which the leader does not read, so the leader used to find no rank in
tmrun.init() and could end a job whose ranks trained (found 2026-12-07)."""

from __future__ import annotations

from torch.distributed import HashStore, PrefixStore

from tmrun.control.leader import START_WINDOW, failed_at_start
from tmrun.launcher.roles.local import _api_reached
from tmrun.protocol import keys
from tmrun.protocol.messages import FailureReport


def _report(**fields: object) -> FailureReport:
    return FailureReport(node_id=0, epoch=1, by_signal=False, detail="rank 1 (pid 7) exit code 1", **fields)


def test_a_report_says_whether_the_nodes_workers_reached_the_api() -> None:
    for reached in (False, True):
        report = _report(reached_api=reached)
        assert FailureReport.decode("k", report.encode()).reached_api is reached
    assert FailureReport.decode("k", '{"node_id": 0, "epoch": 1, "by_signal": false}').reached_api is False


def test_only_a_failure_before_any_rank_reached_the_api_is_at_start() -> None:
    def never() -> bool:
        return False

    assert failed_at_start([_report()], 5.0, never)
    # the node's own keys say a worker reached tmrun.init() (one node, --standby N)
    assert not failed_at_start([_report(reached_api=True)], 5.0, never)
    # the node's in-place controller ran (every rank ran the worker API) and gave up
    assert not failed_at_start([_report(node_fallback="the standby wait ran out")], 5.0, never)
    # the epoch's keys say so (standby nodes, or a plain multi-node job)
    assert not failed_at_start([_report()], 5.0, lambda: True)
    assert not failed_at_start([_report(node_dead=True)], 5.0, never)
    assert not failed_at_start([_report()], START_WINDOW + 1, never)


def test_the_local_role_reads_the_api_key_under_its_groups_prefix() -> None:
    raw = HashStore()
    group = PrefixStore(keys.group_prefix("job", 0), raw)
    assert not _api_reached(group)
    PrefixStore(keys.group_prefix("job", 1), raw).set(keys.API, "1")  # another start's
    assert not _api_reached(group)
    group.set(keys.API, "1")
    assert _api_reached(group)

    class Gone:
        def check(self, names: list[str]) -> bool:
            raise RuntimeError("connection reset by peer")

    assert not _api_reached(Gone())  # type: ignore[arg-type]
