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
time. Whoever asks first decides; the others read the same answer. The survivors decide it in their
recovery (before its last barrier, so before the joiner asks): *local* needs the lost rank's
recordings and every survivor's schedules started for training. A survivor whose schedules were
last started for an evaluation (a script that evaluates at the end of a step; torch 2.14 runs the
start-up again at each switch between ``eval()`` and ``step()``) would run the next training
step's start-up over the network, which the joiner's local start-up does not answer: the
network way then.

A joiner whose first use of a schedule is ``eval()`` (a script that evaluates at the start of a
step, nanoGPT's shape) runs the lost rank's training start-up alone first, then the evaluation's
switch with its peers, as they do.

A start-up in a doomed step (a peer lost: its receives are served locally, with zeros) would
read its neighbours' metadata from zeros (``EOFError``, the survivor dead). Each rank keeps the
messages it received in the last start-up of each kind (training or evaluation, first or a
switch) and a receive served locally in a start-up of that kind gets what the same receive got
last time (a switch not seen yet: the first start-up's of the same mode; a mode not seen yet, the
job's first evaluation in a doomed step: the other mode's, which describe the same stages'
tensors): the metadata the step would have computed, never used beyond the doomed step. A
standby's rehearsal does the same with the start-ups it replayed from rank 0's first step (a
later step's switch was not in it). A rank whose *first* start-up is in a doomed step (a peer
lost in the job's first step, before this rank's start-up ended: nothing of its own to serve
from) takes a replica's: each rank's whole recording is also published under its shard key
(equal on the ranks that hold the same stages), and such a receive waits up to
:data:`REPLICA_WAIT` seconds for a replica's, replayed in order whatever its group's name (the
replica's pipeline group is another group of the same shape).
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any, Callable

import torch
import torch.utils._pytree

from tmrun.comm import backend as tmrun_backend
from tmrun.protocol import keys
from tmrun.worker import pipeline, startup_replay

LOCAL, NETWORK = b"local", b"network"
REPLICA_WAIT = 3.0  # s a first start-up in a doomed step waits for a replica's recording of the same stages

# (store, rank) of an active rank whose start-ups are recorded and served; None for a standby
# (its rehearsal serves every receive locally already: tmrun.worker.startup_replay)
Peer = Callable[[], "tuple[Any, int] | None"]


def recorded(store: Any, rank: int, schedules: int) -> bool:
    return all(store.check([keys.pipeline_startup(rank, index)]) for index in range(schedules))


def local_way(store: Any, gen: int, rank: int, schedules: int, trained: bool = True) -> bool:
    """Whether the joiner of ``rank`` in ``gen`` runs its start-up alone (decided once).
    ``trained``: the asker's schedules are started for training (a survivor's were last started
    for an evaluation: the network way)."""
    way = LOCAL if trained and recorded(store, rank, schedules) else NETWORK
    return store.compare_set(keys.pipeline_startup_way(gen, rank), "", way) == LOCAL


Kind = tuple[bool, bool]  # a start-up's (training, first): first when the P2P warm-up runs in it
# a rank's start-ups of a schedule until its first training one: (training, messages; None where
# they could not be recorded whole)
History = list[tuple[bool, "startup_replay.Recording | None"]]


class Startups:
    """The start-ups of one process's tracked schedules: recorded, or served from a recording."""

    def __init__(self, peer: Peer, log: Callable[[str], None], shard: Callable[[], int] = lambda: 0) -> None:
        self._peer = peer
        self._log = log
        self._shard = shard  # this rank's shard key (tmrun.worker.tracked): equal on its replicas
        self._schedules: list[Any] = []
        self._recorded: set[int] = set()  # schedule indices whose first training start-up was recorded
        self._join: tuple[int, int] | None = None  # (generation, rank) of this joiner, until its start-up
        self.served_locally = 0  # start-ups this process ran alone from a recording
        # (schedule index, kind) -> the messages this rank received in its last start-up of that kind
        self._last: dict[tuple[int, Kind], startup_replay.Recording] = {}
        self._history: dict[int, History] = {}  # schedule index -> its start-ups until its first training one

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
        if not pipeline.needs_startup(schedule):
            return original(*args, **kwargs)
        peer = self._peer()
        training = bool(getattr(schedule, "_has_backward", False))
        if peer is not None and self._join is not None and not pipeline.p2p_done(schedule) and local_way(
                peer[0], self._join[0], self._join[1], len(self._schedules)):
            history: History = pickle.loads(peer[0].get(keys.pipeline_startup(self._join[1], index)))
            result = self._catch_up_locally(peer[1], index, schedule, history, original, args, kwargs)
            if not pipeline.needs_startup(schedule):  # a training step: the lost rank's start-ups were all
                return result
        p2p_before = pipeline.p2p_done(schedule)
        replica = None if peer is None else self._replica(peer[0], peer[1], index, training)
        rerun = _Rerun(*self._previous(index, (training, not p2p_before)), replica=replica)
        rerun.start()
        try:
            result = original(*args, **kwargs)
        finally:
            messages = rerun.stop()
        if rerun.from_replica and peer is not None:
            self._log(f"rank {peer[1]}: its pipeline start-up of schedule {index} in a doomed step had nothing of its "
                      f"own recorded: {rerun.from_replica} receive(s) served from a replica's recording of the same "
                      "stages")
        if not rerun.zeroed and not rerun.incomplete:
            self._last[(index, (training, not p2p_before))] = messages
        if peer is not None and index not in self._recorded:  # a standby's rehearsal publishes nothing
            self._record(peer[0], peer[1], index, training, messages,
                         whole=not (rerun.served_locally or rerun.incomplete))
        return result

    def _previous(self, index: int, kind: Kind) -> tuple[startup_replay.Recording | None,
                                                         startup_replay.Recording | None]:
        """What a receive served locally in a start-up of ``kind`` gets: the messages of this
        rank's last start-up of that kind, or for a kind not seen yet (a switch) the same mode's
        first start-up's (its P2P vote's go unused); and, last, the other mode's (the first
        evaluation of a job, or its first switch back to training, in a doomed step): their
        metadata describe the same stages' tensors, and their values are never used beyond the
        doomed step (its evaluation is void; the next start-up replaces them)."""
        training, _ = kind
        same = self._last.get((index, kind), self._last.get((index, (training, True))))
        other = self._last.get((index, (not training, False)), self._last.get((index, (not training, True))))
        return same, other

    def _replica(self, store: Any, rank: int, index: int, training: bool) -> Callable[[], startup_replay.Recording]:
        """What a receive served locally that nothing else serves gets: the recording of a rank
        that holds the same stages (a replica), fetched then; empty after :data:`REPLICA_WAIT`
        seconds without one (zeros, as before)."""
        def load() -> startup_replay.Recording:
            shard = self._shard()
            if not shard:  # nothing says which stages this rank holds: no replica to take from
                return []
            key = keys.pipeline_startup_of_shard(shard, index)
            deadline = time.monotonic() + REPLICA_WAIT
            while not store.check([key]):
                if time.monotonic() > deadline:
                    self._log(f"rank {rank}: a pipeline start-up of schedule {index} in a doomed step has nothing "
                              f"recorded to serve its receives from, nor a replica's after {REPLICA_WAIT:g}s: zeros")
                    return []
                time.sleep(0.02)
            history: History = pickle.loads(store.get(key))
            whole = [(mode, messages) for mode, messages in history if messages is not None]
            same = [messages for mode, messages in whole if mode == training]
            return (same or [messages for _, messages in whole] or [[]])[-1]

        return load

    def _record(self, store: Any, rank: int, index: int, training: bool, messages: startup_replay.Recording,
                whole: bool) -> None:
        """This rank's start-ups of schedule ``index`` until its first training one (an
        evaluation's may come first), published once that one ran: what its joiner replays."""
        history = self._history.setdefault(index, [])
        history.append((training, messages if whole else None))
        if not training:
            return
        self._done(index)
        if any(recorded is None for _, recorded in history):  # a joiner of this rank cannot run them alone
            self._log(f"rank {rank}: the pipeline start-up of schedule {index} could not be recorded whole; a joiner "
                      "of this rank will run it with its pipeline's survivors")
        elif str(rank) != os.environ.get("TMRUN_TEST_PIPELINE_UNRECORDED"):  # tests only: a rank lost in its start-up
            published = pickle.dumps(history)
            store.compare_set(keys.pipeline_startup(rank, index), "", published)
            shard = self._shard()
            if shard:
                store.compare_set(keys.pipeline_startup_of_shard(shard, index), "", published)
        del self._history[index]

    def _catch_up_locally(self, rank: int, index: int, schedule: Any, history: History,
                          original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The lost rank's start-ups until its first training one, run alone in its order: the
        schedule is then started for training, as its peers' are (an ``eval()`` that comes first
        then runs its switch with them)."""
        asked = schedule._has_backward
        result, replayed = None, 0
        try:
            for position, (training, messages) in enumerate(history):
                schedule._has_backward = training
                if training:  # as the lost rank ran it: with autograd (the asking eval() may be under no_grad)
                    with torch.inference_mode(False), torch.enable_grad():
                        result, count = self._run_locally(messages or [], original, *_autograd_usable(args, kwargs))
                else:
                    result, count = self._run_locally(messages or [], original, args, kwargs)
                replayed += count
                self._last[(index, (training, position == 0))] = messages or []
        finally:
            schedule._has_backward = asked
        total = sum(len(messages or []) for _, messages in history)
        runs = f"{len(history)} start-ups" if len(history) > 1 else "start-up"
        self._log(f"rank {rank}: the pipeline {runs} of schedule {index} ran on this joiner alone ({replayed} of the "
                  f"{total} messages the lost rank received in it replayed, nothing sent); the survivors' pipelines go "
                  "on")
        self._done(index)  # the lost rank's recording is this rank's
        return result

    def _done(self, index: int) -> None:
        self._recorded.add(index)
        if self._recorded >= set(range(len(self._schedules))):
            self._join = None  # every schedule of this joiner started

    def _run_locally(self, messages: startup_replay.Recording, original: Callable[..., Any], args: tuple,
                     kwargs: dict) -> tuple[Any, int]:
        """One start-up with every group of this process served locally, its receives from
        ``messages``: its result, and how many messages it replayed."""
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
        self.served_locally += 1
        return result, replayer.replayed if replayer is not None else 0


def _autograd_usable(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with the tensors made under ``torch.inference_mode`` cloned outside it
    (autograd refuses to save inference tensors)."""
    def usable(value: Any) -> Any:
        return value.clone() if isinstance(value, torch.Tensor) and value.is_inference() else value

    return torch.utils._pytree.tree_map(usable, args), torch.utils._pytree.tree_map(usable, kwargs)


class _Rerun:
    """A start-up's receives recorded. One served locally (a doomed step; a standby's rehearsal)
    gets what the same receive got in the last start-up of the same kind (``previous``), else
    what the replayer set before it gives (a rehearsal's: rank 0's first step), else what it got
    in the other mode's (``other_mode``: training for an evaluation, or the reverse), else what a
    replica's recording has for it (``replica``, fetched then: a first start-up in a doomed step),
    else zeros; a receive from the network takes the place of its recorded one."""

    def __init__(self, previous: startup_replay.Recording | None,
                 other_mode: startup_replay.Recording | None = None,
                 replica: Callable[[], startup_replay.Recording] | None = None) -> None:
        self._recorder = startup_replay.Recorder()
        self._previous = startup_replay.Replayer(previous or [])
        self._other_mode = startup_replay.Replayer(other_mode or [])
        self._replica = startup_replay.Replayer(replica or [], any_group=True)
        self._fallback: tmrun_backend.P2PHook | None = None
        self.served_locally = False
        self.zeroed = False  # a receive served locally got zeros
        self.from_replica = 0  # receives served from a replica's recording

    def _skips(self) -> tuple[tmrun_backend.P2PHook, ...]:
        return self._previous.skip, self._other_mode.skip, self._replica.skip

    def start(self) -> None:
        self._recorder.start()
        for skip in self._skips():
            tmrun_backend.add_p2p_recorder(skip)
        self._fallback = tmrun_backend.p2p_replay()
        tmrun_backend.set_p2p_replay(self._serve)

    def _serve(self, group: str, src: int, tag: int, t: Any) -> bool:
        self.served_locally = True
        fallback = self._fallback
        served = self._previous(group, src, tag, t) or (fallback is not None and fallback(group, src, tag, t)) \
            or self._other_mode(group, src, tag, t)
        if not served and self._replica(group, src, tag, t):
            served = True
            self.from_replica += 1
        if served:
            self._recorder.record(group, src, tag, t)
            return True
        self.zeroed = True
        return False

    def stop(self) -> startup_replay.Recording:
        tmrun_backend.set_p2p_replay(self._fallback)
        for skip in self._skips():
            tmrun_backend.remove_p2p_recorder(skip)
        return self._recorder.stop()

    @property
    def incomplete(self) -> bool:
        return self._recorder.incomplete
