"""End to end: examples/train_hsdp.py (FSDP2 HSDP on a 2 x 2 ("replicate", "shard") mesh, a tiny
GPT, AdamW, an LR schedule and a data loader tracked) under tmrun with a standby, and under plain
torchrun: no failure, the same final bits on every rank. (The standby's sandbox building the same
mesh: tests/comm/test_mesh_dist.py.)"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import EXAMPLES, kill_tree, leftovers, start, tmrun_cmd, torchrun_cmd

SCRIPT = [str(EXAMPLES / "train_hsdp.py"), "--steps", "4", "--layers", "1"]
ENV = {"OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], log: Path) -> None:
    proc = start(cmd, log=log, env=ENV)
    try:
        code = proc.wait(timeout=150)
    finally:
        kill_tree(proc)
    assert code == 0, log.read_text()[-4000:]
    assert leftovers(proc) == []


def _finals(tmp_path: Path, name: str) -> list[str]:
    return [(tmp_path / f"{name}-{r}").read_text().strip() for r in range(4)]


def test_hsdp_example_under_tmrun_equals_torchrun(tmp_path: Path) -> None:
    _run(tmrun_cmd("--standalone", "--nproc-per-node", "4", "--standby", "1", "--console", "plain",
                   *SCRIPT, "--final", str(tmp_path / "tmrun-{rank}")), tmp_path / "tmrun.log")
    _run(torchrun_cmd("--standalone", "--nproc-per-node", "4", *SCRIPT, "--final", str(tmp_path / "torchrun-{rank}")),
         tmp_path / "torchrun.log")
    tm, ref = _finals(tmp_path, "tmrun"), _finals(tmp_path, "torchrun")
    assert tm == ref  # bit for bit, rank by rank (shards, optimizer state, schedule, loader position)
    assert tm[0] == tm[2] and tm[1] == tm[3] and tm[0] != tm[1]  # replicas agree, shards differ
    assert "0 in-place recoveries" in (tmp_path / "tmrun.log").read_text()
