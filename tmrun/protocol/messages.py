"""Every message between tmrun processes, as a validated dataclass (JSON in the store).

A reader rejects a message it cannot parse with a one-line :class:`ProtocolMessageError` that
names the key, instead of a traceback deep in training. Where a message lives: :mod:`keys`.

* leader and agents: :class:`FailureReport`, :class:`NodeInfo`, :class:`LeaderInfo`,
  :class:`WorkersInfo`, :class:`ClosedNotice`;
* the in-place protocol (one controller per prefix writes generations and plans; workers
  write only reports about themselves or a peer they lost): :class:`ReplacementPlan`,
  :class:`Assignment`, :class:`WorkerReport`, :class:`AbortNotice`, :class:`StandbyReady`,
  :class:`NodeRanks`, :class:`StandbyNode`, :class:`RecoveryTiming`;
* operators: :class:`MigrateRequest`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from tmrun.protocol import keys


def read_gen(store: Any) -> int:
    """The current generation of an in-place prefix (0 before the controller published any)."""
    return int(store.get(keys.GEN).decode()) if store.check([keys.GEN]) else 0


def numbered(store: Any, seq_key: str, key_of: Callable[[int], str], start: int) -> Iterator[tuple[int, str]]:
    """(number, key) of the messages written since ``start``, in order; stops at the first one
    whose writer took the number but has not written it yet."""
    for number in range(start, store.add(seq_key, 0)):
        key = key_of(number)
        if not store.check([key]):
            return
        yield number, key


class ProtocolMessageError(ValueError):
    """A message in the store is not what the protocol allows (one line, names the key)."""


def _load(key: str, raw: bytes | str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolMessageError(f"{key}: not JSON ({exc})") from None
    except RecursionError:  # json's scanner recurses per nested array or object
        raise ProtocolMessageError(f"{key}: not JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ProtocolMessageError(f"{key}: expected a JSON object")
    return data


def _show(value: Any, limit: int = 80) -> str:
    """A value in an error message: its repr, cut to ``limit`` characters (one short line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int(key: str, data: dict[str, Any], name: str, minimum: int = 0) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ProtocolMessageError(f"{key}: field {name!r} must be an integer >= {minimum}, got {_show(value)}")
    return value


def _float(key: str, data: dict[str, Any], name: str, default: float = 0.0) -> float:
    """An optional JSON number (any sign; NaN and infinities as json reads them)."""
    value = data.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ProtocolMessageError(f"{key}: field {name!r} must be a number, got {_show(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer beyond a double's range
        raise ProtocolMessageError(f"{key}: field {name!r} is out of range") from None


@dataclass(frozen=True)
class ReplacementPlan:
    """Generation ``gen`` replaces each rank in ``replaced`` with the standby it maps to."""

    gen: int
    world_size: int
    replaced: dict[int, int]  # rank -> standby id
    reason: str = ""
    planned: bool = False  # a migration (the leaver donates, nothing is recomputed)
    created: float = 0.0
    # ranks whose move in the superseded planned generation before this one is void: the
    # migration had not switched when a member was lost, and its leaver keeps the rank
    returned: tuple[int, ...] = ()

    def encode(self) -> str:
        data = asdict(self)
        data["replaced"] = {str(rank): sid for rank, sid in self.replaced.items()}
        data["returned"] = list(self.returned)
        return json.dumps(data)

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> ReplacementPlan:
        data = _load(key, raw)
        gen = _int(key, data, "gen", 1)
        world = _int(key, data, "world_size", 1)
        replaced_raw = data.get("replaced")
        if not isinstance(replaced_raw, dict) or not replaced_raw:
            raise ProtocolMessageError(f"{key}: field 'replaced' must be a non-empty object")
        replaced: dict[int, int] = {}
        for rank_text, sid in replaced_raw.items():
            try:
                rank = int(rank_text)
            except ValueError:
                raise ProtocolMessageError(f"{key}: rank {_show(rank_text)} is not an integer") from None
            if not 0 <= rank < world or not isinstance(sid, int) or sid < 0:
                raise ProtocolMessageError(f"{key}: bad replacement {_show(rank_text)} -> {_show(sid)}")
            replaced[rank] = sid
        return cls(
            gen=gen,
            world_size=world,
            replaced=replaced,
            reason=str(data.get("reason", "")),
            planned=bool(data.get("planned", False)),
            created=_float(key, data, "created"),
            returned=_returned(key, data, world, replaced),
        )


def _returned(key: str, data: dict[str, Any], world: int, replaced: dict[int, int]) -> tuple[int, ...]:
    raw = data.get("returned", [])
    if not isinstance(raw, list) or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world
                                           and r not in replaced for r in raw):
        raise ProtocolMessageError(f"{key}: field 'returned' must list ranks below {world} that are not replaced")
    return tuple(sorted(set(raw)))


@dataclass(frozen=True)
class Assignment:
    """What a standby is told: take ``rank`` in generation ``gen`` (or stop)."""

    rank: int = -1
    gen: int = 0
    stop: bool = False
    planned: bool = False  # a migration: the state comes from the leaving process

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> Assignment:
        data = _load(key, raw)
        if data.get("stop"):
            return cls(stop=True)
        return cls(rank=_int(key, data, "rank"), gen=_int(key, data, "gen", 1), planned=bool(data.get("planned")))


@dataclass(frozen=True)
class MigrateRequest:
    """An operator's request: move ``rank`` (or, across nodes, the node at group rank ``node``)
    to a standby at the next step boundary. Across nodes a member is a node: moving a rank
    moves its whole node."""

    rank: int = -1
    reason: str = "operator request"
    node: int = -1
    time: float = field(default=0.0, compare=False)  # when it was asked (Unix time; 0: unknown)

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> MigrateRequest:
        data = _load(key, raw)
        node = data.get("node", -1)
        reason = str(data.get("reason", "operator request"))
        asked = _number(key, data, "time") if "time" in data else 0.0
        if node == -1:
            return cls(rank=_int(key, data, "rank"), reason=reason, time=asked)
        return cls(node=_int(key, data, "node"), reason=reason, time=asked)

    def describe(self) -> str:
        return f"node at group rank {self.node}" if self.node >= 0 else f"rank {self.rank}"


def request_migration(job_store: Any, rank: int = -1, reason: str = "operator request", node: int = -1) -> int:
    """Ask the controller of the job behind ``job_store`` (prefix ``tmrun/<run>/``) to migrate
    ``rank`` (or the node at group rank ``node``) to a warm standby. Returns the request's number."""
    seq = job_store.add(keys.MIGRATE_SEQ, 1) - 1
    job_store.set(keys.migrate_request(seq), MigrateRequest(rank, reason, node, time=time.time()).encode())
    return seq


@dataclass(frozen=True)
class WorkerReport:
    """A worker's word: ``lost`` is the rank it lost (its own rank for 'I am leaving'; -1 when the
    communicator could not tell, e.g. a collective that timed out with every link alive)."""

    reporter: int
    lost: int
    gen: int
    detail: str = ""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> WorkerReport:
        data = _load(key, raw)
        return cls(
            reporter=_int(key, data, "reporter"),
            lost=_int(key, data, "lost", -1),
            gen=_int(key, data, "gen"),
            detail=str(data.get("detail", "")),
        )


@dataclass(frozen=True)
class AbortNotice:
    reason: str
    gen: int = 0

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> AbortNotice:
        data = _load(key, raw)
        return cls(reason=str(data.get("reason", "unknown")), gen=_int(key, data, "gen") if data.get("gen") else 0)


def _str(key: str, data: dict[str, Any], name: str, default: str | None = None) -> str:
    value = data.get(name, default)
    if not isinstance(value, str):
        raise ProtocolMessageError(f"{key}: field {name!r} must be a string, got {_show(value)}")
    return value


def _int_list(key: str, data: dict[str, Any], name: str) -> list[int]:
    value = data.get(name)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in value):
        raise ProtocolMessageError(f"{key}: field {name!r} must be a list of integers >= 0, got {_show(value)}")
    return list(value)


