"""User mistakes: one clear line, a non-zero exit, no traceback, nothing left running."""

from __future__ import annotations

import pytest

from tests.helpers import EXAMPLES, free_port, run, tmrun_cmd
from tmrun.cli.main import main

SCRIPT = str(EXAMPLES / "train_checkpoint.py")

CASES = {
    "unknown option": (["--no-such-option", SCRIPT], "unrecognized arguments"),
    "missing script": (["--standalone", "/nonexistent/train.py"], "not found"),
    "zero processes": (["--standalone", "--nproc-per-node", "0", SCRIPT], "--nproc-per-node"),
    "zero processes, underscore spelling": (["--standalone", "--nproc_per_node=0", SCRIPT], "--nproc-per-node"),
    "negative standby": (["--standalone", "--standby", "-1", SCRIPT], "--standby"),
    "bad nnodes": (["--nnodes", "3:1", SCRIPT], "--nnodes"),
    "malformed endpoint": (["--nnodes", "2", "--rdzv-endpoint", "host:notaport", SCRIPT], "malformed rendezvous endpoint"),
    "port out of range": (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:70000", SCRIPT], "out of range"),
    "standby with static backend": (["--nnodes", "2", "--rdzv-backend", "static", "--standby", "1", SCRIPT], "tmrun rendezvous backend"),
    "no script": (["--standalone"], "required"),
    "module and no-python": (["--standalone", "--no-python", "-m", "json.tool"], "--no-python"),
    "malformed drill": (["--standalone", "--inject-failure", "rank=1", SCRIPT], "step=N or time"),
    "drill with an unknown point": (["--standalone", "--inject-failure", "rank=1,step=2,at=lunch", SCRIPT], "at="),
    "negative standby wait": (["--standalone", "--standby-wait", "-1", SCRIPT], "--standby-wait"),
    "negative shadow steps": (["--standalone", "--shadow-steps", "-2", SCRIPT], "--shadow-steps"),
    "negative refill delay": (["--standalone", "--standby-refill-delay", "-1", SCRIPT], "--standby-refill-delay"),
    "node drill with a rank": (["--standalone", "--inject-failure", "rank=1,node=1,step=2", SCRIPT], "rank=N or node=G"),
    "etcd without an endpoint": (["--nnodes", "2", "--rdzv-backend", "tmrun-etcd", SCRIPT], "needs --rdzv-endpoint"),
    "malformed etcd endpoint": (["--nnodes", "2", "--rdzv-backend", "tmrun-etcd", "--rdzv-endpoint", "a:b:c:x", SCRIPT],
                                "malformed etcd endpoint"),
}


ENV_CASES = {
    "unknown device plane": ({"TMRUN_DEVICE_PLANE": "infiniband"}, "TMRUN_DEVICE_PLANE='infiniband' is not one of"),
    "missing NCCL library": ({"TMRUN_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"}, "TMRUN_NCCL_LIBRARY"),
    "bad orphan grace": ({"TMRUN_ORPHAN_GRACE": "-3"}, "TMRUN_ORPHAN_GRACE='-3' is not a number of seconds >= 0"),
    "unknown heal overlap": ({"TMRUN_HEAL_OVERLAP": "sometimes"},
                             "TMRUN_HEAL_OVERLAP='sometimes' is not one of auto, on, off"),
    "unknown commit vote": ({"TMRUN_COMMIT_VOTE": "maybe"}, "TMRUN_COMMIT_VOTE='maybe' is not one of on, off"),
}


@pytest.mark.parametrize("name", sorted(CASES) + sorted(ENV_CASES))
def test_bad_input_is_one_clear_line(name: str, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if name in ENV_CASES:
        environ, expected = ENV_CASES[name]
        for key, value in environ.items():
            monkeypatch.setenv(key, value)
        args = ["--standalone", "--nproc-per-node", "2", SCRIPT]
    else:
        args, expected = CASES[name]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("tmrun: error:") and expected in lines[0]


@pytest.mark.e2e  # starts processes that import torch: not in the unit subset
@pytest.mark.parametrize(
    "args, expected",
    [
        (["--no-such-option", SCRIPT], "unrecognized arguments"),
        (["--standalone", "/nonexistent/train.py"], "not found"),
        (["--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29400", SCRIPT], "cannot resolve"),
    ],
)
def test_bad_input_from_the_shell(args: list[str], expected: str) -> None:
    result = run(tmrun_cmd(*args), timeout=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stdout
    error_lines = [line for line in result.stdout.splitlines() if line.startswith("tmrun: error:")]
    assert len(error_lines) == 1 and expected in error_lines[0], result.stdout


@pytest.mark.e2e  # starts processes that import torch: not in the unit subset
def test_unreachable_endpoint_fails_within_connect_timeout() -> None:
    port = free_port()  # nothing listens there once the probe socket is closed
    args = [
        "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-conf", "is_host=false,connect_timeout=2", SCRIPT, "--ckpt-dir", "/tmp",
    ]  # fmt: skip
    result = run(tmrun_cmd(*args), timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stdout
    assert f"tmrun: error: cannot reach the rendezvous endpoint 127.0.0.1:{port} within 2 s" in result.stdout
