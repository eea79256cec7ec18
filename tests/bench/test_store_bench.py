"""bench/store_backends.py: exits 77 (skipped) where there is no etcd, and its takeover measure
runs against a real etcd."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script

BENCH = ROOT / "bench" / "store_backends.py"


def test_without_etcd_it_exits_77() -> None:
    result = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/nonexistent"})
    assert result.returncode == 77, result.stderr
    assert "needs the etcd binary" in result.stderr


@pytest.mark.e2e  # two lease holders and a kill: seconds
def test_takeover_is_bounded_by_the_lease(etcd_server) -> None:  # type: ignore[no-untyped-def]
    bench = load_script(BENCH, "store_backends")
    seconds = bench.takeover(etcd_server.endpoint, 1.0)
    assert 0 < seconds < 10
