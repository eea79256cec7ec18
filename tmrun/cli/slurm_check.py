"""Would SLURM end this job or step when one node fails? Checked once, at start-up, on the
step's first node; each setting that would is one ``tmrun: warning:`` line saying what to add.

SLURM reacts to a node's failure by itself, after ``SlurmdTimeout``, whatever tmrun did: unless
the job was submitted with ``--no-kill`` it cancels the whole job (and requeues it); unless the
step was started with ``srun --no-kill`` it ends the step; with ``srun -K`` (or the site's
``KillOnBadExit=1``) a task that exits non-zero ends the step. None of this is in the tasks'
environment, so the check reads it where SLURM keeps it: the job's batch script (``scontrol
write batch_script``), the srun process that launched this step (its arguments and environment,
when it runs on this host, as it does from a batch script) and the site configuration
(``scontrol show config``). What it cannot see it says it could not check.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil

from tmrun.cli.slurm import scontrol

SCONTROL_TIMEOUT = 10.0
DOCS = "docs/slurm.md"


@dataclass(frozen=True)
class SrunSettings:
    no_kill: bool
    kill_on_bad_exit: bool | None  # None: srun did not say (the site's KillOnBadExit applies)


@dataclass(frozen=True)
class KillSettings:
    job_no_kill: bool  # confirmed (the batch script's directives, or SBATCH_NO_KILL); False: not confirmed
    step: SrunSettings | None  # None: the srun process is not on this host
    site_kill_on_bad_exit: bool | None

    def warnings(self) -> list[str]:
        lines = []
        if not self.job_no_kill:
            lines.append("no `#SBATCH --no-kill` in this job's batch script: unless the job was submitted with "
                         "--no-kill, SLURM cancels the whole job when any of its nodes fails, after tmrun's "
                         f"standby took over; add `#SBATCH --no-kill` ({DOCS})")
        if self.step is None:
            lines.append("could not check how srun started this step (srun is not on this host): it needs "
                         f"`srun --no-kill` and no `-K`, or SLURM ends the step with a node ({DOCS})")
            return lines
        if not self.step.no_kill:
            lines.append("srun ends this step when any of its nodes fails: start it with "
                         f"`srun --no-kill ...` ({DOCS})")
        kill_on_bad_exit = self.step.kill_on_bad_exit
        if kill_on_bad_exit is None:
            kill_on_bad_exit = bool(self.site_kill_on_bad_exit)
        if kill_on_bad_exit:
            origin = "srun -K" if self.step.kill_on_bad_exit else "the site's KillOnBadExit=1"
            lines.append(f"{origin} ends this step when one task exits non-zero, a lost node's agent included: "
                         f"add `srun --kill-on-bad-exit=0` ({DOCS})")
        return lines


def parse_srun_argv(argv: Sequence[str], env: Mapping[str, str]) -> SrunSettings:
    """srun's own options (those before the command it runs) and its input environment."""
    no_kill = env.get("SLURM_NO_KILL", "") not in ("", "0")
    kill_text = env.get("SLURM_KILL_BAD_EXIT")
    kill: bool | None = None if kill_text is None else kill_text not in ("", "0")
    for token in argv[1:]:
        if token.rsplit("/", 1)[-1].startswith(("tmrun", "python")):
            break  # the command srun runs: what follows are its arguments
        if token in ("-k", "--no-kill") or token.startswith("--no-kill="):
            no_kill = not token.endswith(("=off", "=no", "=0"))
        elif token in ("-K", "--kill-on-bad-exit"):
            kill = True
        elif match := re.fullmatch(r"(?:-K|--kill-on-bad-exit=)(\d+)", token):
            kill = match.group(1) != "0"
    return SrunSettings(no_kill, kill)


def batch_script_no_kill(script: str) -> bool:
    """True when the batch script's ``#SBATCH`` lines (before its first command) ask --no-kill."""
    for line in script.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not stripped.startswith("#SBATCH")):
            continue
        if not stripped.startswith("#SBATCH"):
            break  # sbatch stops reading directives at the first command
        options = stripped[len("#SBATCH"):].split()
        if any(o in ("-k", "--no-kill") or o.startswith("--no-kill=") for o in options):
            return True
    return False


def _job_no_kill(job_id: str, env: Mapping[str, str]) -> bool:
    if env.get("SBATCH_NO_KILL", "") not in ("", "0"):
        return True
    script = scontrol("write", "batch_script", job_id, "-", timeout=SCONTROL_TIMEOUT)  # None: not a batch job (salloc)
    return script is not None and batch_script_no_kill(script)


def _find_srun(env: Mapping[str, str]) -> psutil.Process | None:
    """The srun process that launched this step: on this host, listening on the step's port."""
    port_text = env.get("SLURM_SRUN_COMM_PORT", "")
    if not port_text.isdigit():
        return None
    port = int(port_text)
    for process in psutil.process_iter(["name"]):
        if process.info.get("name") != "srun":
            continue
        try:
            if any(c.laddr and c.laddr.port == port for c in process.net_connections(kind="tcp")):
                return process
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def read_kill_settings(env: Mapping[str, str]) -> KillSettings:
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    srun = _find_srun(env)
    step: SrunSettings | None = None
    if srun is not None:
        try:
            step = parse_srun_argv(srun.cmdline(), srun.environ())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            step = None
    job_no_kill = _job_no_kill(job_id, env)
    config = scontrol("show", "config", timeout=SCONTROL_TIMEOUT) or ""
    match = re.search(r"^KillOnBadExit\s*=\s*(\d+)", config, re.MULTILINE)
    return KillSettings(job_no_kill, step, (match.group(1) != "0") if match else None)
