"""The launch sequence: rendezvous handler, worker spec, TmrunAgent, and the outcome."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig

from tmrun.console import say
from tmrun.console.live import LiveConsole
from tmrun.launcher.console_feed import ConsoleFeed
from tmrun.control.detection import DetectionSettings
from tmrun.launcher.agent import AgentSettings, TmrunAgent
from tmrun.launcher.stop_signals import announce_stop, handle_stop_signals
from tmrun.launcher.runfile import event_log_path, remove_runfile, write_runfile
from tmrun.protocol import auth, environment, keys
from tmrun.control.rendezvous_backend import register_tmrun_backend
from tmrun.rendezvous.handler import NodeRetiredError, TmrunRendezvousHandler
from tmrun.protocol.membership import Phase


class LaunchError(RuntimeError):
    """The job could not start or continue, for a reason the user can read in one line."""


@dataclass(frozen=True)
class TmrunOptions:
    standby: int  # spare members: nodes when the job spans nodes, worker processes on one node
    standby_nodes: bool | None = None  # the standbys are nodes (None: when --nnodes is above 1)
    standby_wait: float = 60.0  # in-place: how long a failure waits for a warm standby
    refill_delay: float = 5.0  # one node: seconds after a recovery before the replacement standby starts
    console: str = "plain"  # "live": a live view on the store host's terminal (see tmrun.console.live)
    log_dir: str | None = None  # torchrun's --log-dir: the job's event log goes there (else next to the runfile)
    ops_port: int = 0  # the operations endpoint's preferred port (SLURM: 30400 + job id mod 1000); 0: any
    hang_timeout: float = 0.0  # no step on any rank for this long: fence the hung rank (0: off)
    straggler_factor: float = 0.0  # a rank's own work over this x the others' median ... (0: off)
    straggler_steps: int = 5  # ... for this many consecutive steps: migrate it
    gpu_health: bool = True  # NVML health monitor (off by itself without a GPU)


def launch(config: LaunchConfig, entrypoint: str, args: list[Any], options: TmrunOptions) -> int:
    """Run the job on this node; return the process exit code."""
    register_tmrun_backend()
    handle_stop_signals(getattr(config, "signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"))
    single_node = config.max_nodes == 1 if options.standby_nodes is None else not options.standby_nodes
    rdzv_configs = dict(config.rdzv_configs)
    if config.rdzv_backend in ("tmrun", "tmrun-etcd"):
        rdzv_configs["standby"] = 0 if single_node else options.standby
        rdzv_configs.setdefault("standby_wait", options.standby_wait)
        rdzv_configs.setdefault("event_log", str(event_log_path(config.run_id, options.log_dir)))
        if options.ops_port:
            rdzv_configs.setdefault("ops_port", options.ops_port)
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **rdzv_configs,
    )
    try:
        handler = rdzv_registry.get_rendezvous_handler(params)
        tmrun_handler = handler if isinstance(handler, TmrunRendezvousHandler) else None
        _hand_token_to_workers(tmrun_handler, single_node)
    except (ValueError, RendezvousError) as exc:
        raise LaunchError(str(exc)) from None
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    agent = TmrunAgent(
        spec,
        config.logs_specs,  # type: ignore[arg-type]
        start_method=config.start_method,
        monitor_interval=config.monitor_interval,
        settings=AgentSettings(
            standby_workers=options.standby if single_node else 0,
            standby_nodes=0 if single_node else options.standby,
            standby_wait=options.standby_wait,
            refill_delay=options.refill_delay,
            standby_log_dir=_standby_log_dir(config) if options.console == "live" else "",
            detection=DetectionSettings(hang_timeout=options.hang_timeout, straggler_factor=options.straggler_factor,
                                        straggler_steps=options.straggler_steps, gpu_health=options.gpu_health),
        ),
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=int(getattr(config, "shutdown_timeout", 30)),  # torch >= 2.12 has it
    )
    runfile = None
    console: LiveConsole | None = None
    runfiles: list[Path] = []
    if tmrun_handler is not None and tmrun_handler.config.etcd is not None:
        _write_runfile_when_leading(tmrun_handler, config.run_id, str(rdzv_configs.get("event_log", "")), runfiles)
    if tmrun_handler is not None and tmrun_handler.is_host:
        ops = tmrun_handler.store.get(keys.OPS_ADDR).decode()
        runfile = write_runfile(config.run_id, str(tmrun_handler.endpoint), ops=ops,
                                event_log=str(rdzv_configs.get("event_log", "")), token=tmrun_handler.token)
        say(f"rendezvous store at {tmrun_handler.endpoint} (run id {config.run_id})")
        say(f"the job's events go to {rdzv_configs.get('event_log')}")
        if options.console == "live":
            say(f"live console on; the workers' output goes to files under "
                f"{getattr(config.logs_specs, 'root_log_dir', '') or 'the log directory'} (--console plain to see it here)")
            console = LiveConsole(ConsoleFeed(tmrun_handler))
            console.start()
    try:
        return _run(agent, tmrun_handler)
    finally:
        if console is not None:
            console.stop()
        if tmrun_handler is not None:
            tmrun_handler.leave()
            if tmrun_handler.is_host:
                _say_totals(tmrun_handler)  # after the others left: the job's last events are in
        else:
            handler.shutdown()
        if runfile is not None:
            remove_runfile(runfile)
        for path in runfiles:
            remove_runfile(path)


def _hand_token_to_workers(handler: TmrunRendezvousHandler | None, single_node: bool) -> None:
    """Every process this agent starts (workers, standby workers) inherits the job token in its
    environment (``TMRUN_JOB_TOKEN``; never in argv): their native links prove it. With another
    rendezvous backend than tmrun's, a one-node job still gets a token of its own; a multi-node
    one only the token given to it (every agent must share it)."""
    if handler is not None:
        token: str | None = handler.token
    else:
        token = auth.token_from_environ()
        if token is None and single_node:
            token = auth.new_token()
    os.environ.pop(environment.ENV_JOB_TOKEN_FILE, None)  # one source for the workers: the variable
    if token:
        os.environ[environment.ENV_JOB_TOKEN] = token


def _standby_log_dir(config: LaunchConfig) -> str:
    """Where standby workers write their output while the live console owns the terminal: beside
    the workers' logs (torch's log directory, a temporary one unless --log-dir is given)."""
    root = getattr(config.logs_specs, "root_log_dir", "") or tempfile.mkdtemp(prefix="tmrun-logs-")
    directory = os.path.join(str(root), f"{config.run_id}-standby")
    os.makedirs(directory, exist_ok=True)
    return directory


def _write_runfile_when_leading(handler: TmrunRendezvousHandler, run_id: str, event_log: str,
                                out: list[Path]) -> None:
    """etcd: the agent that holds the lead (now, or after a takeover) writes the run file on its
    host, so that tmrun-ctl there finds the job's operations endpoint without flags."""

    def write() -> None:
        try:
            ops = handler.store.get(keys.OPS_ADDR).decode()
            out.append(write_runfile(run_id, handler.store_url, ops=ops, event_log=event_log, token=handler.token))
        except Exception as exc:  # noqa: BLE001 - tmrun-ctl --endpoint still works; say why not
            say(f"no run file for tmrun-ctl: {exc}")

    handler.on_lead = write
    if handler.leader is not None and not out:
        write()


