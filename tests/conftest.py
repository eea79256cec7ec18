"""Shared fixtures, and the ``e2e`` marker: every test under ``tests/e2e/`` starts whole jobs
(agents, workers, standbys) and is marked ``e2e``, so ``pytest -m "not e2e"`` is the fast
unit subset."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def procs():  # type: ignore[no-untyped-def]
    """Child processes a test started; killed (by PID) and reaped at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
