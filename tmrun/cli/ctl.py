"""``tmrun-ctl``: operate a running tmrun job through its leader's operations endpoint.

Finds the job on this host (the run file the store host writes), or by ``--endpoint HOST:PORT``
(printed by tmrun at start: "operations endpoint at ..."). Talks line-delimited JSON to the
endpoint (:mod:`tmrun.protocol.ops`) and never imports torch: this module and what it imports
start in a fraction of the time (``bench/ctl_latency.py``; a test checks ``sys.modules``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import typer

from tmrun.console import fail
from tmrun.protocol import ops as wire

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Operate a running tmrun job.")

RunIdOption = typer.Option(None, "--run-id", help="The job's --rdzv-id, among the jobs on this host (default: the only one, or inside a SLURM job its own).")
EndpointOption = typer.Option(
    None, "--endpoint", help="HOST:PORT of the job's operations endpoint (tmrun prints it at start; default: the job on this host)."
)
TimeoutOption = typer.Option(5.0, "--timeout", help="Seconds to wait for an answer.")


def _die(message: str, code: int = 1) -> typer.Exit:
    fail(message)
    return typer.Exit(code)


def _given_token() -> str | None:
    from tmrun.protocol.auth import TokenError, token_from_environ

    try:
        return token_from_environ()
    except TokenError as exc:
        raise wire.OpsError(str(exc)) from None


def _locate(run_id: str | None, endpoint: str | None) -> tuple[tuple[str, int], str | None]:
    """The job's operations endpoint and its job token. Exactly one job: ``--endpoint``, else
    ``--run-id``, else inside a SLURM job that job's own run, else the only job on this host
    (several: a refusal that lists them). The token: TMRUN_JOB_TOKEN_FILE / TMRUN_JOB_TOKEN, else
    the token file of the job's run file on this host (also for ``--endpoint``, as tmrun prints it)."""
    from tmrun.launcher.runfile import live_runs

    if endpoint:
        address = wire.parse_address(endpoint)
        given = _given_token()
        if given is not None:
            return address, given
        served = [r for r in live_runs() if _same_endpoint(str(r.get("ops") or ""), address)]
        return address, (_run_token(served[0]) if served else None)
    runs = [r for r in live_runs() if run_id is None or r.get("run_id") == run_id]
    slurm_job = os.environ.get("SLURM_JOB_ID", "") if run_id is None else ""
    if slurm_job:  # inside a SLURM job: its own runs only, never another job's on a shared node
        runs = [r for r in runs if _of_slurm_job(str(r.get("run_id")), slurm_job)]
    if not runs:
        located = _locate_in_slurm(run_id)
        if located is not None:
            return located, _given_token()
        which = f"with run id {run_id!r} " if run_id else (f"of SLURM job {slurm_job} " if slurm_job else "")
        raise wire.OpsError(f"no running tmrun job {which}found on this host; pass --endpoint HOST:PORT "
                            "(tmrun prints it at start: 'operations endpoint at ...')")
    if len(runs) > 1:
        listed = "; ".join(f"{r.get('run_id')} (endpoint {r.get('ops') or 'none'}, started "
                           f"{time.strftime('%H:%M:%S', time.localtime(float(r['started'])))})"  # type: ignore[arg-type]
                           for r in runs)
        raise wire.OpsError(f"{len(runs)} tmrun jobs run on this host: {listed}; choose one with --run-id RUN_ID "
                            "or --endpoint HOST:PORT")
    run = runs[0]
    ops = str(run.get("ops") or "")
    if not ops:
        raise wire.OpsError(f"job {run.get('run_id')} was started by a tmrun without an operations endpoint")
    given = _given_token()
    return wire.parse_address(ops), (given if given is not None else _run_token(run))


def _of_slurm_job(run_id: str, job_id: str) -> bool:
    """A run id of SLURM job ``job_id``: ``slurm-JOB`` (step 0) or ``slurm-JOB.STEP``."""
    return run_id == f"slurm-{job_id}" or run_id.startswith(f"slurm-{job_id}.")


def _same_endpoint(ops: str, address: tuple[str, int]) -> bool:
    """Whether a run file's endpoint is ``address`` (the same port, on this host's name or one
    of its addresses, as tmrun prints it)."""
    import socket

    try:
        host, port = wire.parse_address(ops)
    except wire.OpsError:
        return False
    if port != address[1]:
        return False
    if host == address[0]:
        return True
    try:
        return bool({info[4][0] for info in socket.getaddrinfo(host, port)}
                    & {info[4][0] for info in socket.getaddrinfo(address[0], port)})
    except OSError:
        return False


