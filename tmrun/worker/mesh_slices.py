"""A joiner's set-up slices each device mesh once per dimension, not once per parameter.

torch's ``DeviceMesh.__getitem__`` builds a new sub-mesh on every call, and FSDP2's
``fully_shard`` slices its mesh once per parameter (``FSDPParam._init_shard_mesh`` on an HSDP
mesh): on torch 2.14 that is about 60 % of ``fully_shard`` (101 sub-meshes of the same dimension
for examples/train_hsdp.py's 1.6M parameters), the largest part of a joiner's set-up, on the
recovery's critical path (docs/benchmarks.md). From the joiner's promotion in ``tmrun.init()``
until its first ``steps()`` (:meth:`SliceMemo.start` / :meth:`SliceMemo.stop`), a slice of a mesh
object by the same dimension names returns the sub-mesh that the first such slice made: the
same value (the root mesh, its layout, rank map and group names are unchanged meanwhile), one
object. Outside that window torch's own method runs untouched.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

from tmrun.worker import stale_meshes


class SliceMemo:
    def __init__(self) -> None:
        self._restore: Callable[[], None] | None = None
        self._slices: dict[tuple[int, tuple[str, ...]], tuple[weakref.ref, Any]] = {}
        self.hits = 0  # slices answered from the memo (sub-meshes torch did not build again)

    def start(self) -> None:
        """Answer repeated slices of one mesh object from the memo (a joiner's set-up)."""
        cls = stale_meshes.mesh_class()
        if cls is None or self._restore is not None:
            return
        original = cls.__getitem__
        slices = self._slices

        @functools.wraps(original)
        def getitem(mesh: Any, names: str | tuple[str, ...]) -> Any:
            key = (id(mesh), (names,) if isinstance(names, str) else tuple(names))
            held = slices.get(key)
            if held is not None and held[0]() is mesh:  # the same object (an id can be reused)
                self.hits += 1
                return held[1]
            sub = original(mesh, names)
            slices[key] = (weakref.ref(mesh), sub)
            return sub

        cls.__getitem__ = getitem  # type: ignore[method-assign]

        def restore() -> None:
            cls.__getitem__ = original  # type: ignore[method-assign]

        self._restore = restore

    def stop(self) -> int:
        """torch's method again, the memo dropped; returns the hits since :meth:`start`."""
        if self._restore is not None:
            self._restore()
            self._restore = None
        self._slices.clear()
        hits, self.hits = self.hits, 0
        return hits
