"""Job events (failures, replacements, formation) appended to the store for tmrun-ctl."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tmrun.protocol import keys
from tmrun.protocol.messages import Event, ProtocolMessageError

if TYPE_CHECKING:
    from torch.distributed import Store


def record_event(store: Store, kind: str, epoch: int, detail: str, **fields: Any) -> None:
    """Append an event; ``fields`` are its structured facts (``gen``, ``ranks``, ``nodes``,
    ``seconds``, ``phases``; docs/events.md), where the writer knows them."""
    seq = store.add(keys.EVENT_SEQ, 1) - 1
    store.set(keys.event(seq), Event(time.time(), kind, epoch, detail, fields=fields).encode())


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


def read_new_events(store: Store, since: int) -> tuple[list[Event], int]:
    """Events numbered ``since`` and later, and the number to ask from next time: stops at the
    first one whose writer took its number but has not written it yet (read again later),
    skips a damaged one for good. For readers that keep what they read (the live console)."""
    events = []
    count = store.add(keys.EVENT_SEQ, 0)
    while since < count:
        key = keys.event(since)
        if not store.check([key]):
            break
        try:
            events.append(Event.decode(key, store.get(key), since))
        except ProtocolMessageError:
            pass
        since += 1
    return events, since
