"""The live objects of some classes in this process, found through the garbage collector.

For what tmrun must find although the script never handed it over (the device meshes torch's
caches keep, an untracked LR scheduler or gradient scaler). The test is the type's MRO, not
``isinstance()``: a class whose metaclass asks the object itself (DeviceMesh) or a dead weak
proxy among the collector's objects would raise ``ReferenceError`` when asked. The answer is
kept per type, so one scan costs a dictionary lookup per object (tens of milliseconds in a
process of torch's size: 0.3 M objects), and one scan serves several classes. Objects frozen
out of the collector's view (``gc.freeze()``: what a rehearsed standby kept from its first run)
are not seen. Callers scan once or at a change, never per step.
"""

from __future__ import annotations

import gc
from typing import Any


def instances_of(*classes: type) -> dict[type, list[Any]]:
    """Every live object whose type is one of ``classes`` or a subclass, by the class asked
    (an object of several of them is listed under each)."""
    found: dict[type, list[Any]] = {cls: [] for cls in classes}
    wanted: dict[type, tuple[type, ...]] = {}  # an object's type -> the classes asked it is one of
    for obj in gc.get_objects():
        kind = type(obj)
        matches = wanted.get(kind)
        if matches is None:
            matches = wanted[kind] = tuple(cls for cls in classes if cls in kind.__mro__)
        for cls in matches:
            found[cls].append(obj)
    return found
