"""Failure-free reference runs shared by every end-to-end module that compares against the same
job (the suite runs on 2 cores: each reference is a whole job, run once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def one_node_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The example on one node (2 workers, a standby), STEPS steps, no failure: its final digest."""
    from tests.e2e.test_inplace_one_node import STEPS, _run

    code, log, final, steps = _run(tmp_path_factory.mktemp("ref"), "ref")
    assert code == 0, log
    assert final, log
    assert [s for s, _ in steps[0]] == list(range(STEPS))
    return final


@pytest.fixture(scope="session")
def one_node_migration_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same for MIGRATION_STEPS steps (the migration tests' length)."""
    from tests.e2e.test_inplace_one_node import MIGRATION_STEPS, _run

    code, log, final, _ = _run(tmp_path_factory.mktemp("ref"), "noswitch", steps=MIGRATION_STEPS)
    assert code == 0 and final, log
    return final


@pytest.fixture(scope="session")
def nodes_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The several-node tests' job with no failure: 4 ranks on one node (the same ring, the same
    sums as 2 nodes of 2)."""
    from tests.e2e.test_inplace_nodes import JOB_TIMEOUT, SCRIPT_ARGS, WORLD
    from tests.helpers import EXAMPLES, kill_tree, leftovers, start, tmrun_cmd

    work = tmp_path_factory.mktemp("ref")
    cmd = tmrun_cmd("--standalone", "--nproc-per-node", str(WORLD), "--standby", "1",
                    str(EXAMPLES / "train_inplace.py"), *SCRIPT_ARGS, "--final", str(work / "final"))
    agent = start(cmd, log=work / "agent.log", env={"TMRUN_STATE_DIR": str(work / "state")})
    try:
        assert agent.wait(timeout=JOB_TIMEOUT) == 0, (work / "agent.log").read_text()
    finally:
        kill_tree(agent)
        assert leftovers(agent) == []
    return (work / "final").read_text().strip()
