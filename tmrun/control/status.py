"""A read-only snapshot of a running job, assembled from the store (for tmrun-ctl)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore

from tmrun.control.events import read_events
from tmrun.protocol import keys
from tmrun.rendezvous.endpoint import Endpoint, EndpointError
from tmrun.protocol.membership import Membership
from tmrun.protocol.messages import Event, ProtocolMessageError, WorkersInfo, registered_node


@dataclass(frozen=True)
class NodeStatus:
    node_id: int
    role: str
    group_rank: int | None
    host: str
    agent_pid: int
    workers: list[dict[str, object]]
    standby_workers: list[dict[str, object]]


@dataclass(frozen=True)
class JobStatus:
    run_id: str
    endpoint: str
    membership: Membership
    nodes: list[NodeStatus]
    events: list[Event]


def connect(endpoint: Endpoint, run_id: str, timeout: float = 5.0) -> Store:
    try:
        store = TCPStore(endpoint.host, endpoint.port, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception:
        raise EndpointError(f"no tmrun job answers at {endpoint}") from None
    prefixed = PrefixStore(keys.job_prefix(run_id), store)
    if not prefixed.check([keys.STATE]):
        raise EndpointError(f"the store at {endpoint} has no tmrun job with run id {run_id!r}")
    return prefixed


def read_status(store: Store, run_id: str, endpoint: str, with_events: bool = True) -> JobStatus:
    """The job's snapshot; ``with_events=False`` for readers that keep the events themselves
    (one store read per event, every event since the job started)."""
    membership = Membership.from_json(store.get(keys.STATE))
    nodes = []
    for ordinal in range(store.add(keys.NODE_SEQ, 0)):
        try:
            registered = registered_node(store, ordinal)
            if registered is None:
                continue
            node_id, info = registered
            workers = WorkersInfo(epoch=0, group_rank=None, agent_pid=info.pid)
            if store.check([keys.node_workers(node_id)]):
                workers = WorkersInfo.decode(keys.node_workers(node_id), store.get(keys.node_workers(node_id)))
        except ProtocolMessageError:
            continue  # a damaged entry: show the rest
        nodes.append(
            NodeStatus(
                node_id=node_id,
                role=membership.role_of(node_id),
                group_rank=membership.group_rank_of(node_id),
                host=info.host,
                agent_pid=info.pid,
                workers=list(workers.workers) if membership.role_of(node_id) == "active" else [],
                standby_workers=list(workers.standby_workers),
            )
        )
    return JobStatus(run_id, endpoint, membership, nodes, read_events(store) if with_events else [])