class _Json:
    """Messages whose fields are plain JSON values: ``encode`` is their dict as JSON."""

    def encode(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]


# ---- agents and the leader ------------------------------------------------------------------------


@dataclass(frozen=True)
class FailureReport(_Json):
    """An agent's word about its node in ``epoch`` (or what the leader saw of a node)."""

    node_id: int
    epoch: int
    by_signal: bool  # a worker was killed by a signal (the likely root cause)
    node_dead: bool = False  # the agent itself is gone (liveness channel closed)
    detail: str = ""
    # the node's own in-place controller (one node, --standby N) was in charge of this failure and
    # gave up: why ('' when it was not: a plain script, or standby nodes)
    node_fallback: str = ""
    # a worker of the node reached tmrun.init() in this start of its group (one node with --standby N
    # keeps the worker API's keys under its group's prefix, which the leader does not read)
    reached_api: bool = False
    # when the agent saw its worker's exit (Unix time; its pidfd wakes it at the exit): the
    # earliest evidence of the failure, where a group restart's downtime starts. 0: not said
    at: float = 0.0

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> FailureReport:
        data = _load(key, raw)
        return cls(node_id=_int(key, data, "node_id"), epoch=_int(key, data, "epoch"),
                   by_signal=bool(data.get("by_signal")), node_dead=bool(data.get("node_dead")),
                   detail=str(data.get("detail", "")), node_fallback=str(data.get("node_fallback", "")),
                   reached_api=bool(data.get("reached_api")), at=_number(key, data, "at") if "at" in data else 0.0)


