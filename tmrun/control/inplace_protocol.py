"""The in-place replacement protocol between the agent's controller and its workers.

Everything goes through the agent's store (it outlives every worker), under a prefix
per worker-group start (``tmrun/<run>/ip/<restart>/``, given to workers as ``TMRUN_IP_PREFIX``). The controller is the only writer of generations and plans; workers write
only reports about themselves or about a peer they lost. Every message carries the generation
(the communicator epoch) it is about, and a reader rejects a message it cannot parse with a
one-line :class:`ProtocolMessageError` instead of a traceback deep in training.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

API = "api"  # set by the first worker whose script called tmrun.init() (value: "1")
MEMBERS = "members"  # counter: active ranks that initialised the runtime
GEN = "gen"  # current generation (decimal), written by the controller
REPORT_SEQ = "report_seq"  # counter of worker reports
ABORT = "abort"  # JSON AbortNotice: in-place replacement is over for this job generation


# Planned migrations are requested at the job level (tmrun/<run>/), so that tmrun-ctl needs no
# knowledge of the worker group's prefix.
MIGRATE_SEQ = "migrate_seq"


def migrate_request(seq: int) -> str:
    return f"migrate/{seq}"


def switch(gen: int) -> str:
    """The step at whose end a planned generation takes over (first proposer wins)."""
    return f"switch/{gen}"


def handoff_prefix(gen: int, rank: int) -> str:
    """Where the leaver and the joiner of ``rank`` meet in a planned generation (a node's
    migration moves several ranks at once: one pair each)."""
    return f"handoff/{gen}/{rank}"


def plan(gen: int) -> str:
    return f"plan/{gen}"


def standby_ready(standby_id: int) -> str:
    return f"standby/{standby_id}/ready"


def standby_assign(standby_id: int) -> str:
    return f"standby/{standby_id}/assign"


def report(seq: int) -> str:
    return f"report/{seq}"


def rng(rank: int) -> str:
    return f"rng/{rank}"


def done(rank: int) -> str:
    """Set by a rank whose ``steps()`` finished (value: its last committed step)."""
    return f"done/{rank}"


JOB_ID = "job_id"  # the communicator's job id (rank 0 writes it; joiners read it)


# Several nodes (the prefix is per epoch, ``tmrun/<run>/ip/e<epoch>/``): every active agent
# says which ranks its node runs, every standby agent which standby workers it keeps warm.
def node_ranks(group_rank: int) -> str:
    """JSON {"node_id": N, "ranks": [...]} of the node at ``group_rank`` (its agent writes it)."""
    return f"node/{group_rank}/ranks"


def standby_node(node_id: int) -> str:
    """JSON {"ids": [...]}: the standby workers of standby node ``node_id``, by local rank."""
    return f"standby_node/{node_id}"


def read_gen(store: Any) -> int:
    """The current generation (0 before the controller published any)."""
    return int(store.get(GEN).decode()) if store.check([GEN]) else 0


def node_prefix(run_id: str, epoch: int) -> str:
    """The in-place protocol's prefix of a multi-node job's ``epoch``."""
    return f"tmrun/{run_id}/ip/e{epoch}/"


def recovered(gen: int) -> str:
    """Counter: members that finished recovery into ``gen``."""
    return f"recovered/{gen}"


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
    if not isinstance(data, dict):
        raise ProtocolMessageError(f"{key}: expected a JSON object")
    return data


def _int(key: str, data: dict[str, Any], name: str, minimum: int = 0) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ProtocolMessageError(f"{key}: field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class ReplacementPlan:
    """Generation ``gen`` replaces each rank in ``replaced`` with the standby it maps to."""

    gen: int
    world_size: int
    replaced: dict[int, int]  # rank -> standby id
    reason: str = ""
    planned: bool = False  # a migration (the leaver donates, nothing is recomputed)
    created: float = 0.0

    def encode(self) -> str:
        data = asdict(self)
        data["replaced"] = {str(rank): sid for rank, sid in self.replaced.items()}
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
                raise ProtocolMessageError(f"{key}: rank {rank_text!r} is not an integer") from None
            if not 0 <= rank < world or not isinstance(sid, int) or sid < 0:
                raise ProtocolMessageError(f"{key}: bad replacement {rank_text!r} -> {sid!r}")
            replaced[rank] = sid
        return cls(
            gen=gen,
            world_size=world,
            replaced=replaced,
            reason=str(data.get("reason", "")),
            planned=bool(data.get("planned", False)),
            created=float(data.get("created", 0.0)),
        )


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

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, key: str, raw: bytes | str) -> MigrateRequest:
        data = _load(key, raw)
        node = data.get("node", -1)
        if node == -1:
            return cls(rank=_int(key, data, "rank"), reason=str(data.get("reason", "operator request")))
        return cls(node=_int(key, data, "node"), reason=str(data.get("reason", "operator request")))

    def describe(self) -> str:
        return f"node at group rank {self.node}" if self.node >= 0 else f"rank {self.rank}"


def request_migration(job_store: Any, rank: int = -1, reason: str = "operator request", node: int = -1) -> int:
    """Ask the controller of the job behind ``job_store`` (prefix ``tmrun/<run>/``) to migrate
    ``rank`` (or the node at group rank ``node``) to a warm standby. Returns the request's number."""
    seq = job_store.add(MIGRATE_SEQ, 1) - 1
    job_store.set(migrate_request(seq), MigrateRequest(rank, reason, node).encode())
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
        return cls(reason=str(data.get("reason", "unknown")), gen=int(data.get("gen", 0) or 0))
