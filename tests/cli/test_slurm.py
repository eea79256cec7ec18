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


@pytest.fixture(autouse=True)
def _fake_cluster_names_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """The faked steps name nodes (gpu01...) that do not resolve here; the real lookup is
    tested below and by the SLURM cluster tests (tests/e2e/slurm)."""
    monkeypatch.setattr("tmrun.cli.main.node_address", lambda name, env: name)


def test_node_address_of_a_resolvable_name_is_the_name() -> None:
    from tmrun.cli.slurm import node_address

    assert node_address("localhost", {}) == "localhost"


def test_node_address_without_dns_or_scontrol_says_what_to_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from tmrun.cli.slurm import SlurmStepError, node_address

    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(SlurmStepError, match="does not resolve.*pass --rdzv-endpoint HOST:PORT"):
        node_address("no-such-node.invalid", {})


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
    assert "node_rank=2" in args.rdzv_conf
    assert args.max_restarts == 3
    assert args.ops_port == 30400 + 242  # tmrun-ctl finds the leader from any node of the allocation


def test_explicit_options_override_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SLURM_ENV.items():
        monkeypatch.setenv(key, value)
    args = parse(
        ["--nnodes", "1", "--rdzv-endpoint", "head:1234", "--rdzv_id", "mine", "--node_rank", "0", "--max-restarts", "7", SCRIPT]
    )
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.node_rank, args.max_restarts) == ("1", "head:1234", "mine", 0, 7)


def _in_step(monkeypatch: pytest.MonkeyPatch, **overrides: str) -> None:
    for key in list(__import__("os").environ):
        if key.startswith("SLURM"):
            monkeypatch.delenv(key)
    for key, value in {**SLURM_ENV, **overrides}.items():
        if value:
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)


def test_slurm_step_too_small_for_standby_nodes_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    _in_step(monkeypatch, SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="gpu[01-02]")
    from tmrun.cli.main import UsageError

    with pytest.raises(UsageError, match=r"too few for --standby 2 .*srun -N3.*on one node"):
        parse(["--standby", "2", SCRIPT])


@pytest.mark.parametrize("extra", [[], ["--standalone"]])
def test_one_node_step_standby_means_processes(monkeypatch: pytest.MonkeyPatch, extra: list[str]) -> None:
    """The README's command on a one-node allocation: --standby 1 is one standby worker process,
    the store is on this host (no node name to resolve), with or without --standalone."""
    _in_step(monkeypatch, SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="gpu01", SLURM_NODEID="0")
    args = parse([*extra, "--nproc-per-node", "2", "--standby", "1", SCRIPT])
    assert args.nnodes == "1" and args.standby == 1
    assert args.rdzv_endpoint == "localhost:0"
    assert args.rdzv_backend == "tmrun"


def test_standalone_on_a_multi_node_step_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _in_step(monkeypatch)
    from tmrun.cli.main import UsageError

    with pytest.raises(UsageError, match="--standalone runs a one-node job, but this SLURM step has 3 nodes"):
        parse(["--standalone", "--standby", "1", SCRIPT])


def test_several_tasks_per_node_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _in_step(monkeypatch, SLURM_STEP_TASKS_PER_NODE="2(x3)", SLURM_STEP_NUM_TASKS="6")
    from tmrun.cli.main import UsageError

    with pytest.raises(UsageError, match=r"6 tasks on 3 node.*srun --ntasks-per-node=1"):
        parse(["--standby", "1", SCRIPT])


def test_uneven_tasks_per_node_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _in_step(monkeypatch, SLURM_STEP_TASKS_PER_NODE="2,1(x2)")
    from tmrun.cli.main import UsageError

    with pytest.raises(UsageError, match="4 tasks on 3 node"):
        parse(["--standby", "1", SCRIPT])


def test_one_task_per_node_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    _in_step(monkeypatch, SLURM_STEP_TASKS_PER_NODE="1(x3)", SLURM_STEP_NUM_TASKS="3")
    assert parse(["--standby", "1", SCRIPT]).nnodes == "2"


def test_outside_a_step_of_a_multi_node_job_says_use_srun(monkeypatch: pytest.MonkeyPatch) -> None:
    _in_step(monkeypatch, SLURM_STEP_ID="", SLURM_STEP_NODELIST="", SLURM_STEP_NUM_NODES="", SLURM_JOB_NUM_NODES="3")
    from tmrun.cli.main import UsageError

    with pytest.raises(UsageError, match=r"outside an srun step of a 3-node allocation.*srun --ntasks-per-node=1"):
        parse(["--standby", "1", SCRIPT])
    assert parse(["--nnodes", "1", "--standby", "1", SCRIPT]).nnodes == "1"


def test_outside_a_step_of_a_one_node_job_runs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    _in_step(monkeypatch, SLURM_STEP_ID="", SLURM_STEP_NODELIST="", SLURM_STEP_NUM_NODES="", SLURM_JOB_NUM_NODES="1",
             SLURM_JOB_NODELIST="gpu01", SLURM_NNODES="1", SLURM_NODEID="0")
    args = parse(["--nproc-per-node", "2", "--standby", "1", SCRIPT])
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_id) == ("1", "localhost:0", "slurm-4242")


def test_each_step_has_its_own_store_port(monkeypatch: pytest.MonkeyPatch) -> None:
    ports = set()
    for step in range(10):
        _in_step(monkeypatch, SLURM_STEP_ID=str(step))
        args = parse(["--standby", "1", SCRIPT])
        ports.add((args.rdzv_endpoint, args.ops_port))
        assert args.rdzv_id == f"slurm-4242.{step}"
    assert len(ports) == 10


def test_node_rank_is_a_leader_hint_not_a_static_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch warns that node_rank is only for the static backend: tmrun passes it in rdzv_conf."""
    _in_step(monkeypatch)
    args = parse(["--standby", "1", SCRIPT])
    assert "node_rank=2" in args.rdzv_conf and args.node_rank == 0
    assert "is_host=0" in args.rdzv_conf  # only the step's first node (SLURM_NODEID 0) hosts the store
    _in_step(monkeypatch, SLURM_NODEID="0")
    assert "is_host=1" in parse(["--standby", "1", SCRIPT]).rdzv_conf


def test_slurm_node_name_tags_log_lines(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tmrun.console import say
    from tmrun.protocol import environment

    _in_step(monkeypatch, SLURMD_NODENAME="gpu03")
    monkeypatch.setenv(environment.ENV_NODE_NAME, "")  # recorded, so undone after the test
    monkeypatch.delenv(environment.ENV_NODE_NAME)
    parse(["--standby", "1", SCRIPT])
    say("hello")
    assert "[tmrun@gpu03 " in capsys.readouterr().err


def test_two_node_step_with_one_standby_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """srun -N2 tmrun --standby 1: one active node and one standby node (not one node with a
    standby process on each of two independent jobs)."""
    from tmrun.cli.main import _across_nodes

    _in_step(monkeypatch, SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="gpu[01-02]", SLURM_NODEID="1")
    args = parse(["--standby", "1", SCRIPT])
    assert args.nnodes == "1" and args.rdzv_endpoint.startswith("gpu01:") and _across_nodes(args)
    _in_step(monkeypatch, SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="gpu01", SLURM_NODEID="0")
    assert not _across_nodes(parse(["--standby", "1", SCRIPT]))