@dataclass(frozen=True)
class NodeInfo(_Json):
    """What an agent says about itself when it registers."""

    host: str
    addr: str
    pid: int
    node_rank_hint: int = -1  # preferred group rank (SLURM node rank), -1 for none
    time: float = 0.0

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> NodeInfo:
        data = _load(key, raw)
        return cls(host=_str(key, data, "host"), addr=_str(key, data, "addr", ""), pid=_int(key, data, "pid"),
                   node_rank_hint=_int(key, data, "node_rank_hint", -1), time=_float(key, data, "time"))


def registered_node(store: Any, ordinal: int) -> tuple[int, NodeInfo] | None:
    """The ``ordinal``-th node to register: its id (``keys.node_order``) and its NodeInfo, or None
    while it has not written both yet. A damaged NodeInfo raises ProtocolMessageError."""
    if not store.check([keys.node_order(ordinal)]):
        return None
    node_id = int(store.get(keys.node_order(ordinal)))
    key = keys.node_info(node_id)
    if not store.check([key]):
        return None
    return node_id, NodeInfo.decode(key, store.get(key))


@dataclass(frozen=True)
class LeaderInfo(_Json):
    host: str
    pid: int
    endpoint: str

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> LeaderInfo:
        data = _load(key, raw)
        return cls(host=_str(key, data, "host"), pid=_int(key, data, "pid"), endpoint=_str(key, data, "endpoint"))


@dataclass(frozen=True)
class WorkersInfo(_Json):
    """A node's processes, for ``tmrun-ctl status`` (lists of plain dicts, shown as they are)."""

    epoch: int
    group_rank: int | None
    agent_pid: int
    workers: list[dict[str, Any]] = field(default_factory=list)  # local_rank, rank, pid
    standby_workers: list[dict[str, Any]] = field(default_factory=list)  # StandbyMember.describe()

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> WorkersInfo:
        data = _load(key, raw)
        workers, standby = data.get("workers", []), data.get("standby_workers", [])
        if not isinstance(workers, list) or not isinstance(standby, list):
            raise ProtocolMessageError(f"{key}: workers and standby_workers must be lists")
        group_rank = data.get("group_rank")
        if not isinstance(group_rank, int) or isinstance(group_rank, bool):
            group_rank = None
        return cls(epoch=_int(key, data, "epoch"), group_rank=group_rank,
                   agent_pid=_int(key, data, "agent_pid"), workers=workers, standby_workers=standby)


