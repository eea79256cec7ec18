"""Starting a job on etcd with bad input: one line, non-zero exit, no traceback, nothing left."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers import EXAMPLES, free_port, run, tmrun_cmd
from tmrun.protocol import keys
from tmrun.protocol.etcd import EtcdConfig, EtcdStore
from tmrun.rendezvous.election import job_key_prefix

SCRIPT = str(EXAMPLES / "train_inplace.py")


def _one_error_line(args: list[str], expected: str) -> None:
    result = run(tmrun_cmd(*args), timeout=90)
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stdout, result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("tmrun: error:")]
    assert len(errors) == 1 and expected in errors[0], result.stdout


@pytest.mark.e2e  # starts tmrun, which imports torch
def test_unreachable_etcd_is_one_line() -> None:
    _one_error_line(["--nnodes", "1", "--standby", "1", "--rdzv-backend", "tmrun-etcd", "--rdzv-endpoint",
                     f"127.0.0.1:{free_port()}", "--rdzv-conf", "connect_timeout=2", SCRIPT],
                    "etcd unreachable")


@pytest.mark.e2e
def test_a_finished_run_id_is_refused(etcd_server) -> None:  # type: ignore[no-untyped-def]
    run_id = f"done-{uuid.uuid4().hex[:8]}"
    store = EtcdStore.for_job(EtcdConfig.parse(etcd_server.endpoint), run_id)
    store.set(job_key_prefix(run_id) + keys.CLOSED, "{}")
    _one_error_line(["--nnodes", "1", "--standby", "1", "--rdzv-backend", "tmrun-etcd", "--rdzv-endpoint",
                     etcd_server.endpoint, "--rdzv-id", run_id, SCRIPT], "already ran to its end")
