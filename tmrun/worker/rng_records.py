"""The random state a joiner continues from: what each in-place rank publishes of its RNG states
(torch, CUDA, Python's ``random``, NumPy: :mod:`tmrun.worker.rng`), and what a joiner may take.

A joiner resumes at the step the group resumes at, and must draw the random numbers the lost
rank would have drawn there (its data sampling, its dropout masks). Each rank publishes the state
it starts a step with, and, when its step commits, the state the *next* step will start with:

* at a step's start (a *boundary record*), when the state differs from the one published;
* at the commit (just before the commit vote: the step's draws are done), the next step's state
  as it stands (a *provisional record*); a rank lost in or after its optimizer step leaves it,
  and the group then resumes at the next step. Before 2026-11-29 only boundary records were
  made: a rank lost in its optimizer step handed its joiner the state of the step *before*, which
  then drew that step's batch again (nanoGPT's random batches: exit 0, one in-place recovery,
  a final checkpoint that differed from torchrun's).

A provisional record is right only if the script draws nothing after ``opt.step()``. Each
boundary compares the state with the one the commit saw: equal *verifies* the script, a
difference means it draws after the optimizer step (one line, once), and from then on the rank
records at boundaries only, every step. Records skipped because the state did not change are
valid for later steps only while the script is verified. A joiner whose rank left no record it
can trust for the resume step makes every member fall back to the group restart in one line
(:func:`check`): a wrong random state would be a silent wrong value.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

from tmrun.protocol import keys
from tmrun.worker import rng
from tmrun.worker.context import log
from tmrun.worker.transfer import NoReplicaError

States = dict[str, Any]


@dataclass
class Record:
    """What one rank published: its states by the step they start (at most the current step's
    and the next one's), which of them were captured at a step's start, and what is known of
    the script (a joiner inherits it)."""

    states: dict[int, States] = field(default_factory=dict)
    boundary: set[int] = field(default_factory=set)
    verified: bool = False  # a boundary showed the commit's state is the next step's
    after_commit: bool = False  # the script draws random numbers after opt.step()

    @property
    def trusted(self) -> bool:
        """A record made before a step's end stands for the steps after it."""
        return self.verified and not self.after_commit

    def usable_for(self, step: int) -> States | None:
        """The states a joiner resuming at ``step`` continues from, or None if none is right."""
        if step in self.states and (step in self.boundary or self.trusted):
            return self.states[step]
        earlier = [s for s in self.states if s < step]
        if earlier and self.trusted:  # nothing drawn since (only changes are written)
            return self.states[max(earlier)]
        return None


class Publisher:
    """One rank's records (see the module docstring). ``store`` and ``rank`` are read at each
    write: a promoted standby publishes as its new rank."""

    def __init__(self, store: Callable[[], Any], rank: Callable[[], int]) -> None:
        self._store = store
        self._rank = rank
        self._record = Record()
        self._at_commit: tuple[int, States] | None = None  # (next step, its state as the commit saw it)

    def inherit(self, record: Record | None) -> None:
        """A joiner: what its rank's record knew of the script (it runs the same code)."""
        if record is not None:
            self._record = Record(verified=record.verified, after_commit=record.after_commit)
        self._at_commit = None

    def at_start(self, step: int) -> None:
        """A step starts (or starts again): its boundary record, when needed."""
        states = rng.capture()
        record = self._record
        trusted_before = record.trusted
        if self._at_commit is not None and self._at_commit[0] == step:
            if rng.same(states, self._at_commit[1]):
                record.verified = True
            elif not record.after_commit:
                record.after_commit = True
                which = ", ".join(rng.differing(self._at_commit[1], states))
                log(f"rank {self._rank()}: the script draws random numbers after opt.step() ({which}); its random "
                    "state is now recorded at step boundaries only (a rank lost after its optimizer step then makes "
                    "the job fall back to its group restart)")
        self._at_commit = None
        earlier = [s for s in record.states if s <= step]  # a redone step drops its attempt's provisional record
        last = max(earlier) if earlier else None
        if last is not None and rng.same(states, record.states[last]) and (
                last == step and step in record.boundary or record.trusted):
            kept = {last: record.states[last]}  # still right for this step
        else:
            kept = {step: states}
            record.boundary = {step}
        record.boundary &= set(kept)
        changed = (record.trusted != trusted_before or kept.keys() != record.states.keys()
                   or any(kept[s] is not record.states[s] for s in kept))  # a record replaced under its step
        record.states = kept
        if changed:
            self._publish()

    def at_commit(self, step: int) -> None:
        """``step`` commits (its draws are done): the next step's state, provisional. Called
        before the commit vote, so a rank lost before it was written has not voted and no rank
        commits the step; idempotent within a step."""
        if self._at_commit is not None and self._at_commit[0] == step + 1:
            return
        states = rng.capture()
        self._at_commit = (step + 1, states)
        record = self._record
        if record.after_commit:
            return
        latest = record.states[max(record.states)] if record.states else None
        if record.trusted and latest is not None and rng.same(states, latest):
            return  # nothing drawn: the record stands for the next step too
        earlier = [s for s in record.states if s <= step]
        record.states = {**({max(earlier): record.states[max(earlier)]} if earlier else {}), step + 1: states}
        self._publish()

    def _publish(self) -> None:
        self._store().set(keys.rng(self._rank()), pickle.dumps(self._record))


def read(store: Any, rank: int) -> Record | None:
    """The record ``rank`` published, or None if it published none."""
    key = keys.rng(rank)
    if not store.check([key]):
        return None
    record = pickle.loads(store.get(key))
    return record if isinstance(record, Record) else None


def check(store: Any, joiners: list[int], resume: int) -> None:
    """Every member alike (they read the same records): each joiner's rank left a random state
    right for the step the group resumes at, or the job falls back to its group restart."""
    for rank in joiners:
        record = read(store, rank)
        if record is not None and record.usable_for(resume) is None:
            why = ("the script draws random numbers after opt.step()" if record.after_commit else
                   "the script was not yet seen to leave it alone after opt.step()")
            raise NoReplicaError(
                f"rank {rank}'s random state is recorded for step(s) {sorted(record.states) or 'none'} and its joiner "
                f"resumes at step {resume} ({why}): the state it needs was lost with the rank; falling back to the "
                "group restart")


def adopt(store: Any, rank: int, resume: int) -> Record | None:
    """A joiner continues from the random state ``rank`` left for ``resume`` (checked by
    :func:`check` on every member first); returns the record, for :meth:`Publisher.inherit`."""
    record = read(store, rank)
    if record is None:
        return None
    states = record.usable_for(resume)
    if states is None:  # not reached after check(); never continue from a wrong state
        raise NoReplicaError(f"rank {rank}'s random state for step {resume} was lost with the rank")
    rng.restore(states)
    return record
