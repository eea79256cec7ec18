"""What a rank publishes of a state its joiner must continue from, by the step that state starts:
one mechanism for every such state (its random generators: :mod:`tmrun.worker.rng_records`; the
script's per-rank objects, ``tm.track_per_rank``: :mod:`tmrun.worker.per_rank_records`).

A joiner resumes at the step the group resumes at, and must start it from the state the lost
rank would have started it with. Each rank publishes:

* at a step's start (a *boundary record*), its state when it differs from the one published;
* at the commit (just before the commit vote: the step's work on the state is done), the next
  step's state as it stands (a *provisional record*); a rank lost in or after its optimizer step
  leaves it, and the group then resumes at the next step.

A provisional record is right only if the script leaves the state alone after ``opt.step()``.
Each boundary compares the state with the one the commit saw: equal *verifies* the script, a
difference means it changes the state after the optimizer step (one line, once), and from then on
the rank records at boundaries only. A record not rewritten because the state did not change
stands for later steps only while the script is verified. A joiner whose rank left no record it
can trust for the resume step makes every member fall back to the group restart in one line
(:func:`check`): a wrong state would be a silent wrong value.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from tmrun.worker.context import log
from tmrun.worker.transfer import NoReplicaError


@dataclass(frozen=True)
class Kind:
    """One kind of state: where a rank publishes it, how two of it compare, and what the lines
    about it say."""

    key: Callable[[int], str]  # the store key of a rank's record
    same: Callable[[Any, Any], bool]
    # the line, once, when a boundary finds the state changed after opt.step(): (rank, the
    # commit's state, the boundary's) -> line
    changed_after_commit: Callable[[int, Any, Any], str]
    # a joiner's refusal: (rank, the steps recorded, the resume step, the record) -> reason
    refusal: Callable[[int, list[int], int, "Record"], str]
    required: bool  # a rank that published no record at all leaves its joiner nothing (else: nothing to hand)


@dataclass
class Record:
    """What one rank published: its states by the step they start (at most the current step's
    and the next one's), which of them were captured at a step's start, and what is known of
    the script (a joiner inherits it)."""

    states: dict[int, Any] = field(default_factory=dict)
    boundary: set[int] = field(default_factory=set)
    verified: bool = False  # a boundary showed the commit's state is the next step's
    after_commit: bool = False  # the script changes the state after opt.step()

    @property
    def trusted(self) -> bool:
        """A record made before a step's end stands for the steps after it."""
        return self.verified and not self.after_commit

    def usable_for(self, step: int) -> Any | None:
        """The state a joiner resuming at ``step`` continues from, or None if none is right."""
        if step in self.states and (step in self.boundary or self.trusted):
            return self.states[step]
        earlier = [s for s in self.states if s < step]
        if earlier and self.trusted:  # not changed since (only changes are written)
            return self.states[max(earlier)]
        return None


class Publisher:
    """One rank's records of one kind (see the module docstring), of the state ``capture`` takes.
    ``store`` and ``rank`` are read at each write: a promoted standby publishes as its new rank."""

    def __init__(self, kind: Kind, capture: Callable[[], Any], store: Callable[[], Any],
                 rank: Callable[[], int]) -> None:
        self._kind = kind
        self._capture = capture
        self._store = store
        self._rank = rank
        self._record = Record()
        self._at_commit: tuple[int, Any] | None = None  # (next step, its state as the commit saw it)

    def inherit(self, record: Record | None) -> None:
        """A joiner: what its rank's record knew of the script (it runs the same code)."""
        if record is not None:
            self._record = Record(verified=record.verified, after_commit=record.after_commit)
        self._at_commit = None

    def at_start(self, step: int) -> None:
        """A step starts (or starts again: a redo drops its attempt's provisional record): its
        boundary record, when needed."""
        kind = self._kind
        state = self._capture()
        record = self._record
        trusted_before = record.trusted
        if self._at_commit is not None and self._at_commit[0] == step:
            if kind.same(state, self._at_commit[1]):
                record.verified = True
            elif not record.after_commit:
                record.after_commit = True
                log(kind.changed_after_commit(self._rank(), self._at_commit[1], state))
        self._at_commit = None
        earlier = [s for s in record.states if s <= step]
        last = max(earlier) if earlier else None
        if last is not None and kind.same(state, record.states[last]) and (
                last == step and step in record.boundary or record.trusted):
            kept = {last: record.states[last]}  # still right for this step
        else:
            kept = {step: state}
            record.boundary = {step}
        record.boundary &= set(kept)
        changed = (record.trusted != trusted_before or kept.keys() != record.states.keys()
                   or any(kept[s] is not record.states[s] for s in kept))  # a record replaced under its step
        record.states = kept
        if changed:
            self._publish()

    def at_commit(self, step: int) -> None:
        """``step`` commits (its work on the state is done): the next step's state, provisional.
        Called before the commit vote, so a rank lost before it was written has not voted and no
        rank commits the step; idempotent within a step."""
        if self._at_commit is not None and self._at_commit[0] == step + 1:
            return
        kind = self._kind
        state = self._capture()
        self._at_commit = (step + 1, state)
        record = self._record
        if record.after_commit:
            return
        latest = record.states[max(record.states)] if record.states else None
        if record.trusted and latest is not None and kind.same(state, latest):
            return  # unchanged: the record stands for the next step too
        earlier = [s for s in record.states if s <= step]
        record.states = {**({max(earlier): record.states[max(earlier)]} if earlier else {}), step + 1: state}
        self._publish()

    def _publish(self) -> None:
        self._store().set(self._kind.key(self._rank()), pickle.dumps(self._record))


class ReadOnce:
    """A view of the job's store for one healing: each record is fetched once (checked on every
    member, then adopted by the joiner: two round trips and unpicklings each otherwise). Records
    do not change while their members heal: a lost rank publishes nothing any more and the
    others publish again only once they resume."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._values: dict[str, bytes | None] = {}

    def prefetch(self, kinds: list[Kind], ranks: Iterable[int]) -> None:
        """Fetch the records of ``kinds`` that ``ranks`` published, now (a survivor, before it
        waits for its joiners: its check after the agreement then costs no round trip)."""
        for rank in ranks:
            for kind in kinds:
                self._value(kind.key(rank))

    def _value(self, key: str) -> bytes | None:
        if key not in self._values:
            self._values[key] = self._store.get(key) if self._store.check([key]) else None
        return self._values[key]

    def check(self, keys: list[str]) -> bool:
        return all(self._value(key) is not None for key in keys)

    def get(self, key: str) -> bytes:
        value = self._value(key)
        if value is None:
            raise KeyError(key)
        return value


def read(store: Any, kind: Kind, rank: int) -> Record | None:
    """The record of ``kind`` that ``rank`` published, or None if it published none."""
    key = kind.key(rank)
    if not store.check([key]):
        return None
    record = pickle.loads(store.get(key))
    return record if isinstance(record, Record) else None


def check(store: Any, kind: Kind, joiners: list[int], resume: int) -> None:
    """Every member alike (they read the same records): each joiner's rank left a state of
    ``kind`` right for the step the group resumes at, or the job falls back to its group restart."""
    for rank in joiners:
        _usable(store, kind, rank, resume)


def adopt(store: Any, kind: Kind, rank: int, resume: int) -> tuple[Any, Record] | None:
    """The state of ``kind`` that ``rank`` left for ``resume`` (checked by :func:`check` on every
    member first) and its record (for :meth:`Publisher.inherit`); None where it published none
    and none is required."""
    return _usable(store, kind, rank, resume)


def _usable(store: Any, kind: Kind, rank: int, resume: int) -> tuple[Any, Record] | None:
    record = read(store, kind, rank)
    if record is None:
        if not kind.required:
            return None
        raise NoReplicaError(kind.refusal(rank, [], resume, Record()))
    state = record.usable_for(resume)
    if state is None:
        raise NoReplicaError(kind.refusal(rank, sorted(record.states), resume, record))
    return state, record
