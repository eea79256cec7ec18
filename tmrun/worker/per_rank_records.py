"""The per-rank state a joiner continues from (``tm.track_per_rank``: a data loader's position, a
rank's own counters): what each in-place rank publishes of it, by the step it starts, and what a
joiner loads; the records are :mod:`tmrun.worker.step_records`' (boundary records, and at the
commit the next step's state, provisional).

A provisional record made before any boundary checked the script would hand a joiner the state
before the script's later change (a silent wrong data position): it is used once a boundary
showed the script leaves its per-rank state alone after ``opt.step()``. A joiner whose rank left
no record usable for the step the group resumes at (a rank lost between its optimizer step and
the end of that step, in a script that moves its loader after the optimizer step) makes every
member fall back to the group restart in one line.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

from tmrun.protocol import keys
from tmrun.worker import step_records
from tmrun.worker.step_records import Record

__all__ = ["PER_RANK_STATE", "Publisher", "adopt", "check"]


def _changed_after_commit(rank: int, at_commit: Any, at_boundary: Any) -> str:
    return (f"rank {rank}: the script changes its per-rank state after opt.step(); its records are now made at step "
            "boundaries only")


def _refusal(rank: int, steps: list[int], resume: int, record: Record) -> str:
    unchecked = "" if record.trusted else (" (a record made at a commit is used once a step boundary showed the "
                                            "script leaves its per-rank state alone after opt.step())")
    return (f"rank {rank}'s per-rank state (tm.track_per_rank) is recorded for step(s) {steps or 'none'}, and its "
            f"joiner resumes at step {resume}{unchecked}: the state it needs was lost with the rank; falling back to "
            "the group restart")


# every rank of a script that tracks per-rank objects publishes them: a rank that left none left
# its joiner nothing to continue from
PER_RANK_STATE = step_records.Kind(key=keys.rank_state, same=operator.eq, changed_after_commit=_changed_after_commit,
                                   refusal=_refusal, required=True)


class Publisher(step_records.Publisher):
    """One rank's per-rank records, of the state ``blob`` takes
    (:meth:`tmrun.worker.tracked.Tracked.per_rank_blob`)."""

    def __init__(self, blob: Callable[[], bytes], store: Callable[[], Any], rank: Callable[[], int]) -> None:
        super().__init__(PER_RANK_STATE, blob, store, rank)


def check(store: Any, joiners: list[int], resume: int) -> None:
    """Every member alike: each joiner's rank left its per-rank state for ``resume``, or the job
    falls back to its group restart."""
    step_records.check(store, PER_RANK_STATE, joiners, resume)


def adopt(store: Any, rank: int, resume: int, apply: Callable[[bytes], None]) -> Record:
    """A joiner loads (``apply``) the per-rank state ``rank`` left for ``resume`` (checked by
    :func:`check` on every member first); returns the record, for :meth:`Publisher.inherit`."""
    adopted = step_records.adopt(store, PER_RANK_STATE, rank, resume)
    assert adopted is not None  # required: adopt raises where there is none
    blob, record = adopted
    apply(blob)
    return record
