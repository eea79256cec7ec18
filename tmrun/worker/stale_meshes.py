"""The device meshes a standby's rehearsal leaves in torch's caches, replaced by its second run's.

torch's DTensor caches (the sharding propagation's, in C++ and Python, the redistribute
planner's) are keyed by ``DeviceMesh`` equality, which compares a mesh's layout and dimension
names, not the coordinates of the process that made it (every rank of a job builds equal
meshes). A standby's rehearsal (:mod:`tmrun.worker.rehearsal`) fills them as rank 0; after it is
assigned rank r, its second run's meshes equal the rehearsal's, so a cache hit hands the second
run a spec that holds a *rehearsal* mesh: its coordinates are rank 0's (a shard's offset computed
from it is another rank's: on an HSDP job the joiner's replica diverged silently), and it is
another object than the script's mesh (FSDP2 refuses a parameter whose mesh is not the one
given to ``fully_shard``). Those cache hits are what makes the rehearsal worth it (its joiner's
first step costs about one steady step instead of several), so the caches are kept and every
reference they hold to a rehearsal mesh is made a reference to the second run's mesh:

* :meth:`StaleMeshes.remember`: the meshes alive once the rehearsal is warm (weakly);
* :meth:`StaleMeshes.collect_holders`: once the rehearsal's objects are collected, those still
  alive are held by torch's caches; the containers that hold them are found (one scan);
* :meth:`StaleMeshes.watch`: during the second run every new mesh, as soon as torch made it
  (``DeviceMesh.__init__`` returned), takes the place of the rehearsal meshes equal to it: each
  holder's reference is replaced by the new mesh, and the rehearsal mesh itself takes the new
  mesh's state (a reference left in a holder that cannot be changed, a tuple, has rank r's
  coordinates too); checked with ``get_coordinate()``;
* :meth:`StaleMeshes.finish` (before the first step): a rehearsal mesh that no mesh of the
  second run matched is *retired*: equal to nothing, so no cache lookup returns it.
"""

from __future__ import annotations

import functools
import gc
import sys
import types
import weakref
from typing import Any, Callable

from tmrun.worker.live_objects import instances_of

_retired_classes: dict[type, type] = {}


def mesh_class() -> type | None:
    """torch's ``DeviceMesh``, if this process imported it (None for a job without a mesh)."""
    module = sys.modules.get("torch.distributed.device_mesh")  # never imported here for a job without one
    return getattr(module, "DeviceMesh", None) if module is not None else None


def _live_meshes() -> list[Any]:
    cls = mesh_class()
    if cls is None:
        return []
    return instances_of(cls)[cls]


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


def _attribute_names(holder: Any) -> list[str]:
    """An object's attribute names: its instance dict's (Python 3.11 keeps small ones inline, so
    the collector names the object, not a dict) and its class's slots."""
    names = list(vars(holder)) if hasattr(holder, "__dict__") else []
    return names + _slots(type(holder))


@functools.lru_cache(maxsize=None)
def _slots(cls: type) -> list[str]:
    return [name for klass in cls.__mro__ for name in getattr(klass, "__slots__", ())]


def _replace_in(holder: Any, stale: dict[int, Any], real: Any, names: list[str] | None) -> None:
    """Replace the references ``holder`` has to any mesh of ``stale`` (by id) by ``real``: a
    dict's or a list's, looked through whole (``names`` None), or an object's attributes
    ``names`` (those found holding a rehearsal mesh, :func:`_where`)."""
    if isinstance(holder, dict):
        for key, value in list(holder.items()):
            if id(value) in stale:
                holder[key] = real
        for key in [key for key in holder if id(key) in stale]:
            holder.setdefault(real, holder.pop(key))
        return
    if isinstance(holder, list):
        for index, item in enumerate(holder):
            if id(item) in stale:
                holder[index] = real
        return
    # an object's attributes, set past the class's __setattr__ (a DTensorSpec recomputes its
    # hash there: equal meshes, equal hashes)
    for name in names or ():
        if id(getattr(holder, name, None)) in stale:
            object.__setattr__(holder, name, real)


