"""The random state a joiner continues from: what each in-place rank publishes of its RNG states
(torch, CUDA, Python's ``random``, NumPy: :mod:`tmrun.worker.rng`), and what a joiner may take;
the records are :mod:`tmrun.worker.step_records`' (boundary records, and at the commit the next
step's state, provisional).

A joiner resumes at the step the group resumes at, and must draw the random numbers the lost
rank would have drawn there (its data sampling, its dropout masks). Before 2026-11-29 only
boundary records were made: a rank lost in its optimizer step handed its joiner the state of the
step *before*, which then drew that step's batch again (nanoGPT's random batches: exit 0, one
in-place recovery, a final checkpoint that differed from torchrun's). A script that draws random
numbers after ``opt.step()`` is said so in one line (naming the generators), and a rank of it
lost after its optimizer step makes the job fall back to its group restart.
"""

from __future__ import annotations

from typing import Any, Callable

from tmrun.protocol import keys
from tmrun.worker import rng, step_records
from tmrun.worker.step_records import Record

__all__ = ["RANDOM_STATE", "Publisher", "Record", "adopt", "check", "read"]


def _changed_after_commit(rank: int, at_commit: Any, at_boundary: Any) -> str:
    which = ", ".join(rng.differing(at_commit, at_boundary))
    return (f"rank {rank}: the script draws random numbers after opt.step() ({which}); its random state is now "
            "recorded at step boundaries only (a rank lost after its optimizer step then makes the job fall back "
            "to its group restart)")


def _refusal(rank: int, steps: list[int], resume: int, record: Record) -> str:
    why = ("the script draws random numbers after opt.step()" if record.after_commit else
           "the script was not yet seen to leave it alone after opt.step()")
    return (f"rank {rank}'s random state is recorded for step(s) {steps or 'none'} and its joiner resumes at step "
            f"{resume} ({why}): the state it needs was lost with the rank; falling back to the group restart")


# a rank that published none (a standby's, a job not in place) leaves nothing to hand over
RANDOM_STATE = step_records.Kind(key=keys.rng, same=rng.same, changed_after_commit=_changed_after_commit,
                                 refusal=_refusal, required=False)


class Publisher(step_records.Publisher):
    """One rank's random-state records."""

    def __init__(self, store: Callable[[], Any], rank: Callable[[], int]) -> None:
        super().__init__(RANDOM_STATE, rng.capture, store, rank)


def read(store: Any, rank: int) -> Record | None:
    """The record ``rank`` published, or None if it published none."""
    return step_records.read(store, RANDOM_STATE, rank)


def check(store: Any, joiners: list[int], resume: int) -> None:
    """Every member alike: each joiner's rank left a random state right for ``resume``, or the
    job falls back to its group restart."""
    step_records.check(store, RANDOM_STATE, joiners, resume)


def adopt(store: Any, rank: int, resume: int) -> Record | None:
    """A joiner continues from the random state ``rank`` left for ``resume`` (checked by
    :func:`check` on every member first); returns the record, for :meth:`Publisher.inherit`."""
    adopted = step_records.adopt(store, RANDOM_STATE, rank, resume)
    if adopted is None:
        return None
    states, record = adopted
    rng.restore(states)
    return record
