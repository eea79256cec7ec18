"""The real SLURM cluster fixture: one per test session (munged, slurmctld and three slurmd on
loopback), skipped with the reason where this machine cannot run one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.slurm.cluster import ClusterUnavailable, SlurmCluster, missing_reason, running


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(f"no SLURM here: {reason}")
    root = Path(tmp_path_factory.mktemp("slurm"))
    try:
        yield from running(root)
    except ClusterUnavailable as exc:
        pytest.fail(f"the SLURM cluster did not start: {exc} (logs in {root})")


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster; the jobs the test submits (``slurm.sbatch`` on its thread: not those of the
    module's background scenarios) are cancelled after it."""
    first = len(slurm_cluster.submitted)
    yield slurm_cluster
    me = threading.get_ident()
    slurm_cluster.cancel([job for thread, job in slurm_cluster.submitted[first:] if thread == me])