@dataclass(frozen=True)
class ClosedNotice(_Json):
    """The job is over for everyone: ``phase`` is "succeeded" or "failed" (first writer wins)."""

    phase: str
    reason: str

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> ClosedNotice:
        data = _load(key, raw)
        return cls(phase=_str(key, data, "phase"), reason=_str(key, data, "reason", ""))


# ---- the in-place protocol across nodes ----------------------------------------------------------


@dataclass(frozen=True)
class NodeRanks(_Json):
    """The ranks the node at a group rank runs (its agent writes it; the leader rewrites it
    when a standby node takes the group rank in place)."""

    node_id: int
    ranks: list[int]

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> NodeRanks:
        data = _load(key, raw)
        return cls(node_id=_int(key, data, "node_id"), ranks=_int_list(key, data, "ranks"))


@dataclass(frozen=True)
class StandbyNode(_Json):
    """The standby workers a standby node keeps warm, by local rank."""

    ids: list[int]

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> StandbyNode:
        return cls(ids=_int_list(key, _load(key, raw), "ids"))


@dataclass(frozen=True)
class StandbyReady(_Json):
    """A standby finished its shadow steps and waits: what its sandbox saw."""

    pid: int
    shadow_steps: int
    finite: bool
    local_ops: int = 0
    network_ops: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> StandbyReady:
        data = _load(key, raw)
        return cls(pid=_int(key, data, "pid"), shadow_steps=_int(key, data, "shadow_steps"),
                   finite=bool(data.get("finite")), local_ops=_int(key, data, "local_ops"),
                   network_ops=_int(key, data, "network_ops"),
                   bytes_sent=_int(key, data, "bytes_sent"), bytes_recv=_int(key, data, "bytes_recv"))


@dataclass(frozen=True)
class RecoveryTiming(_Json):
    """One rank's instants of its recovery into generation ``gen`` (key ``timing/<gen>/<rank>``),
    in Unix time (``time.time()`` on the rank's host: the one clock of docs/events.md).

    ``noticed``: when a collective of this rank lost a peer (None: the rank learned of the
    change from the plan, or is the joiner); in a migration, when it stopped at the switch step; ``connected``: its links to the new generation are
    up (a survivor's commit, a joiner's connection); ``healed``: the state agreed and moved,
    just before it counted itself recovered; ``first_step``: the end of its first step after
    the recovery (None until then); ``redone``: a survivor that resumes at the step it was in
    (the step is recomputed), False for one whose step had committed, None for a joiner."""

    rank: int
    gen: int
    connected: float
    healed: float
    noticed: float | None = None
    first_step: float | None = None
    redone: bool | None = None

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> RecoveryTiming:
        data = _load(key, raw)

        def optional(name: str) -> float | None:
            return None if data.get(name) is None else _number(key, data, name)

        return cls(rank=_int(key, data, "rank"), gen=_int(key, data, "gen", 1),
                   connected=_number(key, data, "connected"), healed=_number(key, data, "healed"),
                   noticed=optional("noticed"), first_step=optional("first_step"),
                   redone=_optional_bool(key, data, "redone"))


def _optional_bool(key: str, data: dict[str, Any], name: str) -> bool | None:
    value = data.get(name)
    if value is not None and not isinstance(value, bool):
        raise ProtocolMessageError(f"{key}: field {name!r} must be true, false or null, got {_show(value)}")
    return value


