"""Leadership and liveness on etcd leases (rendezvous.election), and a leader that takes over
from the store (control.leader): real etcd, real threads, bounded waits."""

from __future__ import annotations

import pytest

import threading
import uuid

from torch.distributed import PrefixStore

from tests.helpers import wait_until
from tmrun.control.leader import Leader, LeaderConfig
from tmrun.protocol import keys
from tmrun.protocol.etcd import EtcdConfig, EtcdStore
from tmrun.protocol.membership import GroupLimits, Membership, Phase
from tmrun.protocol.messages import FailureReport, NodeInfo
from tmrun.rendezvous.election import AgentLease, EtcdLiveness, alive_key, departed_key, job_key_prefix


class _Leader:
    def __init__(self, name: str, log: list[tuple[str, bool]], takeover: bool) -> None:
        self.error = None
        self.stopped = threading.Event()
        log.append((name, takeover))

    def stop(self) -> None:
        self.stopped.set()


def _store(server, run_id: str) -> EtcdStore:  # type: ignore[no-untyped-def]
    return EtcdStore.for_job(EtcdConfig.parse(server.endpoint), run_id, timeout=5)


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
def test_one_leader_then_the_next_takes_over(etcd_server) -> None:  # type: ignore[no-untyped-def]
    run_id = f"lead-{uuid.uuid4().hex[:8]}"
    started: list[tuple[str, bool]] = []
    leaders: dict[str, _Leader] = {}

    def starter(name: str):  # type: ignore[no-untyped-def]
        def start(takeover: bool) -> _Leader:
            leaders[name] = _Leader(name, started, takeover)
            return leaders[name]
        return start

    store = _store(etcd_server, run_id)
    first = AgentLease(store.clone(), run_id, 1.0, starter("a"), campaign_interval=0.02)
    first.start()
    assert wait_until(lambda: started == [("a", False)], 10), started
    store.set(job_key_prefix(run_id) + keys.STATE, Membership().to_json())  # a leader wrote its state
    second = AgentLease(store.clone(), run_id, 1.0, starter("b"), campaign_interval=0.02)
    second.start()
    try:
        assert not wait_until(lambda: len(started) > 1, 1.0)  # the lead is taken
        first.close()  # a goodbye frees the lead at once (no TTL to wait)
        assert leaders["a"].stopped.is_set()
        assert wait_until(lambda: len(started) == 2, 10), started
        assert started[1] == ("b", True)  # b goes on from a's state
        assert second.leader is leaders["b"]
    finally:
        second.close()
    assert leaders["b"].stopped.is_set()


def test_an_expired_lease_steps_down(etcd_server) -> None:  # type: ignore[no-untyped-def]
    run_id = f"exp-{uuid.uuid4().hex[:8]}"
    log: list[tuple[str, bool]] = []
    made: list[_Leader] = []
    lease = AgentLease(_store(etcd_server, run_id), run_id, 1.0,
                       lambda takeover: made.append(_Leader("a", log, takeover)) or made[-1], campaign_interval=0.02)
    lease.start()
    assert wait_until(lambda: len(made) == 1, 10)
    _store(etcd_server, run_id).revoke_lease(lease._lease)  # what an expiry looks like to its holder
    assert wait_until(lambda: lease.lost, 10)
    assert made[0].stopped.is_set() and lease.leader is None
    lease.close()