class StaleMeshes:
    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self._holders: list[Any] = []
        # per holder, what to look at when a mesh takes the place of rehearsal meshes: a dict or
        # a list (a cache, which may change) is looked through whole; an object (a cached spec),
        # only the attributes that held a rehearsal mesh when it was found; a tuple or a set
        # (unchangeable), the ids of the rehearsal meshes it holds
        self._holder_names: list[list[str] | frozenset[int] | None] = []
        self._unwatch: Callable[[], None] | None = None
        self.replaced = 0  # rehearsal meshes whose place a mesh of the second run took
        self.unchangeable = 0  # holders that kept a rehearsal mesh (it has the new mesh's state)

    def remember(self) -> int:
        """Every mesh alive now (a rehearsal's, while it waits: those still alive once its
        objects are collected are held by torch's caches); returns how many."""
        self._refs = [weakref.ref(mesh) for mesh in _live_meshes()]
        return len(self._refs)

    def _stale(self) -> list[Any]:
        return [mesh for mesh in (ref() for ref in self._refs) if mesh is not None]

    def collect_holders(self) -> int:
        """After the rehearsal's objects were collected: the containers that still hold one of
        its meshes (torch's caches). Returns how many meshes are left to replace."""
        stale = self._stale()
        self._refs = [weakref.ref(mesh) for mesh in stale]
        holders = gc.get_referrers(*stale) if stale else []
        self._holders = [h for h in holders if h is not stale and not isinstance(h, types.FrameType)]
        ids = {id(mesh) for mesh in stale}
        self._holder_names = [_where(holder, ids) for holder in self._holders]
        return len(stale)

    def watch(self) -> None:
        """From now on (the second run), each new mesh takes its rehearsal twins' place."""
        cls = mesh_class()
        if cls is None or not self._refs or self._unwatch is not None:
            return
        original = cls.__init__

        @functools.wraps(original)
        def init(mesh: Any, *args: Any, **kwargs: Any) -> None:
            original(mesh, *args, **kwargs)
            self.take_place(mesh)

        cls.__init__ = init  # type: ignore[misc]

        def unwatch() -> None:
            cls.__init__ = original  # type: ignore[misc]

        self._unwatch = unwatch

    def take_place(self, real: Any) -> int:
        """``real`` (a mesh of the second run) replaces the rehearsal meshes equal to it in every
        holder; returns how many. Raises RuntimeError when one kept other coordinates."""
        stale = {id(mesh): mesh for mesh in self._stale() if mesh is not real and mesh == real}
        if stale:
            # one pass, whatever the number of equal rehearsal meshes; an object's attributes
            # found holding one before the failure (the scan of each object's attributes here,
            # hundreds of them, was half of an HSDP joiner's 12 ms of mesh replacement)
            for holder, where in zip(self._holders, self._holder_names):
                if isinstance(where, frozenset):  # a tuple or a set keeps its mesh (given the new state below)
                    self.unchangeable += not where.isdisjoint(stale)
                else:
                    _replace_in(holder, stale, real, where)
            for mesh in stale.values():
                mesh.__dict__.clear()
                mesh.__dict__.update(real.__dict__)
                if mesh.get_coordinate() != real.get_coordinate():
                    raise RuntimeError("a rehearsal's device mesh kept other coordinates after the second run's "
                                       "took its place")
            self._refs = [ref for ref in self._refs if id(ref()) not in stale and ref() is not None]
            self.replaced += len(stale)
        if not self._refs:
            self._stop()
        return len(stale)

    def finish(self) -> int:
        """Before the first step: the rehearsal meshes no mesh of the second run matched are
        retired (equal to nothing); stop watching. Returns how many were retired."""
        retired = 0
        for mesh in self._stale():
            mesh.__class__ = _retired(type(mesh))
            retired += 1
        self._refs = []
        self._stop()
        return retired

    def _stop(self) -> None:
        self._holders = []
        self._holder_names = []
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None


def _where(holder: Any, ids: set[int]) -> list[str] | frozenset[int] | None:
    """What of ``holder`` to look at later (StaleMeshes._holder_names), given the ids of the
    rehearsal meshes."""
    if isinstance(holder, (dict, list)):
        return None
    if isinstance(holder, (tuple, set, frozenset)):
        return frozenset(id(item) for item in holder if id(item) in ids)
    return [name for name in _attribute_names(holder) if id(getattr(holder, name, None)) in ids]
