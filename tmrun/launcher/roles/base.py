"""The hooks an agent's role answers (see :mod:`tmrun.launcher.roles`)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from tmrun.protocol import environment
from tmrun.protocol.environment import LaunchEnv, Mode

if TYPE_CHECKING:
    from tmrun.launcher.agent import TmrunAgent
    from tmrun.rendezvous.handler import TmrunRendezvousHandler


class AgentRole:
    """Default answers: torch's behaviour, with the agent's instant failure detection."""

    def __init__(self, agent: TmrunAgent) -> None:
        self.agent = agent

    def start(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start (or adopt) the group's workers; returns local rank -> pid."""
        pids = self.agent.start_group(worker_group)
        self.agent.publish(worker_group, pids, self.standby_members())
        return pids

    def monitor(self, worker_group: WorkerGroup) -> RunResult:
        """One look at the workers (blocks until one exits, or a short interval passes)."""
        self.agent.wait_for_exit(self.agent.wait_interval)
        return self.agent.elastic_check(worker_group)

    def stop_promoted(self) -> None:
        """Stop the promoted standbys still running (the group is being stopped)."""

    def close(self) -> None:
        """The agent's run is over: stop everything this role started."""

    def standby_members(self) -> list[dict[str, object]]:
        return []


def in_place_env(agent: TmrunAgent, handler: TmrunRendezvousHandler, prefix: str, gen_file: str,
                 progress_dir: str = "") -> LaunchEnv:
    """Where workers and standby workers find the in-place protocol (job settings such as the
    shadow steps come from the agent's own environment, set by the CLI)."""
    spec = agent.spec
    entry = [spec.entrypoint, *map(str, spec.args)] if isinstance(spec.entrypoint, str) else []
    base = LaunchEnv.from_environ()
    return LaunchEnv(
        mode=Mode.ACTIVE,
        store_host=handler.endpoint.host,
        store_port=handler.endpoint.port,
        store_etcd=handler.config.etcd.url() if handler.config.etcd is not None else "",
        store_options=json.dumps(handler.config.etcd.options()) if handler.config.etcd is not None else "",
        store_prefix=prefix,
        gen_file=gen_file,
        run_id=handler.get_run_id(),
        agent_pid=os.getpid(),
        shadow_steps=base.shadow_steps,
        recovery_timeout=base.recovery_timeout,
        comm_timeout=base.comm_timeout,
        same_host_reads=base.same_host_reads,
        heal_reads=base.heal_reads,
        entrypoint=tuple(entry),
        progress_dir=progress_dir,
    )


def worker_environ(env: LaunchEnv) -> dict[str, str]:
    """What an in-place worker or standby worker gets in its environment: ``env``'s variables,
    torch's C++ log level at ERROR unless the user set it, and torch's CPU allocator on transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``) unless the
    user set it: a process that dies frees its memory in a few large pages instead of hundreds
    of thousands of small ones, and its sockets close (its peers see the loss) only after that
    (SIGKILL of a worker holding 1.2 GB: 68 ms until its pidfd fires, 15 ms with huge pages on
    this machine); copies out of its memory during healing are faster too. ``TMRUN_NCCL_LIBRARY``
    is preloaded (``LD_PRELOAD``): the device plane then runs on that NCCL, not torch's.
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` and the rest of torch's NCCL watchdog settings a survivor needs
    (``environment.NCCL_WATCHDOG_DEFAULTS``), each unless the user set it (torch's agent would set 1)."""
    environ = env.to_environ()
    if environment.ENV_THP_ALLOC not in os.environ:
        environ[environment.ENV_THP_ALLOC] = "1"
    if environment.ENV_TORCH_CPP_LOG_LEVEL not in os.environ:
        # as for standby workers: a worker whose store's host is gone says so in one line (its
        # agent too), without torch's C++ warning and its stack frames first
        environ[environment.ENV_TORCH_CPP_LOG_LEVEL] = "ERROR"
    for name, value in environment.NCCL_WATCHDOG_DEFAULTS.items():
        if name not in os.environ:
            # torch's agent would set 1 (tear down): a generation's NCCL failure must not end the
            # survivors, whose device plane aborts it and builds the next (2: clean up only)
            environ[name] = value
    library = os.environ.get(environment.ENV_NCCL_LIBRARY, "")
    if library:  # an expert's NCCL instead of torch's: preloaded, so torch's ProcessGroupNCCL binds to it
        preload = os.environ.get("LD_PRELOAD", "")
        environ["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
    return environ


def succeeded(worker_group: WorkerGroup) -> RunResult:
    return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in worker_group.workers})


HEALTHY = RunResult(state=WorkerState.HEALTHY)
