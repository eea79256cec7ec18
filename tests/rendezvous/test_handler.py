"""The tmrun rendezvous handler and its leader, in one process over a real TCPStore."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousInfo, RendezvousParameters

from tests.helpers import free_port, wait_until
from tmrun.control.events import read_events
from tmrun.control.rendezvous_backend import register_tmrun_backend
from tmrun.control.rendezvous_backend import create_handler
from tmrun.rendezvous.handler import TmrunRendezvousHandler
from tmrun.protocol.membership import Phase


def _params(port: int, nnodes: int, standby: int, **conf: object) -> RendezvousParameters:
    return RendezvousParameters(
        backend="tmrun",
        endpoint=f"127.0.0.1:{port}",
        run_id="unit",
        min_nodes=nnodes,
        max_nodes=nnodes,
        standby=standby,
        heartbeat_interval=0.2,
        close_grace=2,
        **conf,
    )


class Node:
    """A handler whose next_rendezvous runs on a thread (a standby blocks there)."""

    def __init__(self, handler: TmrunRendezvousHandler) -> None:
        self.handler = handler
        self.result: RendezvousInfo | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def rendezvous(self) -> None:
        self.result, self.error = None, None

        def target() -> None:
            try:
                self.result = self.handler.next_rendezvous()
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                self.error = exc

        self._thread = threading.Thread(target=target, daemon=True)
        self._thread.start()

    def wait(self, timeout: float = 10) -> RendezvousInfo:
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "next_rendezvous did not return"
        if self.error:
            raise self.error
        assert self.result is not None
        return self.result

    @property
    def waiting(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


@pytest.fixture
def three_nodes() -> Iterator[list[Node]]:
    port = free_port()
    nodes = [Node(create_handler(_params(port, 2, 1))) for _ in range(3)]
    yield nodes
    nodes[0].handler.close(Phase.SUCCEEDED, "test over")
    for node in reversed(nodes):
        node.handler.leave()


def _form_with_standby(a: Node, b: Node, spare: Node) -> None:
    """a and b become the active group (a hosts the store), spare stands by."""
    a.rendezvous()
    assert wait_until(lambda: a.handler.node_id is not None, 5)
    b.rendezvous()
    a.wait(), b.wait()
    spare.rendezvous()
    assert wait_until(lambda: spare.handler.node_id in a.handler._read_membership().standby, 5)


def test_registered_in_torchs_registry() -> None:
    from torch.distributed.elastic.rendezvous.registry import handler_registry

    register_tmrun_backend()
    handler = handler_registry.create_handler(_params(0, 1, 0, last_call_timeout=0))
    try:
        assert handler.get_backend() == "tmrun" and not handler.use_agent_store
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        handler.shutdown()


def test_standby_takes_over_and_epochs_advance(three_nodes: list[Node]) -> None:
    a, b, spare = three_nodes
    assert a.handler.is_host and not b.handler.is_host
    a.rendezvous()
    assert wait_until(lambda: a.handler.node_id is not None, 5)
    b.rendezvous()
    ranks = {a.wait().rank, b.wait().rank}
    assert ranks == {0, 1}
    spare.rendezvous()
    assert wait_until(lambda: spare.handler.node_id in a.handler._read_membership().standby, 5)
    # A standby joining never restarts the active group (no torchrun-style livelock).
    assert a.handler.num_nodes_waiting() == 0 and spare.waiting
    b_rank = b.result.rank  # type: ignore[union-attr]

    b.handler.report_failure(by_signal=True, detail="rank 1 signal SIGKILL")
    assert wait_until(lambda: a.handler.num_nodes_waiting() == 1, 5)
    a.rendezvous()  # the survivor re-rendezvouses (its agent restarts its workers)
    promoted = spare.wait()
    assert promoted.rank == b_rank and spare.handler.epoch == 2
    survivor = a.wait()
    assert survivor.rank == 1 - b_rank and a.handler.epoch == 2
    # Each epoch has its own key space, so the workers' master port is fresh.
    assert survivor.bootstrap_store_info.master_port == promoted.bootstrap_store_info.master_port
    membership = a.handler._read_membership()
    assert membership.standby == [b.handler.node_id]  # the failed node stands by now

    # A report from an epoch that is over is refused.
    b.handler.epoch = 1
    b.handler.report_failure(by_signal=True, detail="late")
    assert wait_until(lambda: any(e.kind == "stale" for e in read_events(a.handler.store)), 5)
    assert a.handler._read_membership().epoch == 2


def test_lost_node_is_replaced_without_any_report(three_nodes: list[Node]) -> None:
    a, b, spare = three_nodes
    _form_with_standby(a, b, spare)
    # Simulate the death of b's agent: its liveness connection drops without a goodbye.
    assert b.handler._beacon is not None
    b.handler._beacon._stop.set()
    b.handler._beacon._sock.close()
    a.rendezvous()
    spare.wait(), a.wait()
    membership = a.handler._read_membership()
    assert b.handler.node_id in membership.dead and spare.handler.node_id in membership.active


def test_closing_releases_standbys(three_nodes: list[Node]) -> None:
    a, b, spare = three_nodes
    _form_with_standby(a, b, spare)
    a.handler.close(Phase.SUCCEEDED, "done")
    with pytest.raises(RendezvousClosedError):
        spare.wait()
    assert spare.handler.closed_reason() == (Phase.SUCCEEDED, "done")


def _in_place_job(node: Node, epoch: int, spare_id: int) -> object:
    """What the agents and workers of an in-place job write: 2 nodes of 1 rank, the worker API,
    a warm standby worker on the spare node."""
    import json

    from torch.distributed import PrefixStore

    from tmrun.protocol import keys

    store = PrefixStore(keys.node_prefix("unit", epoch), node.handler.raw_store)
    store.set(keys.API, "1")
    store.add(keys.MEMBERS, 2)
    members = node.handler._read_membership().active
    for group_rank, node_id in enumerate(members):
        store.set(keys.node_ranks(group_rank), json.dumps({"node_id": node_id, "ranks": [group_rank]}))
    store.set(keys.standby_node(spare_id), json.dumps({"ids": [7]}))
    store.set(keys.standby_ready(7), "{}")
    return store


def test_in_place_node_replacement_keeps_the_epoch(three_nodes: list[Node]) -> None:
    from tmrun.rendezvous.handler import NodeRetiredError

    a, b, spare = three_nodes
    _form_with_standby(a, b, spare)
    b_rank = b.result.rank  # type: ignore[union-attr]
    _in_place_job(a, 1, spare.handler.node_id)  # type: ignore[arg-type]
    b.handler.report_failure(by_signal=True, detail="rank 1 exit code 1")
    promoted = spare.wait()  # the standby node returns from its wait with b's group rank ...
    assert promoted.rank == b_rank and spare.handler.epoch == 1  # ... in the same epoch
    assert a.handler.num_nodes_waiting() == 0  # the survivor's agent restarts nothing
    with pytest.raises(NodeRetiredError):
        b.handler.check_retired()  # the failed node (alive) leaves
    assert any(e.kind == "replace" and "in place" in e.detail for e in read_events(a.handler.store))


def test_a_node_failing_after_the_others_finished_closes_the_job(three_nodes: list[Node]) -> None:
    from tmrun.protocol import keys

    a, b, spare = three_nodes
    _form_with_standby(a, b, spare)
    store = _in_place_job(a, 1, spare.handler.node_id)  # type: ignore[arg-type]
    store.set(keys.done(a.result.rank), "9")  # type: ignore[attr-defined, union-attr]
    b.handler.report_failure(by_signal=True, detail="rank 1 exit code 1")
    assert wait_until(lambda: a.handler.closed_reason() is not None, 5)
    phase, reason = a.handler.closed_reason()  # type: ignore[misc]
    assert phase is Phase.FAILED and "after every other rank had finished" in reason
    assert spare.handler.epoch == 0  # nobody was promoted


@pytest.mark.e2e  # slow: waits out a protocol timeout (over a second), not in the unit subset
def test_node_ids_and_group_ranks_follow_the_slurm_node_rank() -> None:
    """Agents that join out of order (SLURM node 2, then 0, then 1) take their SLURM node rank as
    their node id and group rank; an agent restarted on node 1 (same hint) gets a fresh id."""
    port = free_port()
    host = create_handler(_params(port, 3, 0, node_rank=2, last_call_timeout=0.5))
    nodes = [Node(host), *(Node(create_handler(_params(port, 3, 0, node_rank=hint, last_call_timeout=0.5)))
                           for hint in (0, 1))]
    restarted = None
    try:
        for node in nodes:
            node.rendezvous()
            assert wait_until(lambda n=node: n.handler.node_id is not None, 5)
        infos = [node.wait() for node in nodes]
        assert [node.handler.node_id for node in nodes] == [2, 0, 1]
        assert [info.rank for info in infos] == [2, 0, 1]
        restarted = create_handler(_params(port, 3, 0, node_rank=1))
        assert restarted._claim_node_id() == 3  # noqa: SLF001 - ids 0..2 are taken; the next ordinal is 3
    finally:
        host.close(Phase.SUCCEEDED, "test over")
        for handler in ([restarted] if restarted else []) + [n.handler for n in reversed(nodes)]:
            handler.leave()


@pytest.mark.e2e  # slow: waits out a protocol timeout (over a second), not in the unit subset
def test_slurms_first_nodes_are_the_active_ones() -> None:
    """--nnodes 2 --standby 1 under SLURM: nodes 2 and 0 join first, yet the group waits (up to
    a grace) for node 1, so SLURM's first nodes are active and its last the standby."""
    port = free_port()
    first = Node(create_handler(_params(port, 2, 1, node_rank=2)))
    nodes = [first, Node(create_handler(_params(port, 2, 1, node_rank=0)))]
    try:
        for node in nodes:
            node.rendezvous()
            assert wait_until(lambda n=node: n.handler.node_id is not None, 5)
        time.sleep(1.0)
        assert first.handler._read_membership().phase is Phase.FORMING  # noqa: SLF001
        late = Node(create_handler(_params(port, 2, 1, node_rank=1)))
        nodes.append(late)
        late.rendezvous()
        assert [nodes[1].wait().rank, late.wait().rank] == [0, 1]
        membership = first.handler._read_membership()  # noqa: SLF001
        assert (membership.active, membership.standby) == ([0, 1], [2])
    finally:
        first.handler.close(Phase.SUCCEEDED, "test over")
        for node in reversed(nodes):
            node.handler.leave()


def test_a_standby_that_lost_the_store_still_knows_it_stands_by(three_nodes: list[Node]) -> None:
    """Its stop line names its role (`while standing by; this standby leaves`) and it does not try
    to close the job in a store that is gone; an active node's answer stays no."""
    from torch.distributed import DistNetworkError

    a, b, spare = three_nodes
    _form_with_standby(a, b, spare)
    assert spare.handler.is_standing_by() and not b.handler.is_standing_by()

    def gone() -> None:
        raise DistNetworkError("Broken pipe")

    for node in (b, spare):
        node.handler._read_membership = gone  # type: ignore[method-assign]
    try:
        assert spare.handler.is_standing_by() and not b.handler.is_standing_by()
    finally:
        for node in (b, spare):
            del node.handler._read_membership
