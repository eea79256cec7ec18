"""Job events (failures, replacements, formation) appended to the store for tmrun-ctl."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from torch.distributed import Store

from tmrun.rendezvous import keys


@dataclass(frozen=True)
class Event:
    seq: int
    time: float
    kind: str
    epoch: int
    detail: str


def record_event(store: Store, kind: str, epoch: int, detail: str) -> None:
    seq = store.add(keys.EVENT_SEQ, 1) - 1
    payload = {"time": time.time(), "kind": kind, "epoch": epoch, "detail": detail}
    store.set(keys.event(seq), json.dumps(payload))


def read_events(store: Store, since: int = 0) -> list[Event]:
    count = store.add(keys.EVENT_SEQ, 0)
    events = []
    for seq in range(since, count):
        if not store.check([keys.event(seq)]):
            continue  # its writer has taken the number but not written yet
        data = json.loads(store.get(keys.event(seq)))
        events.append(Event(seq, float(data["time"]), str(data["kind"]), int(data["epoch"]), str(data["detail"])))
    return events