# ---- events -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event(_Json):
    """One line of the job's event log (``seq`` is its key's number, not stored in the value).

    ``fields`` holds what the writer knew in structured form (``gen``, ``ranks``, ``nodes``,
    ``seconds``, ``phases``: see docs/events.md); stored flat next to the four base fields."""

    time: float
    kind: str
    epoch: int
    detail: str
    seq: int = -1
    fields: dict[str, Any] = field(default_factory=dict)

    BASE = ("time", "kind", "epoch", "detail")

    def encode(self) -> str:
        data = {k: v for k, v in self.fields.items() if k not in self.BASE and k != "seq"}
        data.update({"time": self.time, "kind": self.kind, "epoch": self.epoch, "detail": self.detail})
        return json.dumps(data)

    @classmethod
    def decode(cls, key: str, raw: bytes | str, seq: int = -1) -> Event:
        data = _load(key, raw)
        extra = {k: v for k, v in data.items() if k not in cls.BASE and k != "seq"}
        return cls(time=_float(key, data, "time"), kind=_str(key, data, "kind"), epoch=_int(key, data, "epoch"),
                   detail=str(data.get("detail", "")), seq=seq, fields=extra)


# ---- progress -----------------------------------------------------------------------------------------


def _number(key: str, data: dict[str, Any], name: str) -> float:
    value = data.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value or value < 0:
        raise ProtocolMessageError(f"{key}: field {name!r} must be a number >= 0, got {_show(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer beyond a double's range
        raise ProtocolMessageError(f"{key}: field {name!r} is out of range") from None


def _step(key: str, data: dict[str, Any], name: str) -> int:
    """An optional integer >= -1 (-1 when absent: written by an older tmrun)."""
    value = data.get(name, -1)
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ProtocolMessageError(f"{key}: field {name!r} must be an integer >= -1, got {_show(value)}")
    return value


@dataclass(frozen=True)
class RankProgress(_Json):
    """One rank's last completed step, as its current process wrote it (see protocol.progress).

    ``step`` is -1 before the first completed step; ``time`` is when it completed (Unix time);
    ``step_seconds`` its wall time; ``busy_seconds`` its wall time outside collectives (what a
    straggler has more of than its peers); ``role`` the worker's role (active, recovering, ...)."""

    rank: int
    step: int
    step_seconds: float
    busy_seconds: float
    time: float
    pid: int
    role: str = ""
    resumed: int = -1  # the step the process's loop started at (its checkpoint's step + 1); -1: unknown

    @classmethod
    def from_dict(cls, key: str, data: Any) -> RankProgress:
        if not isinstance(data, dict):
            raise ProtocolMessageError(f"{key}: each rank's progress must be a JSON object")
        step = data.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < -1:
            raise ProtocolMessageError(f"{key}: field 'step' must be an integer >= -1, got {_show(step)}")
        return cls(rank=_int(key, data, "rank"), step=step, step_seconds=_number(key, data, "step_seconds"),
                   busy_seconds=_number(key, data, "busy_seconds"), time=_number(key, data, "time"),
                   pid=_int(key, data, "pid"), role=_str(key, data, "role", ""),
                   resumed=_step(key, data, "resumed"))


@dataclass(frozen=True)
class NodeProgress:
    """A node's ranks' progress (key ``progress/<node>`` under the job prefix), written by the
    node's agent at most about once a second; read by tmrun-ctl and the live console.
    ``time`` is when the agent wrote it (Unix time)."""

    node: int
    time: float
    ranks: tuple[RankProgress, ...] = ()
    epoch: int = -1  # the rendezvous epoch of the workers (-1: not said)

    def encode(self) -> str:
        return json.dumps({"node": self.node, "time": self.time, "ranks": [asdict(r) for r in self.ranks],
                           "epoch": self.epoch})

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> NodeProgress:
        data = _load(key, raw)
        ranks = data.get("ranks")
        if not isinstance(ranks, list):
            raise ProtocolMessageError(f"{key}: field 'ranks' must be a list")
        return cls(node=_int(key, data, "node"), time=_number(key, data, "time"),
                   ranks=tuple(RankProgress.from_dict(key, r) for r in ranks), epoch=_step(key, data, "epoch"))
