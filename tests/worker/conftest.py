"""Shared fixtures of the worker and controller tests."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture
def procs():  # type: ignore[no-untyped-def]
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
