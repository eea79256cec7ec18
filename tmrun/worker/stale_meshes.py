"""The device meshes a standby's rehearsal leaves behind in torch's caches, re-seated as its rank.

torch's DTensor caches (the sharding propagation's, the redistribute planner's) are keyed by
``DeviceMesh`` equality, which compares a mesh's layout and dimension names, not the coordinates
of the process that made it (every rank of a job builds equal meshes). A standby's rehearsal
(:mod:`tmrun.worker.rehearsal`) fills them as rank 0; after it is assigned rank r, the second
run's meshes are equal to the rehearsal's, so a cache hit hands it a spec holding a rehearsal
mesh, whose coordinates are rank 0's: a shard's offset computed from it is another rank's (on
an HSDP job, the joiner's replica diverged silently). Those cache hits are what makes the
rehearsal worth it (its joiner's first step costs one steady step instead of several), so the
caches are kept and their meshes made right instead:

* the rehearsal's meshes are remembered (weakly) while it waits (:meth:`StaleMeshes.remember`);
  once its objects are collected, those still alive are the ones torch's caches hold;
* once the second run made its own meshes, each such mesh takes over the state of the second
  run's mesh equal to it (:meth:`StaleMeshes.reseat`): its coordinates and group names are then
  rank r's, whichever cache hands it out; checked with ``get_coordinate()``;
* a rehearsal mesh that no mesh of the second run equals (yet) is *retired*: equal to no other
  mesh, so no cache lookup can return it (that cache entry is only cold).
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

_retired_classes: dict[type, type] = {}


def _mesh_class() -> type | None:
    module = sys.modules.get("torch.distributed.device_mesh")  # never imported here for a job without one
    return getattr(module, "DeviceMesh", None) if module is not None else None


def _live_meshes() -> list[Any]:
    """Every DeviceMesh the collector sees (objects frozen by ``gc.freeze()`` excepted: the
    rehearsal freezes what the process held before it, so this scan is short)."""
    cls = _mesh_class()
    if cls is None:
        return []
    return [obj for obj in gc.get_objects() if isinstance(obj, cls)]


def _retired(cls: type) -> type:
    """A subclass of ``cls`` equal to nothing but itself (hash unchanged)."""
    if cls not in _retired_classes:
        def __eq__(self: Any, other: object) -> bool:
            return self is other

        _retired_classes[cls] = type(f"Retired{cls.__name__}", (cls,), {
            "__eq__": __eq__, "__hash__": cls.__hash__,
            "__doc__": "A standby's rehearsal mesh that no mesh of its second run matched: equal to nothing.",
        })
    return _retired_classes[cls]


class StaleMeshes:
    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []

    def remember(self) -> int:
        """Every mesh alive now (a rehearsal's, before its objects are dropped: those still alive
        afterwards are held by torch's caches); returns how many."""
        self._refs = [weakref.ref(mesh) for mesh in _live_meshes()]
        return len(self._refs)

    def pending(self) -> bool:
        return any(ref() is not None for ref in self._refs)

    def reseat(self, retire: bool) -> tuple[int, int]:
        """Each remembered mesh equal to a mesh made since takes over that mesh's state; with
        ``retire``, the others are retired and nothing is remembered any more. Returns (re-seated,
        retired). Raises RuntimeError when a re-seated mesh's coordinates still differ."""
        stale = [mesh for mesh in (ref() for ref in self._refs) if mesh is not None]
        if not stale:
            self._refs = []
            return 0, 0
        stale_ids = {id(mesh) for mesh in stale}
        current = [mesh for mesh in _live_meshes() if id(mesh) not in stale_ids]
        reseated, retired, left = 0, 0, []
        for mesh in stale:
            twin = next((other for other in current if other == mesh), None)
            if twin is None:
                if retire:
                    mesh.__class__ = _retired(type(mesh))
                    retired += 1
                else:
                    left.append(weakref.ref(mesh))
                continue
            mesh.__dict__.clear()
            mesh.__dict__.update(twin.__dict__)
            if mesh.get_coordinate() != twin.get_coordinate():
                raise RuntimeError("a rehearsal's device mesh kept other coordinates after it was re-seated")
            reseated += 1
        self._refs = [] if retire else left
        return reseated, retired
