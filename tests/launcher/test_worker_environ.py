"""What an in-place worker gets in its environment besides the TMRUN_* variables."""

from __future__ import annotations

import pytest

from tmrun.launcher.roles.base import worker_environ
from tmrun.protocol.environment import (
    ENV_NCCL_ERROR_HANDLING,
    NCCL_WATCHDOG_DEFAULTS,
    ENV_THP_ALLOC,
    ENV_TORCH_CPP_LOG_LEVEL,
    LaunchEnv,
    Mode,
)


def _env() -> LaunchEnv:
    return LaunchEnv(mode=Mode.ACTIVE, store_host="127.0.0.1", store_port=1, store_prefix="p", run_id="r")


def test_huge_pages_for_torch_allocations_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_THP_ALLOC, raising=False)
    monkeypatch.delenv(ENV_TORCH_CPP_LOG_LEVEL, raising=False)
    for name in NCCL_WATCHDOG_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    environ = worker_environ(_env())
    assert environ[ENV_THP_ALLOC] == "1" and environ[ENV_TORCH_CPP_LOG_LEVEL] == "ERROR"
    # torch's watchdog cleans up a failed NCCL communicator without killing the survivor, with
    # no flight recorder, dump or heartbeat monitor (the recorder's traceback killed a survivor)
    assert environ[ENV_NCCL_ERROR_HANDLING] == "2"
    assert {name: environ[name] for name in NCCL_WATCHDOG_DEFAULTS} == {
        ENV_NCCL_ERROR_HANDLING: "2", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0"}
    ours = (ENV_THP_ALLOC, ENV_TORCH_CPP_LOG_LEVEL, *NCCL_WATCHDOG_DEFAULTS)
    assert {k: v for k, v in environ.items() if k not in ours} == _env().to_environ()
    monkeypatch.setenv(ENV_NCCL_ERROR_HANDLING, "3")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")  # the user's flight recorder stays theirs
    chosen = worker_environ(_env())
    assert ENV_NCCL_ERROR_HANDLING not in chosen and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in chosen
    monkeypatch.setenv(ENV_THP_ALLOC, "0")  # the user's choices are inherited as they are
    monkeypatch.setenv(ENV_TORCH_CPP_LOG_LEVEL, "INFO")
    assert ENV_THP_ALLOC not in worker_environ(_env()) and ENV_TORCH_CPP_LOG_LEVEL not in worker_environ(_env())


def test_an_nccl_library_override_is_preloaded(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """TMRUN_NCCL_LIBRARY: the workers preload it, so torch's ProcessGroupNCCL binds to it."""
    library = tmp_path / "libnccl.so.2"
    library.write_bytes(b"")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("TMRUN_NCCL_LIBRARY", raising=False)
    assert "LD_PRELOAD" not in worker_environ(_env())
    monkeypatch.setenv("TMRUN_NCCL_LIBRARY", str(library))
    assert worker_environ(_env())["LD_PRELOAD"] == str(library)
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")  # what the user preloads stays, after it
    assert worker_environ(_env())["LD_PRELOAD"] == f"{library}:/opt/other.so"
