"""A standby that waits in ``tmrun.init()`` imports ahead what the ranks imported.

The standby of a job with subgroups (a device mesh: HSDP, TP, PP) cannot run the script in its
sandbox: it builds its mesh and model only once it has a rank (docs/mesh.md, section 1). Much of
that build in a fresh process is not the build: it is the modules torch imports lazily on first
use. The first ``fully_shard`` of a process imports ``torch._dynamo`` (about 0.85 s of the 1.0 s
it takes on these machines; 0.15 s once imported), DTensor's and the pipelining package's
operators come in the same way. A standby waits idle for seconds to hours; it spends a second of
that importing them, not of the job's downtime.

Rank 0 publishes the names of the modules it holds twice: when its first step starts (what the
script's set-up imported) and when its second step committed (what a first forward, backward and
optimizer step imported). The standby, while it waits for its assignment, imports every name of
each list it does not hold yet. A module that fails to import here is skipped and counted (it
fails again, or not, when the promoted script imports it); nothing of it is fatal.
``TMRUN_WARM_IMPORTS=0`` turns it off.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from tmrun.protocol import keys

OFF_VALUES = ("0", "off", "false", "no")
# never imported ahead: the script itself, and the process's own entry points
SKIPPED = frozenset({"__main__", "__mp_main__"})


def enabled() -> bool:
    return os.environ.get("TMRUN_WARM_IMPORTS", "1").strip().lower() not in OFF_VALUES


def module_names() -> list[str]:
    """The importable modules this process holds, in ``sys.modules``' order (importing a
    submodule imports its package first anyway): real modules with a spec, not placeholders
    (None) nor aliases under another name."""
    names: list[str] = []
    for name, module in list(sys.modules.items()):
        if name in SKIPPED or module is None:
            continue
        spec = getattr(module, "__spec__", None)
        if spec is None or getattr(spec, "name", None) != name:
            continue  # built without a spec (a namespace hack) or registered under an alias
        names.append(name)
    return names


def encode(names: list[str]) -> bytes:
    return "\n".join(names).encode()


def decode(raw: bytes) -> list[str]:
    return [name for name in raw.decode(errors="replace").split("\n") if name]


@dataclass
class ImportResult:
    imported: int = 0  # modules new in sys.modules (a name's import brings its dependencies too)
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0


def import_missing(names: list[str]) -> ImportResult:
    """Import each of ``names`` this process does not hold yet. A failing one (any
    ``Exception`` of its import, a ``SystemExit`` raised by a module included) is skipped and
    named in the result; its partial entry is left as Python leaves it."""
    result = ImportResult()
    started, held = time.perf_counter(), len(sys.modules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ranks printed their import-time warnings already
        for name in names:
            if name in sys.modules or name in SKIPPED:
                continue
            try:
                importlib.import_module(name)
            except (Exception, SystemExit):  # noqa: BLE001  (any module's own failure: skipped, counted)
                result.failed.append(name)
    result.imported = max(0, len(sys.modules) - held)
    result.seconds = time.perf_counter() - started
    return result


class Publisher:
    """Rank 0 of a job with subgroups: its module names at its first step and after its second."""

    def __init__(self) -> None:
        self._published: set[str] = set()

    def at_step_start(self, store: Any, rank: int, has_subgroups: bool) -> None:
        self._publish(store, keys.WARM_IMPORTS_SETUP, rank, has_subgroups)

    def after_commit(self, store: Any, rank: int, committed_step: int, has_subgroups: Callable[[], bool]) -> None:
        if committed_step >= 1 and keys.WARM_IMPORTS_STEADY not in self._published:
            self._publish(store, keys.WARM_IMPORTS_STEADY, rank, has_subgroups())

    def _publish(self, store: Any, key: str, rank: int, has_subgroups: bool) -> None:
        if key in self._published:
            return
        self._published.add(key)
        if rank == 0 and has_subgroups and enabled():
            store.set(key, encode(module_names()))


class Importer:
    """A standby waiting in ``tmrun.init()``: imports each published list once (``poll`` is
    called between two looks at its assignment)."""

    def __init__(self, store: Any, say: Any, quiet_if_none: bool = False) -> None:
        self._store = store
        self._say = say
        self._quiet_if_none = quiet_if_none  # after a rehearsal, which imported them itself: no line for nothing
        self._pending = [keys.WARM_IMPORTS_SETUP, keys.WARM_IMPORTS_STEADY] if enabled() else []
        self.total = ImportResult()

    def poll(self) -> None:
        while self._pending and self._store.check([self._pending[0]]):
            key = self._pending.pop(0)
            result = import_missing(decode(self._store.get(key)))
            self.total.imported += result.imported
            self.total.failed.extend(result.failed)
            self.total.seconds += result.seconds
            if self._quiet_if_none and not result.imported and not result.failed:
                continue
            failed = (f"; {len(result.failed)} could not be imported here, skipped: {', '.join(result.failed[:3])}"
                      f"{' ...' if len(result.failed) > 3 else ''}") if result.failed else ""
            stage = "set-up" if key == keys.WARM_IMPORTS_SETUP else "first steps"
            self._say(f"imported ahead {result.imported} modules rank 0 imported in its {stage} "
                      f"({result.seconds:.2f}s){failed}")