def test_liveness_tells_departed_from_lost(etcd_server) -> None:  # type: ignore[no-untyped-def]
    run_id = f"live-{uuid.uuid4().hex[:8]}"
    store = _store(etcd_server, run_id)
    job = job_key_prefix(run_id)
    leases = {node: store.grant_lease(30) for node in (0, 1, 2)}
    for node, lease in leases.items():
        store.put(job + alive_key(node), "x", lease=lease)
    liveness = EtcdLiveness(store, run_id, ttl=30, check_interval=0)
    lost: dict[int, str] = {}
    liveness.poll(0, lambda n, why, _silent: lost.__setitem__(n, why))
    assert lost == {} and liveness.take_departed() == []
    store.set(job + departed_key(1), "1")
    store.revoke_lease(leases[1])  # node 1 left
    store.revoke_lease(leases[2])  # node 2's lease expired
    liveness.expect([5])  # a node the membership names, with no key: lost
    liveness.poll(0, lambda n, why, _silent: lost.__setitem__(n, why))
    assert sorted(lost) == [2, 5] and "lease expired" in lost[2]
    assert liveness.take_departed() == [1]
    lost.clear()
    liveness.poll(0, lambda n, why, _silent: lost.__setitem__(n, why))
    assert lost == {}  # each loss once


def _config(run_id: str) -> LeaderConfig:
    return LeaderConfig(run_id=run_id, limits=GroupLimits(2, 2, 1), last_call_timeout=0.5, join_timeout=30,
                        failure_settle=0.1, heartbeat_timeout=30, poll_interval=0.01)


def _register(job: PrefixStore, store: EtcdStore, run_id: str, node: int, lease: int) -> None:
    ordinal = job.add(keys.NODE_SEQ, 1) - 1
    job.set(keys.node_order(ordinal), str(node))
    store.put(job_key_prefix(run_id) + alive_key(node), "x", lease=lease)
    job.set(keys.node_info(node), NodeInfo(host="h", addr="a", pid=1, node_rank_hint=-1, time=0.0).encode())


def test_a_leader_that_takes_over_goes_on_from_the_store(etcd_server) -> None:  # type: ignore[no-untyped-def]
    run_id = f"take-{uuid.uuid4().hex[:8]}"
    raw = _store(etcd_server, run_id)
    job = PrefixStore(keys.job_prefix(run_id), raw)
    leases = {n: raw.grant_lease(60) for n in range(3)}
    first = Leader(PrefixStore(keys.job_prefix(run_id), raw.clone()), _config(run_id), raw.clone(),
                   liveness=EtcdLiveness(raw.clone(), run_id, 60, check_interval=0))
    first.start("127.0.0.1")
    try:
        for node in range(3):
            _register(job, raw, run_id, node, leases[node])
        state = lambda: Membership.from_json(job.get(keys.STATE))  # noqa: E731
        assert wait_until(lambda: state().phase is Phase.RUNNING and len(state().standby) == 1, 20), state()
        # a stale report the first leader handled (its epoch is not the current one)
        seq = job.add(keys.FAIL_SEQ, 1) - 1
        job.set(keys.failure(seq), FailureReport(node_id=0, epoch=99, by_signal=True, detail="old").encode())
        assert wait_until(lambda: job.check([keys.FAIL_HANDLED]) and job.get(keys.FAIL_HANDLED) == b"1", 10)
    finally:
        first.stop()
    formed = state()
    raw.revoke_lease(leases[1])  # node 1 (active) dies while nobody leads
    second = Leader(PrefixStore(keys.job_prefix(run_id), raw.clone()), _config(run_id), raw.clone(),
                    liveness=EtcdLiveness(raw.clone(), run_id, 60, check_interval=0), takeover=True)
    second.start("127.0.0.1")
    try:
        # the group is not formed again: node 1's loss is a failure of the running epoch
        assert wait_until(lambda: state().epoch > formed.epoch or 1 in state().dead, 20), state()
        after = state()
        assert 1 in after.dead and after.phase is Phase.RUNNING
        assert formed.active[0] in after.active
        events = [job.get(keys.event(i)).decode() for i in range(job.add(keys.EVENT_SEQ, 0))]
        assert any('"leader"' in e and "took over" in e for e in events), events
        assert sum('"formed"' in e for e in events) == 1, events  # formed once, by the first leader
        assert sum("from epoch 99" in e for e in events) == 1, events  # the handled report is not taken again
    finally:
        second.stop()
