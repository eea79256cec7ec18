"""A pipeline's start-up where a joiner enters it: run by the joiner alone, from the lost rank's
recording, while the survivors' pipelines go on.

torch's schedules run a one-time start-up at their first step (``_initialize_stage(s)``: the
neighbours' P2P warm-up vote and the stages' metadata inference, whose forward also issues a
stage's TP or FSDP collectives). A joiner's fresh schedule runs it at its first step; its peers'
schedules do not, unless they are told to start again (tmrun.worker.pipeline) — and then, where
the stages hold DTensors, every pipeline of the job must.

So each rank records the small messages it receives during its first training start-up of each
tracked schedule and publishes them once (``keys.pipeline_startup``; a few kilobytes: votes and
metadata, not activations). A joiner then runs its start-up with every group of its process
served locally (nothing sent, nothing waited for) and its receives replayed from the lost rank's
recording: the same messages the lost rank received, so the same metadata. No survivor runs
the start-up again.

The survivors and the joiner agree, per generation and rank, through one compare-and-set key
(``keys.pipeline_startup_way``): *local* when the lost rank's recordings are all in the store,
else *network* (it died before its first start-up ended): the survivors of its pipeline then run
the start-up again with the joiner, as before, and the joiner's start-up is recorded for the next
time. Whoever asks first decides; the others read the same answer.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable

from tmrun.comm import backend as tmrun_backend
from tmrun.protocol import keys
from tmrun.worker import pipeline, startup_replay

LOCAL, NETWORK = b"local", b"network"

# (store, rank) of an active rank whose start-ups are recorded and served; None for a standby
# (its rehearsal serves every receive locally already: tmrun.worker.startup_replay)
Peer = Callable[[], "tuple[Any, int] | None"]


def recorded(store: Any, rank: int, schedules: int) -> bool:
    return all(store.check([keys.pipeline_startup(rank, index)]) for index in range(schedules))


def local_way(store: Any, gen: int, rank: int, schedules: int) -> bool:
    """Whether the joiner of ``rank`` in ``gen`` runs its start-up alone (decided once)."""
    way = LOCAL if recorded(store, rank, schedules) else NETWORK
    return store.compare_set(keys.pipeline_startup_way(gen, rank), "", way) == LOCAL


class Startups:
    """The start-ups of one process's tracked schedules: recorded, or served from a recording."""

    def __init__(self, peer: Peer, log: Callable[[str], None]) -> None:
        self._peer = peer
        self._log = log
        self._schedules: list[Any] = []
        self._recorded: set[int] = set()  # schedule indices whose first training start-up was recorded
        self._join: tuple[int, int] | None = None  # (generation, rank) of this joiner, until its start-up
        self.served_locally = 0  # start-ups this process ran alone from a recording

    def wrap(self, schedule: Any) -> None:
        """``schedule`` was tracked: its start-up goes through :meth:`_run` from now on."""
        if any(schedule is known for known in self._schedules):
            return
        index = len(self._schedules)
        self._schedules.append(schedule)
        for name in pipeline.INIT_METHODS:
            original = getattr(schedule, name, None)
            if callable(original):
                def init(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                    return self._run(index, schedule, _original, args, kwargs)

                setattr(schedule, name, init)

    def expect_join(self, gen: int, rank: int) -> None:
        """This process joined as ``rank`` in ``gen``: its next start-ups may be served locally."""
        self._join = (gen, rank)

    def _run(self, index: int, schedule: Any, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        peer = self._peer()
        training = bool(getattr(schedule, "_has_backward", False))
        if peer is None or not training or pipeline.started(schedule):
            return original(*args, **kwargs)
        store, rank = peer
        if self._join is not None and local_way(store, self._join[0], self._join[1], len(self._schedules)):
            raw = store.get(keys.pipeline_startup(self._join[1], index))
            return self._run_locally(rank, index, pickle.loads(raw), original, args, kwargs)
        if index in self._recorded:
            return original(*args, **kwargs)
        recorder = startup_replay.Recorder()
        recorder.start()
        try:
            result = original(*args, **kwargs)
        finally:
            messages = recorder.stop()
        self._done(index)
        if recorder.incomplete:  # a joiner of this rank cannot run the start-up alone: its pipeline starts again
            self._log(f"rank {rank}: the pipeline start-up of schedule {index} could not be recorded whole; a joiner "
                      "of this rank will run it with its pipeline's survivors")
        elif str(rank) != os.environ.get("TMRUN_TEST_PIPELINE_UNRECORDED"):  # tests only: a rank lost in its start-up
            store.compare_set(keys.pipeline_startup(rank, index), "", pickle.dumps(messages))
        return result

    def _done(self, index: int) -> None:
        self._recorded.add(index)
        if self._recorded >= set(range(len(self._schedules))):
            self._join = None  # every schedule of this joiner started

    def _run_locally(self, rank: int, index: int, messages: startup_replay.Recording, original: Callable[..., Any],
                     args: tuple, kwargs: dict) -> Any:
        groups = tmrun_backend.created_groups()
        was_local = [pg.local for pg in groups]
        for pg in groups:
            pg.set_local(True)
        replayer = startup_replay.replay(messages)
        try:
            result = original(*args, **kwargs)
        finally:
            startup_replay.replay(None)
            for pg, local in zip(groups, was_local):
                pg.set_local(local)
        self._done(index)  # the lost rank's recording is this rank's
        self.served_locally += 1
        replayed = replayer.replayed if replayer is not None else 0
        self._log(f"rank {rank}: the pipeline start-up of schedule {index} ran on this joiner alone ({replayed} of "
                  f"the {len(messages)} messages the lost rank received in it replayed, nothing sent); the "
                  "survivors' pipelines go on")
        return result
