"""The fault matrix (docs/reliability.md): one short multi-process test per case that no other
test covers; every one is marked e2e (module level, below each file's imports)."""

from __future__ import annotations


import pytest

from tests.e2e.test_inplace_one_node import _run

STEPS = 12


@pytest.fixture(scope="package")
def reference3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A failure-free run of three workers (the example, the same seed): its final digest."""
    code, log, final, steps = _run(tmp_path_factory.mktemp("ref3"), "ref3", nproc=3, standby=0, step_time=0.1)
    assert code == 0, log
    assert final, log
    assert [s for s, _ in steps[0]] == list(range(STEPS))
    return final
