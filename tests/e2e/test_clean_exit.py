"""Clean ends (issue 31): the worker-API example under plain torchrun exits 0 run after run, with
no std::terminate at a worker's exit (it once ended 'terminate called without an active
exception', SIGABRT, and failed the README's test command on a fresh clone)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from tests.helpers import EXAMPLES, free_port, kill_tree, run, start, torchrun_cmd

RUNS = 3


def test_the_example_under_plain_torchrun_exits_0_every_time() -> None:
    for attempt in range(RUNS):
        result = run(torchrun_cmd("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                                  "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                                  str(EXAMPLES / "train_inplace.py"), "--steps", "6", "--width", "32"),
                     timeout=180)
        assert result.returncode == 0, (attempt, result.stdout[-4000:])
        assert "terminate called" not in result.stdout and "Traceback" not in result.stdout, (attempt, result.stdout)


def test_a_survivor_under_plain_torchrun_raises_when_its_peer_dies(tmp_path: Path) -> None:
    """The worker-API example without tmrun's agent (torchrun's environment, set by hand so that
    nobody SIGTERMs the survivor first), rank 1 SIGKILLed at step 4: rank 0's backward raises
    one Python error naming the lost rank and the process exits 1. It died of SIGSEGV: the
    failed allreduce's future reached DDP's reducer as a success holding no tensors (torch's
    Python Future.set_exception only stores the exception as the value)."""
    port = str(free_port())
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "0", "TMRUN_INJECT_FAILURE": "rank=1,step=4"}
    script = [sys.executable, str(EXAMPLES / "train_inplace.py"), "--steps", "8", "--width", "32", "--step-time", "0.1"]
    victim = start(script, log=tmp_path / "rank1.log", env={**env, "RANK": "1", "LOCAL_RANK": "1"})
    try:
        survivor = run(script, timeout=120, env={**env, "RANK": "0", "LOCAL_RANK": "0"})
        assert victim.wait(timeout=60) == -signal.SIGKILL
    finally:
        kill_tree(victim)
    assert survivor.returncode == 1, survivor.stdout[-4000:]
    assert "PeerLostError" in survivor.stdout and "rank 1 lost" in survivor.stdout, survivor.stdout[-4000:]
    assert "Segmentation fault" not in survivor.stdout, survivor.stdout[-4000:]
