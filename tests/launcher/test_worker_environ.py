"""What an in-place worker gets in its environment besides the TMRUN_* variables."""

from __future__ import annotations

import pytest

from tmrun.launcher.roles.base import worker_environ
from tmrun.protocol.environment import ENV_THP_ALLOC, ENV_TORCH_CPP_LOG_LEVEL, LaunchEnv, Mode


def _env() -> LaunchEnv:
    return LaunchEnv(mode=Mode.ACTIVE, store_host="127.0.0.1", store_port=1, store_prefix="p", run_id="r")


def test_huge_pages_for_torch_allocations_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_THP_ALLOC, raising=False)
    monkeypatch.delenv(ENV_TORCH_CPP_LOG_LEVEL, raising=False)
    environ = worker_environ(_env())
    assert environ[ENV_THP_ALLOC] == "1" and environ[ENV_TORCH_CPP_LOG_LEVEL] == "ERROR"
    assert {k: v for k, v in environ.items() if k not in (ENV_THP_ALLOC, ENV_TORCH_CPP_LOG_LEVEL)} == _env().to_environ()
    monkeypatch.setenv(ENV_THP_ALLOC, "0")  # the user's choices are inherited as they are
    monkeypatch.setenv(ENV_TORCH_CPP_LOG_LEVEL, "INFO")
    assert ENV_THP_ALLOC not in worker_environ(_env()) and ENV_TORCH_CPP_LOG_LEVEL not in worker_environ(_env())
