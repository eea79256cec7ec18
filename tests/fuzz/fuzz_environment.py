"""Fuzz the launch environment (tmrun/protocol/environment.py ``LaunchEnv.from_environ``): any
values of the variables either read into a LaunchEnv or raise a one-line LaunchEnvError; what
reads, written back with ``to_environ`` (plus the torchrun variables), reads back the same.
Also the failure drills the launcher passes to the workers in ``TMRUN_INJECT_FAILURE``
(tmrun/protocol/drills.py ``parse_all``): a list of drills or a one-line DrillSpecError; what
parses re-parses from its encoding to the same drills; times and factors are finite.

    python tests/fuzz/fuzz_environment.py -atheris_runs=100000
    python tests/fuzz/fuzz_environment.py -max_total_time=150
"""

from __future__ import annotations

import json
import sys

from _harness import atheris, expect_error, main

with atheris.instrument_imports(include=["tmrun"]):
    from tmrun.protocol import drills as d
    from tmrun.protocol import environment as e

NAMES = [
    e.ENV_STORE, e.ENV_ROLE, e.ENV_RUN_ID, e.ENV_TORCHELASTIC_RUN_ID, e.ENV_GEN_FILE, e.ENV_PREFIX,
    e.ENV_STANDBY_ID, e.ENV_AGENT_PID, e.ENV_SHADOW_STEPS, e.ENV_RECOVERY_TIMEOUT, e.ENV_COMM_TIMEOUT,
    e.ENV_HANDOVER, e.ENV_HEAL_PATH, e.ENV_ENTRYPOINT, e.ENV_READY_FILE, e.ENV_PROGRESS_DIR, e.ENV_RANK,
    e.ENV_WORLD_SIZE, e.ENV_LOCAL_RANK,
]
TYPICAL = ["", "0", "1", "-1", "2.5", "nan", "inf", "-inf", "1e400", "\u00b2", "\u0661", " 7 ", "1_0", "standby",
           "auto", "socket", "memory", "h:1", "h:", ":1", "[::1]:29500", "h:99999", "h:\u00b2", "[]", '["a", 1]',
           "[" * 3000, "{}", "0x10"]


def _read(environ: dict[str, str]) -> e.LaunchEnv | None:
    try:
        return e.LaunchEnv.from_environ(environ)
    except Exception as exc:  # noqa: BLE001
        expect_error(exc, e.LaunchEnvError)
        return None


DRILL_WORDS = ["rank=1", "node=0", "step=8", "at=forward", "at=handover", "time=2.5", "time=nan", "time=inf",
               "signal=RAISE", "signal=STALL", "signal=TERM", "who=joiner", "slow=3x", "slow=nanx", "slow=infx",
               "rank=\u00b2", "step=1e3", "step=-1", "time=-0", ",", ";", "=", " "]


def _drills(fdp: atheris.FuzzedDataProvider) -> None:
    if fdp.ConsumeBool():
        text = "".join(fdp.PickValueInList(DRILL_WORDS) + fdp.PickValueInList([",", ";", ""])
                       for _ in range(fdp.ConsumeIntInRange(1, 6)))
    else:
        text = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 80))
    try:
        drills = d.parse_all(text)
    except Exception as exc:  # noqa: BLE001
        expect_error(exc, d.DrillSpecError)
        return
    for drill in drills:
        assert drill.seconds < float("inf") and drill.slow < float("inf"), (text, drill)
        assert drill.seconds == drill.seconds and drill.slow == drill.slow, (text, drill)
    again = d.parse_all(";".join(x.encode() for x in drills))
    assert again == drills, (text, drills, again)


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.ConsumeIntInRange(0, 3) == 0:
        _drills(fdp)
        return
    environ: dict[str, str] = {}
    for name in NAMES:
        choice = fdp.ConsumeIntInRange(0, 3)
        if choice == 1:
            environ[name] = fdp.PickValueInList(TYPICAL)
        elif choice == 2:
            environ[name] = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 24))
    env = _read(environ)
    if env is None:
        return
    assert 0 <= env.store_port <= 65535 and env.shadow_steps >= 0, env
    assert env.recovery_timeout >= 0 and env.comm_timeout >= 0, env
    again = dict(env.to_environ())
    again.update({e.ENV_RANK: str(env.rank), e.ENV_WORLD_SIZE: str(env.world_size),
                  e.ENV_LOCAL_RANK: str(env.local_rank)})
    assert e.LaunchEnv.from_environ(again) == env, (environ, env)


def seeds() -> list[bytes]:
    full = e.LaunchEnv(mode=e.Mode.STANDBY, rank=1, world_size=2, store_host="h", store_port=1, gen_file="g",
                       run_id="r", standby_id=0, agent_pid=5, entrypoint=("a.py", "--x"))
    return [json.dumps(full.to_environ()).encode(), bytes(64), bytes([1] * 64), bytes([2] * 200)]


if __name__ == "__main__":
    main(test_one_input, seeds())
    sys.exit(0)
