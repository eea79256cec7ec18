"""A read-only snapshot of a running job, assembled from the store (for tmrun-ctl)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore

from tmrun.control.events import Event, read_events
from tmrun.rendezvous import keys
from tmrun.rendezvous.endpoint import Endpoint, EndpointError
from tmrun.rendezvous.state import Membership


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


def read_status(store: Store, run_id: str, endpoint: str) -> JobStatus:
    membership = Membership.from_json(store.get(keys.STATE))
    nodes = []
    for node_id in range(store.add(keys.NODE_SEQ, 0)):
        if not store.check([keys.node_info(node_id)]):
            continue
        info = json.loads(store.get(keys.node_info(node_id)))
        workers: dict[str, object] = {}
        if store.check([keys.node_workers(node_id)]):
            workers = json.loads(store.get(keys.node_workers(node_id)))
        nodes.append(
            NodeStatus(
                node_id=node_id,
                role=membership.role_of(node_id),
                group_rank=membership.group_rank_of(node_id),
                host=str(info.get("host", "?")),
                agent_pid=int(info.get("pid", 0)),
                workers=list(workers.get("workers", [])) if membership.role_of(node_id) == "active" else [],  # type: ignore[arg-type]
                standby_workers=list(workers.get("standby_workers", [])),  # type: ignore[arg-type]
            )
        )
    return JobStatus(run_id, endpoint, membership, nodes, read_events(store))
