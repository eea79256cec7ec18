"""Key names of a tmrun job in the rendezvous store (one place, so nobody invents a key)."""

from __future__ import annotations


def job_prefix(run_id: str) -> str:
    return f"tmrun/{run_id}/"


STATE = "state"  # Membership JSON, written by the leader only
STATE_VERSION = "state_version"  # counter bumped after every write of STATE
CLOSED = "closed"  # JSON {"phase", "reason"}; set once, first writer wins
NODE_SEQ = "node_seq"  # counter: node ids in join order
FAIL_SEQ = "fail_seq"  # counter: failure reports
EVENT_SEQ = "event_seq"  # counter: events
LEFT = "left"  # counter: agents that have left after the job closed
LIVENESS_ADDR = "leader/liveness"  # "host:port" of the leader's liveness listener
LEADER_INFO = "leader/info"  # JSON about the leader process


def node_info(node_id: int) -> str:
    return f"node/{node_id}/info"


def node_workers(node_id: int) -> str:
    return f"node/{node_id}/workers"


def failure(seq: int) -> str:
    return f"fail/{seq}"


def event(seq: int) -> str:
    return f"event/{seq}"


def epoch_prefix(epoch: int) -> str:
    """Per-epoch namespace: no restart ever reads keys an earlier epoch wrote."""
    return f"epoch/{epoch}/"
