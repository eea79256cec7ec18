"""Would SLURM end the job or the step with a node? The settings read from srun's arguments and
environment, the batch script and the site, and the warnings they give. (Against a real SLURM:
tests/e2e/slurm.)"""

from __future__ import annotations

import pytest

from tmrun.cli.slurm_check import KillSettings, SrunSettings, batch_script_no_kill, parse_srun_argv


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        (["srun", "tmrun", "x.py"], {}, SrunSettings(False, None)),
        (["srun", "--no-kill", "-N", "3", "tmrun", "x.py"], {}, SrunSettings(True, None)),
        (["srun", "-k", "-K1", "/usr/bin/tmrun", "x.py"], {}, SrunSettings(True, True)),
        (["srun", "--kill-on-bad-exit=0", "--no-kill", "python", "-m", "tmrun.cli.main"], {}, SrunSettings(True, False)),
        (["srun", "-K", "tmrun", "x.py", "--no-kill"], {}, SrunSettings(False, True)),  # the script's own flag
        (["srun", "tmrun", "x.py"], {"SLURM_NO_KILL": "1", "SLURM_KILL_BAD_EXIT": "1"}, SrunSettings(True, True)),
    ],
)
def test_srun_settings(argv: list[str], env: dict[str, str], expected: SrunSettings) -> None:
    assert parse_srun_argv(argv, env) == expected


def test_batch_script_directives() -> None:
    assert batch_script_no_kill("#!/bin/bash\n# a comment\n#SBATCH -N 3\n#SBATCH --no-kill\nsrun tmrun x.py\n")
    assert batch_script_no_kill("#!/bin/bash\n#SBATCH -k -N3\n")
    assert not batch_script_no_kill("#!/bin/bash\n#SBATCH -N 3\nsrun tmrun x.py\n#SBATCH --no-kill\n")  # after a command
    assert not batch_script_no_kill("#!/bin/bash\n#SBATCH -N 3\n")


def test_safe_settings_give_no_warning() -> None:
    assert KillSettings(True, SrunSettings(True, False), True).warnings() == []
    assert KillSettings(True, SrunSettings(True, None), False).warnings() == []


def test_each_unsafe_setting_says_what_to_add() -> None:
    lines = KillSettings(False, SrunSettings(False, None), True).warnings()
    assert len(lines) == 3
    assert "#SBATCH --no-kill" in lines[0]
    assert "srun --no-kill" in lines[1]
    assert "KillOnBadExit=1" in lines[2] and "srun --kill-on-bad-exit=0" in lines[2]
    assert "srun -K" in KillSettings(True, SrunSettings(True, True), False).warnings()[0]
    unknown = KillSettings(True, None, None).warnings()
    assert len(unknown) == 1 and "could not check how srun started this step" in unknown[0]
