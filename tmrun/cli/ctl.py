"""``tmrun-ctl``: look at a running tmrun job (status, events)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import typer
from rich.console import Console
from rich.table import Table

from tmrun.console import fail

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Operate a running tmrun job.")


def _locate(run_id: str | None, endpoint: str | None) -> tuple[str, str]:
    from tmrun.launcher.runfile import live_runs

    if endpoint and run_id:
        return run_id, endpoint
    runs = [r for r in live_runs() if run_id is None or r["run_id"] == run_id]
    if not runs:
        raise typer.BadParameter("no running tmrun job found on this host; pass --endpoint and --run-id")
    return str(runs[0]["run_id"]), str(endpoint or runs[0]["endpoint"])


def _open(run_id: str | None, endpoint: str | None):  # type: ignore[no-untyped-def]
    from tmrun.control.status import connect, read_status
    from tmrun.rendezvous.endpoint import EndpointError, parse_endpoint

    try:
        found_id, found_endpoint = _locate(run_id, endpoint)
        store = connect(parse_endpoint(found_endpoint, 29400), found_id)
        return read_status(store, found_id, found_endpoint)
    except (EndpointError, typer.BadParameter) as exc:
        fail(str(exc))
        raise typer.Exit(1) from None


RunIdOption = typer.Option(None, "--run-id", help="The job's --rdzv-id (default: the newest job on this host).")
EndpointOption = typer.Option(None, "--endpoint", help="host:port of the job's rendezvous store.")


@app.command()
def status(
    run_id: str | None = RunIdOption,
    endpoint: str | None = EndpointOption,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Membership of the job: active nodes and their workers, standby members, lost nodes."""
    job = _open(run_id, endpoint)
    if as_json:
        data = asdict(job)
        data["membership"]["phase"] = job.membership.phase.value
        typer.echo(json.dumps(data, indent=2, default=str))
        return
    console = Console()
    m = job.membership
    console.print(f"job {job.run_id} at {job.endpoint}: {m.phase.value}, epoch {m.epoch}")
    if m.reason:
        console.print(f"last change: {m.reason}")
    table = Table("node", "role", "group rank", "host", "agent pid", "workers (rank:pid)", "standby workers")
    for node in job.nodes:
        workers = " ".join(f"{w.get('rank')}:{w.get('pid')}" for w in node.workers)
        standby = " ".join(f"{w.get('pid')}({w.get('state')})" for w in node.standby_workers)
        rank = "" if node.group_rank is None else str(node.group_rank)
        table.add_row(str(node.node_id), node.role, rank, node.host, str(node.agent_pid), workers, standby)
    console.print(table)


@app.command()
def events(run_id: str | None = RunIdOption, endpoint: str | None = EndpointOption) -> None:
    """The job's events (joins, failures, replacements), oldest first."""
    job = _open(run_id, endpoint)
    for event in job.events:
        stamp = time.strftime("%H:%M:%S", time.localtime(event.time)) + f".{int(event.time * 1000) % 1000:03d}"
        typer.echo(f"{stamp} epoch {event.epoch} {event.kind}: {event.detail}")


@app.command()
def migrate(
    rank: int | None = typer.Argument(None, help="The rank to move to a warm standby (across nodes: its node)."),
    node: int | None = typer.Option(None, "--node", help="Move the node at this group rank to a warm standby node."),
    reason: str = typer.Option("operator request", "--reason", help="Recorded with the event."),
    run_id: str | None = RunIdOption,
    endpoint: str | None = EndpointOption,
) -> None:
    """Move a rank (or a node) to a warm standby at the next step boundary (planned: nothing is recomputed)."""
    from tmrun.protocol.messages import request_migration
    from tmrun.control.status import connect
    from tmrun.rendezvous.endpoint import EndpointError, parse_endpoint

    if (rank is None) == (node is None):
        fail("give a rank or --node GROUP_RANK (one of them)")
        raise typer.Exit(2)
    target, value = ("node at group rank", node) if node is not None else ("rank", rank)
    assert value is not None
    if value < 0:
        fail(f"{'--node' if node is not None else 'rank'} must be 0 or more, got {value}")
        raise typer.Exit(2)
    try:
        found_id, found_endpoint = _locate(run_id, endpoint)
        store = connect(parse_endpoint(found_endpoint, 29400), found_id)
    except (EndpointError, typer.BadParameter) as exc:
        fail(str(exc))
        raise typer.Exit(1) from None
    seq = request_migration(store, rank if rank is not None else -1, reason, node=node if node is not None else -1)
    typer.echo(f"migration of {target} {value} requested (request {seq}); see tmrun-ctl events")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
