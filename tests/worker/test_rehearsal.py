"""A standby's rehearsal (tmrun.worker.rehearsal): the runner runs the script a second time once
the rehearsal is assigned or failed, whatever the script does with the rehearsal's end; and the
device meshes torch's caches keep from it are re-seated (tmrun.worker.stale_meshes)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Iterator

import pytest

from tmrun.protocol import messages as proto
from tmrun.worker import rehearsal, runtime, standby_process
from tmrun.worker.stale_meshes import StaleMeshes

ASSIGNED = proto.Assignment(rank=3, gen=1)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Each test starts with no rehearsal; the runtime's teardown is recorded, not run, and what
    the rehearsal froze is unfrozen again."""
    monkeypatch.setattr(rehearsal, "_phase", rehearsal.Phase.NONE)
    monkeypatch.setattr(rehearsal, "_assignment", None)
    monkeypatch.setattr(rehearsal, "_assigned_at", 0.0)
    monkeypatch.setattr(rehearsal, "_left_warm", False)
    monkeypatch.setattr(rehearsal, "_stale", StaleMeshes())
    dropped: list[str] = []
    monkeypatch.setattr(runtime, "drop_for_second_run", lambda: dropped.append("dropped"))
    monkeypatch.delenv(rehearsal.ENV_REHEARSAL, raising=False)
    yield dropped
    gc.unfreeze()


def _script(tmp_path: Path, body: str) -> Path:
    """A script that appends what each of its runs sees to runs.txt, then runs ``body``."""
    path = tmp_path / "job.py"
    path.write_text(
        "from pathlib import Path\n"
        "from tmrun.worker import rehearsal\n"
        "from tmrun.protocol import messages as proto\n"
        f"RUNS = Path({str(tmp_path / 'runs.txt')!r})\n"
        "assignment, at, second = rehearsal.carried()\n"
        "with RUNS.open('a') as out:\n"
        "    out.write(f'{second} {assignment.rank if assignment else None}\\n')\n"
        "if not second and rehearsal.enabled(2):\n"
        "    rehearsal.begin()\n"
        + body
    )
    return path


def _runs(tmp_path: Path) -> list[str]:
    return (tmp_path / "runs.txt").read_text().splitlines()


END = "    rehearsal.end(proto.Assignment(rank=3, gen=1), 12.5)\n"


def test_assigned_in_the_rehearsal_the_script_runs_again_as_that_rank(tmp_path: Path, fresh_state: list[str]) -> None:
    standby_process._run_with_rehearsal("path", str(_script(tmp_path, END)), [])
    assert _runs(tmp_path) == ["False None", "True 3"]  # the second run's init() takes rank 3 at once
    assert fresh_state == ["dropped"]
    assert rehearsal.carried() == (ASSIGNED, 12.5, True)


def test_a_script_that_swallows_the_rehearsals_end_is_run_again_all_the_same(tmp_path: Path) -> None:
    body = "    try:\n    " + END + "    except BaseException:\n        pass\n"
    standby_process._run_with_rehearsal("path", str(_script(tmp_path, body)), [])
    assert _runs(tmp_path) == ["False None", "True 3"]
    assert not rehearsal.left()  # the second run is no rehearsal


WARM = "    rehearsal.leave_warm()\n"


def test_a_rehearsal_that_ends_warm_is_collected_and_run_again_before_any_assignment(
        tmp_path: Path, fresh_state: list[str]) -> None:
    """Warm and unassigned (its shadow steps done), the rehearsal leaves at once: its teardown and
    the script's code before ``tmrun.init()`` run before any failure, and the second run's
    ``tmrun.init()`` waits for the assignment (not as a cold standby: it reported warm)."""
    standby_process._run_with_rehearsal("path", str(_script(tmp_path, WARM)), [])
    assert _runs(tmp_path) == ["False None", "True None"]
    assert fresh_state == ["dropped"]
    assert rehearsal.carried() == (None, 0.0, True) and rehearsal.waits_warm()


def test_a_script_that_swallows_the_warm_end_leaves_again_at_its_next_step(tmp_path: Path) -> None:
    body = ("    for _ in range(3):\n"
            "        try:\n"
            "            rehearsal.leave_again()\n"
            "            rehearsal.leave_warm()\n"
            "        except BaseException:\n"
            "            RUNS.open('a').write('swallowed\\n')\n")
    standby_process._run_with_rehearsal("path", str(_script(tmp_path, body)), [])
    assert _runs(tmp_path) == ["False None", "swallowed", "swallowed", "swallowed", "True None"]
    assert rehearsal.waits_warm() and not rehearsal.left()


