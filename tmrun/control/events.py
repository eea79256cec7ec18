"""Job events (failures, replacements, formation) appended to the store for tmrun-ctl."""

from __future__ import annotations

import time

from torch.distributed import Store

from tmrun.protocol import keys
from tmrun.protocol.messages import Event, ProtocolMessageError


def record_event(store: Store, kind: str, epoch: int, detail: str) -> None:
    seq = store.add(keys.EVENT_SEQ, 1) - 1
    store.set(keys.event(seq), Event(time.time(), kind, epoch, detail).encode())


def read_events(store: Store, since: int = 0) -> list[Event]:
    count = store.add(keys.EVENT_SEQ, 0)
    events = []
    for seq in range(since, count):
        key = keys.event(seq)
        if not store.check([key]):
            continue  # its writer has taken the number but not written yet
        try:
            events.append(Event.decode(key, store.get(key), seq))
        except ProtocolMessageError:
            continue  # not ours to show: a foreign or damaged entry
    return events
