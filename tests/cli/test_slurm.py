"""SLURM: host-list expansion and the defaults a (faked) SLURM step gives the launcher."""

from __future__ import annotations

import pytest

from tests.helpers import EXAMPLES
from tmrun.cli.main import parse
from tmrun.cli.slurm import HostlistError, expand_hostlist, slurm_defaults

SCRIPT = str(EXAMPLES / "train_checkpoint.py")


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[009-011],y", ["x009", "x010", "x011", "y"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "node[01-", "node01]", "node[a-b]", "node[5-2]"])
def test_expand_hostlist_rejects_garbage(text: str) -> None:
    with pytest.raises(HostlistError):
        expand_hostlist(text)


SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[01-03]",
    "SLURM_STEP_NODELIST": "gpu[01-03]",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "2",
}


def test_slurm_defaults_read_the_step() -> None:
    defaults = slurm_defaults(SLURM_ENV)
    assert defaults is not None
    assert (defaults.nnodes_total, defaults.first_host, defaults.run_id, defaults.node_rank) == (3, "gpu01", "slurm-4242.0", 2)
    assert slurm_defaults({"HOME": "/root"}) is None


def test_srun_tmrun_needs_no_other_option(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SLURM_ENV.items():
        monkeypatch.setenv(key, value)
    args = parse(["--nproc-per-node", "8", "--standby", "1", SCRIPT])
    assert args.nnodes == "2"  # three nodes in the step, one of them a standby
    assert args.rdzv_backend == "tmrun"
    host, port = args.rdzv_endpoint.split(":")
    assert host == "gpu01" and 1024 < int(port) < 65536
    assert args.rdzv_id == "slurm-4242.0"
    assert args.node_rank == 2 and "node_rank=2" in args.rdzv_conf
    assert args.max_restarts == 3
    assert args.ops_port == 30400 + 242  # tmrun-ctl finds the leader from any node of the allocation


def test_explicit_options_override_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SLURM_ENV.items():
        monkeypatch.setenv(key, value)
    args = parse(
        ["--nnodes", "1", "--rdzv-endpoint", "head:1234", "--rdzv_id", "mine", "--node_rank", "0", "--max-restarts", "7", SCRIPT]
    )
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.node_rank, args.max_restarts) == ("1", "head:1234", "mine", 0, 7)


def test_slurm_step_too_small_for_standby(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SLURM_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "1")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu01")
    from tmrun.cli.main import UsageError

    with pytest.raises(UsageError, match="too few"):
        parse(["--standby", "1", SCRIPT])
