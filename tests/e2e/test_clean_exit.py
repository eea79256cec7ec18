"""Clean ends (issue 31): the worker-API example under plain torchrun exits 0 run after run, with
no std::terminate at a worker's exit (it once ended 'terminate called without an active
exception', SIGABRT, and failed the README's test command on a fresh clone)."""

from __future__ import annotations

from tests.helpers import EXAMPLES, free_port, run, torchrun_cmd

RUNS = 6


def test_the_example_under_plain_torchrun_exits_0_every_time() -> None:
    for attempt in range(RUNS):
        result = run(torchrun_cmd("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                                  "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                                  str(EXAMPLES / "train_inplace.py"), "--steps", "6", "--width", "32"),
                     timeout=180)
        assert result.returncode == 0, (attempt, result.stdout[-4000:])
        assert "terminate called" not in result.stdout and "Traceback" not in result.stdout, (attempt, result.stdout)
