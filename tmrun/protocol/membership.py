"""Membership of a tmrun job: which node holds which group rank, who stands by, how many nodes.

The leader is the only writer of :class:`Membership`; every other process reads it.  Every
change of the active group bumps ``epoch``; a message that names an older epoch is stale.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum

from tmrun.protocol.messages import ProtocolMessageError, _int, _int_list, _load, _show, _str


class Phase(str, Enum):
    """Life cycle of a job's membership."""

    FORMING = "forming"  # waiting for the first min_nodes agents
    RUNNING = "running"  # an active group exists for ``epoch``
    SUCCEEDED = "succeeded"  # the workers finished; standbys may leave
    FAILED = "failed"  # the job gave up; everyone leaves


CLOSED_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})
_PHASES = tuple(phase.value for phase in Phase)


@dataclass
class Membership:
    """The leader's view of the job, published in the store as JSON."""

    epoch: int = 0
    phase: Phase = Phase.FORMING
    active: list[int] = field(default_factory=list)  # group rank -> node id
    standby: list[int] = field(default_factory=list)  # node ids, promotion order
    dead: list[int] = field(default_factory=list)  # node ids known to be gone
    retired: list[int] = field(default_factory=list)  # live nodes whose ranks a standby took in place
    reason: str = ""  # why the last change happened (for logs and status)

    def to_json(self) -> str:
        data = asdict(self)
        data["phase"] = self.phase.value
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, key: str = "membership") -> Membership:
        """Raises :class:`~tmrun.protocol.messages.ProtocolMessageError` (one line) on anything
        but a membership."""
        data = _load(key, text)
        phase = data.get("phase")
        if not isinstance(phase, str) or phase not in _PHASES:
            raise ProtocolMessageError(f"{key}: field 'phase' must be one of {', '.join(_PHASES)}, got {_show(phase)}")
        if "retired" not in data:
            data = {**data, "retired": []}
        return cls(
            epoch=_int(key, data, "epoch"),
            phase=Phase(phase),
            active=_int_list(key, data, "active"),
            standby=_int_list(key, data, "standby"),
            dead=_int_list(key, data, "dead"),
            retired=_int_list(key, data, "retired"),
            reason=_str(key, data, "reason", ""),
        )

    def group_rank_of(self, node_id: int) -> int | None:
        """The node's group rank, or None when it is not active."""
        try:
            return self.active.index(node_id)
        except ValueError:
            return None

    def is_closed(self) -> bool:
        return self.phase in CLOSED_PHASES

    def role_of(self, node_id: int) -> str:
        if node_id in self.dead:
            return "dead"
        if node_id in self.retired:
            return "retired"
        if node_id in self.active:
            return "active"
        if node_id in self.standby:
            return "standby"
        return "waiting"


@dataclass(frozen=True)
class GroupLimits:
    """How many nodes the job wants: torchrun's --nnodes MIN:MAX plus --standby."""

    min_nodes: int
    max_nodes: int
    standby: int

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.max_nodes
