"""A pipeline's start-up in a standby's rehearsal: the messages rank 0 received in its first step.

torch's pipeline stages learn their neighbours' shapes in their first step (``recv_object_list``
of the neighbour's metadata, forward and backward). In a standby's rehearsal every receive is
served locally with zeros, and unpickling zeros fails (``EOFError``): the rehearsal of a
pipeline job would fail, and its standby would wait cold.

So rank 0 of a job with subgroups records the small point-to-point messages it receives during
its first step (:class:`Recorder`: at most :data:`MAX_MESSAGE` bytes each, :data:`MAX_TOTAL` in
all) and publishes them in the job's store once that step's body ran; the standby, which
rehearses as rank 0, waits for them at its rehearsal's first receive (a job without
point-to-point traffic never waits) and replays them
(:class:`Replayer`) to its own receives of the same group, source, tag, size and dtype, in the
order they came; any other receive (an activation larger than the cap, or a later step's) gets
zeros as before. Nothing goes on the network: the recording travels once through the store.
The replay ends with the rehearsal.
"""

from __future__ import annotations

import ctypes
import pickle
import threading
import time
from collections import defaultdict, deque
from typing import Any, Callable

import torch

from tmrun.comm import backend as tmrun_backend
from tmrun.protocol import keys

MAX_MESSAGE = 1 << 16  # bytes: a pipeline's metadata is well under this, activations mostly above
MAX_TOTAL = 4 << 20  # bytes recorded in all
WAIT = 30.0  # s a standby waits for rank 0's first step to end (a failure in it: no recording)
AFTER_LOSS = 2.0  # s it waits once a worker reported a lost peer

Key = tuple[str, int, int, int, str]  # (group name, source group rank, tag, bytes, dtype)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, without numpy (not a dependency of tmrun, nor of torch)."""
    flat = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return ctypes.string_at(flat.data_ptr(), flat.numel()) if flat.numel() else b""


def _key(group: str, src: int, tag: int, t: torch.Tensor) -> Key:
    return (group, int(src), int(tag), t.numel() * t.element_size(), str(t.dtype))


class Recorder:
    """Rank 0: the messages it receives from :meth:`start` until :meth:`publish`."""

    def __init__(self) -> None:
        self._messages: list[tuple[Key, bytes]] = []
        self._total = 0
        self._lock = threading.Lock()
        self._active = False
        self.incomplete = False  # a message could not be recorded: not to be replayed

    def start(self) -> None:
        self._active = True
        tmrun_backend.add_p2p_recorder(self.record)

    def record(self, group: str, src: int, tag: int, t: torch.Tensor) -> None:
        """``t`` was received (from the network, or served locally from a recording)."""
        key = _key(group, src, tag, t)
        if key[3] > MAX_MESSAGE:
            return
        try:
            data = tensor_bytes(t)
        except Exception:  # noqa: BLE001 (never the receive's failure: a recording left incomplete)
            self.incomplete = True
            return
        with self._lock:  # receives complete on the backend's completer thread too
            if self._total + len(data) <= MAX_TOTAL:
                self._messages.append((key, data))
                self._total += len(data)

    def stop(self) -> list[tuple[Key, bytes]]:
        """Stop recording; what was recorded."""
        self._active = False
        tmrun_backend.remove_p2p_recorder(self.record)
        with self._lock:
            return list(self._messages)

    def publish(self, store: Any) -> None:
        """Stop recording and publish what was recorded (an empty list too: the standby's wait
        ends)."""
        if not self._active:
            return
        messages = self.stop()
        store.set(keys.STARTUP_MESSAGES, pickle.dumps([] if self.incomplete else messages))  # none rather than some

    @property
    def active(self) -> bool:
        return self._active


Recording = list[tuple[Key, bytes]]


class Replayer:
    """A rehearsal's receives served from rank 0's recording. ``messages`` is the recording, or
    what fetches it (called at the rehearsal's first receive, not before: a job without
    point-to-point traffic never waits for it; None from it: no recording, zeros)."""

    def __init__(self, messages: Recording | Callable[[], Recording | None], any_group: bool = False) -> None:
        self._queues: dict[Key, deque[bytes]] = defaultdict(deque)
        self._load: Callable[[], Recording | None] | None = None
        self._any_group = any_group  # a replica's recording: its group names are its own, not this rank's
        self._skipped: list[Key] = []  # receives that came from the network before a lazy recording was loaded
        if callable(messages):
            self._load = messages
        else:
            self._queue(messages)
        self.replayed = 0

    def _match(self, key: Key) -> Key:
        return ("", *key[1:]) if self._any_group else key

    def _queue(self, messages: Recording | None) -> None:
        for key, data in messages or []:
            self._queues[self._match(key)].append(data)
        for key in self._skipped:
            self._drop(key)
        self._skipped = []

    def _drop(self, key: Key) -> None:
        queue = self._queues.get(key)
        if queue:
            queue.popleft()

    def skip(self, group: str, src: int, tag: int, t: torch.Tensor) -> None:
        """The same receive came from the network this time: its recorded message is passed over."""
        key = self._match(_key(group, src, tag, t))
        if self._load is not None:
            self._skipped.append(key)
        else:
            self._drop(key)

    def __call__(self, group: str, src: int, tag: int, t: torch.Tensor) -> bool:
        if self._load is not None:
            load, self._load = self._load, None
            self._queue(load())
        queue = self._queues.get(self._match(_key(group, src, tag, t)))
        if not queue:
            return False
        raw = torch.frombuffer(bytearray(queue.popleft()), dtype=torch.uint8)
        with torch.no_grad():
            t.copy_(raw.view(t.dtype).view(t.shape))
        self.replayed += 1
        return True


def await_recording(store: Any, check: Callable[[], None], wait: float = WAIT,
                    after_loss: float = AFTER_LOSS) -> Recording | None:
    """A standby about to rehearse: rank 0's recording, once its first step's body ran (None
    after ``wait`` seconds: rank 0 did not get that far; or ``after_loss`` seconds after a worker
    reported a lost peer: the first step was doomed, rank 0 lost perhaps, and the controller
    waits for this standby to be warm). ``check`` is called between looks (it raises or exits
    when the standby must stop waiting)."""
    deadline = time.monotonic() + wait
    while not store.check([keys.STARTUP_MESSAGES]):
        now = time.monotonic()
        if now > deadline:
            return None
        if deadline - now > after_loss and store.add(keys.REPORT_SEQ, 0) > 0:
            deadline = now + after_loss
        check()
        time.sleep(0.02)
    return pickle.loads(store.get(keys.STARTUP_MESSAGES))


def published_startups(store: Any, rank: int) -> Recording | None:
    """The pipeline start-ups ``rank`` published (tmrun.worker.pipeline_startup: each tracked
    schedule's until its first training one), in schedule order, as one recording; None when it
    published none. What a rehearsal replays when rank 0 was lost in its first step after its
    start-up ended (its first step's recording never came)."""
    messages: Recording = []
    index = 0
    while store.check([keys.pipeline_startup(rank, index)]):
        for _, recorded in pickle.loads(store.get(keys.pipeline_startup(rank, index))):
            messages += recorded or []
        index += 1
    return messages if index else None


def replay(messages: Recording | Callable[[], Recording | None] | None) -> Replayer | None:
    """Serve the rehearsal's receives from ``messages`` (or what fetches them at the first
    receive; None: stop replaying)."""
    replayer = None if messages is None else Replayer(messages)
    tmrun_backend.set_p2p_replay(replayer)
    return replayer
