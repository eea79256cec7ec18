"""The modules a standby waiting in tmrun.init() imports ahead (tmrun.worker.warm_imports)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tmrun.protocol import keys
from tmrun.worker import warm_imports


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A package on sys.path with a good module (importing a second one), a failing one and one
    that exits; every module it added is removed again."""
    root = tmp_path / "wi_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "good.py").write_text("from wi_pkg import dep\nVALUE = dep.VALUE + 1\n")
    (root / "dep.py").write_text("VALUE = 41\n")
    (root / "bad.py").write_text("raise RuntimeError('needs a GPU')\n")
    (root / "exits.py").write_text("raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "wi_pkg"
    for name in [n for n in sys.modules if n == "wi_pkg" or n.startswith("wi_pkg.")]:
        del sys.modules[name]


def test_module_names_are_the_real_modules_held() -> None:
    import json.decoder  # noqa: F401  (held by now)

    names = warm_imports.module_names()
    assert "json" in names and "json.decoder" in names
    assert "__main__" not in names
    assert "os.path" not in names  # an alias of posixpath: imported under its own name
    assert warm_imports.decode(warm_imports.encode(names)) == names


def test_import_missing_imports_what_is_not_held_and_skips_failures(package: str) -> None:
    result = warm_imports.import_missing(["json", f"{package}.good", f"{package}.bad", f"{package}.exits"])
    assert sys.modules[f"{package}.good"].VALUE == 42
    assert result.imported == 3  # the package, good and its dependency; json was held
    assert result.failed == [f"{package}.bad", f"{package}.exits"]
    again = warm_imports.import_missing([f"{package}.good"])
    assert again.imported == 0 and again.failed == []


def test_rank_0_of_a_job_with_subgroups_publishes_at_its_first_step_and_after_its_second() -> None:
    store = dist.HashStore()
    publisher = warm_imports.Publisher()
    publisher.at_step_start(store, rank=0, has_subgroups=True)
    assert "torch" in warm_imports.decode(store.get(keys.WARM_IMPORTS_SETUP))
    publisher.after_commit(store, rank=0, committed_step=0, has_subgroups=lambda: True)
    assert not store.check([keys.WARM_IMPORTS_STEADY])
    publisher.after_commit(store, rank=0, committed_step=1, has_subgroups=lambda: True)
    assert store.check([keys.WARM_IMPORTS_STEADY])


@pytest.mark.parametrize("rank, has_subgroups, env", [(1, True, "1"), (0, False, "1"), (0, True, "0")])
def test_nothing_published_by_other_ranks_without_subgroups_or_when_off(
        monkeypatch: pytest.MonkeyPatch, rank: int, has_subgroups: bool, env: str) -> None:
    monkeypatch.setenv("TMRUN_WARM_IMPORTS", env)
    store = dist.HashStore()
    publisher = warm_imports.Publisher()
    publisher.at_step_start(store, rank=rank, has_subgroups=has_subgroups)
    publisher.after_commit(store, rank=rank, committed_step=1, has_subgroups=lambda: has_subgroups)
    assert not store.check([keys.WARM_IMPORTS_SETUP]) and not store.check([keys.WARM_IMPORTS_STEADY])


def test_the_standby_imports_each_list_once_as_it_appears(package: str) -> None:
    store = dist.HashStore()
    said: list[str] = []
    importer = warm_imports.Importer(store, said.append)
    importer.poll()
    assert said == []  # nothing published yet
    store.set(keys.WARM_IMPORTS_SETUP, warm_imports.encode([package, f"{package}.bad"]))
    importer.poll()
    importer.poll()
    assert len(said) == 1 and "imported ahead 1 modules" in said[0] and "in its set-up" in said[0]
    assert f"1 could not be imported here, skipped: {package}.bad" in said[0]
    store.set(keys.WARM_IMPORTS_STEADY, warm_imports.encode([f"{package}.good"]))
    importer.poll()
    assert len(said) == 2 and "imported ahead 2 modules" in said[1] and "in its first steps" in said[1]
    assert importer.total.imported == 3 and importer.total.failed == [f"{package}.bad"]