def _say_totals(handler: TmrunRendezvousHandler) -> None:
    """The job's recovery totals (docs/events.md), once, from the host of the leader."""
    ops = getattr(handler.leader, "ops", None)
    if ops is None:
        return
    try:
        from tmrun.control.metrics import describe

        say(f"recovery totals: {describe(ops.totals())}")
    except Exception as exc:  # noqa: BLE001 - the store is gone: no totals to give
        say(f"recovery totals unavailable: {exc}")


def _serve_until_closed(handler: TmrunRendezvousHandler) -> int:
    try:
        phase, reason = handler.wait_closed()
    except SignalException as exc:
        say(f"received {exc.sigval.name} while serving the store; the job stops")
        handler.close(Phase.FAILED, f"the store host received {exc.sigval.name}")
        return 128 + int(exc.sigval)
    except RendezvousClosedError as exc:
        raise LaunchError(str(exc)) from None
    say(f"the job {phase.value}: {reason}")
    return 0


def _run(agent: TmrunAgent, handler: TmrunRendezvousHandler | None) -> int:
    try:
        result = agent.run()
    except NodeRetiredError as exc:
        if handler is not None and handler.is_host:
            # the job's store (and its leader) live in this process: this node stops computing
            # but serves the store until the job ends, or every other node would lose it
            say(f"{exc}; this node runs no workers now and serves the job's store until the job ends")
            return _serve_until_closed(handler)
        say(f"{exc}; this node leaves, the job goes on")
        return 0
    except RendezvousClosedError as exc:
        closed = handler.closed_reason() if handler is not None else None
        if closed is not None and closed[0] is Phase.SUCCEEDED:
            say("the job finished; this standby member leaves")
            return 0
        raise LaunchError(str(exc)) from None
    except SignalException as exc:
        standing_by = handler is not None and handler.is_standing_by()
        announce_stop(handler, exc.sigval)  # (said already when it came while the agent ran)
        if not standing_by and handler is not None:
            _close(handler, Phase.FAILED, f"an agent received {exc.sigval.name}")
        return 128 + int(exc.sigval)
    except RendezvousError as exc:
        raise LaunchError(f"rendezvous failed: {exc}") from None
    except DistError as exc:  # the store's connection failed: its host (the leader's node) is gone
        where = f" at {handler.endpoint}" if handler is not None else ""
        if handler is not None:
            handler.store_lost = True  # nothing to say goodbye to
        if handler is not None and handler.config.etcd is not None:
            raise LaunchError(f"lost the job's store: the etcd cluster ({handler.store_url}) did not answer within "
                              f"{handler.config.connect_timeout:g} s; this node stops") from None
        raise LaunchError(f"lost the job's store{where}: its host is gone ({type(exc).__name__}); "
                          "this node stops (surviving that needs a store outside the job, e.g. --rdzv-backend "
                          "tmrun-etcd)") from None
    if result.is_failed():
        failures = result.failures or {}
        summary = "; ".join(
            f"rank {rank} exit code {f.exitcode}" + (f" ({f.signal_name()})" if f.exitcode < 0 else "")
            for rank, f in sorted(failures.items())
        )
        if handler is not None:
            _close(handler, Phase.FAILED, f"workers failed with no restarts left: {summary}")
        raise LaunchError(f"workers failed and no restarts are left: {summary}")
    if handler is not None:
        _close(handler, Phase.SUCCEEDED, "workers finished")
    return 0


def _close(handler: TmrunRendezvousHandler, phase: Phase, reason: str) -> None:
    """Close the job for every node, unless its store is gone already (its host was lost, or a
    scancel stopped it first): then there is no one to tell, and this node's own outcome stands
    (a stop signal's exit code, the workers' failure) with no traceback."""
    try:
        handler.close(phase, reason)
    except DistError:
        handler.store_lost = True
