"""tmrun.worker.live_objects: one scan of the collector's objects, by class asked."""

from __future__ import annotations

import weakref

from tmrun.worker.live_objects import instances_of


class Base:
    pass


class Child(Base):
    pass


class Other:
    pass


class Asking(type):
    def __instancecheck__(cls, obj: object) -> bool:  # a metaclass that asks the object (DeviceMesh's kind)
        raise AssertionError("asked the object")


class Guarded(metaclass=Asking):
    pass


def test_every_class_asked_gets_its_objects_and_its_subclasses_objects() -> None:
    base, child, other, guarded = Base(), Child(), Other(), Guarded()

    class Gone:
        pass

    holder = [weakref.proxy(Gone())]  # a dead weak proxy among the collector's objects
    found = instances_of(Base, Child, Guarded)
    assert set(found) == {Base, Child, Guarded}
    assert [id(o) for o in found[Base]].count(id(base)) == 1 and any(o is child for o in found[Base])
    assert [o for o in found[Child] if o is base] == [] and any(o is child for o in found[Child])
    assert any(o is guarded for o in found[Guarded])
    assert all(o is not other for objects in found.values() for o in objects)
    del holder