def test_a_failed_or_assigned_rehearsal_does_not_wait_as_a_warm_one(tmp_path: Path) -> None:
    standby_process._run_with_rehearsal("path", str(_script(tmp_path, END)), [])
    assert not rehearsal.waits_warm()


def test_the_rehearsals_end_passes_a_frameworks_except_exception() -> None:
    assert not issubclass(rehearsal.Rehearsed, Exception)  # torch's @record and `except Exception` let it through
    assert not issubclass(rehearsal.Rehearsed, SystemExit)  # @record returns on SystemExit(0)


def test_a_failed_rehearsal_runs_the_script_again_as_a_cold_standby(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    body = "    raise EOFError('Ran out of input')\n"
    standby_process._run_with_rehearsal("path", str(_script(tmp_path, body)), [])
    assert _runs(tmp_path) == ["False None", "True None"]  # no assignment: the cold wait in tmrun.init()
    assert not rehearsal.waits_warm()  # it says it is warm in tmrun.init() (as a cold standby)
    err = capsys.readouterr().err
    assert "the script's rehearsal failed (EOFError: Ran out of input); it waits for its rank cold" in err
    assert "Traceback" not in err


def test_a_failure_after_the_rehearsal_is_the_scripts_own(tmp_path: Path) -> None:
    """The second run, or a run that was no rehearsal, raises as any script does."""
    script = _script(tmp_path, END + "if second:\n    raise ValueError('bad batch')\n")
    with pytest.raises(ValueError, match="bad batch"):
        standby_process._run_with_rehearsal("path", str(script), [])
    assert _runs(tmp_path) == ["False None", "True 3"]


def test_an_interrupt_during_the_rehearsal_is_not_a_failed_rehearsal(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        standby_process._run_with_rehearsal("path", str(_script(tmp_path, "    raise KeyboardInterrupt\n")), [])
    assert _runs(tmp_path) == ["False None"]


def test_a_job_without_subgroups_runs_once(tmp_path: Path, fresh_state: list[str]) -> None:
    """The runner allows a rehearsal; a script that never begins one (no subgroups: the DDP
    sandbox, promoted in the same run) runs once."""
    path = tmp_path / "plain.py"
    path.write_text(f"open({str(tmp_path / 'runs.txt')!r}, 'a').write('run\\n')\n")
    standby_process._run_with_rehearsal("path", str(path), [])
    assert _runs(tmp_path) == ["run"] and fresh_state == []


def test_rehearsal_is_off_without_shadow_steps_or_with_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not rehearsal.enabled(2)  # not started by a runner that can run the script again
    rehearsal.allow()
    assert rehearsal.enabled(2) and not rehearsal.enabled(0)
    monkeypatch.setenv(rehearsal.ENV_REHEARSAL, "0")
    assert not rehearsal.enabled(2)


def test_the_rehearsals_objects_are_collected_before_the_second_run(tmp_path: Path) -> None:
    """A model of the rehearsal held in a reference cycle is gone when the script runs again
    (its memory, a GPU's too, is free for the second build)."""
    body = ("    class Node:\n        pass\n"
            "    a, b = Node(), Node()\n    a.other, b.other = b, a\n"
            "    import weakref, builtins\n    builtins._tm_rehearsal_ref = weakref.ref(a)\n"
            "    del a, b\n" + END)
    script = _script(tmp_path, body + "if second:\n    import builtins\n"
                     "    builtins._tm_alive = builtins._tm_rehearsal_ref() is not None\n")
    gc.disable()  # only the teardown's collection may free the cycle
    try:
        standby_process._run_with_rehearsal("path", str(script), [])
    finally:
        gc.enable()
    import builtins

    assert builtins._tm_alive is False  # type: ignore[attr-defined]
    del builtins._tm_alive, builtins._tm_rehearsal_ref  # type: ignore[attr-defined]


# -- the meshes torch's caches keep (tmrun.worker.stale_meshes) ---------------------------------------


class Mesh:
    """Stands for torch's DeviceMesh: equal by layout, coordinates not compared."""

    def __init__(self, layout: str, coordinate: tuple[int, ...]) -> None:
        self.layout, self.coordinate = layout, coordinate

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self.layout == other.layout

    def __hash__(self) -> int:
        return hash(self.layout)

    def get_coordinate(self) -> tuple[int, ...]:
        return self.coordinate


@pytest.fixture
def mesh_class(monkeypatch: pytest.MonkeyPatch) -> type[Mesh]:
    from tmrun.worker import stale_meshes

    monkeypatch.setattr(stale_meshes, "mesh_class", lambda: Mesh)
    gc.freeze()  # as the rehearsal does: the scans see only what the test makes (unfrozen after it)
    return Mesh


class Spec:
    """Stands for a cached DTensorSpec (an instance dict) and a slotted holder."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh


class SlotSpec:
    __slots__ = ("mesh",)

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh


def test_the_second_runs_mesh_takes_the_place_of_the_cached_rehearsal_mesh_at_once(mesh_class: type[Mesh]) -> None:
    original_init = Mesh.__init__
    stale = Mesh("2x2", (0, 0))  # rank 0's, kept by torch's caches in every kind of holder
    spec, slotted, listed, kept = Spec(stale), SlotSpec(stale), [stale], (stale,)
    cache = {stale: spec}
    lonely = Mesh("1d", (0,))  # cached too; the second run makes no mesh equal to it
    meshes = StaleMeshes()
    assert meshes.remember() == 2
    assert meshes.collect_holders() == 2
    meshes.watch()
    real = Mesh("2x2", (0, 1))  # the second run, as rank 1: replaced as soon as it is made
    assert spec.mesh is real and slotted.mesh is real and listed[0] is real
    assert next(iter(cache)) is real and cache[real] is spec  # still a cache hit, now with the script's mesh
    assert kept[0] is stale and stale.get_coordinate() == (0, 1)  # a tuple cannot change: its mesh has rank 1's state
    assert meshes.replaced == 1 and meshes.unchangeable == 1
    assert meshes.finish() == 1  # the 1-D one: retired
    assert lonely != Mesh("1d", (1,)) and Mesh("1d", (1,)) != lonely  # no cache lookup returns it
    assert type(lonely).__name__ == "RetiredMesh" and isinstance(lonely, Mesh)
    assert Mesh.__init__ is original_init  # not watched any more
    assert meshes.finish() == 0


def test_a_mesh_collected_after_the_rehearsal_is_not_replaced(mesh_class: type[Mesh]) -> None:
    gone = Mesh("2x2", (0, 0))
    ref = weakref.ref(gone)
    meshes = StaleMeshes()
    meshes.remember()
    del gone
    gc.collect()
    assert ref() is None and meshes.collect_holders() == 0
    meshes.watch()
    kept = Mesh("2x2", (1, 1))
    assert meshes.replaced == 0 and meshes.finish() == 0 and kept.get_coordinate() == (1, 1)


@pytest.mark.e2e
def test_torchs_caches_keep_the_rehearsals_mesh_and_re_seating_gives_the_ranks_coordinates() -> None:
    """The hazard itself, on torch: FSDP2 (HSDP) run as rank 0 on a fake process group leaves a
    mesh in torch's caches (equal to any later mesh of that layout, with rank 0's coordinates);
    built again as rank 1, the new mesh takes its place in those caches at once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def train(rank: int) -> DeviceMesh:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        return mesh

    meshes = StaleMeshes()
    try:
        train(0)
        meshes.remember()
        dist.destroy_process_group()
        gc.collect()
        assert meshes.collect_holders() >= 1, "torch no longer caches a rehearsal's mesh"
        meshes.watch()
        real = train(1)
        assert meshes.replaced >= 1
        specs = [s for s in gc.get_objects() if type(s).__name__ == "DTensorSpec"]
        assert specs and all(s.mesh is real for s in specs if s.mesh == real)  # the caches' specs hold rank 1's mesh
        meshes.finish()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("ending", ["warm", "assigned", "failed"])
def test_the_second_run_replaces_the_rehearsals_cached_meshes_however_it_ended(mesh_class: type[Mesh],
                                                                               ending: str) -> None:
    """Whether the rehearsal ended warm (it remembered its meshes), was assigned before, or raised
    (a cold standby follows): the second run's mesh takes the cached mesh's place."""
    rehearsal.allow()
    rehearsal.begin()
    spec = Spec(Mesh("2x2", (0, 0)))  # held by a cache
    if ending == "failed":
        assert rehearsal.failed(RuntimeError("needs a peer"))
    else:
        rehearsal.remember_meshes()
        with pytest.raises(rehearsal.Rehearsed):
            rehearsal.end(ASSIGNED, 1.0) if ending == "assigned" else rehearsal.leave_warm()
    rehearsal.tear_down()
    assert rehearsal.carried() == ((ASSIGNED, 1.0, True) if ending == "assigned" else (None, 0.0, True))
    assert rehearsal.waits_warm() == (ending == "warm")
    real = Mesh("2x2", (1, 1))  # the second run's
    assert spec.mesh is real
    assert rehearsal.finish_meshes() == (1, 0)
