"""The live objects of a class in this process, found through the garbage collector.

For what tmrun must find although the script never handed it over (the device meshes torch's
caches keep, an untracked gradient scaler). The test is the type's MRO, not ``isinstance()``: a
class whose metaclass asks the object itself (DeviceMesh) or a dead weak proxy among the
collector's objects would raise ``ReferenceError`` when asked. One scan reads every object the
collector tracks: milliseconds, up to a fraction of a second in a large process, so callers do it
once or at a change, never per step.
"""

from __future__ import annotations

import gc
from typing import Any


def instances_of(cls: type) -> list[Any]:
    """Every live object whose type is ``cls`` or a subclass of it."""
    return [obj for obj in gc.get_objects() if cls in type(obj).__mro__]
