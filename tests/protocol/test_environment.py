"""The launch environment is one type: what the agent writes is what the worker reads, and a
bad value is a one-line LaunchEnvError."""

from __future__ import annotations

import pytest

from tmrun.protocol import environment
from tmrun.protocol.environment import LaunchEnv, LaunchEnvError, Mode


def test_round_trip_of_every_mode() -> None:
    active = LaunchEnv(mode=Mode.ACTIVE, store_host="10.0.0.1", store_port=29400, store_prefix="tmrun/r/ip/3/",
                       gen_file="/tmp/gen-3", run_id="r", agent_pid=42, shadow_steps=0, recovery_timeout=7.5,
                       comm_timeout=2.0, same_host_reads=False, heal_reads=False, entrypoint=("python", "-u", "train.py", "--x"))
    standby = LaunchEnv(mode=Mode.STANDBY, store_host="h", store_port=1, standby_id=1003, ready_file="/tmp/r")
    for env in (active, standby, LaunchEnv()):
        assert LaunchEnv.from_environ(env.to_environ()) == env


def test_torchrun_variables_are_read_not_written() -> None:
    env = LaunchEnv.from_environ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.mode) == (3, 8, 1, Mode.PLAIN)
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(env.to_environ())


def test_only_tmrun_variables_are_written() -> None:
    assert all(name.startswith("TMRUN_") for name in LaunchEnv(mode=Mode.ACTIVE, store_host="h").to_environ())


@pytest.mark.parametrize("environ,match", [
    ({environment.ENV_STORE: "no-port"}, "is not host:port"),
    ({environment.ENV_SHADOW_STEPS: "many"}, "is not a number"),
    ({environment.ENV_COMM_TIMEOUT: "-1"}, "must not be negative"),
    ({environment.ENV_HANDOVER: "pigeon"}, "must be auto or socket"),
    ({environment.ENV_HEAL_PATH: "auto"}, "must be memory or socket"),
    ({environment.ENV_STANDBY_ID: "x"}, "is not an integer"),
    ({environment.ENV_ENTRYPOINT: "{}"}, "is not a JSON list"),
])
def test_bad_values_are_one_line_errors(environ: dict[str, str], match: str) -> None:
    with pytest.raises(LaunchEnvError, match=match) as caught:
        LaunchEnv.from_environ(environ)
    assert "\n" not in str(caught.value)