def _run_token(run: dict[str, object]) -> str | None:
    token_file = str(run.get("token_file") or "")
    if not token_file:
        return None
    from tmrun.protocol.auth import TokenError, read_token_file

    try:
        return read_token_file(token_file, "its token file ")
    except TokenError as exc:
        raise wire.OpsError(f"job {run.get('run_id')}: {exc}") from None


def _locate_in_slurm(run_id: str | None) -> tuple[str, int] | None:
    """Inside the job's SLURM allocation: the leader's endpoint on the step's first node, for the
    step that ``run_id`` (``slurm-JOB.STEP``) names, else step 0."""
    import re

    from tmrun.cli.slurm import OPS_BASE_PORT, HostlistError, node_address, slurm_defaults, step_port_offset

    try:
        slurm = slurm_defaults(os.environ)
    except (HostlistError, ValueError):
        return None
    if slurm is None:
        return None
    port = slurm.ops_port
    named = re.fullmatch(r"slurm-(\d+)\.(\d+)", run_id or "")
    if named:
        port = OPS_BASE_PORT + step_port_offset(named.group(1), named.group(2))
    try:
        host = node_address(slurm.first_host, os.environ)
    except ValueError:
        host = slurm.first_host
    return host, port


def _ask(run_id: str | None, endpoint: str | None, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    if not timeout > 0:
        raise _die(f"--timeout must be positive, got {timeout}", 2)
    try:
        address, token = _locate(run_id, endpoint)
        reply = wire.ask(address, request, timeout, token=token)
    except wire.OpsError as exc:
        raise _die(str(exc)) from None
    if not reply.get("ok"):
        raise _die(f"the job refused the request: {reply.get('error', 'no reason given')}")
    if run_id is not None and reply.get("run_id") != run_id:
        raise _die(f"the endpoint serves job {reply.get('run_id')!r}, not {run_id!r}")
    return reply


def _stamp(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _totals_line(t: dict[str, Any]) -> str:
    from tmrun.control.metrics import describe

    return describe(t)


# ---- status ----------------------------------------------------------------------------------


@app.command()
def status(
    run_id: str | None = RunIdOption,
    endpoint: str | None = EndpointOption,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    timeout: float = TimeoutOption,
) -> None:
    """Membership of the job (active nodes and their workers, standby members, lost nodes) and
    its recovery totals (downtime, steps recomputed, ETTR)."""
    job = _ask(run_id, endpoint, {"op": "status"}, timeout)
    if as_json:
        job.pop("ok", None)
        typer.echo(json.dumps(job, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = job["membership"]
    console.print(f"job {job['run_id']} at {job.get('endpoint', '')}: {m['phase']}, epoch {m['epoch']}", highlight=False)
    if m.get("reason"):
        console.print(f"last change: {m['reason']}", highlight=False, markup=False)
    table = Table("node", "role", "group rank", "host", "agent pid", "workers (rank:pid)", "standby workers")
    for node in job["nodes"]:
        workers = " ".join(f"{w.get('rank')}:{w.get('pid')}" for w in node["workers"])
        standby = " ".join(f"{w.get('pid')}({w.get('state')})" for w in node["standby_workers"])
        rank = "" if node["group_rank"] is None else str(node["group_rank"])
        table.add_row(str(node["node_id"]), node["role"], rank, node["host"], str(node["agent_pid"]), workers, standby)
    console.print(table)
    console.print(f"recovery: {_totals_line(job['totals'])}", highlight=False)
    if job.get("event_log"):
        console.print(f"event log: {job['event_log']}", highlight=False, markup=False)


# ---- events ----------------------------------------------------------------------------------


def _print_event(event: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(event, sort_keys=True))
    else:
        typer.echo(f"{_stamp(float(event['time']))} epoch {event['epoch']} {event['kind']}: {event['detail']}")


@app.command()
def events(
    run_id: str | None = RunIdOption,
    endpoint: str | None = EndpointOption,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events until the job ends (or Ctrl-C)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line (the event log's schema)."),
    since: int = typer.Option(0, "--since", help="Start at this event number."),
    timeout: float = TimeoutOption,
) -> None:
    """The job's events (joins, failures, replacements, recoveries, migrations), oldest first."""
    if since < 0:
        raise _die(f"--since must be 0 or more, got {since}", 2)
    try:
        while True:
            reply = _ask(run_id, endpoint, {"op": "events", "since": since}, timeout)
            for event in reply["events"]:
                _print_event(event, as_json)
            since = int(reply["next"])
            if not follow or any(e["kind"] == "closed" for e in reply["events"]):
                return
            time.sleep(0.5)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


# ---- migrate, drain --------------------------------------------------------------------------


def _check_target(rank: int | None, node: int | None) -> None:
    if (rank is None) == (node is None):
        raise _die("give a rank or --node GROUP_RANK (one of them)", 2)
    value = node if node is not None else rank
    assert value is not None
    if value < 0:
        raise _die(f"{'--node' if node is not None else 'rank'} must be 0 or more, got {value}", 2)


@app.command()
def migrate(
    rank: int | None = typer.Argument(None, help="The rank to move to a warm standby (across nodes: its node)."),
    node: int | None = typer.Option(None, "--node", help="Move the node at this group rank to a warm standby node."),
    reason: str = typer.Option("operator request", "--reason", help="Recorded with the event."),
    run_id: str | None = RunIdOption,
    endpoint: str | None = EndpointOption,
    timeout: float = TimeoutOption,
) -> None:
    """Move a rank (or a node) to a warm standby at the next step boundary (planned: nothing is recomputed)."""
    _check_target(rank, node)
    request: dict[str, Any] = {"op": "migrate", "reason": reason}
    request["node" if node is not None else "rank"] = node if node is not None else rank
    reply = _ask(run_id, endpoint, request, timeout)
    target = f"node at group rank {node}" if node is not None else f"rank {rank}"
    typer.echo(f"job {reply.get('run_id')}: migration of {target} requested (request {reply['request']}); "
               "see tmrun-ctl events")


@app.command()
def drain(
    node: int = typer.Argument(..., help="The group rank of the node to drain."),
    reason: str = typer.Option("drain", "--reason", help="Recorded with the event."),
    wait: float = typer.Option(600.0, "--wait", help="Seconds to wait for the node's agent to leave."),
    run_id: str | None = RunIdOption,
    endpoint: str | None = EndpointOption,
    timeout: float = TimeoutOption,
) -> None:
    """Move every rank of a node to a warm standby node (a planned migration), then report when
    the node's agent has left: the node is free for maintenance."""
    if node < 0:
        raise _die(f"the node's group rank must be 0 or more, got {node}", 2)
    if not wait > 0:
        raise _die(f"--wait must be positive, got {wait}", 2)
    job = _ask(run_id, endpoint, {"op": "status"}, timeout)
    active = job["membership"]["active"]
    if not 0 <= node < len(active) or active[node] < 0:
        raise _die(f"no node at group rank {node} (the job has {len(active)} active nodes)")
    if not any(n.get("role") == "standby" for n in job["nodes"]):
        raise _die("the job has no standby node to move the node's ranks to (one node: migrate a rank)")
    node_id = int(active[node])
    since = int(job.get("next_event", 0))
    token = os.urandom(4).hex()
    reply = _ask(run_id, endpoint, {"op": "migrate", "node": node, "reason": f"{reason} [{token}]"}, timeout)
    typer.echo(f"job {job.get('run_id')}: draining node {node_id} (group rank {node}): request {reply['request']}")
    deadline = time.monotonic() + wait
    moved = False
    try:
        while time.monotonic() < deadline:
            reply = _ask(run_id, endpoint, {"op": "events", "since": since}, timeout)
            since = int(reply["next"])
            for event in reply["events"]:
                detail = str(event.get("detail", ""))
                if event["kind"] == "migrate-refused" and (token in detail or f"node at group rank {node}" in detail):
                    raise _die(f"the drain was refused: {detail}")
                if token in detail and event["kind"] == "migrate":
                    moved = True
                    typer.echo(f"{_stamp(float(event['time']))} its ranks move to a standby node: {detail}")
                if moved and event["kind"] == "recovered":
                    typer.echo(f"{_stamp(float(event['time']))} handover done: {detail}")
                if moved and event["kind"] in ("left", "lost") and node_id in (event.get("nodes") or []):
                    typer.echo(f"{_stamp(float(event['time']))} node {node_id} drained: its agent left")
                    return
                if event["kind"] == "closed":
                    if moved:  # handed over; its agent leaves with the job
                        typer.echo(f"{_stamp(float(event['time']))} node {node_id} drained: the job ended ({detail})")
                        return
                    raise _die(f"the job ended before the node was drained: {detail}")
            time.sleep(0.2)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    raise _die(f"node {node_id} was not drained within {wait:g} s (see tmrun-ctl events)")


# ---- plan --------------------------------------------------------------------------------------


@app.command()
def plan(
    gpus: int = typer.Option(..., "--gpus", help="GPUs of the training job."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node (a standby is a node)."),
    node_mttf_hours: float | None = typer.Option(None, "--node-mttf-hours", help="One node's mean time to failure, hours."),
    job_mttf_minutes: float | None = typer.Option(None, "--job-mttf-minutes", help="Or the whole job's MTTF, minutes."),
    restart_minutes: float = typer.Option(4.45, "--restart-minutes", help="Downtime of a restart from checkpoint (TrainMover: 4.45 min)."),
    recovery_seconds: float | None = typer.Option(
        None, "--recovery-seconds", help="tmrun's in-place recovery time (default: measured by the job on this host / --endpoint)."),
    repair_hours: float = typer.Option(24.0, "--repair-hours", help="Until a used standby is back in the pool."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    run_id: str | None = RunIdOption,
    endpoint: str | None = EndpointOption,
) -> None:
    """Projected ETTR, GPU-hours lost a week and the standbys that pay for themselves (TrainMover's
    model: loss = downtime per failure / the job's MTTF; see docs/user-guide.md)."""
    from tmrun.control.projection import PlanInput, ProjectionError, project

    source = "given"
    if node_mttf_hours is None and job_mttf_minutes is None:
        raise _die("give --node-mttf-hours or --job-mttf-minutes", 2)
    if recovery_seconds is None:
        job = _ask(run_id, endpoint, {"op": "status"}, 5.0)
        t = job["totals"]
        if not t.get("recoveries"):
            raise _die("the job has no measured recovery yet; pass --recovery-seconds", 2)
        recovery_seconds = float(t["downtime_s"]) / int(t["recoveries"])
        source = f"measured: mean of {t['recoveries']} recoveries of job {job['run_id']}"
    try:
        result = project(PlanInput(gpus=gpus, gpus_per_node=gpus_per_node, node_mttf_h=node_mttf_hours,
                                   job_mttf_min=job_mttf_minutes, restart_min=restart_minutes,
                                   recovery_s=recovery_seconds, repair_h=repair_hours))
    except ProjectionError as exc:
        raise _die(str(exc), 2) from None
    if as_json:
        data = result.to_dict()
        data["recovery_s"] = recovery_seconds
        data["recovery_source"] = source
        typer.echo(json.dumps(data, indent=2))
        return
    r, b = result.restart_only, result.best
    typer.echo(f"{gpus} GPUs ({result.nodes} nodes): job MTTF {result.job_mttf_min:.1f} min, "
               f"{result.failures_per_week:.0f} failures a week")
    typer.echo(f"restart on every failure ({restart_minutes:g} min): ETTR {r.ettr * 100:.2f}% "
               f"(throughput loss {r.loss * 100:.2f}%), {r.gpu_hours_lost_week:,.0f} GPU-hours lost a week")
    typer.echo(f"tmrun with {b.standby} standby nodes (recovery {recovery_seconds:.1f} s, {source}): "
               f"ETTR {b.ettr * 100:.2f}%, {b.gpu_hours_lost_week:,.0f} GPU-hours lost a week "
               f"(idle standbys included; a failure finds none free with p={b.p_no_standby:.2g})")
    if b.standby == 0:
        typer.echo("standbys that pay for themselves: none at this scale (one standby node idles more GPU-hours "
                   "than it saves)")
    else:
        typer.echo(f"standbys that pay for themselves: best {b.standby}, break-even up to {result.break_even}")


def main() -> None:
    """Run tmrun-ctl; a usage mistake is one line (``tmrun: error: ...``) and exit code 2."""
    import sys

    from typer.main import get_command

    from tmrun.cli.fast_params import plain_coercion

    command = get_command(app)
    plain_coercion(command)  # no pydantic: a third of the start-up (docs/benchmarks.md)
    try:
        code = command(standalone_mode=False)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # click's (vendored by typer) usage errors: one line, not a box
        message = getattr(exc, "format_message", None)
        if message is None or not hasattr(exc, "exit_code"):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            app(["--help"], standalone_mode=False)
            sys.exit(2)
        command = getattr(getattr(exc, "ctx", None), "command_path", "tmrun-ctl")
        fail(f"{message().splitlines()[0] if message() else type(exc).__name__} (see {command} --help)")
        sys.exit(int(exc.exit_code))
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
