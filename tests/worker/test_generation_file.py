"""The generation file a waiting worker reads instead of asking the store every few ms."""

from __future__ import annotations

from pathlib import Path

from tmrun.worker.context import GenerationFile


def test_changes_are_seen_once_and_a_missing_file_is_not_usable(tmp_path: Path) -> None:
    path = tmp_path / "gen"
    assert not GenerationFile(str(path)).usable
    assert not GenerationFile("").usable
    path.write_text("0")
    wake = GenerationFile(str(path))
    assert wake.usable and not wake.changed()
    path.write_text("1")
    assert wake.changed() and not wake.changed()
    path.unlink()
    assert wake.changed()  # unreadable now: the waiter asks the store
