"""Workers get the environment torchrun gives them: same variables, same values."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import SCRIPTS, run, tmrun_cmd, torchrun_cmd

# Values that differ between any two launches, or by design (documented in docs/user-guide.md).
RUN_SPECIFIC = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
BY_DESIGN = {
    # tmrun never hands workers the agents' store: each epoch gets a fresh store (see
    # research/peers.md, "stale addresses in a shared store").
    "TORCHELASTIC_USE_AGENT_STORE": ("True", "False"),
}


def _dump(cmd: list[str], out: Path) -> dict[int, dict[str, str]]:
    out.mkdir()
    result = run(cmd, timeout=120, env={"DUMP_DIR": str(out)})
    assert result.returncode == 0, result.stdout
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("env-*.json")}


def test_worker_environment_matches_torchrun(tmp_path: Path) -> None:
    script = str(SCRIPTS / "dump_env.py")
    common = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", script]
    torchrun_env = _dump(torchrun_cmd(*common), tmp_path / "torchrun")
    tmrun_env = _dump(tmrun_cmd(*common), tmp_path / "tmrun")
    assert sorted(torchrun_env) == sorted(tmrun_env) == [0, 1]
    for rank in (0, 1):
        theirs, ours = torchrun_env[rank], tmrun_env[rank]
        assert sorted(theirs) == sorted(ours), f"rank {rank}: {set(theirs) ^ set(ours)}"
        for key, value in theirs.items():
            if key in RUN_SPECIFIC:
                assert ours[key], key
            elif key in BY_DESIGN:
                assert (value, ours[key]) == BY_DESIGN[key]
            else:
                assert ours[key] == value, f"rank {rank} {key}: torchrun {value!r}, tmrun {ours[key]!r}"
    expected = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"}  # fmt: skip
    assert expected <= set(tmrun_env[1])
    assert tmrun_env[1]["RANK"] == "1" and tmrun_env[1]["WORLD_SIZE"] == "2"
